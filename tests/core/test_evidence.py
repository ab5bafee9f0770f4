"""What auto learns about a pair (acceptance per band and position, what cycles cost) and how a pass is priced
and learned; saving it beside the pair's profile is tests/costs/test_profiles.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.support.saved_costs import learned
from uag.core.costmodel import CostProfile
from uag.core.evidence import Counts, Evidence, Prices, confidence_band
from uag.core.lookup import BAND_FLOORS


def test_evidence_keeps_what_earlier_runs_accepted_but_not_their_costs():
    back = Evidence.from_dict(json.loads(json.dumps(learned().to_dict())))
    assert back.lookup == learned().lookup and back.expansion == 0.8
    assert back.lookup_bands == learned().lookup_bands  # lookup's per band of match length (uag.core.lookup)
    assert back.confidence == learned().confidence and back.drafted == learned().drafted  # the model's per band
    assert back.drafter_ms is None and back.verify_ms == {}  # costs are the calibration's, relearned in a run


@pytest.mark.parametrize(
    "bad",
    [
        {"lookup": {"accepted": [1.0], "rejected": []}},
        {"lookup": {"accepted": [-1.0], "rejected": [1.0]}},
        {"lookup": {"accepted": ["nan"], "rejected": [1.0]}},
        {"lookup": {"accepted": [], "rejected": []}, "expansion": 0},
        {**Evidence().to_dict(), "lookup_bands": [{"accepted": [], "rejected": []}]},  # bands another version had
        {**Evidence().to_dict(), "lookup_bands": [{"accepted": [1.0], "rejected": [-1.0]}] * 4},
        {**Evidence().to_dict(), "confidence": [{"accepted": [], "rejected": []}] * 3},  # bands of another version
        {**Evidence().to_dict(), "drafted": [-1.0] * 7},
    ],
)
def test_damaged_evidence_is_refused(bad):
    with pytest.raises(ValueError):
        Evidence.from_dict(bad)


def test_evidence_saved_before_lookup_had_bands_still_opens_a_run():
    saved = {k: v for k, v in learned().to_dict().items() if k not in ("lookup_bands", "confidence", "drafted")}
    saved["model"] = {"accepted": [2.5], "rejected": [0.5]}  # the model's counts per position: no longer read
    back = Evidence.from_dict(saved)
    assert back.lookup == learned().lookup and back.lookup_bands == Evidence().lookup_bands
    assert back.confidence == Evidence().confidence and back.mean_chance() is None  # as if the model never drafted


def test_evidence_saved_with_lookup_s_bands_per_position_keeps_their_first():
    """Files saved before lookup's verdicts were per copied token held each band's counts per proposal position;
    the first position is the same verdict (is the next token of a copy that long kept?), the others are not."""
    saved = {**Evidence().to_dict(), "lookup_bands": [{"accepted": [4.0, 3.0], "rejected": [1.0, 1.0]}] * 6}
    back = Evidence.from_dict(saved)
    assert back.lookup_bands == [Counts([4.0], [1.0])] * 6


def test_a_copy_s_token_is_judged_by_the_length_the_copy_has_reached():
    """Position i of a proposal from a match of m tokens continues a copy of m + i: a 2-token guess whose first
    token is kept is a 3-token match at its second, and past 8 a copy (docs/how-it-works.md, auto)."""
    evidence = Evidence()
    evidence.saw_copy(2, tried=16, kept=3)  # lengths 2, 3 (band 0), 4 kept; 5 rejected (band 1)
    assert [(c.accepted, c.rejected) for c in evidence.lookup_bands[:3]] == [
        ([pytest.approx(1.9)], [0.0]),
        ([pytest.approx(0.9)], [1.0]),  # length 4 kept, then (decayed) length 5 rejected
        ([], []),
    ]
    short = (1.9 + 0.5) / (1.9 + 1)  # band 0's verdicts and the prior's one pseudo-observation
    assert evidence.copy_chances(2, 3, 0.5) == pytest.approx([short, short, (0.9 + short) / (1.9 + 1)])
    rejected = Evidence()
    for _ in range(4):
        rejected.saw_copy(2, tried=8, kept=0)
    chances = rejected.copy_chances(2, 16, 0.5, BAND_FLOORS)
    assert chances[:6] == pytest.approx([0.0 + 0.5 * 1 / (rejected.lookup_bands[0].rejected[0] + 1)] * 6)
    assert chances[6:14] == pytest.approx([0.8] * 8) and chances[14:] == pytest.approx([0.9] * 2)  # floors: 8+, 16+
    assert rejected.copy_chances(2, 16, 0.5) == pytest.approx([chances[0]] * 16)  # no floors: leaning on band 0


def test_a_draft_s_chance_is_its_confidence_until_the_target_s_verdicts_on_its_band_say_otherwise():
    evidence = Evidence()
    assert [confidence_band(q) for q in (0.1, 0.2, 0.85, 0.99)] == [0, 1, 4, 6]
    assert evidence.kept_chance(0.9) == pytest.approx(0.9) and evidence.mean_chance() is None
    evidence.saw_drafts([0.92, 0.93, 0.3], kept=0, proposed=2)  # the first rejected: the second never judged
    band = evidence.confidence[confidence_band(0.92)]
    assert (band.accepted[0], band.rejected[0]) == (0.0, 1.0)
    assert evidence.kept_chance(0.92) == pytest.approx((0 + 2 * 0.92) / 3)
    assert evidence.confidence[confidence_band(0.3)].accepted == []  # drafted, never proposed: no verdict
    assert sum(evidence.drafted) == pytest.approx(1 + 0.9 + 0.81)  # all three drafts say how sure it tends to be
    # a rehearsal's guesses say how sure the drafter is on this text, never how the target judges its drafts
    evidence.saw_guesses([0.05] * 30)
    assert evidence.mean_chance() < 0.15 and evidence.confidence[0].accepted == []


def test_a_new_run_keeps_how_confidence_reads_but_only_a_few_drafts_of_how_sure_the_last_text_made_it():
    evidence = Evidence()
    for _ in range(20):
        evidence.saw_drafts([0.99, 0.98], kept=2, proposed=2)
    verdicts = [c.to_dict() for c in evidence.confidence]
    evidence.carry(3.0)
    assert sum(evidence.drafted) == pytest.approx(3.0)
    assert [c.to_dict() for c in evidence.confidence] == verdicts


def test_in_a_batch_a_pass_is_priced_as_the_batch_s_round_and_not_learned():
    """Batched with others (uag.runtime.batching), auto prices a proposal of w as the batch's round with it: the
    others at what they propose, every sequence of a pass padded to its widest, the batch cut into passes as it
    cuts them. The pass it ran in is not learned: rows over caches of their own cost more than one row of their
    tokens, and learning them as one (on a CPU, 4 rows of 1 token as a 4-token pass) made a plain step dearer than
    a draft beside parked members; nor is its wait for the others' passes."""
    from uag.core.evidence import Prices
    from uag.core.records import Cycle, Sharing

    profile = CostProfile(target_ms={1: 100.0, 4: 130.0, 16: 200.0, 64: 500.0}, drafter_ms=10.0, translate_ms=0.0)
    prices = Prices(profile, Evidence())
    assert [prices.verify_ms(w) for w in (1, 16)] == [100.0, 200.0] and prices.others_tokens() == 0.0  # alone
    shared = Sharing(others=(Sharing(), Sharing(), Sharing()))  # three others, each proposing a plain step
    shared.shared(size=4, widest=16, ms=480.0)  # the last pass: the widest of the others was 16 tokens

    batched = Prices(profile, prices.evidence, sharing=shared)
    plain, draft = batched.verify_ms(1), batched.verify_ms(16)
    batched.time_verify(Cycle.plain(0, verify_ms=2000.0))
    assert plain == 130.0  # 4 × 1 tokens
    assert draft == 200.0 + 120.0  # 16 alone and 3 × 1: cheaper than 4 × 16 (500), as the batch cuts it
    assert batched.others_tokens() == 3.0  # what the others commit in the pass that verifies its draft
    assert prices.evidence.verify_ms == {} and prices.evidence.scale == 1.0  # nothing learned from the batch
    shared.shared(size=1, widest=0, ms=None)  # alone again: its own passes are learned
    prices.time_verify(Cycle.plain(0, verify_ms=110.0))
    assert prices.evidence.verify_ms == {1: 110.0} and prices.evidence.scale == pytest.approx(1.1)


def test_a_cycle_that_waited_for_a_batch_s_round_learns_no_cost_of_its_own():
    """A member whose pass was the only sequence of its round still waited for that round, which also ran another
    member's read (or the others' passes before they left): its wall time is not its pass's. Learnt as its own, a
    plain step of the coder target timed at 3.9 s against its calibration's 0.41 s, and every draft beside it
    looked nearly free (docs/results.md, dk). Only a cycle whose passes since the last one learnt all ran as the
    model's own call, alone in the batch (`Sharing.solo`), teaches the run its costs; a rehearsal likewise."""
    from uag.core.policy import AdaptiveK
    from uag.core.records import Cycle, Rehearsal, Sharing

    profile = CostProfile(target_ms={1: 400.0, 4: 460.0}, drafter_ms=40.0, translate_ms=0.0)
    shared = Sharing()
    auto = AdaptiveK(k_max=4, profile=profile, sharing=shared)
    auto.begin(0, 64)
    shared.rounds, shared.solo = 1, False  # its pass went to the batch: a read ran in the same round
    shared.shared(1, 0, None)
    auto.observe(Cycle.plain(0, verify_ms=3900.0))
    assert auto.evidence.verify_ms == {}  # not a cost of its own
    shared.solo = True  # the others gone and nobody queued: its next pass is the model's own call
    auto.observe(Cycle.plain(0, verify_ms=420.0))
    assert auto.evidence.verify_ms == {1: 420.0}
    shared.rounds, shared.solo = 2, False  # the rehearsal's drafter pass waited for a round
    auto.rehearsed(Rehearsal(hits=[], read=9, ms=900.0, target_tokens=8))
    assert auto.evidence.read_ms is None
    shared.solo = True
    auto.rehearsed(Rehearsal(hits=[], read=9, ms=120.0, target_tokens=8))
    assert auto.evidence.read_ms == pytest.approx((120.0 - 40.0 * 420 / 400) / 8)  # a step at the run's scale


def test_a_tree_pass_is_timed_at_the_rows_it_read():
    """A tree pass reads every branch's nodes: its time is that width's, not the kept branch's (a 16-row pass on a
    CPU whose curve dips at 16 would otherwise be priced as a 23-row one)."""
    from uag.core.evidence import Prices
    from uag.core.records import Cycle

    prices = Prices(None, Evidence())
    tree = Cycle(
        index=0,
        k=15,
        draft_ids=[],
        proposed_ids=list(range(15)),
        accepted=15,
        emitted=16,
        verify_ms=1900.0,
        source="lookup",
        branches=3,
        nodes=22,
    )
    prices.time_verify(tree)
    prices.time_verify(replace(tree, branches=1, nodes=0, verify_ms=1000.0))
    assert prices.evidence.verify_ms == {23: 1900.0, 16: 1000.0}


def test_a_pass_that_compiled_its_kernels_is_not_learned_whole():
    """MLX's CUDA backend compiles a kernel at its first use: a pass of a width not run before can take seconds once.
    Learned whole, it priced that width (and, anchored there, its neighbours) at many times a plain step for the rest
    of a server's life, and auto never drafted there again. A timing counts at most OUTLIER times what was expected
    of it; a machine that really slowed is still learned within a few passes, and a faster one at once."""
    from uag.core.evidence import OUTLIER, Prices
    from uag.core.records import Cycle

    profile = CostProfile(target_ms={1: 8.0, 2: 8.2, 17: 9.0, 64: 12.0}, drafter_ms=3.0, translate_ms=0.0)
    prices = Prices(profile, Evidence())
    for _ in range(5):
        prices.time_verify(Cycle.plain(0, 8.0))
    prices.time_verify(Cycle(0, 1, [5], [5], 1, 2, verify_ms=900.0))  # width 2, the first time: compiling
    assert prices.target_ms(2) <= (1 - 0.2 + 0.2 * OUTLIER) * 8.2 + 1e-9
    assert prices.target_ms(17) < 2 * 9.0 and prices.evidence.scale < 1.5
    for _ in range(8):
        prices.time_verify(Cycle.plain(0, 80.0))  # slower for good: ten times the profile's step
    assert prices.target_ms(1) > 60.0
    quick = Prices(profile, Evidence())
    quick.time_verify(Cycle.plain(0, 2.0))  # a profile measured on a busier machine gives way at once
    assert quick.target_ms(1) == 2.0


def test_what_a_batch_realised_of_a_kind_s_prices_is_over_its_recent_cycles():
    """`Evidence.saw_realised`'s example, then a stall counted at OUTLIER times what the kind realised so far, and a
    plain step pulling a drafting kind 1 % of the way to its own ratio."""
    from uag.core.evidence import OUTLIER

    evidence = Evidence()
    evidence.saw_realised("lookup", 10.0, 5.0)
    evidence.saw_realised("lookup", 4.0, 4.0)
    assert evidence.realised["lookup"] == pytest.approx(13.5 / 8.75)
    ratio = evidence.realised["lookup"]
    evidence.saw_realised("lookup", 1e6, 1.0)
    sums = evidence.realised_ms["lookup"]
    assert sums[0] == pytest.approx(0.95 * 13.5 + OUTLIER * ratio)
    before = evidence.realised["lookup"]
    evidence.saw_realised("", 1.0, 1.0)
    assert evidence.realised["lookup"] == pytest.approx(before + 0.01 * (1.0 - before))
    assert evidence.realised_ms["lookup"][0] == pytest.approx(evidence.realised["lookup"] * sums[1])


def test_a_width_never_timed_is_priced_from_the_nearest_timed_one_as_the_widths_grow():
    """`target_ms` anchors the profile at the timed width nearest w (the narrower of two as near), found by bisection
    of the widths sorted once: the same width a scan of them finds, as widths are learned between calls."""
    import random

    rng = random.Random(7)
    profile = CostProfile({1: 10.0, 8: 12.0, 64: 30.0, 128: 50.0}, drafter_ms=1.0)
    prices = Prices(profile, Evidence())
    timed = prices.evidence.verify_ms
    for _ in range(60):
        timed[rng.randint(1, 130)] = rng.uniform(5, 60)
        for w in [rng.randint(1, 140) for _ in range(20)]:
            near = min(timed, key=lambda v: (abs(v - w), v))
            expected = timed[w] if w in timed else profile.target_at(w) * timed[near] / profile.target_at(near)
            assert prices.target_ms(w) == pytest.approx(expected, rel=1e-12)
    prices.evidence = Evidence(verify_ms={3: 20.0})  # another evidence of its own: its widths, not the old ones'
    assert prices.target_ms(100) == pytest.approx(profile.target_at(100) * 20.0 / profile.target_at(3))
