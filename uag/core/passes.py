"""Forward passes and KV caches: the few mlx operations the target and the drafter share."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

PREFILL_STEP = 512  # tokens per forward pass when reading a long stretch (a prompt), as mlx-lm does


def prefill(model, cache: list, ids: Sequence[int]) -> mx.array | None:
    """Feed `ids` in chunks; return the last position's logits (None when `ids` is empty)."""
    logits = None
    for start in range(0, len(ids), PREFILL_STEP):
        logits = model(mx.array(ids[start : start + PREFILL_STEP])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return None if logits is None else logits[:, -1, :]


def trim_to(cache: list, length: int) -> None:
    """Trim the cache back to `length` tokens with mlx-lm's `trim_prompt_cache` (a no-op where it holds fewer)."""
    extra = cache[0].offset - length if cache else 0
    if extra > 0:
        trim_prompt_cache(cache, extra)


def logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def settle_allocator() -> None:
    """Charge a forward pass's memory clean-up to that pass, not to whatever allocates next.

    A forward pass frees thousands of small buffers into glibc's fastbins; the next sizeable malloc
    merges them all (1.5-2 ms after a demo-target pass on our 2-core CPU). Without this, that cost
    lands in the first tokenizer call of the translation phase. Allocating above pymalloc's 512-byte
    limit triggers the merge here instead; total time is unchanged.
    """
    bytearray(4096)
