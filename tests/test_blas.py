"""The note uag adds to a pair when MLX would compute on a Linux CPU with its slow reference BLAS."""

import os
import sys

import pytest

from uag import _blas


@pytest.mark.parametrize(
    ("status", "device", "platform", "warned"),
    [
        ("openblas:/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "cpu", "linux", False),
        ("reference (no libopenblas found: apt-get install libopenblas0-pthread)", "cpu", "linux", True),
        ("reference (UAG_OPENBLAS=0)", "cpu", "linux", True),
        ("reference (UAG_OPENBLAS=0)", "gpu", "linux", False),
        ("not needed (not linux)", "cpu", "darwin", False),
    ],
)
def test_slow_cpu_note(monkeypatch, status, device, platform, warned):
    monkeypatch.setattr(_blas, "status", status)
    monkeypatch.setattr(sys, "platform", platform)
    note = _blas.slow_cpu_note(device)
    assert (note is not None) == warned
    if warned:
        assert status in note  # says what happened, and the status says how to fix it


def test_this_process_uses_openblas_where_installed():
    # CI installs libopenblas0-pthread; uag loads it before mlx, so the demo pair gets no warning there.
    if not any(os.path.exists(p) for p in _blas._CANDIDATES):
        pytest.skip("no system OpenBLAS on this machine")
    assert _blas.status.startswith("openblas:"), _blas.status
    assert _blas.slow_cpu_note("cpu") is None
