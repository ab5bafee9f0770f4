"""The speculative loop on real mlx-lm models: lossless, sampling, caches, limits, bad input."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from tests.support.tiny_models import build_tiny, tiny_pair
from uag.cli import main
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice, make_drafter
from uag.core.engine import GenerationConfig, PromptCaches, Seams, generate, prompt_ids, stream
from uag.core.policy import AdaptiveK, AutoSettings
from uag.core.translate import IntersectionTranslator, make_translator
from uag.models.store import ModelError

STRATEGIES = ("none", "naive", "context", "tli", "auto")
KS = (1, 2, 4)
PROMPTS = ["Stolica Polski to", "W 1989 roku w Polsce", "Zażółć gęślą jaźń, a w winie 🙂"]


@pytest.fixture(scope="module")
def tiny(store):
    """Tiny random models in the study's roles: Mistral-vocabulary target, Qwen and Llama drafters."""
    target, qwen = tiny_pair("qwen2.5", "mistral-v1", tie_embeddings=False)
    llama = build_tiny("llama", "llama-3.2", seed=7, tie_embeddings=False)
    return store.get(str(target)), {"qwen": store.get(str(qwen)), "llama": store.get(str(llama))}


def baseline_ids(target, prompt, max_tokens, **kw):
    return generate(target, None, prompt, GenerationConfig("baseline", max_tokens=max_tokens, **kw)).token_ids


@pytest.mark.parametrize("drafter_name", ["qwen", "llama"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tiny_models_greedy_output_equals_baseline(tiny, drafter_name, strategy):
    target, drafters = tiny
    for prompt in PROMPTS:
        expected = baseline_ids(target, prompt, 20)
        for k in KS:
            run = generate(
                target, drafters[drafter_name], prompt, GenerationConfig.parse(strategy=strategy, k=k, max_tokens=20)
            )
            assert run.token_ids == expected, (prompt, strategy, k)
            assert run.generated == 20 and run.finish_reason == "length"
            assert run.stalls == 0 and all(c.emitted >= 1 for c in run.cycles)


def test_self_speculation_accepts_everything_and_feeds_the_drafter_nothing_twice(tiny):
    target, _ = tiny
    expected = baseline_ids(target, PROMPTS[0], 25)
    for k in KS:
        run = generate(target, target, PROMPTS[0], GenerationConfig(k=k, max_tokens=25))
        assert run.token_ids == expected
        assert run.translation == "identity" and run.acceptance_rate == 1.0
        assert any("drafter is the target itself" in note for note in run.notes)
        full = [c for c in run.cycles if c.k == k]
        assert all(c.drafter_passes == k for c in full)  # no extra pass to re-sync after full acceptance
        assert all(c.accepted == k and c.emitted == k + 1 for c in full)


def test_sampling_every_emitted_token_is_one_the_target_sampled(tiny):
    target, drafters = tiny
    calls: list[list[int]] = []
    base = make_sampler(0.9)

    def recording(logprobs):
        y = base(logprobs)
        calls.append(np.array(y).reshape(-1).tolist())
        return y

    config = GenerationConfig(translation="context", k=3, max_tokens=30, temperature=0.9, seed=3)
    # the target drafts for itself: shared vocabulary, drafts get accepted, so both paths are exercised
    ids = prompt_ids(target, PROMPTS[0])
    run = list(stream(target, target, ids, config, seams=Seams(sampler=recording)))[-1].run
    assert run.accepted > 0 and any(c.accepted < c.proposed for c in run.cycles)
    assert run.opening == run.cycles[0].emitted and run.cycles[0].proposed  # the prompt pass verified a draft
    assert len(calls) == len(run.cycles)
    position = 0
    for cycle, sampled in zip(run.cycles, calls):
        assert run.token_ids[position : position + cycle.emitted] == sampled[: cycle.emitted]
        position += cycle.emitted
    assert position == run.generated


class CountingModel:
    """A model that records the width of every forward pass it makes."""

    def __init__(self, inner):
        self.inner, self.widths = inner, []

    def __call__(self, x, cache=None):
        self.widths.append(x.shape[1])
        return self.inner(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("strategy", ["context", "tli"])
def test_the_prompt_pass_verifies_the_first_draft(tiny, strategy):
    target, drafters = tiny
    counting = replace(target, model=CountingModel(target.model))
    ids = prompt_ids(target, PROMPTS[1])
    run = generate(counting, drafters["qwen"], ids, GenerationConfig.parse(strategy=strategy, k=3, max_tokens=12))
    assert run.token_ids == baseline_ids(target, ids, 12)
    first = run.cycles[0]
    assert first.proposed and run.opening == first.emitted
    widths = counting.model.widths
    # the prompt but its last token, then one pass per cycle: the first verifies the first draft
    assert widths[0] == len(ids) - 1 and widths[1] == 1 + first.proposed
    assert len(widths) == 1 + len(run.cycles)
    assert run.stats()["prompt_pass_tokens"] == run.opening


def test_sampling_is_seedable(tiny):
    target, drafters = tiny
    config = GenerationConfig(translation="context", k=2, max_tokens=15, temperature=1.0, seed=11)
    first = generate(target, drafters["qwen"], PROMPTS[1], config).token_ids
    again = generate(target, drafters["qwen"], PROMPTS[1], config).token_ids
    assert first == again
    other = GenerationConfig(translation="context", k=2, max_tokens=15, temperature=1.0, seed=12)
    assert generate(target, drafters["qwen"], PROMPTS[1], other).token_ids != first


def assert_cache_holds(model, cache, ids):
    """The cache holds exactly ids[:offset]: continuing from it matches a fresh prefill of all of `ids`."""
    offset = cache[0].offset
    assert 0 < offset < len(ids)
    from_cache = model.model(mx.array(ids[offset:])[None], cache=cache)[0, -1]
    fresh = model.model(mx.array(ids)[None], cache=model.make_cache())[0, -1]
    np.testing.assert_allclose(np.array(from_cache), np.array(fresh), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("stop_after", [None, 3])
@pytest.mark.parametrize("strategy", ["context", "naive", "tli"])
def test_caches_hold_the_committed_sequences_after_a_run_and_after_an_early_stop(tiny, strategy, stop_after):
    target, drafters = tiny
    drafter = drafters["llama"]
    config = GenerationConfig.parse(strategy=strategy, k=3, max_tokens=24)
    translator = make_translator(strategy, target.vocab, drafter.vocab, window=config.window, shared=False)
    caches = (target.make_cache(), drafter.make_cache())
    events = stream(
        target,
        drafter,
        prompt_ids(target, PROMPTS[2]),
        config,
        caches=PromptCaches(target_cache=caches[0], drafter_cache=caches[1]),
        seams=Seams(translator=translator),
    )
    for n, event in enumerate(events):  # noqa: B007 (the last event is read below)
        if stop_after is not None and n == stop_after:
            break
    events.close()
    run = event.run
    assert run.finish_reason == ("stopped" if stop_after else "length")
    assert translator.target_ids == run.prompt_ids + run.token_ids
    assert caches[0][0].offset == len(translator.target_ids) - 1  # every committed token but the newest
    assert_cache_holds(target, caches[0], translator.target_ids)
    assert_cache_holds(drafter, caches[1], translator.drafter_ids)


def test_auto_drafts_long_when_a_profile_says_drafts_are_cheap_and_stays_lossless(tiny):
    """Self-speculation accepts everything; with a cheap drafter, auto should go to k_max."""
    target, _ = tiny
    cheap = CostProfile({1: 10.0, 2: 10.2, 3: 10.3, 4: 10.4, 5: 10.5, 9: 11.0}, drafter_ms=0.2, translate_ms=0.05)
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=40)
    pinned = AutoSettings(learn_costs=False)  # the profile's costs, not this machine's load
    policy = AdaptiveK(k_max=4, profile=cheap, settings=pinned)
    ids = prompt_ids(target, PROMPTS[0])
    run = list(stream(target, target, ids, config, seams=Seams(policy=policy)))[-1].run
    assert run.token_ids == baseline_ids(target, PROMPTS[0], 40)
    assert run.k_policy == "adaptive" and [c.k for c in run.cycles].count(4) >= 5


def test_auto_parks_on_a_drafter_that_cannot_pay_and_stays_lossless(tiny):
    target, drafters = tiny  # random drafter: nothing accepted, and it is bigger than the target
    run = generate(target, drafters["qwen"], PROMPTS[1], GenerationConfig(k_policy="adaptive", k=4, max_tokens=40))
    assert run.token_ids == baseline_ids(target, PROMPTS[1], 40)
    assert sum(c.k == 0 for c in run.cycles) >= 30  # parked


def test_tli_with_adaptive_k_runs_the_adaptive_policy_over_the_tli_translator_and_stays_lossless(tiny):
    """`--strategy tli --k-policy adaptive` (strategy "tli+auto"): before the split, tli could only draft a fixed k."""
    target, drafters = tiny
    config = GenerationConfig("tli", 4, k_policy="adaptive", max_tokens=20)
    drafter = make_drafter(DrafterChoice(model=drafters["qwen"]), target, config)
    assert isinstance(drafter.translator, IntersectionTranslator)
    run = generate(target, drafters["qwen"], PROMPTS[0], config)
    assert (run.translation, run.k_policy, run.k) == ("tli", "adaptive", 4)
    assert run.token_ids == baseline_ids(target, PROMPTS[0], 20)


class ParkedRehearsingEvery5(AdaptiveK):
    """Parks always and rehearses every 5 parked steps, whatever the costs: exercises the engine's
    parked stretches and the drafter's catch-ups on them."""

    def best_k(self, rates=None):
        return 0

    def rehearsal_wait(self):
        return 5


class PassingLookupOver(AdaptiveK):
    """Parks always and passes over every lookup match (its proposals never pay here), counting its decisions."""

    decisions = 0

    def best_k(self, rates=None):
        return 0

    def lookup_rates(self, k_max, match=None, branched=False):
        return {}

    def choose(self, offer, left=None):
        self.decisions += 1
        return super().choose(offer, left)


def test_a_parked_stretch_goes_on_past_the_matches_its_decision_passed_over(store):
    """A tied target echoes its last token, so lookup matches at every step: a policy that passes every match over
    decides again only where the match reaches a longer band (or the stretch ends), not at every token."""
    target = store.get(str(build_tiny("llama", "mistral-v1", seed=5)))  # tied: greedy decoding repeats
    policy = PassingLookupOver(k_max=4, profile=CostProfile({1: 10.0, 2: 11.0}, drafter_ms=1.0))
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=60)
    run = generate(target, DrafterChoice(lookup=True), [5, 6, 7, 8] * 3, config, seams=Seams(policy=policy))
    assert run.token_ids == baseline_ids(target, [5, 6, 7, 8] * 3, 60)
    assert run.cycles and all(c.k == 0 for c in run.cycles)
    assert policy.decisions <= 8  # one a band a match passes through (2-3, 4-7, ... 64+) and the first; not 60


class PricingLookupBelowPlain(PassingLookupOver):
    """Parks always; prices every lookup proposal of one token, at next to nothing (so it passes each over)."""

    def lookup_rates(self, k_max, match=None, branched=False):
        return {1: 1e-9}


def test_the_first_step_of_each_stretch_says_the_lookup_proposal_its_decision_passed_over(store):
    """Each decision that parked past a lookup match is said by the next step's record (`Cycle.passed`), once: what
    a server's reply sums up as `passed_lookup`."""
    target = store.get(str(build_tiny("llama", "mistral-v1", seed=5)))  # tied: lookup matches at every step
    policy = PricingLookupBelowPlain(k_max=4, profile=CostProfile({1: 10.0, 2: 11.0}, drafter_ms=1.0))
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=40)
    run = generate(target, DrafterChoice(lookup=True), [5, 6, 7, 8] * 3, config, seams=Seams(policy=policy))
    assert run.token_ids == baseline_ids(target, [5, 6, 7, 8] * 3, 40)
    passed = [c.passed for c in run.cycles if c.passed is not None]
    assert passed and len(passed) <= policy.decisions
    assert all(p.k == 1 and p.match >= 2 and p.gain < 1 and p.batch == 1 for p in passed)


@pytest.mark.parametrize("stop_after", [None, 9])
def test_parked_stretches_and_rehearsals_are_lossless_and_keep_the_caches_exact(tiny, stop_after):
    target, drafters = tiny
    drafter = drafters["llama"]
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=30)
    translator = make_translator("context", target.vocab, drafter.vocab, window=config.window, shared=False)
    caches = (target.make_cache(), drafter.make_cache())
    events = stream(
        target,
        drafter,
        prompt_ids(target, PROMPTS[2]),
        config,
        caches=PromptCaches(target_cache=caches[0], drafter_cache=caches[1]),
        seams=Seams(policy=ParkedRehearsingEvery5(k_max=4), translator=translator),
    )
    for n, event in enumerate(events):  # noqa: B007 (the last event is read below)
        if stop_after is not None and n == stop_after:
            break
    events.close()
    run = event.run
    assert run.token_ids == baseline_ids(target, PROMPTS[2], 30)[: run.generated]
    assert all(c.k == 0 for c in run.cycles)
    rehearsals = [c for c in run.cycles if c.drafter_read]
    assert len(rehearsals) >= (1 if stop_after else 5)
    assert all(c.drafter_passes == 1 and c.drafter_read >= 2 and c.draft_ms > 0 for c in rehearsals)
    assert rehearsals[0].drafter_read > max((c.drafter_read for c in rehearsals[1:]), default=0)  # the prompt too
    assert_cache_holds(target, caches[0], translator.target_ids)
    assert_cache_holds(drafter, caches[1], translator.drafter_ids)


def test_a_batch_is_told_while_the_drafter_rehearses(tiny):
    """A server's batch does not hold the others' target passes for a rehearsal's drafter pass: the run's `Sharing`
    says `rehearsing` while the drafter reads its parked stretch, and only then."""
    from uag.core.records import Sharing

    target, drafters = tiny
    sharing, seen = Sharing(), []

    class Watched:  # the drafter's model, noting at each pass whether the run says it rehearses
        def __init__(self, model):
            self.model = model

        def __call__(self, *args, **kwargs):
            seen.append(sharing.rehearsing)
            return self.model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.model, name)

    drafter = replace(drafters["llama"], model=Watched(drafters["llama"].model))
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=30)
    translator = make_translator("context", target.vocab, drafter.vocab, window=config.window, shared=False)
    run = generate(
        target,
        drafter,
        PROMPTS[2],
        config,
        sharing=sharing,
        seams=Seams(policy=ParkedRehearsingEvery5(k_max=4), translator=translator),
    )
    assert len([c for c in run.cycles if c.drafter_read]) >= 5  # parked throughout: every drafter pass rehearses
    assert seen and all(seen) and not sharing.rehearsing
    seen.clear()
    drafting = GenerationConfig(k_policy="fixed", k=4, max_tokens=30)
    run = generate(target, drafter, PROMPTS[2], drafting, sharing=sharing, seams=Seams(translator=translator))
    assert any(c.k for c in run.cycles) and seen and not any(seen)  # drafts: the batch may hold the target for them


@pytest.mark.parametrize("strategy", ["context", "tli"])
def test_a_rehearsal_checks_the_drafter_guess_at_every_generated_position(tiny, strategy):
    """The target rehearsing its own greedy output guesses every token; a random drafter few. Either way the
    drafter's cache then holds everything but the newest token, as after a draft."""
    target, drafters = tiny
    ids, written = prompt_ids(target, PROMPTS[0]), baseline_ids(target, PROMPTS[0], 12)
    config = GenerationConfig.parse(strategy=strategy, max_tokens=12)
    for model, expected in ((target, [True] * 12), (drafters["qwen"], None)):
        drafter = make_drafter(DrafterChoice(model=model), target, config, shared=model is target)
        n_prompt = drafter.start(ids)
        drafter.commit(None, written)
        rehearsal = drafter.rehearse()
        drafter_ids = drafter.translator.drafter_ids
        assert rehearsal.target_tokens == 12 and rehearsal.read == len(drafter_ids) - 1
        assert len(rehearsal.hits) == len(drafter_ids) - n_prompt
        if expected is not None:
            assert rehearsal.hits == expected
        else:
            assert sum(rehearsal.hits) < len(rehearsal.hits) / 2
        assert_cache_holds(model, drafter.cache, drafter_ids)
        assert drafter.rehearse() is None  # nothing new to read


def test_drafter_passes_per_cycle_stay_at_k(tiny):
    target, drafters = tiny
    for k in KS:
        run = generate(target, drafters["qwen"], PROMPTS[0], GenerationConfig("context", k=k, max_tokens=30))
        assert run.drafter_passes <= (k + 0.2) * len(run.cycles)


def test_eos_stops_the_run_and_max_tokens_is_exact(tiny):
    target, drafters = tiny
    eos = next(iter(target.eos_ids))
    calls = []

    def greedy_then_eos(logprobs):
        calls.append(1)
        y = mx.argmax(logprobs, axis=-1)
        return mx.full(y.shape, eos, y.dtype) if len(calls) == 4 else y

    config = GenerationConfig(translation="context", k=2, max_tokens=50)
    events = stream(
        target, drafters["qwen"], prompt_ids(target, PROMPTS[0]), config, seams=Seams(sampler=greedy_then_eos)
    )
    run = list(events)[-1].run
    assert run.finish_reason == "eos" and run.token_ids[-1] == eos and run.token_ids.count(eos) == 1
    for max_tokens in (1, 2, 7):
        run = generate(target, drafters["qwen"], PROMPTS[0], GenerationConfig(k=4, max_tokens=max_tokens))
        assert run.generated == max_tokens


def test_sliding_window_layers_get_an_exact_trimmable_cache(store):
    """Gemma-3's sliding layers may use a plain KVCache: same tokens as mlx-lm's rotating cache, far
    past the window (8 tokens here), and speculation stays possible there."""
    gemma = store.get(str(build_tiny("gemma3_text", "llama-3.2", seed=3, tie_embeddings=False)))
    prompt = mx.array(prompt_ids(gemma, "Zażółć gęślą jaźń"))
    rotating = [
        t for t, _ in generate_step(prompt, gemma.model, max_tokens=40, prompt_cache=make_prompt_cache(gemma.model))
    ]
    plain = [t for t, _ in generate_step(prompt, gemma.model, max_tokens=40, prompt_cache=gemma.make_cache())]
    assert rotating == plain
    run = generate(gemma, gemma, prompt.tolist(), GenerationConfig(k=3, max_tokens=40))
    assert run.token_ids == plain


def test_non_trimmable_cache_is_refused_before_generation(store, tiny):
    target, _ = tiny
    mamba = store.get(str(build_tiny("mamba", "llama-3.2")))
    with pytest.raises(ModelError, match="cannot be trimmed"):
        stream(mamba, target, "Ala ma kota", GenerationConfig())
    with pytest.raises(ModelError, match="cannot be trimmed"):
        stream(target, mamba, "Ala ma kota", GenerationConfig())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["   "], "the prompt is empty"),
        (["-k", "0", "Ala"], "k (draft length) must be a whole number from 1 to 32 (got 0)"),
        (["-k", "33", "Ala"], "k (draft length) must be a whole number from 1 to 32 (got 33)"),
        (["--max-tokens", "0", "Ala"], "max tokens must be a whole number from 1 to 4096 (got 0)"),
        (["--max-tokens", "-5", "Ala"], "max tokens must be a whole number from 1 to 4096 (got -5)"),
        (["--temp", "-1", "Ala"], "temperature must be a number from 0 to 2"),
        (["--target", "/no/such/model", "Ala"], "no model directory at '/no/such/model'"),
        (["--target", "uag-test/no-such-model", "Ala"], "not in the Hugging Face cache"),
    ],
)
def test_bad_input_gives_a_clear_message_and_no_traceback(capsys, args, message):
    assert main(["generate", "--strategy", "baseline", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_refuses_models_it_cannot_speculate_with(capsys):
    mamba = str(build_tiny("mamba", "llama-3.2"))
    assert main(["generate", "--target", mamba, "--drafter", mamba, "Ala ma kota"]) == 2
    err = capsys.readouterr().err
    assert "cannot be trimmed" in err and "Traceback" not in err


def test_a_prompt_longer_than_the_context_is_refused(capsys):
    short = str(build_tiny("llama", "llama-3.2", max_position_embeddings=16))
    assert main(["generate", "--strategy", "baseline", "--target", short, "Ala ma kota " * 10]) == 2
    err = capsys.readouterr().err
    assert "has a context of 16" in err and "Traceback" not in err


def test_json_output_has_the_documented_fields(capsys, tiny):
    target, drafters = tiny
    args = ["generate", "--target", str(target.path), "--drafter", str(drafters["qwen"].path)]
    assert main([*args, "-k", "2", "--max-tokens", "6", "--json", PROMPTS[0]]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "from_draft", "stats", "cycles"} <= out.keys()
    assert {"acceptance_rate", "tokens_per_second", "cycles"} <= out["stats"].keys()
    assert len(out["token_ids"]) == len(out["from_draft"]) == 6


# --- the embedded demo pair: a real cross-family pair with real acceptance -------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompt, strategies",
    [
        ("Stolica Polski to", STRATEGIES),  # every strategy; the second prompt (a longer, diacritic-rich one)
        ("Kraków – miasto w południowej Polsce, położone nad", ("context", "tli")),
    ],  # the translating ones
)
def test_demo_pair_every_strategy_and_k_reproduces_the_baseline(demo_pair, prompt, strategies):
    target, drafter = demo_pair
    expected = baseline_ids(target, prompt, 20)
    accepted = 0
    for strategy in strategies:
        for k in (1, 4):  # the narrowest and a wide draft (k = 2 runs in the CLI check below and on tiny pairs)
            run = generate(target, drafter, prompt, GenerationConfig.parse(strategy=strategy, k=k, max_tokens=20))
            assert run.token_ids == expected, (strategy, k)
            accepted += run.accepted if strategy in ("context", "tli") else 0
    assert accepted > 0  # a real pair: some drafts really are accepted


@pytest.mark.slow
def test_demo_cli_context_equals_baseline(capsys):
    """The issue's acceptance check, through the CLI."""
    import json

    outputs = {}
    for strategy in ("baseline", "context"):
        assert (
            main(["generate", "--strategy", strategy, "-k", "2", "--max-tokens", "24", "--json", "Stolica Polski to"])
            == 0
        )
        outputs[strategy] = json.loads(capsys.readouterr().out)
    assert outputs["context"]["token_ids"] == outputs["baseline"]["token_ids"]
    assert outputs["context"]["stats"]["acceptance_rate"] > 0
