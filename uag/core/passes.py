"""Forward passes and KV caches: the few mlx operations the target and the drafter share, and the caches
a conversation keeps from one run to the next (`PromptCaches`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from uag.core.translate import longest_common_prefix

PREFILL_STEP = 512  # tokens per forward pass when reading a long stretch (a prompt), as mlx-lm does


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
    cache its maker gives with the model it belongs to).
    """

    target_cache: list | None = None
    target_ids: list[int] = field(default_factory=list)
    drafter_cache: list | None = None
    drafter_ids: list[int] = field(default_factory=list)
    target_model: str | None = None
    drafter_model: str | None = None

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
