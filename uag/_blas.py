"""Fast CPU matmuls for MLX on Linux.

MLX's Linux wheel links a reference BLAS, far slower than an optimised one. Loading a system OpenBLAS with
RTLD_GLOBAL *before* ``mlx.core`` is imported makes libmlx bind ``cblas_*`` to it instead (fp32 only; measured:
docs/results.md#which-dtype-benchmarksdtype_costpy). This module does that once, on import of ``uag``; set
``UAG_OPENBLAS=0`` to keep the reference BLAS, or ``UAG_OPENBLAS=/path/libopenblas.so.0`` to choose the library.
A command line run with OpenBLAS on one thread ends without the library's exit code, which crashed there
(`_skip_library_exit`).
"""

from __future__ import annotations

import atexit
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
_library: ctypes.CDLL | None = None  # the OpenBLAS loaded, if any
#: The code a command line run ends with, once it is known (`end_with`); None: not a command line run
exit_code: int | None = None


def preload_openblas() -> str:
    """Load OpenBLAS globally if we are on Linux, mlx is not imported yet and a library is found."""
    global status, _library
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
                library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            status, _library = f"openblas:{path}", library
            atexit.register(_skip_library_exit)  # registered on import of uag, so it runs after the others
            break
    return status


def single_threaded() -> bool:
    """Whether the loaded OpenBLAS runs one thread now (OPENBLAS_NUM_THREADS=1, as `make test`'s workers set it, or
    a one-core machine)."""
    try:
        return _library is not None and _library.openblas_get_num_threads() == 1
    except AttributeError:  # a BLAS without OpenBLAS's thread calls
        return False


def end_with(code: int) -> int:
    """Note the code a command line run ends with (see `_skip_library_exit`); returns it."""
    global exit_code
    exit_code = code
    return code


def _skip_library_exit() -> None:
    """A command line run ends here, once Python's own exit work is done (threads joined, exit handlers run), without
    the libraries' exit code, where OpenBLAS runs one thread: Debian 12's OpenBLAS (0.3.21) run single-threaded, as
    MLX's stream threads call it, crashes in its exit code now and then (`blas_shutdown`, from `_dl_fini`), after a
    run's output (exit status -11); mlx-lm's own `generate_step` does too. Anything else (a program that imports uag,
    or uag with several OpenBLAS threads) exits as usual."""
    if exit_code is None or not single_threaded():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader left
            pass
    os._exit(exit_code)


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
