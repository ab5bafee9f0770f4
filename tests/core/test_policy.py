"""The adaptive draft length (no models): it speculates when drafts pay, parks when they do not."""

import math
from dataclasses import replace

import pytest

from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.evidence import Counts, Evidence, confidence_band, expected_tokens
from uag.core.policy import AdaptiveK, AutoSettings, FixedK, make_policy, within
from uag.core.records import Cycle, Offer, Rehearsal

PINNED = AutoSettings(learn_costs=False)  # the profile's costs, never the run's own timings
CHEAP_DRAFTER = CostProfile({1: 10.0, 2: 10.5, 3: 11.0, 5: 12.0, 9: 14.0}, drafter_ms=0.5, translate_ms=0.1)
COSTLY_DRAFTER = CostProfile({1: 10.0, 2: 15.0, 5: 30.0, 9: 50.0}, drafter_ms=6.0, translate_ms=0.1)


def cycle(k: int, proposed: int, accepted: int, *, verify_ms=10.0, draft_ms=None, confidence=0.5) -> Cycle:
    """A model cycle of k drafts, each of the drafter's `confidence`; a plain step for k = 0."""
    return Cycle(
        index=0,
        k=k,
        draft_ids=list(range(k)),
        proposed_ids=list(range(proposed)),
        accepted=accepted,
        emitted=accepted + 1,
        draft_ms=draft_ms if draft_ms is not None else 0.5 * k,
        verify_ms=verify_ms,
        drafter_passes=k,
        confidence=[confidence] * k,
    )


def test_expected_tokens_follows_the_per_position_acceptance():
    policy = AdaptiveK(k_max=4)
    assert expected_tokens(policy.acceptances(2)) == pytest.approx(1 + 0.5 + 0.25)  # the 50 % prior
    for _ in range(40):
        policy.observe(cycle(2, 2, 2))
    assert policy.acceptance(0) > 0.9 and policy.acceptance(1) > 0.9
    assert expected_tokens(policy.acceptances(2)) > 2.7


def test_first_decision_times_a_plain_step():
    policy = AdaptiveK(k_max=4)
    assert policy.next_k() == 0 and policy.plain_steps() == 1
    policy.observe(cycle(0, 0, 0, verify_ms=10.0))
    assert policy.next_k() > 0  # 50 % prior, a drafter at r = 0.1: worth a try


def test_high_acceptance_with_a_cheap_drafter_drafts_long():
    policy = AdaptiveK(k_max=8, profile=CHEAP_DRAFTER)
    for _ in range(30):
        policy.observe(cycle(8, 8, 8, verify_ms=14.0, draft_ms=4.0))
    assert policy.next_k() == 8


def rehearsal(hits: str, *, read=None, ms=1.0) -> Rehearsal:
    """A rehearsal from a string of guesses: "x" right and sure (0.95), "." wrong and unsure (0.05)."""
    flags = [c == "x" for c in hits]
    return Rehearsal(flags, read or len(flags), ms, len(flags), [0.95 if hit else 0.05 for hit in flags])


def parked(profile=CHEAP_DRAFTER, **kw) -> AdaptiveK:
    """A policy that has learned drafts do not pay (drafted at its profile's own costs)."""
    policy = AdaptiveK(k_max=4, profile=profile, **kw)
    for _ in range(30):
        policy.observe(cycle(2, 2, 0, verify_ms=profile.target_at(3), draft_ms=2 * profile.drafter_ms))
    assert policy.best_k() == 0
    return policy


def test_low_acceptance_parks_and_rehearses_ever_less_often_until_drafting_pays_again():
    policy = parked(settings=AutoSettings(rehearse_every=5))
    decisions, rehearsals = [], []
    for i in range(75):
        k = policy.next_k()
        decisions.append(k)
        policy.observe(cycle(k, k, 0, verify_ms=10.0))
        if policy.wants_rehearsal():
            rehearsals.append(i)
            policy.rehearsed(rehearsal(".....", ms=0.1))  # the drafter still guesses wrong
    assert decisions == [0] * 75  # parked throughout
    assert rehearsals == [4, 14, 34, 74] and policy.rehearsal_gap == 80  # each failed one doubles the gap
    policy.rehearsed(rehearsal("xxxxxxx.xxxxxxx", ms=0.1))  # the text turned predictable
    assert policy.next_k() > 0 and policy.rehearsal_gap == 5


def test_a_rehearsal_where_the_drafter_guessed_well_brings_speculation_back():
    policy = parked(settings=AutoSettings(rehearse_every=8))
    for _ in range(8):
        assert policy.next_k() == 0
        policy.observe(cycle(0, 0, 0, verify_ms=10.0))
    assert policy.wants_rehearsal()
    policy.rehearsed(rehearsal("xxxxxxx.xxxxxxx"))  # the text turned predictable
    assert policy.unread == 0 and policy.parked_for == 0
    assert policy.next_k() >= 2


def test_a_rehearsal_teaches_how_sure_the_drafter_is_not_whether_its_guesses_hit():
    """Where the target's tokenizer splits a word otherwise (Polish in an English drafter's tokens) a right guess
    is often a proposal the target would not keep: only the guesses' confidence is read."""
    hit, missed = parked(), parked()
    hit.rehearsed(Rehearsal([True] * 20, 20, 1.0, 20, [0.95] * 20))
    missed.rehearsed(Rehearsal([False] * 20, 20, 1.0, 20, [0.95] * 20))
    assert hit.rates() == missed.rates() and hit.next_k() > 0


def test_parked_policy_asks_for_a_stretch_of_plain_steps_until_the_next_rehearsal():
    policy = parked(settings=AutoSettings(rehearse_every=8))
    assert policy.next_k() == 0
    assert policy.plain_steps() == 8 - policy.parked_for


WIDE_IS_CHEAP = CostProfile({1: 10.0, 2: 12.0, 9: 12.8}, drafter_ms=2.0, translate_ms=0.1)


def test_a_rehearsal_waits_until_its_reading_costs_at_most_the_budget_of_the_stretch():
    policy = parked(WIDE_IS_CHEAP, settings=AutoSettings(rehearse_every=4))
    policy.begin(100)  # the drafter has not read its 100-token prompt: the first rehearsal must pay for it
    policy.observe(cycle(0, 0, 0, verify_ms=10.0))
    # reading a token: the wide pass's 0.35 ms per extra token × drafter step / target step (2 / 10)
    read = (12.8 - 10.0) / 8 * 2.0 / 10.0
    assert policy.prices.reading_ms(2) == pytest.approx(read)
    # one drafter pass reads the prompt and the stretch: a step, and `read` for every token after the first
    wait = math.ceil((2.0 + read * 99) / (AutoSettings().rehearsal_budget * 10.0 - read))
    assert policy.rehearsal_wait() == wait > policy.settings.rehearse_every
    steps = 1
    while not policy.wants_rehearsal():
        assert policy.next_k() == 0
        policy.observe(cycle(0, 0, 0, verify_ms=10.0))
        steps += 1
    assert steps == wait
    budget = AutoSettings().rehearsal_budget * 10.0 * wait
    assert 2.0 + read * (100 + wait - 1) <= budget  # the prompt and the stretch, within budget
    policy.rehearsed(rehearsal("." * wait, read=100 + wait, ms=2.0 + read * (100 + wait - 1)))
    assert policy.rehearsal_wait() < wait  # the backlog is read


def test_a_drafter_that_reads_too_slowly_for_the_budget_never_rehearses():
    policy = AdaptiveK(k_max=4, profile=COSTLY_DRAFTER, settings=AutoSettings(rehearse_every=4))
    policy.begin(20)
    policy.observe(cycle(0, 0, 0, verify_ms=10.0))
    # 5 ms per extra token of a wide pass × 6 / 10: 3 ms a token, ten times the budget's 0.3 ms a step
    assert policy.prices.reading_ms(2) == pytest.approx(3.0)
    assert policy.rehearsal_wait() == math.inf
    for _ in range(1000):
        assert policy.next_k() == 0 and not policy.wants_rehearsal()
        policy.observe(cycle(0, 0, 0, verify_ms=10.0))
    assert policy.plain_steps() == AutoSettings().stretch_max  # parked, but deciding again now and then


def test_what_reading_costs_per_token_is_learned_apart_from_the_drafter_step():
    policy = AdaptiveK(k_max=4, profile=COSTLY_DRAFTER, settings=AutoSettings(rehearse_every=4))
    for _ in range(30):
        policy.observe(cycle(2, 2, 0, verify_ms=15.0, draft_ms=12.0))  # 6 ms per drafter pass
    caught_up = cycle(1, 1, 0, verify_ms=15.0, draft_ms=6.0 + 40 * 0.05)
    caught_up.drafter_read = 41  # it read 40 missed tokens with its one pass
    policy.observe(caught_up)
    assert policy.evidence.drafter_ms == pytest.approx(6.0)
    assert policy.prices.reading_ms(2) == pytest.approx(0.05) and policy.prices.reading_ms(41) == pytest.approx(2.0)
    assert policy.unread == 0
    policy.observe(cycle(0, 0, 0, verify_ms=10.0))
    assert policy.unread == 1 and policy.rehearsal_wait() < math.inf
    # a rehearsal's reading is learned too: one pass, its step apart from what each token read added
    policy.rehearsed(rehearsal("." * 40, read=40, ms=6.0 + 39 * 0.08))
    assert policy.prices.reading_ms(2) == pytest.approx(0.05 * 0.8 + 0.08 * 0.2)


def test_measured_costs_override_the_profile():
    policy = AdaptiveK(k_max=2, profile=CHEAP_DRAFTER)
    assert policy.prices.target_ms(3) == 11.0
    policy.observe(cycle(2, 2, 1, verify_ms=30.0))
    assert policy.prices.target_ms(3) == 30.0


def test_a_profile_measured_on_a_busier_machine_is_scaled_to_the_run_own_speed():
    busy = CostProfile({w: 10 * ms for w, ms in CHEAP_DRAFTER.target_ms.items()}, drafter_ms=5.0, translate_ms=0.1)
    policy = AdaptiveK(k_max=8, profile=busy)
    policy.observe(cycle(0, 0, 0, verify_ms=10.0))  # this run's plain step: ten times faster than the profile's
    assert policy.prices.target_ms(9) == pytest.approx(14.0)
    assert policy.prices.drafter_step_ms(10.0) == pytest.approx(0.5)
    for _ in range(30):  # so the choice is the quiet profile's: long drafts, not parking
        policy.observe(cycle(8, 8, 8, verify_ms=14.0, draft_ms=4.0))
    assert policy.next_k() == 8
    pinned = AdaptiveK(k_max=8, profile=busy, settings=PINNED)
    pinned.observe(cycle(0, 0, 0, verify_ms=10.0))
    assert pinned.prices.target_ms(9) == pytest.approx(140.0)  # costs pinned by a test stay the profile's


def test_an_untimed_width_is_priced_from_the_nearest_width_timed_not_from_another_contexts_scale():
    """A server's evidence carries from request to request: after a long edit conversation its passes of 9 were
    timed at 3 s and the profile scaled by 2; on a short chat the run's own 2-token passes take 700 ms. The plain
    step it never timed is priced from those (630 ms), not from the old scale (900 ms), against which drafting
    one token at α 0.2 looked cheaper than a plain step — and auto drafted a whole reply that it lost on."""
    profile = CostProfile({1: 450.0, 2: 500.0, 9: 1200.0}, drafter_ms=50.0, translate_ms=0.0)
    evidence = Evidence(verify_ms={2: 700.0, 9: 3000.0}, scale=2.0)
    for _ in range(10):  # one draft in five accepted
        for kept in (1, 0, 0, 0, 0):
            evidence.saw_drafts([0.5], kept, 1)
    policy = AdaptiveK(k_max=4, profile=profile, evidence=evidence)
    assert policy.prices.target_ms(1) == pytest.approx(630.0)  # 450 × 700 / 500
    assert policy.prices.target_ms(8) == pytest.approx(1100.0 * 3000.0 / 1200.0)  # nearest timed: 9
    assert policy.acceptance(0) < 0.25 and policy.next_k() == 0  # parks: one draft at α 0.2 does not pay here
    pinned = AdaptiveK(k_max=4, profile=profile, evidence=Evidence(verify_ms={2: 700.0}), settings=PINNED)
    assert pinned.prices.target_ms(1) == pytest.approx(450.0)  # costs a test pinned stay the profile's


def test_with_a_target_curve_lookup_drafts_at_the_first_decision_and_without_one_a_step_is_timed_first():
    curve = CostProfile({1: 10.0, 2: 10.5, 5: 12.0, 9: 14.0}, drafter_ms=0.0)  # what prompt lookup's profile holds
    source, k = AdaptiveK(k_max=8, profile=curve).choose({"lookup": 4})
    assert source == "lookup" and k == 3  # at the 50 % prior, 3 tokens for 11.5 ms beat 4 for 12
    assert AdaptiveK(k_max=8).choose({"lookup": 4}) == ("", 0)


CODER_CPU = CostProfile({1: 450.0, 2: 574.0, 3: 708.0, 4: 832.0, 5: 845.0, 9: 1000.0}, drafter_ms=65.0)


def test_a_prompt_the_drafter_must_read_first_is_charged_to_drafting_over_the_tokens_left():
    """Reading a 100-token prompt costs the drafter ~1 s here (2 target steps; no measured reading curve: the
    estimate from the target's wide passes): a 32-token run could never earn that back at a 50 % guess, a
    1000-token run easily does."""
    short, long = AdaptiveK(k_max=4, profile=CODER_CPU), AdaptiveK(k_max=4, profile=CODER_CPU)
    short.begin(100, budget=32)
    long.begin(100, budget=1000)
    assert short.backlog_ms() == pytest.approx(99 * (1000 - 450) / 8 * 65 / 450)
    assert short.next_k() == 0 and long.next_k() > 0
    after = AdaptiveK(k_max=4, profile=CODER_CPU)
    after.begin(100, budget=32)
    first = replace(cycle(1, 1, 1, verify_ms=574.0, draft_ms=65.0 + 990.0), drafter_read=100)
    after.observe(first)  # the prompt is read: no backlog left, and what reading it cost is learned
    assert after.backlog_ms() == 0 and after.remaining == 30 and after.next_k() > 0


def test_a_lookup_match_that_runs_far_back_drafts_long_and_a_short_one_does_not():
    """On code-editing turns a lookup from a 2-token match is a guess and one from a 30-token match a copy
    (uag.core.lookup): auto learns acceptance per band of match length, so the same run drafts 8 tokens
    from the copy and takes a plain step at the guess. Pooled over both, one k fits neither."""
    policy = AdaptiveK(k_max=8, profile=replace(CODER_CPU, drafter_ms=0.0), settings=PINNED)
    looked_up = lambda match, kept: replace(  # noqa: E731
        cycle(8, 8, kept, verify_ms=1000.0, draft_ms=0.0), source="lookup", match=match, drafter_passes=0
    )
    for _ in range(6):
        policy.observe(looked_up(2, 0))  # a 2-token match: its proposal fails at once
        policy.observe(looked_up(30, 8))  # a 30-token match: all 8 kept
    assert policy.choose(Offer({"lookup": 8}, match=30)) == ("lookup", 8)
    assert policy.choose(Offer({"lookup": 8}, match=2)) == ("", 0)
    assert policy.choose(Offer({"lookup": 8, "model": 8}, match=3)) != ("lookup", 8)
    bands = policy.evidence.lookup_bands
    # each token in the band of the copy's length when judged: 2 (and never 3), 30-31, then 32-37
    assert bands[0].rejected[0] > 4 and bands[3].accepted[0] > 4 and bands[4].accepted[0] > 4
    assert bands[1].accepted == bands[1].rejected == [] and bands[0].accepted == [0.0]


def test_a_lookup_proposal_passed_over_is_kept_as_it_was_priced():
    """Where auto parks at a lookup match, `passed_over` says the proposal as it priced it (its match, the k that priced
    best, the tokens it expected, its rate against parking's, below 1) until the next decision; where it drafts the
    copy, nothing was passed over."""
    policy = AdaptiveK(k_max=8, profile=replace(CODER_CPU, drafter_ms=0.0), settings=PINNED)
    looked_up = lambda match, kept: replace(  # noqa: E731
        cycle(8, 8, kept, verify_ms=1000.0, draft_ms=0.0), source="lookup", match=match, drafter_passes=0
    )
    for _ in range(6):
        policy.observe(looked_up(2, 0))
        policy.observe(looked_up(30, 8))
    assert policy.choose(Offer({"lookup": 8}, match=2)) == ("", 0)
    passed = policy.passed_over()
    assert passed is not None and passed.match == 2 and 1 <= passed.k <= 8 and passed.batch == 1
    assert 0 < passed.gain < 1 and 1 <= passed.expected < 2  # its 2-3 band keeps almost nothing
    assert policy.choose(Offer({"lookup": 8}, match=30)) == ("lookup", 8) and policy.passed_over() is None
    assert policy.choose(Offer({"model": 8})) is not None and policy.passed_over() is None
    assert FixedK(4).passed_over() is None


def test_a_stretch_goes_on_past_matches_like_the_one_its_decision_passed_over():
    """Parked past a lookup match, the stretch is not ended by the next match in that band or a shorter one (a copy's
    match grows a token a step: deciding at every step costs a batch a decision per member per token), but by one in
    a longer band; a decision that passed over no match heeds any."""
    policy = AdaptiveK(k_max=8, profile=replace(CODER_CPU, drafter_ms=0.0), settings=PINNED)
    policy.observe(cycle(0, 0, 0, verify_ms=1000.0))
    for _ in range(6):
        policy.observe(replace(cycle(8, 8, 0, verify_ms=1000.0, draft_ms=0.0), source="lookup", match=5))
    assert policy.heeds(Offer({"lookup": 8}, match=5))  # no decision yet
    assert policy.choose(Offer({"lookup": 8}, match=5)) == ("", 0) and policy.passed == 1
    assert not policy.heeds(Offer({"lookup": 8}, match=7)) and not policy.heeds(Offer({"lookup": 8}, match=2))
    assert policy.heeds(Offer({"lookup": 8}, match=9))  # band 2: decided again
    policy.choose(Offer({"model": 8}))  # no match offered: nothing passed over
    assert policy.passed is None and policy.heeds(Offer({"lookup": 8}, match=2))
    assert FixedK(4).heeds(Offer({"lookup": 8}, match=5))


def test_a_lookup_band_with_no_verdicts_of_its_own_leans_on_the_shorter_one_s_or_its_floor():
    """The 2-3 band leans on all of lookup's first position; each longer band on the one below it (a longer copy
    breaks no more often), or on its floor where that is higher: from 8 tokens on, a match is a copy."""
    policy = AdaptiveK(k_max=8, profile=replace(CODER_CPU, drafter_ms=0.0), settings=PINNED)
    for kept in (8, 8, 0, 8):
        policy.evidence.lookup.add(8, kept)
    first = policy.acceptances(1, "lookup")[0]
    assert 0.5 < first < 0.8
    assert policy.acceptances(8, "lookup", match=5) == pytest.approx([first] * 3 + [0.8] * 5)  # lengths 5-7, 8-12


def test_failed_guesses_do_not_keep_auto_from_a_copy_until_copies_fail_too():
    """Found on an edit conversation's second turn: two 2-token lookup guesses failed in the first, lookup's
    pooled estimate fell to 0.17, and auto drafted by the model for the whole of a turn that rewrote a file
    (2.3 tok/s against 3.1 where it copied). A match of 16 tokens or more starts at its band's floor instead,
    and its own failures still bring it down within four cycles (the first already shortens it)."""
    policy = AdaptiveK(k_max=8, profile=replace(CODER_CPU, drafter_ms=0.0), settings=PINNED)
    guess = lambda match, kept: replace(  # noqa: E731
        cycle(2, 2, kept, verify_ms=574.0, draft_ms=0.0), source="lookup", match=match, drafter_passes=0
    )
    policy.observe(guess(2, 0))
    policy.observe(guess(3, 0))
    assert policy.acceptances(1, "lookup") < [0.2] and policy.choose({"lookup": 8}) == ("", 0)
    assert policy.choose(Offer({"lookup": 8}, match=30)) == ("lookup", 8)
    for _ in range(4):  # copies that fail at once: shorter after one, a plain step worth more within four
        source, k = policy.choose(Offer({"lookup": 8}, match=30))
        if source != "lookup":
            break
        policy.observe(replace(guess(30, 0), k=k, proposed_ids=list(range(k))))
    assert policy.choose(Offer({"lookup": 8}, match=30)) == ("", 0)


def test_fixed_k_never_changes():
    policy = FixedK(3)
    policy.observe(cycle(3, 3, 0))
    assert policy.choose({"model": 8}) == ("model", 3) and policy.plain_steps() == 1
    assert policy.choose({"lookup": 8, "model": 8}) == ("lookup", 3)  # lookup costs nothing: where it matches
    assert policy.choose({"lookup": 2, "model": 8}) == ("lookup", 2) and policy.choose({}) == ("", 0)
    assert not policy.wants_rehearsal()


def test_k_max_must_be_positive():
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(k_max=0)


# --- the Policy seam ---------------------------------------------------------------------------------------------


def test_every_policy_says_its_k_policy_and_keeps_within_the_budget_by_one_clamp():
    assert (FixedK.k_policy, AdaptiveK.k_policy) == ("fixed", "adaptive")
    assert make_policy(GenerationConfig(translation="context", k=3)) == FixedK(3)
    auto = make_policy(GenerationConfig(k_policy="adaptive", k=6), CODER_CPU)
    assert auto.k_policy == "adaptive" and auto.k_max == 6 and auto.profile is CODER_CPU
    assert within(("model", 4), 3) == ("model", 2) and within(("lookup", 2), 1) == ("", 0)
    assert within(("model", 4), None) == ("model", 4)
    assert FixedK(4).choose({"model": 8}, left=3) == ("model", 2)
    assert FixedK(4).choose({"model": 8}, left=1) == ("", 0)  # one token left: the target writes it
    drafting = AdaptiveK(k_max=8, profile=CHEAP_DRAFTER, evidence=sure(0.95))
    assert drafting.choose({"model": 8})[1] > 2 and drafting.choose({"model": 8}, left=3) == ("model", 2)


def test_choosing_ages_no_evidence_and_passing_lookup_over_ages_its_evidence_once_observed():
    policy = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, evidence=sure(0.95))
    for _ in range(5):
        policy.observe(replace(cycle(2, 2, 0, verify_ms=11.0), source="lookup", draft_ms=0.0))
    before = policy.evidence.lookup.to_dict()
    for _ in range(3):
        assert policy.choose({"lookup": 4, "model": 4})[0] == "model"  # lookup failed: the model drafts
    assert policy.evidence.lookup.to_dict() == before  # deciding changed nothing
    policy.observe(cycle(2, 2, 2, verify_ms=11.0))
    assert policy.evidence.lookup.rejected[0] == pytest.approx(0.9 * before["rejected"][0])


# --- evidence: where a run starts, and how fast it moves ----------------------------------------------------------

# The coder pair on a 2-core CPU (Qwen2.5-Coder-1.5B fp32, SmolLM2-135M): verification over w tokens, a drafter
# step, and the drafter's one pass over n tokens (reading a prompt costs a pass, not n steps).
CODER = CostProfile(
    {1: 444.0, 2: 504.0, 3: 585.0, 4: 650.0, 5: 700.0, 9: 900.0, 16: 1400.0},
    drafter_ms=55.0,
    translate_ms=2.0,
    read_ms={1: 55.0, 8: 75.0, 32: 120.0, 128: 300.0, 512: 1000.0},
)
# The demo pair: a drafter that costs half a target step cannot pay at a 50 % guess.
DEMO = CostProfile({1: 20.0, 2: 21.0, 3: 22.5, 9: 28.0}, drafter_ms=10.0, translate_ms=0.5, read_ms={1: 10.0, 64: 20.0})


def sure(alpha: float, n: float = 20.0) -> Evidence:
    """Evidence of earlier runs whose drafts, all of confidence `alpha`, the target kept `alpha` of the time."""
    evidence, band = Evidence(), confidence_band(alpha)
    evidence.confidence[band], evidence.drafted[band] = Counts([alpha * n], [(1 - alpha) * n]), n
    return evidence


def opening(profile: CostProfile, evidence: Evidence | None = None, prompt: int = 120, budget: int = 48):
    """The policy's first decision after the prompt pass (which never waits for the drafter to read the prompt)."""
    policy = AdaptiveK(k_max=8, profile=profile, evidence=evidence, settings=PINNED)
    policy.begin(prompt, budget)
    assert policy.choose({"model": 8}, budget) == ("", 0) and policy.plain_steps() == 1
    return policy, policy.choose({"model": 8}, budget)


def test_the_prompt_pass_never_waits_for_the_drafter_to_read_the_prompt():
    """TTFT: with a prompt to read, the opening parks or copies; without one (a conversation's cache), it may draft."""
    policy = AdaptiveK(k_max=8, profile=CODER, evidence=sure(0.8), settings=PINNED)
    policy.begin(120, 48)
    assert policy.choose({"model": 8}, 48) == ("", 0) and policy.plain_steps() == 1  # one step, then it may draft
    assert policy.choose({"model": 8}, 47) == ("model", 8)
    policy.begin(120, 48)
    assert policy.choose(Offer({"model": 8, "lookup": 64}, match=40), 48)[0] == "lookup"  # a copy costs no reading
    policy.begin(0, 48)
    assert policy.choose({"model": 8}, 48) == ("model", 8)


def test_the_opening_drafts_where_the_calibrated_costs_pay_and_parks_where_they_do_not():
    # no earlier run: the 50 % guess. Coder: a k = 1 cycle costs 55 + 504 ms for 1.5 tokens; the prompt's
    # reading, one 120-token pass (~290 ms), is earned back within the run -> it drafts from the first token
    policy, decision = opening(CODER)
    assert decision == ("model", 8) and policy.next_k() == 1  # it drafts; how far, the drafts' confidence says
    assert policy.backlog_ms() == pytest.approx(CODER.drafter_pass(120) - 55.0)
    assert policy.rates()[1] * 444.0 > 1.1
    # the demo pair: 10 + 21 ms for 1.5 tokens is 0.97 of the target alone's 20 ms per token -> parks
    assert opening(DEMO)[1] == ("", 0)
    # a run too short to earn the prompt's reading back parks
    assert opening(CODER, budget=2)[1] == ("", 0)


def test_the_opening_follows_what_earlier_runs_of_the_pair_accepted():
    assert opening(CODER, sure(0.8))[1][1] >= 3  # code: long drafts from the first token
    assert opening(CODER, sure(0.1))[1] == ("", 0)  # an English drafter on Polish: parked from the start
    assert opening(DEMO, sure(0.25))[1] == ("", 0)


# The coder pair with the 0.5B drafter on a 2-core CPU, as `uag calibrate` measured it: a drafter step costs 0.38
# of a target step, and reading a prompt ~10 ms a token.
CODER_05B = CostProfile(
    {1: 378.0, 2: 441.0, 3: 489.0, 5: 564.0, 9: 670.0, 16: 723.0, 33: 1211.0, 65: 1988.0},
    drafter_ms=142.0,
    read_ms={1: 138.0, 16: 249.0, 32: 376.0, 64: 661.0, 128: 1255.0, 256: 2587.0},
)


def parked_at_opening(evidence: Evidence, budget: int, settings=PINNED) -> AdaptiveK:
    """A run of the 0.5B pair opening on `evidence` with a 90-token prompt unread, parked after its prompt pass."""
    policy = AdaptiveK(k_max=16, profile=CODER_05B, evidence=evidence, settings=settings)
    policy.begin(90, budget)
    assert policy.choose({"model": 16}, budget) == ("", 0) and policy.plain_steps() == 1
    policy.observe(Cycle.plain(0, 378.0))
    assert policy.choose({"model": 16}, budget - 1) == ("", 0)
    return policy


def test_a_run_parked_on_other_texts_evidence_looks_at_its_own_early_where_drafting_may_pay():
    """The budget's first rehearsal over a 90-token prompt comes after ~650 parked steps here: a reply shorter than
    that, parked on evidence carried from other texts, never drafted, however well the model would have done on it
    (docs/results.md, dl). Where what a look may show is worth its reading, the run rehearses after 16 steps."""
    policy = parked_at_opening(sure(0.55), budget=64)
    assert policy._budgeted_wait() > 600  # the budget alone: parked throughout
    assert policy.plain_steps() == 15 and policy.look_at == 16
    steps = 1
    while not policy.wants_rehearsal():
        policy.observe(Cycle.plain(0, 378.0))
        steps += 1
    assert steps == 16
    cost = CODER_05B.drafter_ms + policy.prices.reading_ms(90 + 16)
    assert policy.first_look_ms(64 - 16) > cost
    policy.rehearsed(Rehearsal([True] * 16, 106, cost, 16, [0.99] * 16))  # its own text: the drafter is sure of it
    assert policy.looked and policy.next_k() > 0
    # off: as before, the budget alone
    off = parked_at_opening(sure(0.55), budget=64, settings=replace(PINNED, first_look=False))
    assert off.plain_steps() == off.settings.stretch_max and not off.wants_rehearsal()


def test_a_first_look_is_taken_only_where_it_may_pay_for_its_reading():
    # a longer reply: the same chance of a better text saves more tokens' time
    assert parked_at_opening(sure(0.3), budget=400).first_look() == 16
    # a 64-token reply on evidence that its drafts hardly pay: the look would cost more than it may save
    unlikely = parked_at_opening(sure(0.3), budget=64)
    assert unlikely.first_look_ms(48) < CODER_05B.drafter_ms + unlikely.prices.reading_ms(106)
    assert unlikely.first_look() == math.inf and unlikely.plain_steps() == unlikely.settings.stretch_max
    # too few tokens left to earn any reading back
    assert parked_at_opening(sure(0.5), budget=24).first_look() == math.inf
    # the more certain the evidence of a poor drafter, the less a look is worth
    assert parked_at_opening(sure(0.1), budget=400).first_look_ms(384) < unlikely.first_look_ms(384)


def test_a_drafter_the_prior_parks_is_looked_at_once_before_it_ever_drafted():
    """A drafter costing 0.38 of a target step does not pay at the prior's 50 %: with nothing seen yet the chance is
    taken about the prior with the weight of one observation, and a look at 16 steps pays for its reading."""
    policy = parked_at_opening(Evidence(), budget=64)
    assert policy.evidence.mean_chance() is None
    assert policy.plain_steps() == 15 and policy.look_at == 16
    assert policy.first_look_ms(48) > 1.5 * (CODER_05B.drafter_ms + policy.prices.reading_ms(106))


def test_after_one_look_the_rehearsal_budget_paces_the_rest():
    policy = parked_at_opening(sure(0.5), budget=400)
    assert policy.plain_steps() == 15
    for _ in range(15):
        policy.observe(Cycle.plain(0, 378.0))
    assert policy.wants_rehearsal()
    policy.rehearsed(Rehearsal([False] * 16, 106, 1200.0, 16, [0.05] * 16))  # its text: the drafter is lost here
    assert policy.next_k() == 0 and policy.looked
    assert policy.rehearsal_wait() == policy._budgeted_wait() > 16
    policy.begin(90, 400)  # the next run looks again, at its own text
    assert not policy.looked and policy.look_at is None


def test_evidence_of_earlier_runs_is_overruled_within_a_few_cycles_both_ways():
    # opened on long drafts that this text rejects: parked within 6 cycles, each draft shorter than the last
    policy, (_, k) = opening(CODER, sure(0.8), budget=200)
    ks = []
    while k:
        k = policy.next_k()  # the draft its estimate pays for best (the drafter may stop short of the offer's 8)
        ks.append(k)
        policy.observe(cycle(k, k, 0, verify_ms=CODER.target_at(k + 1), draft_ms=55.0 * k))
        k = policy.choose({"model": 8}, 200)[1]
    assert len(ks) <= 6 and ks == sorted(ks, reverse=True) and ks[0] >= 3
    # opened parked on a text the drafter guesses well: drafting again from the first rehearsal
    policy, decision = opening(CODER, sure(0.1), budget=200)
    assert decision == ("", 0)
    steps = 0
    while not policy.wants_rehearsal():
        policy.observe(Cycle.plain(0, 444.0))
        steps += 1
    # reading the 120-token prompt and the stretch fits 3 % of the stretch from here on
    assert steps == policy.rehearsal_wait() <= 32
    policy.rehearsed(rehearsal("xxxxxxx.xxxxxxx.xxxxxxxxxx", read=120 + steps, ms=300.0))
    assert policy.choose({"model": 8}, 200)[1] >= 1


def test_a_policy_learns_into_the_evidence_it_was_given_and_the_next_run_starts_from_it():
    evidence = Evidence()
    first = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, evidence=evidence)
    first.begin(10, 100)
    for _ in range(20):
        first.observe(cycle(2, 2, 2, verify_ms=11.0))
    learned = first.acceptance(0)
    assert first.evidence is evidence and learned > 0.9
    second = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, evidence=evidence)
    second.begin(10, 100)  # how sure the first run's drafts were weighs as `carry` drafts now; the verdicts stay
    assert sum(evidence.drafted) == pytest.approx(AutoSettings().carry)
    assert second.acceptance(0) == pytest.approx(learned)
    fresh = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, evidence=evidence, settings=AutoSettings(carried=False))
    fresh.begin(10, 100)  # carrying nothing: the prior again
    assert fresh.acceptance(0) == AutoSettings().prior and evidence.mean_chance() is None


def test_drafts_that_translate_into_no_target_token_count_as_misses():
    """A model draft stripped by translation (a partial word at the boundary) proposes nothing and keeps nothing:
    auto learns that drafting does not pay there and parks, instead of drafting forever at its prior."""
    policy = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER)
    policy.begin(0, None)
    assert policy.next_k() > 0
    for _ in range(10):
        policy.observe(cycle(1, 0, 0, verify_ms=CHEAP_DRAFTER.target_at(1), confidence=0.3))
    assert policy.acceptance(0) < 0.15 and policy.next_k() == 0


# --- how far the model drafts: its confidence in each draft, as it drafts ----------------------------------------


def drafting(profile: CostProfile = CODER, evidence: Evidence | None = None) -> AdaptiveK:
    """An auto policy that has just chosen to draft with the model (no backlog to read)."""
    policy = AdaptiveK(k_max=8, profile=profile, evidence=evidence, settings=PINNED)
    policy.begin(0, 100)
    assert policy.choose({"model": 8}, 100) == ("model", 8)
    return policy


def test_the_drafter_drafts_on_while_its_drafts_are_sure_and_proposes_only_those_worth_their_verification():
    enough = drafting().stop_rule("model", 8)  # with the offer of 8 drafts it was chosen for
    assert enough([0.97]) is None and enough([0.97, 0.95]) is None  # likely kept: draft another
    assert enough([0.97, 0.95, 0.03]) == 2  # a draft hardly ever kept is not worth its wider pass
    assert enough([0.03]) == 0  # nothing: a plain step (what the drafter read is read)
    assert enough([0.97] * 8) == 8  # the most the offer held: all of them


def test_the_stop_rule_runs_at_the_pace_the_choice_just_made_was_made_at_without_pricing_again(monkeypatch):
    policy = drafting()
    pace = max(policy.decided.values())
    monkeypatch.setattr(policy, "rates", lambda: pytest.fail("the rates were worked out again"))
    heard = []
    monkeypatch.setattr(policy, "enough", lambda confidences, at, cap: heard.append((at, cap)))
    policy.stop_rule("model", 8)([0.97])
    assert heard == [(pace, 8)]


def test_a_draft_s_worth_is_what_its_band_of_confidence_earned_on_this_pair():
    evidence = Evidence()
    for _ in range(30):  # this pair's sure drafts are rejected: its confidence reads high
        evidence.saw_drafts([0.97], kept=0, proposed=1)
    policy = drafting(evidence=sure(0.8))
    assert policy.stop_rule("model", 8)([0.97]) is None
    policy.evidence.confidence = evidence.confidence
    assert policy.stop_rule("model", 8)([0.97]) == 0


def test_where_the_drafts_it_makes_are_unsure_auto_parks_and_where_they_are_sure_it_drafts_long():
    unsure = AdaptiveK(k_max=8, profile=CODER, settings=PINNED)
    unsure.begin(0, 100)
    for _ in range(6):  # Polish in an English drafter: unsure drafts, cut before they cost a verification
        unsure.observe(replace(cycle(1, 0, 0, verify_ms=444.0, draft_ms=55.0), confidence=[0.08]))
    assert unsure.evidence.mean_chance() < 0.2 and unsure.choose({"model": 8}, 100) == ("", 0)
    sure_drafts = AdaptiveK(k_max=8, profile=CODER, settings=PINNED)
    sure_drafts.begin(0, 100)
    for _ in range(6):
        sure_drafts.observe(replace(cycle(3, 3, 3, verify_ms=585.0, draft_ms=165.0), confidence=[0.98] * 3))
    assert sure_drafts.acceptance(0) > 0.9 and sure_drafts.next_k() >= 4
    assert sure_drafts.choose({"model": 8}, 100) == ("model", 8)


def test_kept_drafts_are_counted_in_drafter_tokens_where_translation_changed_their_number():
    policy = drafting()
    # 4 drafts translated into 2 target tokens; the target kept 1: the first 2 drafts held, the third did not
    policy.observe(replace(cycle(4, 2, 1, verify_ms=504.0, draft_ms=220.0), confidence=[0.5, 0.5, 0.5, 0.5]))
    band = policy.evidence.confidence[confidence_band(0.5)]
    assert band.accepted[0] == pytest.approx((1 * 0.9 + 1) * 0.9) and band.rejected[0] == pytest.approx(1.0)


# --- each mechanism switched off on its own (AutoSettings; the ablation in docs/how-it-works.md) -------------------


def switched_off(name: str, **kw) -> AdaptiveK:
    return AdaptiveK(k_max=8, settings=replace(PINNED, **{name: False}), **kw)


def test_without_the_stop_rule_the_model_drafts_the_k_its_estimate_pays_for_and_is_still_heard():
    on, off = drafting(), switched_off("stop_rule", profile=CODER)
    off.begin(0, 100)
    assert on.choose({"model": 8}, 100) == ("model", 8)  # up to the offer: its drafter stops where it pays
    assert off.choose({"model": 8}, 100) == ("model", off.next_k()) and 0 < off.next_k() < 8
    assert off.stop_rule("model", 8)([0.03]) is None  # never stops: the drafts' confidence still teaches
    assert on.stop_rule("model", 8)([0.03]) == 0


def test_without_confidence_bands_a_draft_s_chance_is_its_confidence():
    evidence = Evidence()
    for _ in range(30):  # this pair's sure drafts are rejected
        evidence.saw_drafts([0.97], kept=0, proposed=1)
    on = AdaptiveK(k_max=8, profile=CODER, evidence=evidence, settings=PINNED)
    off = switched_off("confidence_bands", profile=CODER, evidence=evidence)
    assert evidence.kept_chance(0.97) < 0.2 and evidence.kept_chance(0.97, bands=False) == 0.97
    assert on.acceptance(0) < 0.2 < 0.9 < off.acceptance(0)
    assert on.next_k() == 0 < off.next_k()


def test_without_rehearsals_a_parked_policy_never_catches_up_and_decides_again_every_stretch():
    policy = parked(settings=replace(AutoSettings(), rehearsals=False))
    for _ in range(200):
        policy.observe(cycle(0, 0, 0, verify_ms=10.0))
        assert not policy.wants_rehearsal()
    assert policy.plain_steps() == AutoSettings().stretch_max


def test_without_band_floors_failed_guesses_keep_auto_from_a_copy():
    profile = replace(CODER_CPU, drafter_ms=0.0)
    on, off = AdaptiveK(k_max=8, profile=profile, settings=PINNED), switched_off("band_floors", profile=profile)
    for policy in (on, off):
        for match in (2, 3):
            guess = cycle(2, 2, 0, verify_ms=574.0, draft_ms=0.0)
            policy.observe(replace(guess, source="lookup", match=match, drafter_passes=0))
    assert on.choose(Offer({"lookup": 8}, match=30)) == ("lookup", 8)
    assert off.choose(Offer({"lookup": 8}, match=30)) == ("", 0)


def test_a_copy_grows_past_k_as_far_as_the_verify_curve_pays_and_a_guess_stays_short():
    """A lookup copy is not held to k (lookup.LOOKUP_REACH): with a match of 64+ tokens (its band trusted at least
    0.97 per token) and a CPU's verify curve measured to 65 (a 65-token pass ~3 steps), auto proposes far more than
    the model's k = 16; where a pass costs as much per token as a step, it proposes less; a guess, a few tokens."""
    steep = CostProfile({1: 420.0, 17: 930.0, 33: 1200.0, 65: 1300.0}, drafter_ms=0.0)
    policy = AdaptiveK(k_max=16, profile=steep, settings=PINNED)
    policy.begin(0, 1000)
    source, k = policy.choose(Offer({"lookup": 64}, match=80), 1000)
    assert source == "lookup" and 32 < k <= 64
    assert policy.choose(Offer({"lookup": 64}, match=80), 10) == ("lookup", 9)  # never past the budget
    linear = CostProfile({1: 420.0, 65: 65 * 420.0}, drafter_ms=0.0)
    flat = AdaptiveK(k_max=16, profile=linear, settings=PINNED)
    flat.begin(0, 1000)
    assert flat.choose(Offer({"lookup": 64}, match=80), 1000)[1] <= 16
    assert policy.choose(Offer({"lookup": 64}, match=2), 1000)[1] <= 4  # a guess (the prior's 0.5 a token)


def test_a_proposal_that_brings_other_continuations_pays_for_their_rows():
    """A short match that occurred before followed otherwise brings up to k // 2 more rows into its pass
    (lookup.branch_room). On a CPU whose verify curve dips at 16 rows (OpenBLAS: 16 rows cost less than 8, 24 rows
    nearly twice 16), auto proposes 15 alone but 10 with branches (10 + 1 + 5 = 16 rows), not 15 and a 23-row pass."""
    jagged = CostProfile({1: 700.0, 8: 1300.0, 16: 1000.0, 24: 1900.0, 33: 1700.0, 65: 3000.0}, drafter_ms=0.0)
    policy = AdaptiveK(k_max=16, profile=jagged, settings=PINNED)
    for _ in range(10):
        policy.evidence.saw_copy(2, tried=16, kept=15)
    assert policy.choose(Offer({"lookup": 64}, match=2)) == ("lookup", 15)
    assert policy.choose(Offer({"lookup": 64}, match=2, branched=True)) == ("lookup", 10)


def test_a_copy_grows_with_how_far_its_match_runs_back():
    """Slow start (AdaptiveK.copy_reach): past k a proposal reaches at most twice its match, however much the
    evidence of long copies says. Off, a 4-token match that held in whole-file copies proposes a whole pass."""
    steep = CostProfile({1: 420.0, 17: 930.0, 33: 1200.0, 65: 1300.0}, drafter_ms=0.0)
    on, off = AdaptiveK(k_max=16, profile=steep, settings=PINNED), switched_off("slow_start", profile=steep)
    off.k_max = 16
    for policy in (on, off):
        for _ in range(10):
            policy.evidence.saw_copy(4, tried=64, kept=64)  # copies from 4-token matches that held throughout
    assert on.copy_reach(64, 4) == 16 and on.copy_reach(64, 20) == 40 and on.copy_reach(64, 40) == 64
    assert on.choose(Offer({"lookup": 64}, match=4))[1] <= 16 and on.choose(Offer({"lookup": 64}, match=40))[1] > 32
    assert off.choose(Offer({"lookup": 64}, match=4))[1] > 32


def test_a_batched_policy_tells_its_batch_what_its_calibration_says_a_pass_costs_beside_its_tokens():
    """`CostProfile.fixed_tokens`: one token's pass over what each token more adds, in tokens (a GPU running a small
    model: hundreds; a CPU: tens); a batched policy hands it to its batch (`Sharing.prior_rows`), which cuts passes by
    it until it has timed passes of its own."""
    from uag.core.records import Sharing

    assert CostProfile({1: 10.0, 9: 14.0}, drafter_ms=1.0).fixed_tokens() == 20.0
    assert CostProfile({1: 10.0, 9: 10.0}, drafter_ms=1.0).fixed_tokens() == 1000.0  # flat: tokens cost nothing
    assert CostProfile({1: 10.0, 2: 60.0}, drafter_ms=1.0).fixed_tokens() == 1.0  # at least a token
    sharing, alone = Sharing(), Sharing()
    AdaptiveK(k_max=4, profile=CostProfile({1: 10.0, 9: 14.0}, drafter_ms=1.0), sharing=sharing)
    AdaptiveK(k_max=4, sharing=alone)
    assert sharing.prior_rows == 20.0 and alone.prior_rows is None


def test_a_plain_step_timed_under_a_burst_of_load_does_not_keep_auto_drafting():
    """A width is learned only where the run passes: a plain step timed while something else held the machine stayed
    that dear for as long as auto drafted, and drafts that lost (α 0.2 with a drafter at 0.3 of a step: 1.2 tokens
    in 1.45 steps) looked to pay against it for the whole run. A wider pass caps the plain step's price at what it
    took, so auto parks once its drafts are seen to lose."""
    profile = CostProfile({1: 100.0, 2: 115.0, 3: 130.0, 5: 160.0}, drafter_ms=30.0, translate_ms=0.1)
    policy = AdaptiveK(k_max=4, profile=profile)
    policy.observe(cycle(0, 0, 0, verify_ms=350.0))  # 3.5 times its step: a burst of load, within OUTLIER
    assert policy.evidence.verify_ms == {1: 350.0}
    decisions = []
    for i in range(40):
        k = policy.next_k()
        decisions.append(k)
        kept = 1 if k and i % 5 == 0 else 0
        policy.observe(cycle(k, k, kept, verify_ms=profile.target_at(k + 1), draft_ms=30.0 * k))
    assert decisions[0] > 0 and decisions[-20:] == [0] * 20  # it tried, then parked for good
    assert policy.evidence.verify_ms[1] == pytest.approx(100.0, rel=0.01)  # re-timed once parked
