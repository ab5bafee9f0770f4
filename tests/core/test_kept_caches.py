"""`uag.core.kept_caches.KeptCaches`: a batched pass over caches kept merged gives every member the logits and the
greedy tokens a pass of its own would (float32, CPU), through ragged proposals, per-row rejections of different
lengths, members of different lengths, members joining and leaving, passes over some of the rows, compaction and a
sliding window; and a pass copies no cache (the storage stays the same arrays)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from tests.support.tiny_models import build_tiny
from uag.core.kept_caches import STEP, KeptCaches, RowCache
from uag.core.passes import prefill, trim_to


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
    """Logits equal within float32 rounding, and the same greedy token at every position."""
    return a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item() and (a.argmax(-1) == b.argmax(-1)).all().item()


class Member:
    """A sequence run twice: `own` with its own plain cache, `cache` as a row of the kept caches."""

    def __init__(self, tiny, n: int, seed: int):
        self.own, self.cache, self.rng = filled(tiny, n, seed), filled(tiny, n, seed), random.Random(seed)

    def proposal(self) -> mx.array:
        return mx.array([self.rng.randrange(3, 500) for _ in range(self.rng.randint(1, 5))])

    def rejected(self, width: int) -> None:
        """A speculative cycle's end: the pass's tokens kept up to a random point, the rest trimmed off."""
        keep = self.rng.randint(1, width)
        for cache in (self.own, self.cache):
            trim_to(cache, cache[0].offset - (width - keep))


def cycle(tiny, kept: KeptCaches, members: list[Member]) -> None:
    proposals = [m.proposal() for m in members]
    rows = [kept.adopt(m.cache) for m in members]
    together = kept.run(tiny.model, rows, proposals)
    for m, p, logits in zip(members, proposals, together):
        assert same(logits, tiny.model(p[None], cache=m.own))
        assert m.cache[0].offset == m.own[0].offset
        m.rejected(len(p))


@pytest.mark.parametrize("span_step", [1, STEP], ids=["cpu-span", "gpu-span"])
def test_a_pass_on_kept_caches_is_each_member_s_own_through_joins_leaves_and_rejections(tiny, span_step):
    kept = KeptCaches()
    kept.span_step = span_step  # as on a GPU: slots past the pass's tokens attended in whole steps, masked out
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
