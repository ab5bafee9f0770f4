"""uag: cross-tokenizer speculative decoding (Universal Assisted Generation) on MLX."""

import os

from uag._blas import preload_openblas

preload_openblas()  # must run before anything imports mlx.core
# uag never uses PyTorch; transformers' "PyTorch was not found" advice is noise for our users.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
