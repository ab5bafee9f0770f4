"""Fast CPU matmuls for MLX on Linux.

MLX's Linux wheel links a reference BLAS, far slower than an optimised one. Loading a system OpenBLAS with
RTLD_GLOBAL *before* ``mlx.core`` is imported makes libmlx bind ``cblas_*`` to it instead (fp32 only; measured:
docs/results.md#which-dtype-benchmarksdtype_costpy). This module does that once, on import of ``uag``; set
``UAG_OPENBLAS=0`` to keep the reference BLAS, or ``UAG_OPENBLAS=/path/libopenblas.so.0`` to choose the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

#: What happened: "openblas:<path>", "reference", "reference (mlx imported first)", "not linux" ...
status = "not attempted"


def preload_openblas() -> str:
    """Load OpenBLAS globally if we are on Linux, mlx is not imported yet and a library is found."""
    global status
    choice = os.environ.get("UAG_OPENBLAS", "").strip()
    if not sys.platform.startswith("linux"):
        status = "not needed (not linux)"
    elif choice == "0":
        status = "reference (UAG_OPENBLAS=0)"
    elif "mlx.core" in sys.modules:
        status = "reference (mlx was imported before uag)"
    else:
        paths = [choice] if choice else [*_CANDIDATES, ctypes.util.find_library("openblas")]
        status = "reference (no libopenblas found: apt-get install libopenblas0-pthread)"
        for path in filter(None, paths):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            status = f"openblas:{path}"
            break
    return status


def slow_cpu_note(device: str) -> str | None:
    """What to tell the user when MLX computes on a Linux CPU without OpenBLAS (None when it does not).

    Example: slow_cpu_note("cpu") with no OpenBLAS found -> "MLX runs on the CPU with its reference BLAS ..."
    """
    if device != "cpu" or not sys.platform.startswith("linux") or status.startswith("openblas"):
        return None
    return (
        f"MLX runs on the CPU with its reference BLAS ({status}): float32 matrix products are ~50x slower "
        "than with OpenBLAS and verifying k drafts costs about k plain steps, so speculation is unlikely to pay"
    )
