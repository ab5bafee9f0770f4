"""Loading target and drafter models with mlx-lm, once each, with the checks speculation needs.

A model is named by a hub id ("mlx-community/Qwen2.5-1.5B-Instruct-4bit"), a local directory, or one
of the embedded offline demo models ("demo-target", "demo-drafter", converted on first use).
"""

from __future__ import annotations

import gc
import json
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, can_trim_prompt_cache, make_prompt_cache

from uag import _blas
from uag.errors import ModelError
from uag.models import demo, memory
from uag.models.demo import DEMO_NAMES
from uag.models.dtypes import parse_dtype
from uag.models.loading import local_folder
from uag.models.vocab import HFVocab, same_vocabulary

# Architectures whose sliding-window layers build the window into the attention mask, so those layers
# can use a plain (always trimmable) KVCache instead of a RotatingKVCache, which stops being trimmable
# once it wraps around (checked against the rotating cache in tests/core/test_engine.py).
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

    @cached_property
    def dtype(self) -> str:
        """The loaded weights' float dtypes ("float32", "4-bit (bfloat16)"…), found once: a server reads it at every
        request (the keys of auto's profiles and evidence)."""
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
    """The dtype the demo models run in, chosen by measurement (docs/results.md#which-dtype-benchmarksdtype_costpy).

    CPU: only float32 (with OpenBLAS) lets a k-token verification cost less than k decode steps;
    bf16 and quantized CPU kernels do not amortise. GPU (MLX-CUDA): the demo models are so small that a
    step is launch-bound whatever the dtype, and in bf16 a k-token verification rounds differently from k
    single steps, so greedy speculation can part from the baseline at a near-tie; float32 reproduced it in
    every run. The demo pair exists to show lossless speculation, so it runs in float32 everywhere.
    """
    return "float32"


class ModelStore:
    """Loads each model once per resolved identity and hands out the same `LoadedModel` afterwards
    (thread-safe). `x`, `x/`, `x//` and `./x` are one folder, so one model.

    A model is held per dtype (`get(name, dtype="q4")`, uag.models.dtypes): each dtype is a model of its own.

    With `max_models` or `max_gb` it keeps at most that many models, or that many GB of weights, and
    unloads the least recently used first (never one named in `keep`, in any dtype, nor the one just loaded, nor
    one `pinned` by a run still using it). `on_evict` callbacks hear of each model unloaded, so that holders of
    references can drop them.
    """

    def __init__(self, *, dtype: str | None = None, max_models: int | None = None, max_gb: float | None = None):
        if max_models is not None and max_models < 2:
            raise ValueError(f"max_models must be at least 2: a target and its drafter (got {max_models})")
        self.dtype = dtype
        self.max_models = max_models
        self.max_bytes = None if max_gb is None else max_gb * 1e9
        self.on_evict: list[Callable[[LoadedModel], None]] = []
        # (identity, dtype) -> model, least recently used first; dtype None: as stored
        self._models: OrderedDict[tuple[str, str | None], LoadedModel] = OrderedDict()
        self._pins: Counter[tuple[str, str | None]] = Counter()  # runs using each model now (`pinned`)
        self._lock = threading.RLock()

    @staticmethod
    def identity(name: str) -> str:
        """The key a model is stored under: a folder's resolved path, else the name (hub id, demo name).

        Example: identity("x/") == identity("./x") == identity("x//") == "/abs/path/x";  identity("org/m") -> "org/m"
        """
        name = (name or "").strip()
        if name in DEMO_NAMES:
            return name
        path = Path(name).expanduser()
        if name.startswith((".", "/", "~")) or path.exists() or name.count("/") != 1:
            return str(path.resolve())
        return name

    def __contains__(self, name: str) -> bool:
        return any(identity == self.identity(name) for identity, _ in list(self._models))

    def key(self, name: str, dtype: str | None = None) -> tuple[str, str | None]:
        """What `get(name, dtype=dtype)` holds the model under: its identity and the dtype it loads in (None: as
        stored; an offline model's default is the store's dtype, else default_dtype()).

        Example: key("demo-target") == key("demo-target", "float32") == ("demo-target", "float32")
        """
        identity = self.identity(name)
        dtype = parse_dtype(dtype)
        if identity in DEMO_NAMES:
            dtype = dtype or parse_dtype(self.dtype) or default_dtype()
        return identity, dtype

    def has(self, name: str, dtype: str | None = None) -> bool:
        """Whether `get(name, dtype=dtype)` would return a model already loaded."""
        return self.key(name, dtype) in self._models

    @property
    def loaded(self) -> list[str]:
        """The loaded models' names as first asked for, least recently used first."""
        return [model.name for model in list(self._models.values())]

    @property
    def weight_bytes(self) -> int:
        return sum(model.weight_bytes for model in list(self._models.values()))

    def holds(self, model: LoadedModel) -> bool:
        """Whether `model` is still loaded here (not unloaded to make room)."""
        return any(held is model for held in list(self._models.values()))

    def get(
        self,
        name: str,
        *,
        dtype: str | None = None,
        progress: Callable[[str], None] | None = None,
        keep: Collection[str] = (),
    ) -> LoadedModel:
        """The model `name` in `dtype` (uag.models.dtypes; None: as stored, an offline model in the store's dtype),
        loaded on first use; a dtype it is not stored in is converted once into the user cache (uag.models.demo)."""
        name = (name or "").strip()
        if not name:
            raise ModelError("no model given")
        key = self.key(name, dtype)
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            if Path(key[0]).is_absolute():
                _check_folder(name, Path(key[0]))
            protected = {key[0], *map(self.identity, keep)}
            # Room first, so that the store never holds the new model on top of a budget's worth of others; then
            # again, for a model whose size its files could not tell before it loaded (a hub id not downloaded).
            incoming = self.size_on_disk(name, key[1]) if self.max_bytes is not None else None
            self._evict(protected, coming=[incoming])
            model = _load(name, dtype=key[1], progress=progress)
            self._models[key] = model
            self._evict(protected)
            return model

    @contextmanager
    def pinned(self, *models: LoadedModel | None) -> Iterator[None]:
        """Hold `models` (None: skipped) loaded while the block runs, whatever the budget: a request generating
        with them, or batched beside one that loads another model. Pins count, so that runs sharing a model each
        hold it; once none does, a store over its budget unloads down to it.

        Example: with store.pinned(target): store.get("other") unloads the least recently used model but `target`
        """
        with self._lock:
            keys = [key for key, held in self._models.items() if any(held is model for model in models)]
            self._pins.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(keys)
                self._pins = +self._pins  # drop the models no run pins any more
                self._evict(protected=set())

    @property
    def pinned_names(self) -> list[str]:
        """The models a run pins now (`pinned`), as first asked for."""
        with self._lock:
            return [self._models[key].name for key in self._pins if key in self._models]

    def size_on_disk(self, name: str, dtype: str | None = None) -> int | None:
        """The bytes `get(name, dtype=dtype)` would load, from the model files' headers (nothing is loaded); None
        when its files are not on this machine yet."""
        identity, dtype = self.key(name, dtype)
        folder = local_folder(identity)
        return None if folder is None else memory.model_bytes(folder, dtype)

    def unloads_for(self, coming: Collection[int | None], keep: Collection[str] = ()) -> list[LoadedModel]:
        """The models this store would unload, least recently used first, to make room within its budget for
        models of `coming` bytes each (None: size unknown; none without a budget; never one in `keep` or pinned by a
        run).

        Example: max_gb=8, holding a (1 GB, least recently used) and b (6 GB): coming [2e9] -> [a]"""
        with self._lock:
            return [self._models[key] for key in self._unload_order({*map(self.identity, keep)}, list(coming))]

    def _unload_order(self, protected: set[str], coming: list[int | None]) -> list[tuple[str, str | None]]:
        count = len(self._models) + len(coming)
        held = self.weight_bytes + sum(size for size in coming if size is not None)
        chosen = []
        for key, model in self._models.items():  # least recently used first
            over_count = self.max_models is not None and count > self.max_models
            if not (over_count or (self.max_bytes is not None and held > self.max_bytes)):
                break
            if key[0] in protected or self._pins[key]:
                continue  # in use: kept, over budget or not
            chosen.append(key)
            count, held = count - 1, held - model.weight_bytes
        return chosen

    def _evict(self, protected: set[str], *, coming: Collection[int | None] = ()) -> None:
        """Unload the least recently used models beyond the budget, making room first for models about to load,
        `coming` bytes each (None: size unknown)."""
        self._unloaded([self._models.pop(key) for key in self._unload_order(protected, list(coming))])

    def clear(self) -> None:
        """Unload every model no run is using now (a server that has stopped, a notebook moving on); the holders
        of references hear of each through `on_evict` and drop them, so that the memory is freed."""
        with self._lock:
            self._unloaded([self._models.pop(key) for key in list(self._models) if not self._pins[key]])

    def _unloaded(self, evicted: list[LoadedModel]) -> None:
        for model in evicted:
            for callback in self.on_evict:
                callback(model)
        if evicted:
            del model
            evicted.clear()
            gc.collect()
            mx.clear_cache()


def _check_folder(name: str, path: Path) -> None:
    """Fail with a message the user can act on for a model folder mlx-lm would choke on: a config.json that
    is not JSON or names no model_type, a safetensors file cut short (a copy or download that stopped)."""
    config = path / "config.json"
    if not config.is_file():
        return  # resolve says what is missing
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        line = f" (line {err.lineno})" if isinstance(err, json.JSONDecodeError) else ""
        raise ModelError(f"cannot load {name!r}: its config.json is not valid JSON{line}") from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ModelError(
            f"cannot load {name!r}: its config.json names no model_type, so mlx-lm cannot tell which "
            'architecture it is (add e.g. "model_type": "llama")'
        )
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        try:
            with weights.open("rb") as file:
                (length,) = struct.unpack("<Q", file.read(8))
                header = json.loads(file.read(length)) if 8 + length <= size else None
            end = 8 + length + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError):
            header, end = None, size + 1
        if header is None or size < end:
            raise ModelError(
                f"cannot load {name!r}: {weights.name} is incomplete or damaged ({size:,} bytes"
                f"{f' of {end:,}' if header is not None else ''}): copy or download it again"
            )


def resolve(name: str, progress: Callable[[str], None] | None = None) -> Path | str:
    """Where mlx-lm loads `name` from: a demo model's folder (converted on first use), a local model folder
    (ModelError when it is not one), or the hub id itself."""
    if name in DEMO_NAMES:
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
    import mlx_lm  # mlx-lm (and transformers under it): loaded with the first model
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    source = resolve(name, progress)
    try:
        if dtype is not None and not (name in DEMO_NAMES and dtype == default_dtype()):
            source = _in_dtype(name, source, dtype, progress)
        if progress:
            progress(f"loading {name}" + (f" ({dtype})" if dtype else ""))
        model, tokenizer, config = mlx_lm.load(str(source), return_config=True)
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError):
        raise ModelError(
            f"cannot load {name!r}: it is not a local directory, not in the Hugging Face cache, and the "
            "hub could not provide it. Check the id, or the network."
        ) from None
    except (FileNotFoundError, ValueError) as err:
        raise ModelError(f"cannot load {name!r}: {err}") from None
    if name in DEMO_NAMES and dtype == default_dtype():  # the converted folder itself: float32 as it always was
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
    path = source if isinstance(source, Path) else Path(mlx_lm.utils.hf_repo_to_path(name))
    return LoadedModel(name=name, path=path, model=model, tokenizer=tokenizer, config=config)


def _in_dtype(name: str, source: Path | str, dtype: str, progress: Callable[[str], None] | None) -> Path:
    """The folder to load `name` from in `dtype`: its own when it is stored so, else a conversion cached in the
    user cache (uag.models.demo.in_dtype; a hub model is fetched first, as mlx-lm would)."""
    import mlx_lm.utils  # mlx-lm (and transformers under it): loaded with the first model

    folder = source if isinstance(source, Path) else Path(mlx_lm.utils._download(source))
    if memory.stored_dtype(folder) == dtype:
        return folder
    return demo.in_dtype(ModelStore.identity(name), folder, dtype, progress=progress)


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
