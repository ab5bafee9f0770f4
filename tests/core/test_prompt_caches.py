"""A conversation's caches (`PromptCaches`): a later run reads only its new tokens, and stays exact.

Every test compares a run that reused caches with a cold run of the same prompt (greedy: token for token),
and checks what the caches say they hold against a fresh read of those ids (the next step's logits).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from tests.support.tiny_models import build_tiny, tiny_pair
from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice
from uag.core.engine import PromptCaches, Seams, generate, prompt_ids, stream
from uag.core.passes import trim_to
from uag.core.policy import AdaptiveK
from uag.core.translate import longest_common_prefix

PROMPT = "1. jabłko\n2. gruszka\n3. śliwka\n\nTa sama lista:\n1. jabłko\n2."  # lookup finds something here
MAX_TOKENS = 12

# (strategy, drafter): the target alone, a model through each translation, lookup, the hybrid, auto, and
# the target drafting for itself (identity: every draft accepted, so long cycles reach the caches' ends).
KINDS = [
    ("baseline", None),
    ("context", "model"),
    ("tli", "model"),
    ("context", "lookup"),
    ("context", "lookup+model"),
    ("auto", "lookup+model"),
    ("auto", "model"),
    ("context", "self"),
]


@pytest.fixture(scope="module")
def tiny(store):
    """Tiny random models with real tokenizers: a Mistral-vocabulary target and a Qwen drafter."""
    target, drafter = tiny_pair("qwen2.5", "mistral-v1", tie_embeddings=False)
    return store.get(str(target)), store.get(str(drafter))


def drafter_for(kind: str | None, target, model):
    return {
        None: None,
        "model": model,
        "lookup": DrafterChoice(lookup=True),
        "lookup+model": DrafterChoice(lookup=True, model=model),
        "self": target,
    }[kind]


def encode(model, text: str) -> list[int]:
    return list(model.tokenizer.encode(text, add_special_tokens=False))


def assert_holds(model, cache, ids):
    """The cache holds exactly `ids`: a step from it gives the logits that a fresh read of `ids` and that
    step gives. The cache is left as it was."""
    assert cache[0].offset == len(ids) > 0
    probe = ids[-1]
    from_cache = model.model(mx.array([probe])[None], cache=cache)[0, -1]
    trim_to(cache, len(ids))
    fresh = model.model(mx.array([*ids, probe])[None], cache=model.make_cache())[0, -1]
    np.testing.assert_allclose(np.array(from_cache), np.array(fresh), atol=1e-3, rtol=1e-3)


def assert_exact(caches: PromptCaches, target, drafter_model=None):
    assert_holds(target, caches.target_cache, caches.target_ids)
    if drafter_model is not None:
        assert_holds(drafter_model, caches.drafter_cache, caches.drafter_ids)


@pytest.mark.parametrize(("strategy", "kind"), KINDS)
def test_a_second_turn_with_reused_caches_equals_a_cold_run(tiny, strategy, kind):
    target, model = tiny
    drafter = drafter_for(kind, target, model)
    config = GenerationConfig.parse(strategy=strategy, k=3, max_tokens=MAX_TOKENS)
    caches = PromptCaches.empty()
    first_ids = prompt_ids(target, PROMPT)
    first = generate(target, drafter, first_ids, config, caches=caches)
    assert first.cached_tokens == 0
    committed = [*first_ids, *first.token_ids]
    assert caches.target_ids == committed[:-1]  # every committed token but the newest

    second_ids = [*committed, *encode(target, " Dalej:")]
    index = caches.lookup  # prompt lookup's, over all the first run committed: the second goes on with it
    assert (index is not None and index.ids == committed) == ("lookup" in (kind or ""))
    second = generate(target, drafter, second_ids, config, caches=caches)
    cold = generate(target, drafter, second_ids, config)
    assert second.token_ids == cold.token_ids
    assert caches.lookup is index and (index is None or index.ids == [*second_ids, *second.token_ids])
    assert second.cached_tokens == len(committed) - 1 and cold.cached_tokens == 0
    assert second.stats()["cached_tokens"] == second.to_dict()["stats"]["cached_tokens"] == second.cached_tokens
    drafter_model = target if kind == "self" else model if kind in ("model", "lookup+model") else None
    assert_exact(caches, target, drafter_model if caches.drafter_ids else None)  # auto may never have read
    if strategy != "auto" and kind in ("model", "self"):  # the drafter model read only the turn's new text
        assert caches.drafter_ids
        assert sum(c.drafter_read for c in second.cycles) < sum(c.drafter_read for c in cold.cycles)
    if drafter_model is None:
        assert caches.drafter_cache is None and caches.drafter_ids == []  # nothing drafted with a model


@pytest.mark.parametrize(("strategy", "kind"), [("baseline", None), ("context", "model"), ("context", "lookup+model")])
def test_a_prompt_that_parts_early_reuses_only_the_common_prefix(tiny, strategy, kind):
    target, model = tiny
    drafter = drafter_for(kind, target, model)
    config = GenerationConfig.parse(strategy=strategy, k=3, max_tokens=MAX_TOKENS)
    caches = PromptCaches.empty()
    generate(target, drafter, PROMPT, config, caches=caches)
    held = list(caches.target_ids)
    other = prompt_ids(target, "1. jabłko\n2. wiśnia, a potem zupełnie inna lista")
    shared = longest_common_prefix(held, other)
    assert 0 < shared < len(other) - 1  # parts within the prompt
    index = caches.lookup
    run = generate(target, drafter, other, config, caches=caches)
    assert run.cached_tokens == shared
    assert run.token_ids == generate(target, drafter, other, config).token_ids
    if index is not None:  # lookup's index holds what this prompt does not go on from: indexed anew
        assert caches.lookup is not index and caches.lookup.ids == [*other, *run.token_ids]
    assert_exact(caches, target, model if kind is not None else None)


@pytest.mark.parametrize(("strategy", "kind"), [("baseline", None), ("context", "lookup+model")])
def test_a_copy_of_a_held_prefix_continues_exactly_and_leaves_the_original_as_it_was(tiny, strategy, kind):
    """`prefix(n)`: what the server hands a prompt that shares a long head with a held conversation but parts from
    it early (aider's layout): a run from the copy equals a cold run, and the held caches still hold their ids."""
    target, model = tiny
    drafter = drafter_for(kind, target, model)
    config = GenerationConfig.parse(strategy=strategy, k=3, max_tokens=MAX_TOKENS)
    held = PromptCaches.empty()
    generate(target, drafter, PROMPT, config, caches=held)
    ids = list(held.target_ids)
    n = len(ids) // 2
    copy = held.prefix(n)
    assert copy.target_ids == ids[:n] and copy.drafter_cache is None and copy.target_model == held.target_model
    assert_holds(target, copy.target_cache, ids[:n])
    other = [*ids[:n], *encode(target, " zupełnie inna lista")]
    run = generate(target, drafter, other, config, caches=copy)
    assert run.cached_tokens == n
    assert run.token_ids == generate(target, drafter, other, config).token_ids
    assert held.target_cache[0].offset == len(held.target_ids) == len(ids)
    assert_exact(held, target)
    assert held.prefix(len(ids) + 1) is None and held.prefix(0) is None
    assert PromptCaches.empty().prefix(1) is None


@pytest.mark.parametrize(("strategy", "kind"), [("baseline", None), ("context", "model"), ("context", "lookup")])
def test_a_prompt_the_caches_hold_entirely_still_reads_its_last_token(tiny, strategy, kind):
    target, model = tiny
    drafter = drafter_for(kind, target, model)
    config = GenerationConfig.parse(strategy=strategy, k=3, max_tokens=MAX_TOKENS)
    caches = PromptCaches.empty()
    ids = prompt_ids(target, PROMPT)
    first = generate(target, drafter, ids, config, caches=caches)
    again = generate(target, drafter, ids, config, caches=caches)  # the same prompt: held, and more
    assert again.cached_tokens == len(ids) - 1
    assert again.token_ids == first.token_ids
    shorter = [*ids, *first.token_ids][: len(ids) + 3]  # a prefix of what the caches hold
    run = generate(target, drafter, shorter, config, caches=caches)
    assert run.cached_tokens == len(shorter) - 1
    assert run.token_ids == generate(target, drafter, shorter, config).token_ids


@pytest.mark.parametrize("how", ["cancel", "close"])
@pytest.mark.parametrize(("strategy", "kind"), [("baseline", None), ("context", "model"), ("auto", "lookup+model")])
def test_a_stopped_run_leaves_exact_caches_that_the_next_turn_reuses(tiny, strategy, kind, how):
    target, model = tiny
    drafter = drafter_for(kind, target, model)
    config = GenerationConfig.parse(strategy=strategy, k=3, max_tokens=30)
    caches, cancel = PromptCaches.empty(), threading.Event()
    ids = prompt_ids(target, PROMPT)
    events = stream(target, drafter, ids, config, caches=caches, cancel=cancel)
    for n, event in enumerate(events):  # noqa: B007 (the last event is read below)
        if n == 2:
            if how == "close":
                break
            cancel.set()
    events.close()
    run = event.run
    assert run.finish_reason == "stopped" and run.generated < 30
    committed = [*ids, *run.token_ids]
    assert caches.target_ids == committed[:-1]
    assert_exact(caches, target, model if kind is not None and caches.drafter_ids else None)
    follow_up = [*committed, *encode(target, " i dalej")]
    config = config.replace(max_tokens=MAX_TOKENS)
    again = generate(target, drafter, follow_up, config, caches=caches)
    assert again.cached_tokens == len(committed) - 1
    assert again.token_ids == generate(target, drafter, follow_up, config).token_ids


class ParkedRehearsingEvery3(AdaptiveK):
    """Parks always and rehearses every 3 parked steps: the drafter reads its backlog only in rehearsals."""

    def best_k(self, rates=None):
        return 0

    def rehearsal_wait(self):
        return 3


def test_rehearsals_start_from_the_drafter_cache_a_conversation_kept(tiny):
    target, model = tiny
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=16)
    caches = PromptCaches.empty()
    ids = prompt_ids(target, PROMPT)
    first = generate(target, model, ids, config, caches=caches, seams=Seams(policy=ParkedRehearsingEvery3(k_max=4)))
    assert any(c.drafter_read for c in first.cycles) and caches.drafter_ids
    held = len(caches.drafter_ids)
    follow_up = [*ids, *first.token_ids, *encode(target, " Dalej:")]
    second = generate(
        target, model, follow_up, config, caches=caches, seams=Seams(policy=ParkedRehearsingEvery3(k_max=4))
    )
    cold = generate(target, model, follow_up, config, seams=Seams(policy=ParkedRehearsingEvery3(k_max=4)))
    assert second.token_ids == cold.token_ids
    reads = [c.drafter_read for c in second.cycles if c.drafter_read]
    cold_reads = [c.drafter_read for c in cold.cycles if c.drafter_read]
    assert reads[0] < cold_reads[0] and reads[0] <= cold_reads[0] - held + 1  # the first read skipped what was held
    assert_exact(caches, target, model)


def test_a_failed_run_drops_the_caches_and_the_next_run_reads_cold(tiny):
    target, model = tiny
    config = GenerationConfig(translation="context", k=3, max_tokens=MAX_TOKENS)
    caches = PromptCaches.empty()
    ids = prompt_ids(target, PROMPT)
    generate(target, model, ids, config, caches=caches)
    calls = []

    def failing(logprobs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a pass failed part way")
        return mx.argmax(logprobs, axis=-1)

    with pytest.raises(RuntimeError, match="part way"):
        generate(target, model, ids, config, caches=caches, seams=Seams(sampler=failing))
    assert caches.target_cache is None and caches.target_ids == [] and caches.drafter_ids == []
    assert caches.nbytes() == 0
    run = generate(target, model, ids, config, caches=caches)
    assert run.cached_tokens == 0 and run.token_ids == generate(target, model, ids, config).token_ids


def test_another_models_cache_is_never_reused(tiny, store):
    target, model = tiny
    other = store.get(str(build_tiny("mistral", "mistral-v1", seed=9, tie_embeddings=False)))
    config = GenerationConfig(translation="context", k=3, max_tokens=MAX_TOKENS)
    caches = PromptCaches.empty()
    ids = prompt_ids(target, PROMPT)
    generate(target, model, ids, config, caches=caches)
    run = generate(other, model, ids, config, caches=caches)
    assert run.cached_tokens == 0  # the same ids, another target: read cold
    assert run.token_ids == generate(other, model, ids, config).token_ids
    assert caches.target_model == other.name


def test_a_cache_that_cannot_be_trimmed_is_not_kept(store):
    """A recurrent target's state cannot be cut back to a common prefix: every run reads its prompt."""
    mamba = store.get(str(build_tiny("mamba", "llama-3.2")))
    config = GenerationConfig(translation="baseline", max_tokens=5)
    caches = PromptCaches.empty()
    first = generate(mamba, None, "Ala ma kota", config, caches=caches)
    assert caches.target_cache is None and caches.target_ids == []
    again = generate(mamba, None, "Ala ma kota", config, caches=caches)
    assert again.cached_tokens == 0 and again.token_ids == first.token_ids


def test_nbytes_counts_both_caches(tiny):
    target, model = tiny
    caches = PromptCaches.empty()
    assert caches.nbytes() == 0 and "0 tokens" in repr(caches)
    generate(target, model, PROMPT, GenerationConfig(translation="context", k=2, max_tokens=4), caches=caches)
    target_bytes = sum(c.nbytes for c in caches.target_cache)
    assert target_bytes > 0 and caches.nbytes() == target_bytes + sum(c.nbytes for c in caches.drafter_cache)


# --- the embedded demo pair: a real cross-family pair ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "drafter"),
    [
        ("baseline", None),
        ("context", "demo-drafter"),
        ("tli", "demo-drafter"),
        ("context", "lookup"),
        ("context", "lookup+demo-drafter"),
        ("auto", "lookup+demo-drafter"),
    ],
)
def test_demo_pair_second_turn_with_reused_caches_equals_a_cold_run(demo_pair, store, strategy, drafter):
    from uag.core.drafters import load_drafter_choice

    target, _ = demo_pair
    choice = None if drafter is None else load_drafter_choice(store, drafter)
    config = GenerationConfig.parse(strategy=strategy, k=3, max_tokens=16)
    caches = PromptCaches.empty()
    question = "Wymień trzy miasta w Polsce:\n1."
    first = generate(target, choice, question, config, caches=caches)
    # The next turn as text, tokenized afresh: the conversation so far and a new request.
    follow_up = f"{question}{first.text}\n\nTa sama lista jeszcze raz:\n1."
    second = generate(target, choice, follow_up, config, caches=caches)
    cold = generate(target, choice, follow_up, config)
    assert second.token_ids == cold.token_ids
    assert second.cached_tokens >= len(prompt_ids(target, question)) - 1
    drafter_model = None if choice is None else choice.model
    assert_exact(caches, target, drafter_model if caches.drafter_ids else None)  # auto may never have read
