"""The note uag adds to a pair when MLX would compute on a Linux CPU with its slow reference BLAS."""

import json
import os
import subprocess
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


@pytest.mark.slow
def test_a_command_run_with_one_openblas_thread_ends_with_its_own_code(tmp_path, demo_pair):
    """Debian 12's OpenBLAS run single-threaded crashed in its exit code after most `uag generate` runs (-11, the
    output printed): the command line ends without the libraries' exit code there, with the command's own status."""
    if not _blas.status.startswith("openblas:"):
        pytest.skip("no system OpenBLAS on this machine")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "uag", "generate", "--max-tokens", "4", "--strategy", "baseline", "--json"]
    for _ in range(3):  # it crashed in 3 runs of 4
        done = subprocess.run([*command, "Ala ma"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(json.loads(done.stdout)["token_ids"]) == 4
    done = subprocess.run([*command, "--k", "x", "Ala"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error:")  # a user's mistake keeps its code


@pytest.mark.parametrize("script, command", [("bench", "bench"), ("analyze", "analyze"), ("calibrate", "calibrate")])
def test_the_named_scripts_are_uag_commands_ending_the_same_way(monkeypatch, capsys, script, command):
    """`uag-bench` is `uag bench` (pyproject's scripts): its status noted for the exit as `uag`'s is."""
    from uag import cli

    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 3)
    monkeypatch.setattr(sys, "argv", [f"uag-{script}", "--out", "r.db"])
    monkeypatch.setattr(_blas, "exit_code", None)
    with pytest.raises(SystemExit) as ended:
        getattr(cli, script)()
    assert ended.value.code == 3 and _blas.exit_code == 3 and seen == [[command, "--out", "r.db"]]
