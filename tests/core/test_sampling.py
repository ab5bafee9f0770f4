"""Samplers and penalties (top_p, top_k, min_p; repetition, presence, frequency): checked settings, mlx-lm's
meanings, and speculation that stays the target's under them; and what a run's prompt time measures."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from scipy.stats import chisquare

from tests.support.tiny_models import tiny_pair
from uag.core.config import FIELDS, SAMPLING_FIELDS, GenerationConfig
from uag.core.drafters import DrafterChoice, make_drafter
from uag.core.engine import PromptCaches, Seams, generate, prompt_ids
from uag.core.policy import FixedK
from uag.core.sampling import PENALTY_CONTEXT, TargetSampling, greedy_ids
from uag.core.verify import IdMap, accept_rejection, draft_distribution
from uag.errors import InputError

PROMPTS = ["Stolica Polski to", "W 1989 roku w Polsce", "Zażółć gęślą jaźń, a w winie 🙂"]
PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=0.8),
    dict(frequency_penalty=0.5),
    dict(repetition_penalty=1.1, presence_penalty=-0.4, frequency_penalty=0.3),
]
NEW = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


# --- settings ----------------------------------------------------------------------------------------------------


def test_the_new_settings_are_neutral_by_default_and_stay_out_of_the_apps_controls():
    config = GenerationConfig()
    assert (config.top_p, config.top_k, config.min_p) == (1.0, 0, 0.0)
    assert (config.repetition_penalty, config.presence_penalty, config.frequency_penalty) == (1.0, 0.0, 0.0)
    assert not config.penalized and not config.truncated
    assert {f.name for f in SAMPLING_FIELDS} == set(NEW) <= {f.name for f in fields(GenerationConfig)}
    assert not set(NEW) & {f.name for f in FIELDS}


def test_what_counts_as_truncated_or_penalized():
    assert not GenerationConfig(top_k=40, top_p=0.9, min_p=0.1).truncated  # greedy: the argmax is in every cut
    assert GenerationConfig(temperature=0.7, top_k=40).truncated
    assert GenerationConfig(temperature=0.7, top_p=0.9).truncated
    assert not GenerationConfig(temperature=0.7, top_p=1.0, top_k=0, min_p=0.0).truncated
    for penalty in PENALTIES:
        config = GenerationConfig(**penalty)
        assert config.penalized and not config.truncated


def test_settings_are_parsed_from_loose_input():
    config = GenerationConfig.parse(
        top_p="0.9", top_k=40.0, min_p="0.05", repetition_penalty="1.1", presence_penalty=-2, frequency_penalty="2"
    )
    assert (config.top_p, config.top_k, config.min_p) == (0.9, 40, 0.05)
    assert config.top_k.__class__ is int
    assert (config.repetition_penalty, config.presence_penalty, config.frequency_penalty) == (1.1, -2.0, 2.0)
    assert GenerationConfig.parse(top_p=1, min_p=1, top_k=1).top_p == 1.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (dict(top_p=0), "top_p must be a number above 0, up to 1 (got 0)"),
        (dict(top_p=1.5), "top_p must be a number above 0, up to 1 (got 1.5)"),
        (dict(top_k=-1), "top_k must be a whole number from 0 to 1000000 (got -1)"),
        (dict(top_k=2.5), "top_k must be a whole number from 0 to 1000000 (got 2.5)"),
        (dict(top_k=True), "top_k must be a whole number"),
        (dict(min_p=-0.1), "min_p must be a number from 0 to 1 (got -0.1)"),
        (dict(min_p="nan"), "min_p must be a number from 0 to 1 (got 'nan')"),
        (dict(repetition_penalty=0), "repetition_penalty must be a number above 0, up to 10 (got 0)"),
        (dict(repetition_penalty=11), "repetition_penalty must be a number above 0, up to 10 (got 11)"),
        (dict(presence_penalty=2.5), "presence_penalty must be a number from -2 to 2 (got 2.5)"),
        (dict(frequency_penalty="-inf"), "frequency_penalty must be a number from -2 to 2 (got '-inf')"),
    ],
)
def test_a_setting_out_of_bounds_is_refused_with_its_name_and_bounds(raw, message):
    with pytest.raises(InputError) as err:
        GenerationConfig.parse(**raw)
    assert message in str(err.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(InputError) as err:
        GenerationConfig.parse(
            top_p=2, top_k=-3, min_p=5, repetition_penalty=-1, presence_penalty=9, frequency_penalty=9, k=0
        )
    message = str(err.value)
    assert all(f"{name} must be" in message for name in (*NEW, "k (draft length)"))
    with pytest.raises(InputError, match="top_k"):
        GenerationConfig(top_k=-1).validate()
    assert GenerationConfig().replace(top_k="5").top_k == 5


# --- mlx-lm's pieces, per position ------------------------------------------------------------------------------


def test_the_truncated_sampler_draws_what_mlx_lms_make_sampler_draws():
    """Same cut, same order, same draw: the target's sampler and the distribution rejection sampling uses agree
    with mlx-lm's make_sampler."""
    logprobs = mx.log(mx.softmax(mx.random.normal((6, 50), key=mx.random.key(0)) * 3, axis=-1))
    for settings in (dict(top_k=5), dict(min_p=0.1), dict(top_p=0.8), dict(top_p=0.9, min_p=0.05, top_k=7)):
        config = GenerationConfig(temperature=0.8, **settings)
        ours = TargetSampling.of(config).sampler
        theirs = make_sampler(
            0.8, top_p=config.top_p if config.top_p < 1 else 0.0, min_p=config.min_p, top_k=config.top_k
        )
        for seed in range(5):
            mx.random.seed(seed)
            a = ours(logprobs).tolist()
            mx.random.seed(seed)
            assert a == theirs(logprobs).tolist(), settings


def test_the_distribution_is_zero_outside_the_cut_and_a_top_k_past_the_vocabulary_keeps_everything():
    logits = mx.random.normal((3, 40), key=mx.random.key(1)) * 2
    p = np.array(TargetSampling.of(GenerationConfig(temperature=1.0, top_k=4)).distribution(logits))
    assert ((p > 0).sum(axis=-1) == 4).all() and np.allclose(p.sum(axis=-1), 1)
    top4 = np.argsort(-np.array(logits), axis=-1)[:, :4]
    assert all(set(np.nonzero(row)[0]) == set(best) for row, best in zip(p, top4))
    wide = TargetSampling.of(GenerationConfig(temperature=1.0, top_k=1000))
    everything = np.array(wide.distribution(logits))
    np.testing.assert_allclose(everything, np.array(mx.softmax(logits, axis=-1)), rtol=1e-5)
    assert wide.sampler(logits).shape == (3,)  # mlx-lm's apply_top_k would refuse 1000 > 40


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_greedy_ids_are_the_argmax_of_the_log_probabilities_or_none(dtype):
    """Random rows (with exact ties planted) give mlx-lm's greedy choice; a row whose top logit has a neighbour the
    subtraction could merge with it gives None: bfloat16 0.01 above zeros over 262,144 ids is a tie at -log V, where
    the logits' own argmax (7) is not the log-probabilities' (0); half precision's slack holds it too; float32's
    does not, and there 7 is the answer."""
    mx.random.seed(3)
    rows = (mx.random.normal((16, 50_000)) * 4).astype(dtype)
    rows[mx.arange(16), mx.random.randint(0, 50_000, (16,))] = 30.0  # a clear top (past half precision's slack)
    rows[2, 9] = rows[2, 40_000] = 30.0  # an exact tie: both sides take the first
    expected = mx.argmax(rows - mx.logsumexp(rows, axis=-1, keepdims=True), axis=-1).tolist()
    assert greedy_ids(rows) == expected and expected[2] == 9
    merged = mx.zeros((1, 262_144), dtype=dtype)
    merged[0, 7] = 0.01
    if dtype == mx.bfloat16:
        assert mx.argmax(merged - mx.logsumexp(merged, axis=-1, keepdims=True), axis=-1).item() == 0
    assert greedy_ids(merged) == ([7] if dtype == mx.float32 else None)  # float32: 0.01 is far past its slack
    assert greedy_ids(mx.array([[0.0, float("nan"), 1.0]], dtype=dtype)) is None


def test_ids_take_the_whole_path_where_the_shortcut_cannot_answer_and_only_for_mlx_lms_greedy_sampler():
    merged = mx.zeros((2, 262_144), dtype=mx.bfloat16)
    merged[:, 7] = 0.01
    greedy = TargetSampling.of(GenerationConfig())
    assert greedy.greedy and greedy.ids(merged) == [0, 0] == greedy.choose(merged).tolist()
    last = TargetSampling.of(GenerationConfig(), sampler=lambda x: mx.full(x.shape[:-1], x.shape[-1] - 1))
    assert not last.greedy and last.ids(merged) == [262_143, 262_143]  # a custom sampler is asked, never bypassed
    assert not TargetSampling.of(GenerationConfig(temperature=0.7)).greedy


def test_on_a_gpu_greedy_ids_take_the_whole_path(monkeypatch):
    """There the log-sum-exp is a few launches, like the shortcut's own: it is not taken."""
    import uag.core.sampling as sampling

    logits = mx.array([[0.1, 3.0, 2.0]])
    monkeypatch.setattr(sampling, "_argmax_if_sure", lambda _: pytest.fail("the shortcut was taken on a GPU"))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert TargetSampling.of(GenerationConfig()).ids(logits) == [1]
    assert sampling.greedy_picks(logits).arrays == [sampling.greedy_picks(logits).ids]  # nothing else to evaluate


def test_picks_built_before_they_are_read_give_what_ids_give():
    """A batch builds its members' picks beside its pass and reads them after (one evaluation for all): the same ids
    as each member's own `ids`, the whole path included where the shortcut cannot answer (bfloat16 0.01 above zeros)."""
    from uag.core.sampling import greedy_picks

    mx.random.seed(5)
    clear = mx.random.normal((4, 1000)) * 3
    merged = mx.zeros((2, 262_144), dtype=mx.bfloat16)
    merged[:, 7] = 0.01
    greedy = TargetSampling.of(GenerationConfig())
    picks = [greedy_picks(clear), greedy_picks(merged)]
    mx.eval([a for p in picks for a in p.arrays])
    assert [p.read() for p in picks] == [greedy.ids(clear), [0, 0]]
    assert greedy.by_argmax and not TargetSampling.of(GenerationConfig(repetition_penalty=1.2)).by_argmax


@pytest.mark.parametrize("penalty", PENALTIES)
def test_each_verified_row_is_penalized_with_the_history_before_its_position(penalty):
    committed, proposed = [3, 1, 4, 1, 5, 9, 2, 6] * 4, [5, 3, 5, 8]
    logits = mx.random.normal((len(proposed) + 1, 12), key=mx.random.key(2))
    sampling = TargetSampling.of(GenerationConfig(**penalty))
    rows = sampling.rows(committed, proposed, logits)
    processors = make_logits_processors(**penalty)  # mlx-lm's own defaults: a context of 20 tokens
    assert PENALTY_CONTEXT == 20
    for i in range(len(proposed) + 1):
        expected = logits[i : i + 1]
        for processor in processors:
            expected = processor(mx.array(committed + proposed[:i]), expected)
        np.testing.assert_allclose(np.array(rows[i]), np.array(expected[0]), rtol=1e-6)
    assert not np.allclose(np.array(rows[1]), np.array(rows[2]))  # a proposed token changes the next row's
    plain = TargetSampling.of(GenerationConfig())
    assert plain.rows(committed, proposed, logits) is logits  # nothing to process: not even a copy


def test_generate_step_after_a_cached_prefix_sees_the_prefix_through_with_prefix():
    sampling = TargetSampling.of(GenerationConfig(repetition_penalty=2.0))
    logits = mx.zeros((1, 10))
    prefix, read = [1, 2, 3], [4]
    seen = sampling.with_prefix(prefix, len(read))[0](mx.array(read), logits)
    whole = sampling.processors[0](mx.array(prefix + read), logits)
    assert np.array(seen).tolist() == np.array(whole).tolist()
    assert sampling.with_prefix([], 4) is sampling.processors


def test_rejection_sampling_keeps_the_targets_truncated_distribution():
    """The target's distribution after top_k = 2 of 5 tokens: what rejection sampling emits follows it exactly,
    though the drafter proposes every token."""
    to_target = {0: 4, 1: 3, 2: 2, 3: 1, 4: 0}
    target_logits = mx.array([[2.0, 0.5, 0.1, -1.0, 1.0], [0.0, 1.0, 2.0, 0.5, -0.5]])
    id_map = IdMap(to_target, 5)
    q = draft_distribution(mx.array([[0.3, 1.5, -0.2, 0.8, 0.0]]), 1.0)
    p = TargetSampling.of(GenerationConfig(temperature=1.0, top_k=2)).distribution(target_logits)
    mx.random.seed(0)
    outputs = []
    for _ in range(4000):
        draft = mx.random.categorical(mx.log(q[0])).item()
        verdict = accept_rejection(p, q, [draft], [to_target[draft]], id_map)
        outputs.append(to_target[draft] if verdict.accepted else verdict.token)
    counts = np.bincount(outputs, minlength=5)
    assert counts[1] == counts[2] == counts[3] == 0
    expected = np.array(p[0], dtype=np.float64)
    kept = expected > 0
    assert chisquare(counts[kept], expected[kept] / expected[kept].sum() * len(outputs)).pvalue > 1e-3


# --- the engine on tiny models ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(store):
    """A Mistral-vocabulary target and a Qwen drafter, untied (varied text: penalties change it)."""
    target, qwen = tiny_pair("qwen2.5", "mistral-v1", tie_embeddings=False)
    return store.get(str(target)), store.get(str(qwen))


@dataclass
class Alternating(FixedK):
    """Parked for 3 plain steps, then a draft of k, in turn, from a parked start: both of the engine's paths."""

    turn: int = 0

    def choose(self, offer, left=None):
        self.turn += 1
        return ("", 0) if self.turn % 2 else super().choose(offer, left)

    def plain_steps(self) -> int:
        return 3


def baseline_ids(target, prompt, max_tokens, **settings):
    config = GenerationConfig(translation="baseline", max_tokens=max_tokens, **settings)
    return generate(target, None, prompt, config).token_ids


# (strategy, k, policy): fixed k, auto, and parked stretches between drafts
SCHEDULES = (("context", 1, None), ("context", 4, None), ("auto", 4, None), ("context", 3, Alternating))


@pytest.mark.parametrize("penalty", PENALTIES)
def test_greedy_with_a_penalty_under_speculation_is_the_target_alone_with_it(tiny, penalty):
    target, qwen = tiny
    drafters = {
        "self": target,
        "lookup": DrafterChoice(lookup=True),
        "hybrid": DrafterChoice(lookup=True, model=target),
    }
    changed, accepted = 0, 0
    for n, prompt in enumerate(PROMPTS):
        expected = baseline_ids(target, prompt, 24, **penalty)
        changed += expected != baseline_ids(target, prompt, 24)
        translated = {"qwen": qwen} if n == 0 else {}  # a big vocabulary to translate into: slow, so one prompt
        for name, drafter in {**drafters, **translated}.items():
            for strategy, k, policy in SCHEDULES if name != "qwen" else SCHEDULES[:1]:
                config = GenerationConfig.parse(strategy=strategy, k=k, max_tokens=24, **penalty)
                run = generate(target, drafter, prompt, config, seams=Seams(policy=policy and policy(k)))
                assert run.token_ids == expected, (prompt, name, strategy, k, policy)
                accepted += run.accepted if name == "self" else 0
    assert changed >= 1  # the penalty changes the target's output: the comparison can fail
    assert accepted > 0  # drafts were kept, so rows after the first were verified under the penalty


def test_a_penalty_reads_the_whole_conversation_whatever_the_caches_held(tiny):
    """A second turn read from a kept cache picks as a cold read of the same ids does: the penalties see the
    cached tokens too, for the target alone and under speculation."""
    target, qwen = tiny
    penalty = dict(repetition_penalty=1.3, presence_penalty=0.5)
    first_ids = prompt_ids(target, PROMPTS[2])
    for drafter in (None, target, qwen):
        config = GenerationConfig("baseline" if drafter is None else "context", k=3, max_tokens=12, **penalty)
        caches = PromptCaches.empty()
        first = generate(target, drafter, first_ids, config, caches=caches)
        second_ids = [*first_ids, *first.token_ids, *prompt_ids(target, " i dalej")[1:]]
        second = generate(target, drafter, second_ids, config, caches=caches)
        assert second.cached_tokens > PENALTY_CONTEXT
        assert second.token_ids == baseline_ids(target, second_ids, 12, **penalty)


def test_top_k_of_one_at_temperature_one_is_greedy(tiny):
    target, qwen = tiny
    for prompt in PROMPTS[:2]:
        expected = baseline_ids(target, prompt, 16)
        assert baseline_ids(target, prompt, 16, temperature=1.0, top_k=1, seed=5) == expected
        for drafter, strategy in ((target, "context"), (qwen, "tli"), (DrafterChoice(lookup=True), "auto")):
            config = GenerationConfig.parse(strategy=strategy, k=3, max_tokens=16, temperature=1.0, top_k=1, seed=5)
            assert generate(target, drafter, prompt, config).token_ids == expected, (strategy, drafter)


def kept_by_the_cut(target, ids: list[int], n: int, *, top_k: int = 0, min_p: float = 0.0) -> list[bool]:
    """For each of the last n tokens of `ids`: whether the target's top_k / min_p cut at its position keeps it
    (the target read from scratch; a little slack for the incremental passes' rounding)."""
    logits = target.model(mx.array(ids)[None], cache=target.make_cache())[0, -n - 1 : -1].astype(mx.float32)
    logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    chosen = logprobs[np.arange(n), ids[-n:]][:, None]
    kept = np.ones(n, dtype=bool)
    if top_k:
        kept &= (logprobs > chosen + 1e-4).sum(axis=-1) < top_k
    if min_p:
        kept &= chosen[:, 0] >= logprobs.max(axis=-1) + np.log(min_p) - 1e-4
    return kept.tolist()


@pytest.mark.parametrize("cut", [dict(top_k=3), dict(min_p=0.2)])
def test_a_seeded_sampled_run_emits_only_tokens_inside_the_cut(tiny, cut):
    target, qwen = tiny
    ids = prompt_ids(target, PROMPTS[1])
    outside = 0
    # the target alone; exact-match sampling (the target drafting for itself); rejection sampling (tli)
    for drafter, strategy in ((None, "baseline"), (target, "context"), (qwen, "tli")):
        for seed in (1, 2):
            settings = dict(translation=strategy, k=3, max_tokens=16, temperature=1.5, seed=seed)
            run = generate(target, drafter, ids, GenerationConfig(**settings, **cut))
            assert all(kept_by_the_cut(target, ids + run.token_ids, run.generated, **cut)), (strategy, seed)
            free = generate(target, drafter, ids, GenerationConfig(**settings))
            outside += not all(kept_by_the_cut(target, ids + free.token_ids, free.generated, **cut))
    assert outside > 0  # without the cut, sampling at this temperature does leave it: the check can fail


def test_generate_step_with_mlx_lms_pieces_is_the_reference(tiny):
    """The target alone is mlx-lm's generate_step with make_sampler and make_logits_processors."""
    target, _ = tiny
    ids = prompt_ids(target, PROMPTS[0])
    processors = make_logits_processors(repetition_penalty=1.3, frequency_penalty=0.5)
    steps = generate_step(mx.array(ids), target.model, max_tokens=16, logits_processors=processors)
    assert [t for t, _ in steps] == baseline_ids(target, ids, 16, repetition_penalty=1.3, frequency_penalty=0.5)


# --- the prompt time ---------------------------------------------------------------------------------------------


class SlowDrafter:
    """A drafter that takes `delay` seconds more to start a run and to make each proposal."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def start(self, prompt):
        time.sleep(self.delay)
        return self.inner.start(prompt)

    def propose(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.propose(*args, **kwargs)


def test_the_prompt_time_of_a_one_token_read_excludes_the_first_drafting(tiny):
    """A conversation's next turn whose caches hold all but one token: the prompt time is the target reading that
    token (with the first draft's verification), not the drafter's start and first draft, however long they take."""
    target, qwen = tiny
    config = GenerationConfig(translation="context", k=3, max_tokens=8)
    caches = PromptCaches.empty()
    first = generate(target, qwen, PROMPTS[0], config, caches=caches)
    ids = [*first.prompt_ids, *first.token_ids]
    slow = SlowDrafter(make_drafter(DrafterChoice(model=qwen), target, config, caches=caches), delay=0.3)
    start = time.perf_counter()
    run = generate(target, slow, ids, config, caches=caches)
    assert run.cached_tokens == len(ids) - 1 and run.cycles[0].proposed and run.opening == run.cycles[0].emitted
    assert (run.first_token_s - start) * 1000 >= 600  # the opening waited for the slow drafter ...
    assert run.cycles[0].verify_ms <= run.prompt_ms < 600  # ... which the prompt time leaves out
    assert run.stats()["prompt_tps"] == pytest.approx(1 / (run.prompt_ms / 1000))


def test_the_prompt_time_of_a_run_parked_from_the_start_is_the_target_reading_the_prompt(tiny):
    target, qwen = tiny
    config = GenerationConfig(translation="context", k=3, max_tokens=8)
    slow = SlowDrafter(make_drafter(DrafterChoice(model=qwen), target, config), delay=0.6)
    start = time.perf_counter()
    run = generate(target, slow, PROMPTS[1], config, seams=Seams(policy=Alternating(3)))
    assert run.cycles[0].k == 0 and run.opening == 1
    assert (run.first_token_s - start) * 1000 >= 600 > run.prompt_ms > 0  # the drafter's start is not in it


class FixedMask:
    """A grammar stand-in whose every row allows the same tokens (uag.core.grammar.Matcher's `masks` shape)."""

    def __init__(self, allowed: list[int], width: int):
        self.row = np.zeros((width + 31) // 32, dtype=np.int32)
        for t in allowed:
            self.row.view(np.uint32)[t >> 5] |= np.uint32(1 << (t & 31))

    def masks(self, proposed):
        return np.stack([self.row] * (len(proposed) + 1))


def test_under_a_grammar_the_distribution_is_the_targets_renormalised_over_what_it_allows():
    """What rejection sampling draws from (and greedy picks) under a constraint: the target's softmax over the
    allowed tokens only, renormalised; every verified row masked."""
    logits = mx.array([[0.5, 2.0, 1.0, -1.0, 3.0, 0.0], [3.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    sampling = TargetSampling.of(GenerationConfig(temperature=1.0), grammar=FixedMask([1, 3, 5], 6))
    rows = sampling.rows([7], [1], logits)
    p = np.array(sampling.distribution(rows))
    for row, raw in zip(p, np.array(logits)):
        expected = np.zeros(6)
        expected[[1, 3, 5]] = np.exp(raw[[1, 3, 5]]) / np.exp(raw[[1, 3, 5]]).sum()
        assert np.allclose(row, expected, atol=1e-6)
    assert TargetSampling.of(GenerationConfig(), grammar=FixedMask([1, 3, 5], 6)).choose(rows).tolist() == [1, 5]
