"""Drafter kinds: prompt lookup (pure n-gram matching) and the hybrid, lossless through the same cycle."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from tests.support.tiny_models import build_tiny, tiny_pair
from uag.core.anatomy import Loss
from uag.core.config import DrafterSpec, GenerationConfig
from uag.core.drafters import DrafterChoice, LookupDrafter, load_drafter_choice, lookup_offer, make_drafter
from uag.core.engine import PromptCaches, Seams, generate, prompt_ids, stream
from uag.core.lookup import LOOKUP_REACH, MATCH_CAP, NgramIndex, match_band
from uag.core.translate import make_translator
from uag.errors import InputError

KS = (1, 2, 4, 8)
# Repetitive prompts give lookup something to find; the last has no repeated n-gram at all.
PROMPTS = [
    "1. jabłko\n2. gruszka\n3. śliwka\n\nTa sama lista:\n1. jabłko\n2.",
    "Ala ma kota, a kot ma Alę. Ala ma kota, a kot",
    "Zażółć gęślą jaźń 🙂",
]


# --- the n-gram index (pure) ----------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence_longest_ngram_first():
    index = NgramIndex((3, 2))
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    assert index.match == (3, 3)  # "1 2 3" (n = 3) beats the more recent "2 3" (n = 2)
    assert index.propose(2) == [4, 9]
    index.extend([7])
    assert index.match is None and index.propose(4) == []


def test_lookup_carries_a_repetition_past_the_end_of_the_sequence():
    index = NgramIndex((2,))
    index.extend([5, 6, 5, 6])
    assert index.propose(5) == [5, 6, 5, 6, 5]


def test_lookup_uses_the_most_recent_occurrence_and_nothing_on_short_or_empty_input():
    index = NgramIndex((2,))
    assert index.propose(3) == []
    index.extend([1, 2, 7, 1, 2, 8, 1, 2])
    assert index.propose(1) == [8]
    assert NgramIndex((2,)).propose(4) == [] and index.propose(0) == []
    with pytest.raises(ValueError):
        NgramIndex((0,))


def test_a_match_says_how_far_back_it_runs_and_which_band_that_falls_in():
    index = NgramIndex((3, 2))
    index.extend([5, 1, 2, 3, 9, 7, 1, 2, 3])
    assert index.match == (3, 4) and index.match_length() == 3  # 5 and 7 differ before "1 2 3"
    copied = list(range(100, 140))
    index = NgramIndex((3, 2))
    index.extend([*copied, 0, *copied[:30]])  # a file being written out again
    assert index.match_length() == 30 and index.match_length(cap=16) == 16
    index.extend([*copied[30:], *range(200, 300)])  # a longer file then written again
    index.extend(range(200, 300))
    assert index.match_length() == MATCH_CAP  # followed back no further than the cap
    index.extend([77])
    assert index.match is None and index.match_length() == 0
    assert [match_band(n) for n in (2, 3, 4, 7, 8, 15, 16, 40, 63, 64, 500)] == [0, 0, 1, 1, 2, 2, 3, 4, 4, 5, 5]


def test_a_lookup_offer_and_its_cycle_carry_how_far_the_match_ran_back(tiny):
    """What auto judges a lookup by reaches it: in the offer before the draft, in the cycle's record after."""
    target, _ = tiny
    drafter = LookupDrafter(target.vocab)
    drafter.start([1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5, 6])
    offer = drafter.offer(4)  # a copy may run past k: as far as auto's verify curve pays (LOOKUP_REACH)
    assert dict(offer) == {"lookup": LOOKUP_REACH} and offer.match == 6 and dict(drafter.offer(80)) == {"lookup": 80}
    assert not offer.branched  # "… 6" occurred once: no other continuation to verify beside it
    draft = drafter.propose("lookup", 4, 8)
    assert draft.proposed == [9, 1, 2, 3] and draft.match == 6
    record = draft.cycle(4, 2, 3, verify_ms=1.0, resync_ms=0.0, resync_absorbed=False, loss=Loss())
    assert record.match == 6
    drafter.commit(draft, [9, 1, 7])
    assert drafter.offer(4) == {} and drafter.offer(4).match == 0


def test_drafter_spec_names_every_kind():
    assert DrafterSpec.parse("lookup").kind == "lookup"
    assert DrafterSpec.parse(" lookup+demo-drafter ") == DrafterSpec(lookup=True, model="demo-drafter")
    assert DrafterSpec.parse("org/model").kind == "model" and str(DrafterSpec.parse("lookup+x")) == "lookup+x"
    for bad in ("", "lookup+", "lookup+lookup"):
        with pytest.raises(InputError):
            DrafterSpec.parse(bad)


# --- through the engine, on tiny real mlx-lm models -------------------------------------------------


@pytest.fixture(scope="module")
def tiny(store):
    target, qwen = tiny_pair("qwen2.5", "mistral-v1", tie_embeddings=True)  # tied: the target tends to repeat
    return store.get(str(target)), store.get(str(qwen))


def baseline_ids(target, prompt, max_tokens):
    return generate(target, None, prompt, GenerationConfig(translation="baseline", max_tokens=max_tokens)).token_ids


@pytest.mark.parametrize("kind", ["lookup", "hybrid"])
@pytest.mark.parametrize("strategy", ["context", "naive", "auto"])
def test_every_drafter_kind_is_lossless_greedy_at_every_k(tiny, kind, strategy):
    target, model = tiny
    choice = DrafterChoice(lookup=True, model=model if kind == "hybrid" else None)
    for prompt in PROMPTS:
        expected = baseline_ids(target, prompt, 24)
        for k in KS:
            run = generate(target, choice, prompt, GenerationConfig.parse(strategy=strategy, k=k, max_tokens=24))
            assert run.token_ids == expected, (prompt, kind, strategy, k)
            assert run.generated == 24 and all(c.emitted >= 1 for c in run.cycles)
            reach = k if strategy != "auto" else max(k, LOOKUP_REACH)  # auto: a copy as long as it pays
            assert all(len(c.proposed_ids) <= reach for c in run.cycles if c.source == "lookup")
            assert {c.source for c in run.cycles} <= {"", "lookup", "model"}
            assert run.drafter == ("lookup" if kind == "lookup" else f"lookup+{model.name}")


def test_lookup_drafts_are_used_and_accepted_where_the_output_repeats(tiny):
    target, _ = tiny
    expected = baseline_ids(target, PROMPTS[1], 40)
    run = generate(target, DrafterChoice(lookup=True), PROMPTS[1], GenerationConfig(k=4, max_tokens=40))
    assert run.token_ids == expected
    lookups = [c for c in run.cycles if c.source == "lookup"]
    assert lookups and all(c.drafter_passes == 0 and c.draft_ids == c.proposed_ids for c in lookups)
    assert run.stats()["sources"]["lookup"] == len(lookups)
    assert run.accepted >= 10  # this tiny target loops ("ototot…"), which lookup predicts
    assert sum(run.from_draft) == run.accepted


@pytest.mark.parametrize("kind", ["lookup", "hybrid"])
def test_sampling_every_emitted_token_is_one_the_target_sampled(tiny, kind):
    target, model = tiny
    calls: list[list[int]] = []
    base = make_sampler(0.7)

    def recording(logprobs):
        y = base(logprobs)
        calls.append(np.array(y).reshape(-1).tolist())
        return y

    choice = DrafterChoice(lookup=True, model=model if kind == "hybrid" else None)
    for k in KS:
        calls.clear()
        config = GenerationConfig(translation="context", k=k, max_tokens=30, temperature=0.7, seed=5)
        events = stream(target, choice, prompt_ids(target, PROMPTS[0]), config, seams=Seams(sampler=recording))
        run = list(events)[-1].run
        # one target pass (one sampler call) per cycle, and one for the prompt pass unless it verified a draft
        position = len(calls) - len(run.cycles)
        assert position in (0, 1)
        assert run.token_ids[:position] == calls[0][:position]
        for cycle, sampled in zip(run.cycles, calls[position:]):
            assert run.token_ids[position : position + cycle.emitted] == sampled[: cycle.emitted], k
            position += cycle.emitted
        assert position == run.generated == 30


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_a_lookup_proposal_never_runs_past_the_token_budget(tiny, max_tokens):
    target, model = tiny
    for choice in (DrafterChoice(lookup=True), DrafterChoice(lookup=True, model=model)):
        run = generate(target, choice, PROMPTS[1], GenerationConfig(k=8, max_tokens=max_tokens))
        assert run.generated == max_tokens and run.token_ids == baseline_ids(target, PROMPTS[1], max_tokens)


def test_a_lookup_proposal_that_runs_past_eos_stops_at_the_first_eos(tiny):
    target, _ = tiny
    eos = next(iter(target.eos_ids))
    calls = []

    def greedy_then_eos(logprobs):
        calls.append(1)
        y = mx.argmax(logprobs, axis=-1)
        return mx.full(y.shape, eos, y.dtype) if len(calls) == 6 else y

    config = GenerationConfig(k=8, max_tokens=60)
    ids = prompt_ids(target, PROMPTS[1])
    run = list(stream(target, DrafterChoice(lookup=True), ids, config, seams=Seams(sampler=greedy_then_eos)))[-1].run
    assert run.finish_reason == "eos" and run.token_ids[-1] == eos and run.token_ids.count(eos) == 1


def test_lookup_with_nothing_to_find_runs_plain_target_steps(tiny):
    target, _ = tiny
    ids = prompt_ids(target, "x")[:1] or prompt_ids(target, "x")  # the shortest context there is
    expected = generate(target, None, ids, GenerationConfig(translation="baseline", max_tokens=6)).token_ids
    run = generate(target, DrafterChoice(lookup=True), ids, GenerationConfig(k=4, max_tokens=6))
    assert run.token_ids == expected


@pytest.mark.parametrize("stop_after", [None, 4])
def test_hybrid_leaves_both_caches_exact_after_a_run_and_an_early_stop(tiny, stop_after):
    target, model = tiny
    config = GenerationConfig(translation="context", k=4, max_tokens=24)
    translator = make_translator("context", target.vocab, model.vocab, window=config.window, shared=False)
    caches = (target.make_cache(), model.make_cache())
    choice = DrafterChoice(lookup=True, model=model)
    events = stream(
        target,
        choice,
        prompt_ids(target, PROMPTS[0]),
        config,
        caches=PromptCaches(target_cache=caches[0], drafter_cache=caches[1]),
        seams=Seams(translator=translator),
    )
    for n, event in enumerate(events):  # noqa: B007 (the last event is read below)
        if stop_after is not None and n == stop_after:
            break
    events.close()
    run = event.run
    committed = run.prompt_ids + run.token_ids
    assert caches[0][0].offset == len(committed) - 1
    assert translator.target_ids == committed
    for model_, cache, ids in ((target, caches[0], committed), (model, caches[1], translator.drafter_ids)):
        offset = cache[0].offset
        from_cache = model_.model(mx.array(ids[offset:])[None], cache=cache)[0, -1]
        fresh = model_.model(mx.array(ids)[None], cache=model_.make_cache())[0, -1]
        np.testing.assert_allclose(np.array(from_cache), np.array(fresh), atol=1e-3, rtol=1e-3)


def test_load_drafter_loads_no_model_for_lookup(store):
    assert load_drafter_choice(store, "lookup") == DrafterChoice(lookup=True)
    llama = build_tiny("llama", "llama-3.2", seed=3, tie_embeddings=False)
    choice = load_drafter_choice(store, f"lookup+{llama}")
    assert choice.lookup and choice.model is store.get(str(llama)) and choice.kind == "hybrid"


def test_a_prompt_longer_than_the_drafters_context_is_refused_with_one_line(tiny):
    import dataclasses

    target, model = tiny
    short = dataclasses.replace(model, config={**model.config, "max_position_embeddings": 4})
    with pytest.raises(InputError, match=r"for the drafter .* whose context is 4 tokens: .*prompt lookup"):
        generate(target, short, PROMPTS[0], GenerationConfig(k=2, max_tokens=4))
    run = generate(target, DrafterChoice(lookup=True), PROMPTS[0], GenerationConfig(k=2, max_tokens=4))
    assert run.generated == 4  # lookup has no context of its own to outgrow


@pytest.mark.parametrize("kind", ["model", "lookup", "hybrid"])
def test_every_rejected_position_gets_a_cause_in_the_cycle_records_and_the_run(tiny, kind):
    from uag.app.compare_view import loss_line

    target, model = tiny
    choice = DrafterChoice(lookup=kind != "model", model=None if kind == "lookup" else model)
    run = generate(target, choice, PROMPTS[0], GenerationConfig(k=4, max_tokens=24))
    rejected = [c for c in run.cycles if c.accepted < len(c.proposed_ids)]
    for c in rejected:  # every position after the first rejection is lost to that rejection's cause
        assert sum(c.loss.values()) == len(c.proposed_ids) - c.accepted, c
    loss = run.stats()["loss"]
    assert sum(loss[name] for name in ("disagree", "split", "held", "absorbed", "short")) == sum(
        sum(c.loss.values()) for c in run.cycles
    )
    assert loss["translation"] == loss["split"] + loss["held"] + loss["absorbed"]
    assert run.to_dict()["cycles"][0]["loss"] == run.cycles[0].loss  # per cycle in --json
    assert (loss_line(run) != "") == any(c.loss for c in run.cycles)


def test_auto_with_lookup_alone_gets_the_target_verify_curve_once_and_reuses_it(tiny, tmp_path, monkeypatch):
    from uag.api import profile_for
    from uag.costs.calibrate import QUICK
    from uag.costs.profiles import find_calibration, target_key

    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path))
    target, _ = tiny
    said = []
    profile = profile_for(target, DrafterChoice(lookup=True), progress=said.append)
    assert said and profile is not None and profile.drafter_ms == 0.0 and set(profile.target_ms) == set(QUICK["widths"])
    # every width as measured (a BLAS may price a wider pass below a narrower one: no envelope is laid over it)
    assert all(math.isfinite(ms) and ms > 0 for ms in profile.target_ms.values())
    saved = find_calibration(target_key(target))
    assert saved is not None and saved.key["drafter"] == "lookup" and saved.profile == profile
    again = []
    assert profile_for(target, DrafterChoice(lookup=True), progress=again.append) == profile and not again


def test_a_stop_rule_ends_the_model_s_drafts_where_it_says_and_its_cache_stays_exact(tiny):
    target, model = tiny
    config = GenerationConfig(translation="context", k=6, max_tokens=24)
    prompt = prompt_ids(target, PROMPTS[0])
    pipelined = make_drafter(DrafterChoice(model=model), target, config)
    pipelined.start(prompt)
    drafted = pipelined.propose("model", 3, 10).draft_ids
    stopped = make_drafter(DrafterChoice(model=model), target, config)
    stopped.start(prompt)
    asked = []
    draft = stopped.propose("model", 6, 10, stop=lambda qs: asked.append(list(qs)) or (2 if len(qs) == 3 else None))
    assert [len(qs) for qs in asked] == [1, 2, 3]  # asked after each draft, with every confidence so far
    assert draft.passes == 3 and draft.draft_ids == drafted[:2]  # the same greedy drafts; the third dropped
    assert len(draft.confidence) == 3 and all(0 < q <= 1 for q in draft.confidence)
    stopped.commit(draft, [*draft.proposed[:1], 7])  # the target kept one of them, then wrote its own
    ids, cache = stopped.translator.drafter_ids, stopped.cache
    from_cache = model.model(mx.array(ids[cache[0].offset :])[None], cache=cache)[0, -1]
    fresh = model.model(mx.array(ids)[None], cache=model.make_cache())[0, -1]
    np.testing.assert_allclose(np.array(from_cache), np.array(fresh), atol=1e-3, rtol=1e-3)


def test_an_offer_says_when_its_proposal_would_bring_other_continuations():
    """A short match whose n-gram occurred before followed otherwise: its pass will also read the others
    (NgramIndex.branches), which auto prices (AdaptiveK.lookup_rates)."""
    index = NgramIndex()
    index.extend([1, 2, 3, 1, 2, 4, 1, 2])
    assert index.branching() and index.branches(4) and lookup_offer(index, 4).branched
    index = NgramIndex()
    index.extend([1, 2, 3, 1, 2])
    assert not index.branching() and not index.branches(4) and not lookup_offer(index, 4).branched
