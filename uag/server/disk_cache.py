"""Conversation caches that survive a restart (`uag serve --cache-dir DIR`): a finished request's KV caches written
with mlx-lm's prompt-cache files, per API key and model, and read back by a later request — after a restart too —
whose prompt starts with what a file holds.

    disk = DiskCaches("~/.cache/uag/kv", max_bytes=8e9)
    caches = disk.take(owner, target, drafter, ids)   # on the worker: a file's caches, or None
    held = disk.hold(owner, target, drafter, caches)  # before the caches go back to the memory LRU
    disk.later(held)                                  # after the reply went out, still on the worker …
    disk.flush()                                      # … written when no other request waits for it

A file is named and checked by the API key's digest (`owner`), the model's identity (name, folder, dtype, config
and weight files: `model_identity`) and a hash of its tokens, with uag's format version; its header is read first,
and a file whose header, tokens, layers or contents (a SHA-256 over the arrays) do not match is skipped with a
warning, never loaded. Files load lazily (a request's prompt picks the one sharing its longest prefix, when the
memory LRU has nothing): the memory budget holds what is used now, and nothing is read for a key or a model that
never asks. A saved conversation replaces the files it shares most of their tokens with (its own earlier turns,
as the memory LRU reuses them: uag.server.prompt_cache); beyond `max_bytes` the least recently used file goes
first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from uag.core.translate import longest_common_prefix
from uag.server.prompt_cache import MIN_SHARED

log = logging.getLogger(__name__)

FORMAT = "1"  # uag's layout of a cache file's metadata; a file of another version is skipped
SUFFIX = ".safetensors"
PARTIAL = ".partial" + SUFFIX  # a file being written (renamed when whole)
MIN_TOKENS = 256  # a shorter head is read in a moment: neither saved nor looked for (uag.server.prompt_cache)
MAX_HEADER = 64 * 2**20  # bytes of a file's JSON header beyond which it is not a cache file of ours
DEFAULT_CACHE_DIR_GB = 8.0
MAX_PENDING = 4  # conversations whose caches wait for an idle worker to be written; beyond it the oldest is written


def model_identity(model: Any) -> str:
    """A digest of what a model's KV cache depends on: its name and folder, its dtype, its config and its weight
    files (sizes and modification times): a file made by another model, another dtype or weights converted again is
    foreign."""
    path = Path(model.path)
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.glob("*.safetensors"))
    who = {
        "format": FORMAT,
        "name": model.name,
        "path": str(path.resolve()),
        "dtype": model.dtype,
        "config": model.config,
        "weights": weights,
    }
    return hashlib.sha256(json.dumps(who, sort_keys=True, default=str).encode()).hexdigest()


def tokens_digest(ids: list[int]) -> str:
    """Example: tokens_digest([1, 2]) == tokens_digest([1, 2]) != tokens_digest([1, 2, 3])"""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def read_header(path: Path) -> dict[str, str]:
    """The uag metadata of a prompt-cache file (mlx-lm stores it under "0.<name>"), from its safetensors header
    alone (no arrays read); ValueError when the file is not one: too short, no JSON header, a size other than its
    header says, no uag format."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            raise ValueError("its header is too large to be a cache file's")
        raw = f.read(size)
    if len(raw) < size:
        raise ValueError("truncated in its header")
    header = json.loads(raw)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if path.stat().st_size != 8 + size + end:
        raise ValueError(f"{path.stat().st_size} bytes where its header says {8 + size + end}: truncated or padded")
    meta = header.get("__metadata__") or {}
    fields = {name[2:]: value for name, value in meta.items() if name.startswith("0.")}
    if "uag_format" not in fields:
        raise ValueError("not a uag prompt-cache file")
    return fields


@dataclass
class Saved:
    """One file as the index knows it (from its header)."""

    path: Path
    owner: str
    model: str
    tokens: list[int]
    drafter_model: str  # "" where the file holds no drafter cache
    drafter_ids: list[int]
    nbytes: int
    used: float  # last written or read (its modification time): the LRU's order


@dataclass
class Held:
    """A finished request's caches as they were when the reply ended (views that later runs cannot change)."""

    owner: str
    model: str
    tokens: list[int]
    arrays: list[Any]  # per layer (keys, values): the target's, then the drafter's
    target_layers: int
    drafter_model: str = ""
    drafter_ids: list[int] = field(default_factory=list)


class DiskCaches:
    """The files of `folder`, at most `max_bytes` of them (the least recently used go first); `min_tokens`: the
    shortest head saved or looked for. Every method but `__init__` runs on the MLX worker thread."""

    def __init__(self, folder: str | Path, max_bytes: float, *, min_tokens: int = MIN_TOKENS):
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.index: dict[Path, Saved] = {}
        self._warned: set[Path] = set()
        self.pending: list[Held] = []  # what `later` keeps for `flush`, oldest first
        self.saves = self.loads = self.skipped = 0
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            if path.name.endswith(PARTIAL):
                continue  # a write cut short: never whole
            try:
                self.index[path] = self._entry(path)
            except (OSError, ValueError, KeyError) as err:
                self._skip(path, f"it is not a readable uag cache file ({err})")
        if self.index:
            log.info("%d saved prompt caches in %s (%.2f GB)", len(self.index), self.folder, self.nbytes / 1e9)

    @property
    def nbytes(self) -> int:
        return sum(saved.nbytes for saved in self.index.values())

    def _entry(self, path: Path) -> Saved:
        fields = read_header(path)
        if fields["uag_format"] != FORMAT:
            raise ValueError(f"uag format {fields['uag_format']!r}, not {FORMAT!r}")
        tokens = json.loads(fields["tokens"])
        if tokens_digest(tokens) != fields["tokens_digest"]:
            raise ValueError("its tokens do not match their digest")
        stat = path.stat()
        return Saved(
            path,
            fields["owner"],
            fields["model"],
            tokens,
            fields.get("drafter_model", ""),
            json.loads(fields.get("drafter_ids", "[]")),
            stat.st_size,
            stat.st_mtime,
        )

    def _skip(self, path: Path, why: str) -> None:
        self.index.pop(path, None)
        if path not in self._warned:
            self._warned.add(path)
            self.skipped += 1
            log.warning("prompt cache file %s skipped: %s", path, why)

    # --- reading --------------------------------------------------------------------------------------------
    def take(self, owner: str, target: Any, drafter: Any, ids: list[int]) -> Any:
        """The `PromptCaches` of the file of `owner` and `target` sharing the longest prefix (at least `min_tokens`)
        with `ids`, its drafter cache too where `drafter` is the model that made it; None where none does."""
        model = model_identity(target)
        best, shared = None, self.min_tokens - 1
        for saved in list(self.index.values()):
            if saved.owner != owner:
                continue  # another key's: never read for this one
            common = longest_common_prefix(saved.tokens, ids)
            if saved.model != model:
                if common >= self.min_tokens:
                    self._skip(saved.path, "saved for another model, dtype or version of the weights")
                continue
            if common > shared:
                best, shared = saved, common
        if best is None:
            return None
        try:
            caches = self._load(best, target, drafter)
        except Exception as err:  # a file changed under us, truncated, or whose arrays do not add up: skipped
            self._skip(best.path, f"it could not be loaded ({err})")
            return None
        best.used = time.time()
        _touch(best.path)
        self.loads += 1
        return caches

    def _load(self, saved: Saved, target: Any, drafter: Any) -> Any:
        from mlx_lm.models.cache import KVCache, load_prompt_cache  # mlx here and below: the index is read without it

        from uag.core.passes import PromptCaches

        cache, meta = load_prompt_cache(str(saved.path), return_metadata=True)
        layers, n = int(meta["target_layers"]), len(saved.tokens)
        if (
            meta.get("owner") != saved.owner
            or meta.get("model") != saved.model
            or layers != len(target.make_cache())
            or not 0 < layers <= len(cache)
            or any(type(c) is not KVCache for c in cache)
            or any(c.offset != n for c in cache[:layers])
            or any(c.offset != len(saved.drafter_ids) for c in cache[layers:])
        ):
            raise ValueError("its layers do not match its header or the model")
        if contents_digest([a for c in cache for a in (c.keys, c.values)]) != meta["contents"]:
            raise ValueError("its arrays do not match their checksum")
        caches = PromptCaches(target_cache=cache[:layers], target_ids=list(saved.tokens), target_model=target.name)
        if drafter is not None and cache[layers:] and saved.drafter_model == model_identity(drafter):
            caches.drafter_cache, caches.drafter_ids = cache[layers:], list(saved.drafter_ids)
            caches.drafter_model = drafter.name
        return caches

    # --- writing --------------------------------------------------------------------------------------------
    def hold(self, owner: str, target: Any, drafter: Any, caches: Any) -> Held | None:
        """What `save` writes of a finished request's `caches`, taken before they go back to the memory LRU (where
        the next request may extend them): None when they hold fewer than `min_tokens` or are not plain KV caches."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache

        ids, cache = list(caches.target_ids), caches.target_cache
        if (
            len(ids) < self.min_tokens
            or not cache
            or any(type(c) is not KVCache or c.offset != len(ids) for c in cache)
        ):
            return None
        arrays = _views(cache)
        held = Held(owner, model_identity(target), ids, arrays, len(cache))
        d_cache, d_ids = caches.drafter_cache, list(caches.drafter_ids)
        if (
            drafter is not None
            and d_cache
            and caches.drafter_model == drafter.name
            and all(type(c) is KVCache and c.offset == len(d_ids) for c in d_cache)
        ):
            held.arrays += _views(d_cache)
            held.drafter_model, held.drafter_ids = model_identity(drafter), d_ids
        mx.eval(held.arrays)  # views of what the caches hold now (a later run's writes copy, never change them)
        return held

    def later(self, held: Held) -> None:
        """Keep `held` to be written by `flush` (the server calls it when no other request waits), in place of what
        its conversation left pending before; beyond `MAX_PENDING` conversations the oldest is written now."""
        self.pending = [p for p in self.pending if not _replaces(held, p.owner, p.model, p.tokens)] + [held]
        while len(self.pending) > MAX_PENDING:
            self.save(self.pending.pop(0))

    def flush(self) -> None:
        """Write every pending conversation's caches."""
        while self.pending:
            self.save(self.pending.pop(0))

    def save(self, held: Held) -> Path | None:
        """Write `held` as a file (replacing the files of its conversation's earlier turns), then drop the least
        recently used files beyond `max_bytes`; a failure is logged, never raised (the reply has gone out)."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, save_prompt_cache

        digest = tokens_digest(held.tokens)
        path = self.folder / f"{held.owner[:16]}-{held.model[:16]}-{digest[:24]}{SUFFIX}"
        if path in self.index and _touch(path):  # the same head again: only its use counts
            self.index[path].used = time.time()
            return path
        partial = path.with_name(path.name.removesuffix(SUFFIX) + PARTIAL)
        try:
            arrays = [mx.contiguous(a) for a in held.arrays]
            mx.eval(arrays)
            layers = []
            for keys, values in zip(arrays[::2], arrays[1::2]):
                layer = KVCache()
                layer.state = (keys, values, keys.shape[2])
                layers.append(layer)
            meta = {
                "uag_format": FORMAT,
                "owner": held.owner,
                "model": held.model,
                "tokens": json.dumps(held.tokens),
                "tokens_digest": digest,
                "target_layers": str(held.target_layers),
                "drafter_model": held.drafter_model,
                "drafter_ids": json.dumps(held.drafter_ids),
                "contents": contents_digest(arrays),
            }
            save_prompt_cache(str(partial), layers, meta)
            os.replace(partial, path)
            self.index[path] = self._entry(path)
        except Exception:
            log.warning("saving a prompt cache to %s failed", self.folder, exc_info=True)
            partial.unlink(missing_ok=True)
            return None
        self.saves += 1
        for saved in list(self.index.values()):  # this conversation's earlier turns: this file holds what they share
            if saved.path != path and _replaces(held, saved.owner, saved.model, saved.tokens):
                self._remove(saved)
        self._evict()
        return path

    def _evict(self) -> None:
        while self.index and self.nbytes > self.max_bytes:
            self._remove(min(self.index.values(), key=lambda saved: saved.used))

    def _remove(self, saved: Saved) -> None:
        self.index.pop(saved.path, None)
        saved.path.unlink(missing_ok=True)


def _replaces(held: Held, owner: str, model: str, tokens: list[int]) -> bool:
    """Whether `held` stands for a conversation's earlier turn (`owner`, `model`, `tokens`): the same key and model,
    and most of its tokens (`MIN_SHARED`, as the memory LRU reuses an entry) at its start.

    Example: held [1, 2, 3, 4, 5] replaces [1, 2, 3, 9] (3 of 4 shared), not [1, 7, 8, 9] (1 of 4)
    """
    return (
        owner == held.owner
        and model == held.model
        and longest_common_prefix(tokens, held.tokens) >= MIN_SHARED * len(tokens)
    )


def _views(cache: list) -> list[Any]:
    """Each layer's keys and values as far as it holds them (its buffers run ahead in steps)."""
    return [a[..., : c.offset, :] for c in cache for a in (c.keys, c.values)]


def _touch(path: Path) -> bool:
    """Mark a file used now (the LRU's order survives a restart); False when it is gone."""
    try:
        os.utime(path)
    except OSError:
        return False
    return True


def contents_digest(arrays: list[Any]) -> str:
    """A SHA-256 over the arrays' bytes, in order (contiguous arrays: as saved, or as loaded)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(str((a.dtype, a.shape)).encode())
        h.update(memoryview(a))
    return h.hexdigest()
