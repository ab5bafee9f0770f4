"""Loading target and drafter models with mlx-lm, once each, with the checks speculation needs.

A model is named by a hub id ("mlx-community/Qwen2.5-1.5B-Instruct-4bit"), a local directory, or one
of the embedded offline demo models ("demo-target", "demo-drafter", converted on first use).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, can_trim_prompt_cache, make_prompt_cache

from uag import _blas
from uag.errors import ModelError
from uag.vocab import HFVocab, same_vocabulary

DEMO_NAMES = ("demo-target", "demo-drafter")
# Architectures whose sliding-window layers build the window into the attention mask, so those layers
# can use a plain (always trimmable) KVCache instead of a RotatingKVCache, which stops being trimmable
# once it wraps around (checked against the rotating cache in tests/test_engine.py).
WINDOW_MASKED = frozenset({"gemma3_text", "gemma3"})


@dataclass
class LoadedModel:
    """An mlx-lm model with its tokenizer and what uag needs to know about it."""

    name: str
    path: Path
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict = field(default_factory=dict)

    @cached_property
    def vocab(self) -> HFVocab:
        return HFVocab(self.tokenizer)

    @cached_property
    def weight_bytes(self) -> int:
        """Bytes of all parameters as loaded (quantized weights count packed): the cost model's r."""
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    @property
    def dtype(self) -> str:
        dtypes = {v.dtype for _, v in tree_flatten(self.model.parameters())}
        floats = sorted(str(d).removeprefix("mlx.core.") for d in dtypes if mx.issubdtype(d, mx.floating))
        quant = self.config.get("quantization") or self.config.get("quantization_config")
        base = "/".join(floats) or "?"
        return f"{quant['bits']}-bit ({base})" if isinstance(quant, dict) and "bits" in quant else base

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.eos_token_ids)

    @property
    def context_length(self) -> int | None:
        cfg = self.config.get("text_config", self.config)
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
        return None

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    def make_cache(self) -> list:
        """A fresh KV cache; sliding-window layers get a trimmable cache where that is exact."""
        cache = make_prompt_cache(self.model)
        if self.model_type in WINDOW_MASKED:
            cache = [KVCache() if isinstance(c, RotatingKVCache) else c for c in cache]
        return cache

    def check_trimmable(self, role: str) -> None:
        cache = self.make_cache()
        if not can_trim_prompt_cache(cache):
            kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
            raise ModelError(
                f"{role} {self.name!r} keeps a KV cache that cannot be trimmed ({', '.join(kinds)}): "
                "rejected drafts could not be rolled back, so speculative decoding is impossible with it"
            )


def default_dtype() -> str:
    """The dtype the demo models run in, chosen by measurement (README, "Which dtype").

    CPU: only float32 (with OpenBLAS) lets a k-token verification cost less than k decode steps;
    bf16 and quantized CPU kernels do not amortise. GPU (H100, MLX-CUDA): the demo models are so small
    that a step is launch-bound (bf16 8.1 ms, float32 10.3 ms), and in bf16 a k-token verification
    rounds differently from k single steps, so greedy speculation parted from the baseline at a near-tie
    (benchmarks/auto_vs_fixed.py stopped on its first prompt); float32 reproduced it in every run. The
    demo pair exists to show lossless speculation, so it runs in float32 everywhere.
    """
    return "float32"


class ModelStore:
    """Loads each model once and hands out the same `LoadedModel` afterwards (thread-safe)."""

    def __init__(self, *, dtype: str | None = None):
        self.dtype = dtype
        self._models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self._models

    @property
    def loaded(self) -> list[str]:
        return list(self._models)

    def get(self, name: str, *, progress: Callable[[str], None] | None = None) -> LoadedModel:
        name = (name or "").strip()
        if not name:
            raise ModelError("no model given")
        with self._lock:
            if name not in self._models:
                self._models[name] = _load(name, dtype=self.dtype, progress=progress)
            return self._models[name]


def _resolve(name: str, progress: Callable[[str], None] | None) -> Path | str:
    if name in DEMO_NAMES:
        from uag import demo

        return demo.ensure(name, progress=progress)
    path = Path(name).expanduser()
    looks_local = name.startswith((".", "/", "~")) or path.exists() or name.count("/") != 1
    if looks_local:
        if not path.is_dir():
            raise ModelError(f"no model directory at {str(path)!r}")
        if not (path / "config.json").exists():
            raise ModelError(f"{str(path)!r} is not an mlx-lm model directory (no config.json)")
        return path
    return name  # a hub id: mlx-lm fetches it, or finds it in the Hugging Face cache


def _load(name: str, *, dtype: str | None, progress: Callable[[str], None] | None) -> LoadedModel:
    import mlx_lm
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    source = _resolve(name, progress)
    if progress:
        progress(f"loading {name}")
    try:
        model, tokenizer, config = mlx_lm.load(str(source), return_config=True)
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError) as err:
        raise ModelError(
            f"cannot load {name!r}: it is not a local directory, not in the Hugging Face cache, and the "
            f"hub could not provide it ({type(err).__name__}). Check the id, or the network."
        ) from None
    except (FileNotFoundError, ValueError) as err:
        raise ModelError(f"cannot load {name!r}: {err}") from None
    if name in DEMO_NAMES:
        model.set_dtype(getattr(mx, dtype or default_dtype()))
        mx.eval(model.parameters())
    path = source if isinstance(source, Path) else Path(mlx_lm.utils.hf_repo_to_path(name))
    return LoadedModel(name=name, path=path, model=model, tokenizer=tokenizer, config=config)


@dataclass(frozen=True)
class Pair:
    """A target and a drafter checked for speculation, with what the user should know about them."""

    target: LoadedModel
    drafter: LoadedModel
    shared_vocabulary: bool
    notes: tuple[str, ...] = ()

    @property
    def r(self) -> float:
        """Drafter bytes / target bytes (the cost model's r)."""
        return self.drafter.weight_bytes / self.target.weight_bytes


def check_pair(target: LoadedModel, drafter: LoadedModel) -> Pair:
    """Fail with a clear message if this pair cannot speculate; note what is unusual about it."""
    target.check_trimmable("target")
    drafter.check_trimmable("drafter")
    notes = []
    if target is drafter or target.path.resolve() == drafter.path.resolve():
        notes.append(
            "the drafter is the target itself: every draft is accepted, so the run measures only speculation's overhead"
        )
    shared = same_vocabulary(target.vocab, drafter.vocab)
    if shared:
        notes.append("target and drafter share a vocabulary: drafts pass without translation")
    if blas := _blas.slow_cpu_note(mx.default_device().type.name):
        notes.append(blas)
    return Pair(target, drafter, shared, tuple(notes))
