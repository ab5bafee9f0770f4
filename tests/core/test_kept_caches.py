"""`uag.core.kept_caches.KeptCaches`: a batched pass over caches kept merged gives every member the logits and the
greedy tokens a pass of its own would (float32, CPU), through ragged proposals, per-row rejections of different
lengths, members of different lengths, members joining and leaving, passes over some of the rows, compaction, a
sliding window and rows read as trees beside rows of one proposal; and a pass copies no cache (the storage stays
the same arrays)."""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import pytest

from tests.support.tiny_models import build_tiny
from uag.core.kept_caches import STEP, KeptCaches, RowCache, packs
from uag.core.passes import keep_path, prefill, tree_pass, trim_to
from uag.core.verify import Tree


@pytest.fixture(scope="module", params=["qwen2", "gemma3_text"])
def tiny(store, request):
    """An untied qwen2 (varied greedy text) and a gemma3 whose every other layer slides over 8 tokens."""
    tokenizer = "qwen2.5" if request.param == "qwen2" else "llama-3.2"
    return store.get(str(build_tiny(request.param, tokenizer, seed=5, tie_embeddings=False)))


def filled(tiny, n: int, seed: int) -> list:
    cache = tiny.make_cache()
    prefill(tiny.model, cache, [(seed * 31 + 7 * i) % 500 + 3 for i in range(n)])
    return cache


def same(a: mx.array, b: mx.array) -> bool:
    """Logits equal within float32 rounding, and the same greedy token at every position. OpenBLAS sums a batched
    matmul's rows in another order than one row's, and the rows' keys and values carry that from pass to pass: up to
    ~1.6e-4 apart after dozens of passes here, on logits of tens; a wrong mask or position is off by whole units."""
    close = mx.allclose(a, b, atol=1e-3).item()
    return a.shape == b.shape and close and (a.argmax(-1) == b.argmax(-1)).all().item()


class Member:
    """A sequence run twice: `own` with its own plain cache, `cache` as a row of the kept caches."""

    def __init__(self, tiny, n: int, seed: int):
        self.own, self.cache, self.rng = filled(tiny, n, seed), filled(tiny, n, seed), random.Random(seed)

    def proposal(self) -> mx.array:
        return mx.array([self.rng.randrange(3, 500) for _ in range(self.rng.randint(1, 5))])

    def tree(self) -> Tree:
        """Two or three proposals, some sharing a first token or more."""
        first = [self.rng.randrange(3, 500) for _ in range(self.rng.randint(1, 4))]
        others = [
            first[: self.rng.randint(0, len(first) - 1)]
            + [self.rng.randrange(3, 500) for _ in range(self.rng.randint(1, 3))]
            for _ in range(self.rng.randint(1, 2))
        ]
        return Tree.of([first, *others])

    def kept_path(self, tree: Tree) -> list[int]:
        """What a verification keeps of a tree: some branch's first nodes (maybe none)."""
        path = tree.paths[self.rng.randrange(len(tree.paths))]
        return path[: self.rng.randint(0, len(path))]

    def rejected(self, width: int) -> None:
        """A speculative cycle's end: the pass's tokens kept up to a random point, the rest trimmed off."""
        keep = self.rng.randint(1, width)
        for cache in (self.own, self.cache):
            trim_to(cache, cache[0].offset - (width - keep))


def cycle(tiny, kept: KeptCaches, members: list[Member], packed: bool = False) -> None:
    proposals = [m.proposal() for m in members]
    rows = [kept.adopt(m.cache) for m in members]
    together = kept.run(tiny.model, rows, proposals, packed=packed)
    for m, p, logits in zip(members, proposals, together):
        assert same(logits, tiny.model(p[None], cache=m.own))
        assert m.cache[0].offset == m.own[0].offset
        m.rejected(len(p))


def tree_cycle(tiny, kept: KeptCaches, members: list[Member]) -> None:
    """Each member reads a tree or one proposal in one pass; a tree's logits are its own tree pass's, and keeping a
    path leaves the row as its own cache (the next cycles check it)."""
    trees = [m.tree() if m.rng.random() < 0.6 else None for m in members]
    inputs = [
        m.proposal() if t is None else mx.array([m.rng.randrange(3, 500), *t.tokens]) for m, t in zip(members, trees)
    ]
    rows = [kept.adopt(m.cache) for m in members]
    together = kept.run(tiny.model, rows, inputs, trees=trees)
    for m, x, tree, logits in zip(members, inputs, trees, together):
        if tree is None:
            assert same(logits, tiny.model(x[None], cache=m.own))
            m.rejected(len(x))
            continue
        start = m.own[0].offset + 1
        assert same(logits, tree_pass(tiny.model, m.own, int(x[0].item()), tree))
        path = m.kept_path(tree)
        for cache in (m.own, m.cache):
            keep_path(cache, start, path)
        assert m.cache[0].offset == m.own[0].offset == start + len(path)


@pytest.mark.parametrize("span_step", [1, STEP], ids=["cpu-span", "gpu-span"])
def test_trees_on_kept_caches_read_and_keep_as_each_member_s_own(tiny, span_step):
    kept = KeptCaches()
    kept.span_step = span_step
    a, b, c = Member(tiny, 40, 0), Member(tiny, 7, 1), Member(tiny, 23, 2)
    for _ in range(6):
        tree_cycle(tiny, kept, [a, b, c])
        cycle(tiny, kept, [c, a])  # one proposal each, after the trees kept: the rows as their own caches
    tree = a.tree()  # a tree read, its path not yet kept, while the others pass on and leave holes
    x = mx.array([5, *tree.tokens])
    start = a.own[0].offset + 1
    kept.run(tiny.model, [kept.adopt(a.cache)], [x], trees=[tree])
    tree_pass(tiny.model, a.own, 5, tree)
    copies = kept.copies
    for _ in range(30):
        cycle(tiny, kept, [b, c])
    assert kept.copies == copies  # no compaction moves a tree's nodes before its path is kept
    with pytest.raises(AssertionError, match="before its path is kept"):
        kept.run(tiny.model, [a.cache[0].row], [mx.array([7])])
    path = a.kept_path(tree)
    for cache in (a.own, a.cache):
        keep_path(cache, start, path)
    for _ in range(4):
        cycle(tiny, kept, [a, b, c])
    assert kept.copies > copies  # compacted once the path was kept
    d = Member(tiny, 12, 3)  # read as a tree, then its run ends without a path: the row keeps its pending token
    kept.run(tiny.model, [kept.adopt(d.cache)], [mx.array([9, 10, 11])], trees=[Tree.of([[10], [11]])])
    kept.hand_back(d.cache)
    assert d.cache[0].offset == 13
    prefill(tiny.model, d.own, [9])
    assert same(tiny.model(mx.array([[4]]), cache=d.cache), tiny.model(mx.array([[4]]), cache=d.own))
    for m in (a, b, c):
        kept.hand_back(m.cache)
        assert m.cache[0].offset == m.own[0].offset
        for mine, own in zip(m.cache, m.own):
            assert mx.allclose(mine.keys[..., : own.offset, :], own.keys[..., : own.offset, :], atol=1e-5).item()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("span_step", [1, STEP], ids=["cpu-span", "gpu-span"])
def test_a_pass_on_kept_caches_is_each_member_s_own_through_joins_leaves_and_rejections(tiny, span_step, packed):
    kept = KeptCaches()
    kept.span_step = span_step  # as on a GPU: slots past the pass's tokens attended in whole steps, masked out
    cycle = functools.partial(globals()["cycle"], packed=packed)  # packed: the rows' tokens as one sequence
    assert packs(tiny.model)
    a, b, c = Member(tiny, 40, 0), Member(tiny, 7, 1), Member(tiny, 23, 2)
    for _ in range(3):
        cycle(tiny, kept, [a, b])
    assert all(isinstance(layer, RowCache) for layer in a.cache)
    d = Member(tiny, 60, 3)  # joins longer than any row
    for _ in range(3):
        cycle(tiny, kept, [a, b, c, d])
    kept.hand_back(b.cache)  # b leaves: its plain caches hold what its own do
    assert all(type(layer) is not RowCache for layer in b.cache) and b.cache[0].offset == b.own[0].offset
    for mine, own in zip(b.cache, b.own):
        assert mx.allclose(mine.keys[..., : own.offset, :], own.keys[..., : own.offset, :], atol=1e-5).item()
    p = b.proposal()
    assert same(tiny.model(p[None], cache=b.cache), tiny.model(p[None], cache=b.own))
    e = Member(tiny, 3, 4)  # takes b's free row
    for _ in range(3):
        cycle(tiny, kept, [a, c, d, e])
        cycle(tiny, kept, [d, a])  # some rows only, not in row order (a gather)
    for m in (a, c, d, e):
        kept.hand_back(m.cache)
    assert not kept


def test_passes_copy_no_cache_until_holes_are_worth_a_compaction(tiny):
    kept = KeptCaches()
    members = [Member(tiny, n, s) for s, n in enumerate((30, 12, 50))]
    cycle(tiny, kept, members)
    storage, copies = [*kept.keys, *kept.values], kept.copies
    for _ in range(4):
        cycle(tiny, kept, members)
    assert kept.copies == copies and all(a is b for a, b in zip([*kept.keys, *kept.values], storage))
    for _ in range(40):  # rejections leave holes: compacted now and then, never wrong
        cycle(tiny, kept, members)
    assert kept.copies > copies and kept.end < 45 * 5
    for m in members:
        kept.hand_back(m.cache)
        assert m.cache[0].offset == m.own[0].offset


def test_a_pass_that_fails_part_way_loses_the_kept_caches_and_says_so(tiny):
    """A failed pass leaves the storage unknown: the members' caches come back empty (their engines drop them), and
    no cache is adopted into it again."""
    kept = KeptCaches()
    a, b = Member(tiny, 20, 0), Member(tiny, 9, 1)
    cycle(tiny, kept, [a, b])
    held = a.cache[0].offset

    def fails(tokens, cache):
        cache[0].update_and_fetch(mx.zeros((2, 2, 1, 16)), mx.zeros((2, 2, 1, 16)))
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        kept.run(fails, [0, 1], [mx.array([5]), mx.array([6])])
    assert kept.broken and a.cache[0].offset == held  # the failed pass counted nothing
    kept.hand_back(a.cache)
    assert all(type(layer) is not RowCache and layer.offset == 0 for layer in a.cache)
    with pytest.raises(RuntimeError, match="lost with a failed pass"):
        kept.adopt(filled(tiny, 5, 2))
