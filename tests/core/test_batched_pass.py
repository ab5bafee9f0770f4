"""`uag.core.passes.batched_pass`: one pass over several sequences, each with its own cache, gives each the logits
a pass of its own would, and leaves each cache as that pass would."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.support.tiny_models import build_tiny
from uag.core.passes import batched_pass, prefill


@pytest.fixture(scope="module")
def qwen(store):
    return store.get(str(build_tiny("qwen2", "qwen2.5", seed=5, tie_embeddings=False)))


def filled(model, n: int, seed: int) -> list:
    cache = model.make_cache()
    prefill(model.model, cache, [(seed * 31 + 7 * i) % 500 + 3 for i in range(n)])
    return cache


def close(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


def test_ragged_proposals_get_the_logits_and_caches_of_passes_of_their_own(qwen):
    lengths, proposals = (40, 7, 23), ([5, 6, 7, 8], [9], [10, 11])
    alone = [filled(qwen, n, s) for s, n in enumerate(lengths)]
    together = [filled(qwen, n, s) for s, n in enumerate(lengths)]
    expected = [qwen.model(mx.array(p)[None], cache=c) for p, c in zip(proposals, alone)]
    logits = batched_pass(qwen.model, [mx.array(p) for p in proposals], together)
    assert all(close(a, b) for a, b in zip(logits, expected))
    for own, solo in zip(together, alone):
        assert own[0].offset == solo[0].offset
        assert all(close(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]) for a, b in zip(own, solo))
