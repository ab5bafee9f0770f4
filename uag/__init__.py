"""uag: cross-tokenizer speculative decoding (Universal Assisted Generation) on MLX.

    import uag
    target = uag.load("demo-target")
    run = uag.generate(target, uag.load_drafter("demo-drafter"), "Stolica Polski to",
                       uag.GenerationConfig(translation="context", k=2))

Importing uag does two things beyond defining names. On Linux it loads the system OpenBLAS so that MLX's CPU
matmuls use it (~50x faster float32 than MLX's reference BLAS); that must happen before anything imports mlx.core,
and `UAG_OPENBLAS=0` turns it off (uag/_blas.py). And it turns MLX's CUDA graphs off unless MLX_USE_CUDA_GRAPHS is
set (`CUDA_GRAPHS_DEFAULTED`). The heavy modules (mlx, mlx-lm, transformers) are imported only when a name below is
first used.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from uag._blas import preload_openblas

preload_openblas()  # must run before anything imports mlx.core
# MLX's CUDA backend records each evaluation as a CUDA graph, and builds a new one for every new shape of it.
# Speculation's passes change shape from cycle to cycle (their widths, their rows in a batch, a lookup's tree), and a
# server batching speculative requests ran much faster with the graphs off, the target alone a little slower
# (docs/results.md, by). MLX reads the variable at its first GPU evaluation; set it to 1 to keep the graphs.
# (No effect on a CPU or on Metal.) CUDA_GRAPHS_DEFAULTED: uag chose it, not the environment (benchmarks start peers
# such as mlx_lm.server as their users would: with MLX's own default).
CUDA_GRAPHS_DEFAULTED = "MLX_USE_CUDA_GRAPHS" not in os.environ
os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")
# uag never uses PyTorch; transformers' "PyTorch was not found" advice is noise for our users.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"

_EXPORTS = {
    "GenerationConfig": "uag.core.config",
    "DrafterSpec": "uag.core.config",
    "UserError": "uag.errors",
    "load": "uag.api",
    "load_drafter": "uag.api",
    "generate": "uag.api",
    "stream": "uag.api",
    "saved_profile": "uag.api",
    "Run": "uag.core.records",
    "Cycle": "uag.core.records",
    "CostProfile": "uag.core.costmodel",
}
__all__ = [
    "CostProfile",
    "Cycle",
    "DrafterSpec",
    "GenerationConfig",
    "Run",
    "UserError",
    "generate",
    "load",
    "load_drafter",
    "saved_profile",
    "stream",
    "__version__",
]

if TYPE_CHECKING:
    from uag.api import generate, load, load_drafter, saved_profile, stream
    from uag.core.config import DrafterSpec, GenerationConfig
    from uag.core.costmodel import CostProfile
    from uag.core.records import Cycle, Run
    from uag.errors import UserError


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'uag' has no attribute {name!r}")
