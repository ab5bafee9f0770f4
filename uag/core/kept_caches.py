"""A batch's KV caches kept merged between its passes: per model one storage, each member's cache a row of it.

Why holes rather than mlx-lm's `BatchKVCache`: speculation trims every row by a different amount every cycle, and a
left-padded cache can only trim all rows alike; here every slot carries its token's position (the rope position),
a pass writes all rows' new tokens at one shared slot index, and a trim only shortens its row: the slots it gave up
become holes the next pass masks out. A pass copies nothing (but gathers rows that are not next to each other);
one gather compacts the holes once they pass a quarter of the longest row. The engine keeps "its cache": the
list's entries are `RowCache`s while it is a row, plain `KVCache`s again when it leaves.
A row's tokens may be a tree (uag.core.verify.Tree: several proposals verified at once): its nodes sit at the
positions of their depths and see only their ancestors, beside rows reading one proposal in the same pass, and
keeping a path (`keep_path`) only makes the other nodes holes.
Plain `KVCache`s only; rotating and quantized ones stay on `batched_pass`.

    rows = [kept.adopt(cache) for cache in caches]      # each member's cache copied in once
    logits = kept.run(model, rows, [ids_a, ids_b])      # a pass: no merge, no split
    kept.hand_back(caches[0])                           # plain KV caches again, holding what the row held
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from uag.core.verify import Tree

UNSET = 2**30  # the position of a slot no token of its row is in: beyond every query, so never attended
STEP = 256  # slots added at a time, as mlx-lm's caches grow
MIN_HOLES = 64  # holes tolerated whatever the rows' length (a compaction copies every row)
HOLES_SHARE = 0.25  # compact once holes exceed this share of the longest row: attention reads every slot


class RowCache:
    """One layer of a member's cache while it is a row of a `KeptCaches`: what its engine reads and trims. Written
    only by the batch's passes; `offset` is the row's length, and `trim` just lowers it (the slots become holes)."""

    def __init__(self, kept: KeptCaches, row: int, layer: int, offset: int):
        self.kept, self.row, self.layer, self.offset = kept, row, layer, offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self.kept.stale = self.kept.stale or n > 0
        return n

    @property
    def state(self) -> list:
        keys, values = self.kept.keys[self.layer], self.kept.values[self.layer]
        return [] if keys is None else [keys, values]

    @property
    def nbytes(self) -> int:
        """Bytes of the tokens the row holds in this layer (its share of the storage, holes not counted)."""
        keys, values = self.kept.keys[self.layer], self.kept.values[self.layer]
        if keys is None:
            return 0
        return self.offset * (keys.nbytes + values.nbytes) // (keys.shape[0] * keys.shape[2])

    def update_and_fetch(self, keys, values):
        raise RuntimeError("a row of a batch's kept caches is written by the batch's passes only (KeptCaches.run)")


class KeptCaches:
    """The KV caches of a batch's members for one model, kept merged between passes (see the module)."""

    def __init__(self):
        self.keys: list[mx.array | None] = []  # per layer: (rows, heads, capacity, dim), None until written
        self.values: list[mx.array | None] = []
        self.positions: mx.array | None = None  # (rows, capacity) int32: each slot's position, UNSET where none
        self.owners: list[list | None] = []  # per row: the cache list (of RowCaches) it backs; None: free
        self.end = 0  # slots written so far: the next pass writes at end
        self.copies = 0  # times every row was copied (growth, compaction): a pass itself copies none
        self.broken = False  # a pass failed part way: what the storage holds is unknown
        # some row's slots at or past its length are not marked UNSET yet (a trim, a pass's padding, a row freed):
        # the next pass marks them first (`_tidy`); plain decoding leaves none, and costs no marking
        self.stale = False
        # slots a pass attends to, in whole steps of: on a GPU, STEP (past its tokens they are masked out), so that
        # its attention kernels see a few key lengths rather than a new one each pass; on a CPU every masked slot
        # costs its share of the pass, and a new length nothing
        self.span_step = STEP if mx.default_device() == mx.gpu else 1
        self.trees: dict[int, tuple[int, int]] = {}  # per row read as a tree: (the pass's first slot, its nodes),
        #   until the path kept is known (`keep_path`)

    # --- members coming and going -----------------------------------------------------------------------------
    @staticmethod
    def keepable(cache: list) -> bool:
        """Whether a cache can be a row here: plain KV caches (or rows already), every layer of the same length."""
        if not cache or not all(type(c) is KVCache or isinstance(c, RowCache) for c in cache):
            return False
        return len({c.offset for c in cache}) == 1

    def holds(self, cache: list) -> bool:
        return bool(cache) and isinstance(cache[0], RowCache) and cache[0].kept is self

    def adopt(self, cache: list) -> int:
        """Make a member's plain KV caches a row (their contents copied in; the list's entries become `RowCache`s)
        and return the row; a cache already a row here returns its row, copying nothing."""
        if self.holds(cache):
            return cache[0].row
        if self.broken or isinstance(cache[0], RowCache):  # a row of storage a failed pass left unknown
            raise RuntimeError("the batch's kept caches were lost with a failed pass")
        if not self.keys:
            self.keys, self.values = [None] * len(cache), [None] * len(cache)
        assert len(cache) == len(self.keys), (len(cache), len(self.keys))
        row = next((r for r, owner in enumerate(self.owners) if owner is None), None)
        if row is None:
            row = len(self.owners)
            self._add_rows(max(2, 2 * len(self.owners)) - len(self.owners))
        n = cache[0].offset
        if n > self.end:  # the others' rows get holes up to n (fresh slots: UNSET already)
            self._room(n - self.capacity)
            self.end = n
        start = self.end - n  # right-aligned: the next pass writes just after it
        for layer, own in enumerate(cache):
            if n:
                self._allocated(layer, own.keys, own.values)
                self.keys[layer][row : row + 1, :, start : self.end] = own.keys[..., :n, :]
                self.values[layer][row : row + 1, :, start : self.end] = own.values[..., :n, :]
        slots = mx.arange(self.capacity)
        self.positions[row] = mx.where((slots >= start) & (slots < self.end), slots - start, UNSET)
        cache[:] = [RowCache(self, row, layer, n) for layer in range(len(cache))]
        self.owners[row] = cache
        return row

    def hand_back(self, cache: list) -> None:
        """Make a row's cache list plain KV caches again, holding what the row held (one row copied out), and free
        the row. After a failed pass the caches come back empty (their contents are unknown)."""
        if not self.holds(cache):
            return
        if cache[0].row in self.trees:  # read as a tree, no path kept (its run ended there): the nodes are holes
            self.keep_path(cache, cache[0].offset - self.trees[cache[0].row][1], [])
        row, n = cache[0].row, cache[0].offset
        plain = [KVCache() for _ in cache]
        if n and not self.broken:
            order = mx.argsort(self._live()[row])[:n]  # the row's slots in position order: 0 … n-1
            room = -(-n // KVCache.step) * KVCache.step - n  # the room a cache of its own would have: no copy next
            for layer, own in enumerate(plain):
                own.keys, own.values = (
                    mx.pad(mx.take(store[layer][row : row + 1], order, axis=2), [(0, 0), (0, 0), (0, room), (0, 0)])
                    for store in (self.keys, self.values)
                )
                own.offset = n
            mx.eval([c.state for c in plain])
        cache[:] = plain
        self.owners[row] = None
        self.stale = True

    def __bool__(self) -> bool:
        """Whether any row is held."""
        return any(owner is not None for owner in self.owners)

    # --- a pass ---------------------------------------------------------------------------------------------
    def run(
        self,
        model,
        rows: Sequence[int],
        inputs: Sequence[mx.array],
        wait: bool = True,
        trees: Sequence[Tree | None] | None = None,
        packed: bool = False,
    ) -> list[mx.array]:
        """One pass of `model` over the given rows' new tokens (ragged widths, right padded: a row's padding comes
        after its tokens, which the causal mask keeps from them); each row's logits, evaluated, and each row
        longer by its own tokens. With `wait` False the pass is only queued (`mx.async_eval`): the caller goes on
        while the device runs it, and learns whether it failed when it next waits for the logits (or for later passes).
        `trees`: per row, None, or the `Tree` its tokens are (the pending token, then the tree's nodes): each node
        at the position of its depth, seeing the row's text and its own ancestors only, as `passes.tree_pass` reads
        one alone; the row then holds every node until `keep_path` says which stay.
        `packed` (rows of one proposal each, a model that `packs`): the rows' tokens run as one sequence of their
        total, unpadded, and each row attends over its own slots only (`_PackedLayer`): a pass over [17, 1, 1, 1]
        computes 20 tokens, not 68 — on a CPU, where every token costs its share, one pass where padding would
        have cost more than a pass of its own (uag.core.records.groups).

        Example: rows [0, 2] holding 30 and 12 tokens, inputs of widths [1, 4] -> one pass over 2 × 4 tokens at
                 positions 30… and 12…, written at slots end … end + 3; logits (1, 1, V) and (1, 4, V)
        """
        assert rows and len(rows) == len(inputs) and not self.broken
        trees = [None] * len(rows) if trees is None else list(trees)
        if list(rows) != sorted(rows):  # in row order, so that rows next to each other are a view, not a gather
            order = sorted(range(len(rows)), key=rows.__getitem__)
            logits = self.run(
                model, [rows[i] for i in order], [inputs[i] for i in order], wait, [trees[i] for i in order], packed
            )
            return [logits[order.index(i)] for i in range(len(rows))]
        caches = [self.owners[r] for r in rows]
        assert all(c is not None and self.holds(c) and self.keepable(c) for c in caches), "rows not adopted here"
        assert not any(r in self.trees for r in rows), "a row read as a tree is passed again before its path is kept"
        widths = [int(x.shape[-1]) for x in inputs]
        width = max(widths)
        lengths = [c[0].offset for c in caches]
        self._tidy(width)
        at = self.end
        branched = any(tree is not None for tree in trees)  # rows of one proposal only: positions in a row
        if packed and not branched:
            tokens, layers, placing, starts = self._packed(model, rows, inputs, widths, lengths)
        else:
            tokens, layers, placing = self._padded(model, rows, inputs, widths, lengths, trees, branched)
            starts = None
        try:
            with placing:
                logits = model(tokens, cache=layers)
            (mx.eval if wait else mx.async_eval)(logits, self.positions, self.storage())
        except BaseException:
            self.broken = True
            raise
        self.end = at + width
        self.stale = self.stale or min(widths) < width  # the narrower rows' padding or slots: past their lengths
        for row, cache, w, tree in zip(rows, caches, widths, trees):
            for layer in cache:
                layer.offset += w
            if tree is not None:
                self.trees[row] = (at, len(tree))
        if starts is not None:
            return [logits[:, s : s + w] for s, w in zip(starts, widths)]
        return [logits[i : i + 1, :w] for i, w in enumerate(widths)]

    def _padded(self, model, rows, inputs, widths: list[int], lengths: list[int], trees: list, branched: bool):
        """`run`'s pass over the rows' tokens right-padded to the widest: (tokens, layers, the rope's placing)."""
        at, width = self.end, max(widths)
        picked = (
            slice(rows[0], rows[0] + len(rows))
            if list(rows) == list(range(rows[0], rows[0] + len(rows)))
            else mx.array(rows)
        )
        offsets = mx.array(lengths)
        depths = [_depths(tree, width) for tree in trees] if branched else None
        queries = offsets[:, None] + (mx.array(depths) if branched else mx.arange(width)[None])
        self.positions[picked, at : at + width] = queries  # each new token's position
        span = -(-(at + width) // self.span_step) * self.span_step
        layers = [_PassLayer(self, layer, picked, at, width, span, offsets) for layer in range(len(self.keys))]
        masks: dict = {}
        seen = mx.array([_sees(tree, w, width) for tree, w in zip(trees, widths)]) if branched else None
        for layer in layers:
            layer.masks, layer.queries, layer.seen = masks, queries, seen
        # one row of token ids each (what a member sampled: uint32, or its int32 ids), padded only where narrower
        tokens = mx.concatenate(
            [
                x.reshape(1, -1) if w == width else mx.pad(x.reshape(1, -1), [(0, 0), (0, width - w)])
                for x, w in zip(inputs, widths)
            ]
        )
        return tokens, layers, placed(model, depths, queries) if branched else nullcontext()

    def _packed(self, model, rows, inputs, widths: list[int], lengths: list[int]):
        """`run`'s pass over the rows' tokens packed into one sequence (see `run`): each row's tokens written at the
        slots from `end` on (a narrower row's slots past its tokens are holes, as after padding), each placed at its
        own positions and attending over its own row: (tokens, layers, the rope's placing, each row's first token)."""
        at, width = self.end, max(widths)
        span = -(-(at + width) // self.span_step) * self.span_step
        for row, n in zip(rows, lengths):  # a row's slots past its own tokens: holes once it is that long
            self.positions[row, at : at + width] = mx.arange(n, n + width)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        masks: dict = {}
        layers = [
            _PackedLayer(self, layer, rows, at, widths, starts, lengths, span, masks) for layer in range(len(self.keys))
        ]
        tokens = mx.concatenate([x.reshape(1, -1) for x in inputs], axis=1)
        return tokens, layers, packing(model, starts, widths, lengths), starts

    def keep_path(self, cache: list, start: int, path: Sequence[int]) -> None:
        """After a tree pass over a row (`run` with its `Tree`, from position `start` - 1): the nodes on `path` kept
        at positions start, start + 1, … (where their depths put them already), every other node a hole, the row
        `start` + len(path) long. Nothing is copied: a slot's position says where its token is.

        Example: start 10, nodes at depths [1, 2, 1, 2], path [2, 3] -> slots of nodes 0 and 1 holes; the row holds 12
        """
        row = cache[0].row
        at, nodes = self.trees.pop(row)
        kept = set(path)
        dropped = [at + 1 + i for i in range(nodes) if i not in kept]
        if dropped:
            self.positions[row, mx.array(dropped)] = UNSET
        for layer in cache:
            layer.offset = min(layer.offset, start + len(path))
        self.stale = True

    # --- storage ----------------------------------------------------------------------------------------------
    def storage(self) -> list[mx.array]:
        """Every layer's keys and values written so far."""
        return [a for a in (*self.keys, *self.values) if a is not None]

    @property
    def capacity(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[1])

    def _lengths(self) -> mx.array:
        """Each row's length (-1 for a free row, whose slots are all holes)."""
        return mx.array([-1 if owner is None else owner[0].offset for owner in self.owners])

    def _live(self) -> mx.array:
        """`positions` with the holes trims and padding left marked UNSET: a row's slots at or past its length."""
        return mx.where(self.positions >= self._lengths()[:, None], UNSET, self.positions)

    def _tidy(self, width: int) -> None:
        """Before a pass of `width`: holes marked, compacted when they cost more than a copy, room for the pass."""
        if self.stale:
            self.positions, self.stale = self._live(), False
        longest = max(owner[0].offset for owner in self.owners if owner is not None)
        holes = self.end - longest
        if holes >= max(MIN_HOLES, HOLES_SHARE * longest) and not self.trees:  # a tree's nodes stay where it knows them
            self._compact(longest)
        self._room(self.end + width - self.capacity)

    def compact(self) -> None:
        """Gather every row's tokens to the front now, whatever the holes (`_tidy` does when they cost more than
        a copy): a server's warm-up runs it once, so that its kernels are built before a request waits on them."""
        assert not self.trees, "a tree's nodes are where it knows them until its path is kept"
        if self:
            self.positions, self.stale = self._live(), False
            self._compact(max(owner[0].offset for owner in self.owners if owner is not None))

    def _compact(self, longest: int) -> None:
        """Every row's tokens gathered to the front, in position order (one copy of the storage); `positions` has
        its holes marked (`_live`)."""
        order = mx.argsort(self.positions, axis=1)[:, :longest]  # holes (UNSET) sort last
        fresh = self.capacity - longest
        self.positions = mx.pad(
            mx.take_along_axis(self.positions, order, axis=1), [(0, 0), (0, fresh)], constant_values=UNSET
        )
        for store in (self.keys, self.values):
            for layer, a in enumerate(store):
                if a is not None:
                    kept = mx.take_along_axis(a, order[:, None, :, None], axis=2)
                    store[layer] = mx.pad(kept, [(0, 0), (0, 0), (0, fresh), (0, 0)])
        self.end = longest
        self.copies += 1

    def _room(self, more: int) -> None:
        """At least `more` slots added past the capacity (in STEPs; one copy of the storage)."""
        if more <= 0:
            return
        more = -(-more // STEP) * STEP
        self.positions = mx.pad(self.positions, [(0, 0), (0, more)], constant_values=UNSET)
        for store in (self.keys, self.values):
            for layer, a in enumerate(store):
                if a is not None:
                    store[layer] = mx.pad(a, [(0, 0), (0, 0), (0, more), (0, 0)])
        self.copies += 1

    def _add_rows(self, more: int) -> None:
        """Rows for members to come (doubling: the rows grow, and every row is copied, a few times per batch)."""
        capacity = max(self.capacity, STEP)
        fresh = mx.full((more, capacity), UNSET, mx.int32)
        self.positions = fresh if self.positions is None else mx.concatenate([self.positions, fresh])
        for store in (self.keys, self.values):
            for layer, a in enumerate(store):
                if a is not None:
                    store[layer] = mx.pad(a, [(0, more), (0, 0), (0, 0), (0, 0)])
        self.owners += [None] * more
        if any(a is not None for a in self.keys):
            self.copies += 1

    def _allocated(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """A layer's storage, made on its first tokens (their heads, dims and dtype)."""
        if self.keys[layer] is None:
            rows, capacity = len(self.owners), self.capacity
            self.keys[layer] = mx.zeros((rows, keys.shape[1], capacity, keys.shape[3]), keys.dtype)
            self.values[layer] = mx.zeros((rows, values.shape[1], capacity, values.shape[3]), values.dtype)


class _PassLayer:
    """One layer's cache as the model sees it during one `KeptCaches.run`: the rows' positions as rope offsets,
    their slots as one batch (`update_and_fetch`), and the mask of what each new token may attend to (`make_mask`)."""

    def __init__(self, kept: KeptCaches, layer: int, rows: Any, at: int, width: int, span: int, offset: mx.array):
        self.kept, self.layer, self.rows, self.at, self.width, self.offset = kept, layer, rows, at, width, offset
        self.span = span  # slots fetched and masked: past at + width they are fresh (UNSET), never attended
        self.masks: dict = {}
        self.queries: mx.array | None = None
        self.seen: mx.array | None = None  # (rows, width, width): which of the pass's tokens each sees (trees)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        kept, end = self.kept, self.at + self.width
        kept._allocated(self.layer, keys, values)
        kept.keys[self.layer][self.rows, :, self.at : end] = keys
        kept.values[self.layer][self.rows, :, self.at : end] = values
        return kept.keys[self.layer][self.rows, :, : self.span], kept.values[self.layer][self.rows, :, : self.span]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """(rows, 1, n, slots): a slot is attended where its position is at most the query's (holes are UNSET),
        and within the window where the model asks for one; the pass's own slots, where a row is a tree, as `seen`
        says (a node sees its ancestors, not the siblings at positions before its own)."""
        assert n == self.width, (n, self.width)
        if window_size not in self.masks:
            slots = self.kept.positions[self.rows, : self.span][:, None, None, :]
            queries = self.queries[:, None, :, None]
            mask = slots <= queries
            if self.seen is not None:
                end = self.at + self.width
                mask = mx.concatenate([mask[..., : self.at], self.seen[:, None], mask[..., end:]], axis=-1)
            if window_size is not None:
                mask = mask & (queries - slots < window_size)
            self.masks[window_size] = mask
        return self.masks[window_size]


class _RowMasks:
    """A packed pass's masks, one per row ((1, 1, w, span): its tokens over its own slots), handed by the model to
    its attention unchanged, as it hands any mask (`_PackedLayer.attend` reads them)."""

    def __init__(self, rows: list[mx.array]):
        self.rows = rows


class _PackedLayer:
    """One layer's cache as the model sees it during a packed `KeptCaches.run`: the model runs one sequence of every
    row's tokens; this writes each row's keys and values into its own slots, and `attend` (the model's attention,
    through `packing`) reads each row's queries over that row's slots only."""

    def __init__(self, kept, layer, rows, at, widths, starts, lengths, span, masks: dict):
        self.kept, self.layer, self.rows, self.at = kept, layer, list(rows), at
        self.widths, self.starts, self.lengths, self.span = widths, starts, lengths, span
        self.offset = 0  # what the model passes its rope, which `packing` replaces by each row's positions
        self.masks = masks  # per window size, shared by the pass's layers

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        kept, at = self.kept, self.at
        kept._allocated(self.layer, keys, values)
        for row, s, w in zip(self.rows, self.starts, self.widths):
            kept.keys[self.layer][row, :, at : at + w] = keys[0, :, s : s + w]
            kept.values[self.layer][row, :, at : at + w] = values[0, :, s : s + w]
        return keys, values  # unread: `attend` reads each row's own slots

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> _RowMasks:
        """Per row: a slot is attended where its position is at most the query's (holes are UNSET), within the
        window where the model asks for one."""
        assert n == sum(self.widths), (n, self.widths)
        if window_size not in self.masks:
            out = []
            for row, n0, w in zip(self.rows, self.lengths, self.widths):
                slots = self.kept.positions[row, : self.span][None, None, None, :]
                queries = mx.arange(n0, n0 + w)[None, None, :, None]
                mask = slots <= queries
                if window_size is not None:
                    mask = mask & (queries - slots < window_size)
                out.append(mask)
            self.masks[window_size] = _RowMasks(out)
        return self.masks[window_size]

    def attend(self, queries: mx.array, scale: float, mask: _RowMasks, sinks: mx.array | None = None) -> mx.array:
        """The attention of each row's queries over its own slots, as one (1, heads, tokens, dim) output."""
        keys, values = self.kept.keys[self.layer], self.kept.values[self.layer]
        parts = [
            mx.fast.scaled_dot_product_attention(
                queries[:, :, s : s + w],
                keys[row : row + 1, :, : self.span],
                values[row : row + 1, :, : self.span],
                scale=scale,
                mask=m,
                sinks=sinks,
            )
            for row, s, w, m in zip(self.rows, self.starts, self.widths, mask.rows)
        ]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _attention_modules(model) -> list | None:
    """The modules whose `scaled_dot_product_attention` the model's attention layers call, or None where a layer
    has no rope to place tokens with or calls none (a packed pass cannot run in it)."""
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    modules = []
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        module = sys.modules.get(type(attention).__module__) if attention is not None else None
        if not hasattr(attention, "rope") or not callable(getattr(module, "scaled_dot_product_attention", None)):
            return None
        modules += [] if module in modules else [module]
    return modules


def packs(model) -> bool:
    """Whether `KeptCaches.run` can pack rows with this model (`packed`): attention layers with a `rope` that call
    mlx-lm's `scaled_dot_product_attention` (llama, qwen2, qwen3, gemma3 and most of mlx-lm's models)."""
    return _attention_modules(model) is not None


@contextmanager
def packing(model, starts: Sequence[int], widths: Sequence[int], lengths: Sequence[int]) -> Iterator[None]:
    """For one packed pass: every attention layer's rope places each row's tokens at that row's positions, and the
    attention its layers call reads each row over its own slots (`_PackedLayer.attend`); any other cache (another
    model's pass, on any thread) gets mlx-lm's attention as before."""
    modules = _attention_modules(model)
    assert modules is not None, "a packed pass needs a model that packs (packs(model))"

    def rope_by_rows(rope) -> Callable:
        def apply(x: mx.array, offset: Any = 0) -> mx.array:
            parts = [rope(x[..., s : s + w, :], offset=n) for s, w, n in zip(starts, widths, lengths)]
            return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)

        return apply

    originals = [(module, module.scaled_dot_product_attention) for module in modules]

    def attention_of(original: Callable) -> Callable:
        def attention(*args, **kwargs):  # mlx-lm's: (queries, keys, values, cache, scale, mask, sinks=None)
            given = dict(zip(("queries", "keys", "values", "cache", "scale", "mask", "sinks"), args), **kwargs)
            cache = given.get("cache")
            if isinstance(cache, _PackedLayer):
                return cache.attend(given["queries"], given["scale"], given["mask"], given.get("sinks"))
            return original(*args, **kwargs)

        return attention

    attention = [layer.self_attn for layer in model.layers]
    for layer in attention:  # an instance attribute hides the rope module (nn.Module keeps it as a dict entry)
        object.__setattr__(layer, "rope", rope_by_rows(layer.rope))
    for module, original in originals:
        module.scaled_dot_product_attention = attention_of(original)
    try:
        yield
    finally:
        for module, original in originals:
            module.scaled_dot_product_attention = original
        for layer in attention:
            object.__delattr__(layer, "rope")


def _depths(tree: Tree | None, width: int) -> list[int]:
    """Each of a row's `width` tokens' distance from its first: the column itself for a row of one proposal, a
    tree's pending token then its nodes' depths; padding at its column, past every token of the row (a hole once
    the row's length is known: `KeptCaches._live`).

    Example: _depths(Tree.of([[5, 6], [7]]), 5) -> [0, 1, 2, 1, 4]
    """
    if tree is None:
        return list(range(width))
    depths = [0, *tree.depths]
    return [*depths, *range(len(depths), width)]


def _sees(tree: Tree | None, w: int, width: int) -> list[list[bool]]:
    """(width, width): which of a row's pass tokens each of its `w` tokens attends to: its ancestors and itself in
    a tree (`Tree.mask`), every token up to it otherwise; a padding column (from `w` on) sees what a row of one
    proposal would (its logits are dropped), and is seen by none of the row's tokens.

    Example: _sees(Tree.of([[5], [6]]), 3, 4) -> [[T, F, F, F], [T, T, F, F], [T, F, T, F], [T, T, T, T]]
    """
    own = tree.mask() if tree is not None else [[j <= q for j in range(w)] for q in range(w)]
    return [[own[q][j] if q < w and j < w else j <= q and q >= w for j in range(width)] for q in range(width)]


def position_runs(depths: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """The pass's columns as runs [first, end) over which every row's depths go up one at a time: one rope call
    each (a row of one proposal never breaks a run; a tree's branch does).

    Example: depths [[0, 1, 2, 3], [0, 1, 2, 1]] -> [(0, 3), (3, 4)]
    """
    out: list[tuple[int, int]] = []
    for j in range(len(depths[0])):
        if out and all(d[j] == d[j - 1] + 1 for d in depths):
            out[-1] = (out[-1][0], j + 1)
        else:
            out.append((j, j + 1))
    return out


@contextmanager
def placed(model, depths: Sequence[Sequence[int]], positions: mx.array) -> Iterator[None]:
    """For one pass, every attention layer's rope places each token at its own position (`positions`, (rows, width):
    each row's first position plus its `depths`), whatever offset the layer passes: one rope call per run of columns
    (`position_runs`). A tree's nodes sit at their depths, so a row reading a tree needs it (`run`; a tree read alone,
    `uag.core.passes.tree_pass`)."""
    runs = position_runs(depths)

    def rope_by_runs(rope) -> Callable:
        def apply(x: mx.array, offset: Any = 0) -> mx.array:
            parts = [rope(x[..., first:end, :], offset=positions[:, first]) for first, end in runs]
            return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)

        return apply

    attention = [layer.self_attn for layer in model.layers]
    for layer in attention:  # an instance attribute hides the rope module (nn.Module keeps it as a dict entry)
        object.__setattr__(layer, "rope", rope_by_runs(layer.rope))
    try:
        yield
    finally:
        for layer in attention:
            object.__delattr__(layer, "rope")


def trees_fit(model) -> bool:
    """Whether `run` can read trees with this model: attention layers with a `rope` to place each node."""
    layers = getattr(model, "layers", None)
    return layers is not None and all(hasattr(getattr(layer, "self_attn", None), "rope") for layer in layers)
