"""Which machine this is: its MLX backend, device, BLAS and user cache. One answer for every module.

Profiles (uag.costs.profiles) and results rows (uag.study.results) are keyed by what this module says, so a
calibration and a sweep made on the same machine always agree on its name.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from uag import _blas


def cache_dir() -> Path:
    """``$UAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/uag``, else ``~/.cache/uag``: converted models, profiles."""
    if explicit := os.environ.get("UAG_CACHE_DIR"):
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "uag"


def backend() -> str:
    """ "cpu", "metal", "cuda" or "gpu" (an accelerator MLX names no further): what runs the default device."""
    import mlx.core as mx  # here and below: this module is read without mlx (no mlx: import uag, the pure modules)

    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "gpu"


def device_name() -> str:
    """The accelerator's or CPU's name, e.g. "NVIDIA H100 80GB HBM3", "Apple M2 Pro", "x86_64"."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return str(info.get("device_name") or platform.processor() or platform.machine())


def blas() -> str:
    """How float32 matmuls run on a Linux CPU: "openblas:<path>" or why the reference BLAS is in use."""
    return _blas.status


def slow_cpu_note() -> str | None:
    """A note for the user when MLX computes on a Linux CPU without OpenBLAS; None otherwise."""
    import mlx.core as mx

    return _blas.slow_cpu_note(mx.default_device().type.name)
