"""Forward passes and KV caches: the few mlx operations the target and the drafter share, and the caches
a conversation keeps from one run to the next (`PromptCaches`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from uag.core.kept_caches import KeptCaches, RowCache, placed, trees_fit
from uag.core.translate import longest_common_prefix
from uag.core.verify import Tree, TreeVerdict, accept_tree

if TYPE_CHECKING:
    from uag.core.lookup import NgramIndex

PREFILL_STEP = 2048  # tokens per forward pass when reading a long stretch (a prompt), as mlx-lm's generate_step


def prefill(model, cache: list, ids: Sequence[int]) -> mx.array | None:
    """Feed `ids` in chunks; return the last position's logits (None when `ids` is empty)."""
    logits = None
    for start in range(0, len(ids), PREFILL_STEP):
        logits = model(mx.array(ids[start : start + PREFILL_STEP])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return None if logits is None else logits[:, -1, :]


def trim_to(cache: list, length: int) -> None:
    """Trim the cache back to `length` tokens with mlx-lm's `trim_prompt_cache` (a no-op where it holds fewer,
    and for a cache mlx-lm cannot trim, such as a recurrent layer's state, which a baseline run may keep)."""
    if not cache or not can_trim_prompt_cache(cache):
        return
    extra = cache[0].offset - length
    if extra > 0:
        trim_prompt_cache(cache, extra)


@dataclass(repr=False)
class PromptCaches:
    """The KV caches of one conversation, kept between its runs so that a later turn reads only its new tokens.

    `target_cache` holds exactly `target_ids` (target tokens); `drafter_cache` holds exactly `drafter_ids` (the
    drafter model's tokens for the same text, as its translator wrote them). A run given this object trims
    each cache to the longest common prefix of what it holds and what the run must read, reads the rest,
    and when it ends (also when stopped or cancelled) leaves the object describing what the caches then
    hold: every committed token but the newest. A run that fails part way leaves it empty. `target_model`
    and `drafter_model` name the models that filled the caches, whose caches no other model reuses (None: a
    cache its maker gives with the model it belongs to). `lookup`: prompt lookup's n-gram index of the last run
    (uag.core.lookup.NgramIndex, over its prompt and every token it committed), which a later run whose prompt
    goes on from those tokens extends rather than index its prompt anew (about 0.6 KB a token, which `nbytes` leaves
    out: a KV cache holds tens of KB a token).
    """

    target_cache: list | None = None
    target_ids: list[int] = field(default_factory=list)
    drafter_cache: list | None = None
    drafter_ids: list[int] = field(default_factory=list)
    target_model: str | None = None
    drafter_model: str | None = None
    lookup: NgramIndex | None = None

    @classmethod
    def empty(cls) -> PromptCaches:
        return cls()

    def nbytes(self) -> int:
        """Memory the caches take (their allocated buffers, which grow in steps ahead of what they hold)."""
        return sum(c.nbytes for c in [*(self.target_cache or ()), *(self.drafter_cache or ())])

    def __repr__(self) -> str:
        return (
            f"PromptCaches(target {self.target_model!r}: {len(self.target_ids)} tokens, drafter {self.drafter_model!r}:"
            f" {len(self.drafter_ids)} tokens, {self.nbytes() / 1e6:.1f} MB)"
        )

    def clear(self) -> None:
        """Forget both caches (their contents are unknown, say after a failed pass)."""
        self.target_cache, self.target_ids, self.target_model = None, [], None
        self.drafter_cache, self.drafter_ids, self.drafter_model = None, [], None
        self.lookup = None

    def prefix(self, n: int) -> PromptCaches | None:
        """A copy of the target cache's first `n` tokens, this one left as it is (the drafter's cache is not copied:
        a drafter model reads its prompt anew). None where the target cache holds fewer or is not plain KV caches.

        Example: holding [5, 6, 7, 8] -> prefix(2) holds [5, 6] in caches of its own
        """
        cache = self.target_cache
        held = cache[0].offset if cache and all(type(c) is KVCache for c in cache) else -1
        if held != len(self.target_ids) or not 0 < n <= held:
            return None
        copies = []
        for layer in cache:
            copy = KVCache()
            copy.keys = mx.contiguous(layer.keys[..., :n, :])
            copy.values = mx.contiguous(layer.values[..., :n, :])
            copy.offset = n
            copies.append(copy)
        mx.eval([c.state for c in copies])
        return PromptCaches(target_cache=copies, target_ids=self.target_ids[:n], target_model=self.target_model)

    def keep(self, committed: list[int], failed: bool) -> None:
        """Say what the target's cache holds after a run: every committed token but the newest. After a failure
        (a pass that raised part way) neither cache's contents are known: both are dropped. So is a cache
        mlx-lm cannot trim, which the next run could not cut back to what it shares with its prompt."""
        cache = self.target_cache
        if failed:
            self.clear()
        elif cache and can_trim_prompt_cache(cache) and cache[0].offset == len(committed) - 1:
            self.target_ids = committed[:-1]
        else:
            self.target_cache, self.target_ids, self.target_model = None, [], None


def reuse(cache: list | None, held: Sequence[int], ids: Sequence[int], make: Callable[[], list]) -> tuple[list, int]:
    """A cache to read `ids` into, and how many of them it holds already: `cache` (holding `held`) trimmed to
    the longest common prefix of `held` and `ids`, but never to all of `ids` (the last one is read again: its
    logits are what the run starts from). A cold read, with a fresh cache from `make`, where there is no
    cache, where mlx-lm cannot trim it (a recurrent layer's state, a rotating window that wrapped), or where
    it does not hold len(held) tokens.

    Example: held [1, 2, 3, 4], ids [1, 2, 5] -> the cache trimmed to 2 tokens, 2
             held [1, 2, 3],    ids [1, 2, 3] -> the cache trimmed to 2 tokens, 2
    """
    if not cache or not can_trim_prompt_cache(cache) or cache[0].offset != len(held):
        return make(), 0
    n = max(0, min(longest_common_prefix(held, ids), len(ids) - 1))
    trim_to(cache, n)
    return cache, n


def logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def settle_allocator() -> None:
    """Charge a forward pass's memory clean-up to that pass, not to whatever allocates next.

    A forward pass frees thousands of small buffers into glibc's fastbins; the next sizeable malloc
    merges them all (docs/results.md#engine-overhead-benchmarksengine_overheadpy). Without this, that cost
    lands in the first tokenizer call of the translation phase. Allocating above pymalloc's 512-byte
    limit triggers the merge here instead; total time is unchanged.
    """
    bytearray(4096)


# --- passes shared by several requests (continuous batching: uag.runtime.batching) -------------------------------


def mergeable(cache: list) -> bool:
    """Whether mlx-lm can merge this kind of cache into a batch (its KV caches, plain and rotating, can)."""
    return bool(cache) and all(hasattr(c, "merge") and hasattr(c, "update_and_fetch") for c in cache)


def batched_pass(model, inputs: Sequence[mx.array], caches: Sequence[list]) -> list[mx.array]:
    """One forward pass over several sequences, each with its own cache: the logits each would get alone.

    Each sequence's cache is merged with the others' (left padded, mlx-lm's `BatchKVCache`); its new tokens
    are right padded to the longest (padding after a row's tokens cannot reach them: the mask is causal). The
    keys and values the pass computes for each row's own tokens are appended to that row's cache, so that every
    cache ends as a pass of its own would leave it; the padding's are dropped with the merged cache. Merging
    copies every cache (on a CPU, 40-60 % of a pass over four 1,000-token conversations): a batch runs plain KV
    caches on caches it keeps merged instead (uag.core.kept_caches), and this pass the caches they cannot hold.

    Example: inputs of widths [1, 5, 3] -> one pass over 3 × 5 tokens; logits of shapes (1, 1, V), (1, 5, V),
             (1, 3, V)
    """
    widths = [int(x.shape[-1]) for x in inputs]
    width = max(widths)
    rows = [mx.pad(x.reshape(1, -1).astype(mx.int32), [(0, 0), (0, width - w)]) for x, w in zip(inputs, widths)]
    merged = [_merge(list(layer), room=width) for layer in zip(*caches)]
    fresh = []
    for batch in merged:
        computed: list = []
        batch.update_and_fetch = _recorded(type(batch).update_and_fetch.__get__(batch), computed)
        fresh.append(computed)
    logits = model(mx.concatenate(rows), cache=merged)
    for row, (cache, w) in enumerate(zip(caches, widths)):
        for layer, computed in zip(cache, fresh):
            keys, values = computed[0]
            layer.update_and_fetch(keys[row : row + 1, :, :w], values[row : row + 1, :, :w])
    return [logits[row : row + 1, :w] for row, w in enumerate(widths)]


def _recorded(update: Callable, into: list) -> Callable:
    """A merged cache's `update_and_fetch` that also keeps the new keys and values it is handed."""

    def update_and_fetch(keys: mx.array, values: mx.array):
        into.append((keys, values))
        return update(keys, values)

    return update_and_fetch


def _merge(layer: list, room: int):
    """One layer's caches merged into a batch cache, with room for `room` more tokens when they are plain KV
    caches (mlx-lm's own merge leaves none: the pass would copy the whole cache again to grow it)."""
    if not all(type(c) is KVCache for c in layer):
        return layer[0].merge(layer)
    lengths = [c.offset if c.keys is not None else 0 for c in layer]
    longest = max(lengths)
    filled = next((c for c in layer if c.keys is not None), None)
    batch = BatchKVCache([longest - n for n in lengths])
    if filled is None:
        return batch
    _, heads, _, k_dim = filled.keys.shape
    v_dim = filled.values.shape[3]
    keys = mx.zeros((len(layer), heads, longest + room, k_dim), dtype=filled.keys.dtype)
    values = mx.zeros((len(layer), heads, longest + room, v_dim), dtype=filled.values.dtype)
    for row, (c, n) in enumerate(zip(layer, lengths)):
        if n:
            keys[row : row + 1, :, longest - n : longest] = c.keys[..., :n, :]
            values[row : row + 1, :, longest - n : longest] = c.values[..., :n, :]
    batch.keys, batch.values, batch._idx = keys, values, longest
    batch.offset = mx.array(lengths)
    return batch


def kv_bytes(model, tokens: int) -> int:
    """Bytes a sequence of `tokens` takes in the model's KV caches (a sliding-window layer holds its window at
    most), from the model's shapes: what a request's caches will need, before it runs.

    Example: 28 layers, 2 KV heads of 128, float32, 1,000 tokens -> 28 · 2 · 2 · 128 · 4 · 1,000 = 57.3 MB
    """
    args = model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    weights = (v for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    itemsize = next(weights).itemsize
    total = 0
    for layer in make_prompt_cache(model):
        held = min(tokens, layer.max_size) if getattr(layer, "max_size", None) else tokens
        total += 2 * heads * head_dim * itemsize * held
    return total


# --- several proposals in one pass (a tree: uag.core.verify.Tree) ------------------------------------------------


@runtime_checkable
class Shareable(Protocol):
    """A model that requests running together share (uag.runtime.batching.SharedModel): `alone()` says whether a
    call made now is the model's own (no other request's pass waits on it), so that a caller may change the model
    for one pass; `verify` hands a verifying pass (one proposal, or a tree of them) to the batch, which reads it
    beside the others' passes and, where the target picks each row by its argmax, reads the picks with it."""

    def alone(self) -> bool: ...

    def verify(
        self, inputs: mx.array, cache: list, tree: Tree | None = None, greedy: bool = True
    ) -> tuple[mx.array, list[int] | None]: ...


def verify_pass(
    model, inputs: mx.array, cache: list, *, tree: Tree | None = None, greedy: bool = False
) -> tuple[mx.array, list[int] | None]:
    """A pass that verifies (`inputs` (1, w): the pending token, then a proposal or a tree's tokens): the model's
    logits (1, w, V), and where `greedy` (the target picks each row by its argmax: TargetSampling.by_argmax) and the
    pass ran in a batch beside others', the target's picks, read with the pass: one read-back for all of a round's
    members rather than one each after it (each a launch and a wait on a GPU; no gain in throughput measured on an
    H200 or a CPU: docs/results.md, df, dg). Else None: the caller picks. A tree's nodes are placed at their
    depths (`tree_pass`)."""
    if tree is None:
        if greedy and isinstance(model, Shareable):  # its batch's pass, or where it runs alone the model's own call
            return model.verify(inputs, cache)
        return model(inputs, cache=cache), None
    if isinstance(model, Shareable) and not model.alone():
        return model.verify(inputs, cache, tree, greedy)
    return _tree_pass(model, inputs, cache, tree), None


def tree_ready(model, cache: list, sampling, *, batched: bool = False) -> bool:
    """Whether a tree pass can verify several proposals at once: a model of its own outside a batch (`batched`: the
    run is in one) or a `Shareable` one while the request runs alone (the pass changes the model's ropes), on plain
    KV caches (a rotating or quantized one cannot take its keys back in place); a `Shareable` one with others, on
    caches its batch keeps merged (`KeptCaches.keepable`: the batch reads the tree beside their passes); attention
    layers with a `rope` to place each node, and a target that picks each row alone (no penalties, which read the
    tokens before a row, and no grammar, which follows one proposal)."""
    if not cache or sampling.processors or sampling.grammar is not None or not trees_fit(model):
        return False
    if isinstance(model, Shareable) and not model.alone():
        fits = KeptCaches.keepable(cache)
    else:
        own = isinstance(model, Shareable) or (isinstance(model, nn.Module) and not batched)
        fits = own and all(type(c) is KVCache for c in cache)
    return fits and len(model.layers) == len(cache)


def verify_tree(
    model, cache: list, pending: int, proposals: Sequence[Sequence[int]], pick, greedy: bool = False
) -> TreeVerdict:
    """One target pass over the pending token and every proposal, merged into a tree; the target's choice per row
    (`pick`: TargetSampling.ids, or the picks a batch read with the pass where `greedy`: `verify_pass`) walks it
    (uag.core.verify.accept_tree), and the cache is left holding the pending token and the kept nodes, as if it had
    read them alone (`keep_path`).

    Example: pending 7, proposals [[5, 6], [5, 8]] -> one pass over [7, 5, 6, 8]; the target choosing 5 then 8:
             path [0, 2] (5, 8), cache + [7, 5, 8], branch 1
    """
    tree = Tree.of(proposals)
    read = cache[0].offset
    logits, picks = verify_pass(model, mx.array([pending, *tree.tokens])[None], cache, tree=tree, greedy=greedy)
    verdict = accept_tree(tree, pick(logits[0]) if picks is None else picks)
    keep_path(cache, read + 1, verdict.path)
    settle_allocator()
    return verdict


def tree_pass(model, cache: list, pending: int, tree: Tree) -> mx.array:
    """The model's logits (1, 1 + len(tree), V) over [pending, *tree.tokens]: each row attends to the cached
    text, the pending token and its own ancestors (the tree mask, through each layer's `make_mask`), at the
    position of its depth (each attention layer's `rope` applied per run of consecutive positions, for this pass).
    A member of a server's batch running with others hands it to the batch (`Shareable.verify`)."""
    return verify_pass(model, mx.array([pending, *tree.tokens])[None], cache, tree=tree)[0]


def _tree_pass(model, inputs: mx.array, cache: list, tree: Tree) -> mx.array:
    """`tree_pass` on the model's own plain caches."""
    read, depths = cache[0].offset, [0, *tree.depths]
    positions = read + mx.array(depths)
    mask = mx.concatenate([mx.ones((len(depths), read), dtype=mx.bool_), mx.array(tree.mask())], axis=1)
    with placed(model, [depths], positions[None]):
        layers = [_TreeCache(c, mask, positions) for c in cache]
        return model(inputs, cache=layers)


def keep_path(cache: list, start: int, path: Sequence[int]) -> None:
    """After a tree pass that read from position `start - 1`: the kept nodes' keys and values (node i at
    start + i) moved to follow position `start - 1` in order, and the cache trimmed after them.

    A row of a batch's kept caches copies nothing: the other nodes become holes (`KeptCaches.keep_path`).

    Example: start 10, path [0, 3] -> positions 10 and 13 copied to 10 and 11; the cache holds 12
    """
    if isinstance(cache[0], RowCache):
        cache[0].kept.keep_path(cache, start, path)
        return
    if list(path) != list(range(len(path))):  # the first proposal's kept nodes are in place already
        rows = mx.array([start + i for i in path])
        for layer in cache:
            layer.keys[..., start : start + len(path), :] = mx.take(layer.keys, rows, axis=2)
            layer.values[..., start : start + len(path), :] = mx.take(layer.values, rows, axis=2)
    trim_to(cache, start + len(path))


class _TreeCache:
    """A layer's KV cache for one tree pass: its own offset and `update_and_fetch`, the tree's mask (within a
    sliding window where the model asks for one, by the rows' positions)."""

    def __init__(self, cache: KVCache, mask: mx.array, positions: mx.array):
        self.cache, self.mask, self.positions = cache, mask, positions

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self.cache.update_and_fetch(keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        assert n == self.mask.shape[0], (n, self.mask.shape)
        if window_size is None:
            return self.mask
        columns = mx.concatenate([mx.arange(self.mask.shape[1] - n), self.positions])
        return self.mask & (self.positions[:, None] - columns[None] < window_size)
