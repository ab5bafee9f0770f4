"""Drafting priced across the batch (issue 52, item 3), no models: beside other requests, `auto` prices a member's
proposal by what it adds to the round all of them wait on, given the others' proposals, and parks (one token a
pass, as speculation off) where the draft does not pay under that load; alone the same drafts pay. Costs are
CPU-like and pinned: a pass over n tokens costs 28 + n ms, so that one of 4 × 17 tokens costs three of 4 × 1."""

import pytest

from uag.core.costmodel import CostProfile
from uag.core.evidence import Counts, Evidence
from uag.core.policy import AdaptiveK, AutoSettings
from uag.core.records import Cycle, Offer, Sharing, groups

CPU = CostProfile({1: 29.0, 128: 156.0}, drafter_ms=3.0, translate_ms=0.0)  # 28 + n ms; a drafter step 3 ms
PINNED = AutoSettings(learn_costs=False)


def lookup_evidence(alpha: float, weight: float = 100.0) -> Evidence:
    """Lookup's evidence: each of 32 positions kept with chance ≈ alpha."""
    evidence = Evidence()
    n = 32
    evidence.lookup = Counts([alpha * weight] * n, [(1 - alpha) * weight] * n)
    return evidence


def batch_of(n: int) -> list[Sharing]:
    """n members' `Sharing`, each seeing the others (as uag.runtime.batching keeps them)."""
    members = [Sharing() for _ in range(n)]
    for m in members:
        m.others = tuple(o for o in members if o is not m)
    return members


def make(sharing: Sharing | None, **kw) -> AdaptiveK:
    """A fresh auto for one member, its costs pinned to CPU."""
    policy = AdaptiveK(
        kw.pop("k_max", 16),
        CPU,
        evidence=kw.pop("evidence", None),
        settings=kw.pop("settings", PINNED),
        sharing=sharing,
    )
    policy.begin(0, 96)
    return policy


def rate(policy: AdaptiveK, decision: tuple[str, int]) -> float:
    """The batch's tokens per ms at a member's decision (`AdaptiveK.rates`, `lookup_rates`)."""
    source, k = decision
    return policy.lookup_rates(k)[k] if source == "lookup" else policy.rates()[k]


@pytest.mark.parametrize("alpha", [0.3, 0.4, 0.45])
def test_a_lookup_guess_of_middling_acceptance_drafts_alone_and_parks_beside_three(alpha):
    alone = make(None, evidence=lookup_evidence(alpha))
    source, k = alone.choose({"lookup": 16})
    assert source == "lookup" and k >= 1  # alone: a wider pass costs little, and it pays
    four = make(batch_of(4)[0], evidence=lookup_evidence(alpha))
    assert four.choose({"lookup": 16}) == ("", 0)  # beside three: its draft widens the pass all four wait on
    assert four.sharing.width == 1 and four.sharing.tokens == 1.0  # what the others price their drafts beside


@pytest.mark.parametrize("others", [1, 3])
def test_a_copy_keeps_drafting_beside_others(others):
    """Copy-heavy drafts (α ≈ 0.9 over a long match) pay for a pass of their own even at B = 4."""
    policy = make(batch_of(others + 1)[0], evidence=lookup_evidence(0.9))
    source, k = policy.choose(Offer({"lookup": 16}, match=24))
    assert source == "lookup" and k >= 8
    assert policy.sharing.width == k + 1 and policy.sharing.tokens > 4  # the others see its pass coming
    assert rate(policy, (source, k)) > policy.rates()[0]


@pytest.mark.parametrize(("prior", "size", "drafts"), [(0.4, 2, True), (0.4, 4, False), (0.95, 2, True)])
def test_the_model_drafter_drafts_beside_others_only_where_the_batch_gains_by_waiting_on_it(prior, size, drafts):
    """Its drafter steps are rounds in which the batch holds every target pass, and its draft widens the pass all
    of them wait on: beside three parked members a draft of α 0.4 does not earn what the four lose (it parks);
    beside one it does, and so does α 0.95. Alone both draft."""
    settings = AutoSettings(learn_costs=False, prior=prior)
    assert make(None, settings=settings).choose({"model": 8})[0] == "model"
    policy = make(batch_of(size)[0], settings=settings)
    decision = policy.choose({"model": 8})
    assert (decision[0] == "model") == drafts, decision
    if drafts:
        assert policy.rates()[policy.next_k()] > policy.rates()[0]


def test_a_draft_is_priced_by_what_it_adds_to_the_whole_round():
    """The worked example of `AdaptiveK.rates`: drafter steps 2 ms, α 0.4, a pass of n tokens 28 + n ms. Batched,
    the others commit only in the pass that verifies the draft: they wait through its drafter step."""
    cheap = CostProfile({1: 29.0, 128: 156.0}, drafter_ms=2.0, translate_ms=0.0)
    settings = AutoSettings(learn_costs=False, prior=0.4)
    alone = AdaptiveK(1, cheap, settings=settings)
    assert alone.rates() == pytest.approx({0: 1 / 29, 1: 1.4 / 32})
    batched = AdaptiveK(1, cheap, settings=settings, sharing=batch_of(4)[0])
    assert batched.rates() == pytest.approx({0: 4 / 32, 1: (1.4 + 3) / (2 + 36)})


def test_the_others_proposals_raise_the_bar():
    """Beside a copying member the batch already commits more per round, and its wide pass is cut off as a pass of
    its own: a middling draft of this member rides on neither."""
    members = batch_of(4)
    members[1].proposing(17, 9.0)  # a copy of 16 tokens, ~8 kept
    policy = make(members[0], evidence=lookup_evidence(0.45))
    assert members[0].pass_tokens(1) == [17, 3]  # the copy's pass, then the other three plain steps
    assert policy.choose({"lookup": 16}) == ("", 0)


def test_never_slower_than_speculation_off():
    """Whatever the load and acceptance, what auto chooses is worth at least the batch's plain round to it."""
    for size in (1, 2, 4, 8):
        for alpha in (0.1, 0.3, 0.5, 0.7, 0.9):
            sharing = batch_of(size)[0] if size > 1 else None
            policy = make(
                sharing, evidence=lookup_evidence(alpha), settings=AutoSettings(learn_costs=False, prior=alpha)
            )
            decision = policy.choose({"lookup": 16, "model": 8})
            plain = policy.rates()[0]
            assert decision == ("", 0) or rate(policy, decision) >= plain, (size, alpha, decision)


def test_a_member_parked_under_load_drafts_again_once_the_batch_shrinks():
    members = batch_of(4)
    policy = make(members[0], evidence=lookup_evidence(0.45))
    assert policy.choose({"lookup": 16}) == ("", 0)
    policy.observe(Cycle.plain(0, 32.0))
    assert policy.plain_steps() > 1 and not policy.reconsider()  # a parked stretch under load
    for _ in range(5):
        policy.observe(Cycle.plain(0, 32.0))
        assert not policy.reconsider()
    members[0].others = ()  # the three others ended: it runs alone
    assert policy.reconsider()  # the stretch ends at the next token (uag.core.engine's `until`)
    source, k = policy.choose({"lookup": 16})
    assert source == "lookup" and k >= 1
    members[0].others = tuple(members[1:])  # they came back
    assert policy.choose({"lookup": 16}) == ("", 0)


def test_parked_under_load_it_still_rehearses_now_and_then():
    """A parked member's drafter catches up now and then (its evidence keeps updating), though each rehearsal costs
    it a round of the batch: farther apart than alone."""
    alone = make(None, settings=AutoSettings(learn_costs=False, prior=0.05))
    four = make(batch_of(4)[0], settings=AutoSettings(learn_costs=False, prior=0.05))
    for policy in (alone, four):
        assert policy.choose({"model": 8}) == ("", 0)
        policy.observe(Cycle.plain(0, 30.0))
    assert alone.rehearsal_wait() < four.rehearsal_wait() < float("inf")
    eight = make(batch_of(8)[0], settings=AutoSettings(learn_costs=False, prior=0.05))
    eight.choose({"model": 8})
    eight.observe(Cycle.plain(0, 30.0))
    assert four.rehearsal_wait() < eight.rehearsal_wait()  # its drafter pass delays seven rounds of others, not three


def test_a_drafting_cycle_batched_with_others_teaches_no_drafter_step():
    """Its drafter passes waited on the batch's rounds: what they took is the batch's, not a drafter step's."""
    policy = make(batch_of(2)[0], settings=AutoSettings())
    slow = Cycle(0, 4, [1, 2, 3, 4], [1, 2, 3, 4], 2, 3, draft_ms=4000.0, verify_ms=40.0, drafter_passes=4)
    policy.observe(slow)
    assert policy.evidence.drafter_ms is None
    alone = make(None, settings=AutoSettings())
    alone.observe(slow)
    assert alone.evidence.drafter_ms > alone.profile.drafter_ms  # learned alone (at most OUTLIER× the profile's)


@pytest.mark.parametrize(
    ("widths", "fixed", "expected"),
    [([17, 1, 1, 1], 28, [[0], [1, 2, 3]]), ([2, 1, 1, 1], 28, [[0, 1, 2, 3]])],
)
def test_the_batch_is_cut_into_passes_as_its_members_price_it(widths, fixed, expected):
    assert groups(widths, fixed) == expected


def test_a_batch_whose_members_all_draft_parks_where_drafting_alike_does_not_pay():
    """Beside three members drafting 2 each, one more draft of 2 rides in their padding for free; but four drafting
    alike commit 7 tokens in 15 ms against 4 in 7 parked, so each parks, and the batch with it."""
    steep = CostProfile({1: 4.0, 129: 132.0}, drafter_ms=0.0, translate_ms=0.0)  # 3 + n ms
    members = batch_of(4)
    for other in members[1:]:
        other.proposing(3, 1.75)
    policy = AdaptiveK(2, steep, evidence=lookup_evidence(0.5), settings=PINNED, sharing=members[0])
    policy.begin(0, 96)
    assert policy.choose({"lookup": 2}) == ("", 0)
    assert policy.lookup_rates(2)[2] < policy.rates()[0] < (1.75 + 5.25) / 15  # alike, not the free ride
    alone = AdaptiveK(2, steep, evidence=lookup_evidence(0.5), settings=PINNED)
    alone.begin(0, 96)
    assert alone.choose({"lookup": 2})[0] == "lookup"


# --- what the batch realises of the prices (Evidence.realised) ------------------------------------------------------


def realised(evidence: Evidence, ratios: dict[str, float]) -> None:
    """Evidence of one batched cycle per kind that realised `ratios` of its price, plain steps first (each plain step
    ages the drafting kinds' ratios, which would move them)."""
    for kind, ratio in sorted(ratios.items(), key=lambda item: item[0] != ""):
        evidence.saw_realised(kind, ratio, 1.0)
    assert evidence.realised == pytest.approx(ratios)


def shared_batch(n: int) -> list[Sharing]:
    """n members whose last target pass the batch shared among all n (as `Batch._decode` records it)."""
    members = batch_of(n)
    for m in members:
        m.shared(n, 1, None)
    return members


def test_a_batch_learns_what_each_kind_of_cycle_realises_of_its_price():
    """Plain steps against a plain round's price, model cycles against their drafter steps and pass; a plain step
    that waited on others' drafting says nothing of a plain step (the drafting member's cycle carries it)."""
    members = shared_batch(2)
    policy = make(members[0], settings=AutoSettings(), k_max=8)
    prices = policy.prices
    plain = prices.verify_ms(1)
    policy.observe(Cycle.plain(0, 1.5 * plain))
    assert policy.evidence.realised == {"": pytest.approx(1.5)}
    members[0].held += 3  # the batch held its pass three rounds for the other member's drafter
    policy.observe(Cycle.plain(0, 20 * plain))
    assert policy.evidence.realised == {"": pytest.approx(1.5)}
    priced = 4 * prices.drafter_step_ms(0.0) + prices.cycle_overhead_ms() + prices.verify_ms(5)
    drafted = Cycle(0, 4, [1, 2, 3, 4], [1, 2, 3, 4], 2, 3, draft_ms=2.5 * priced, verify_ms=0.5 * priced)
    drafted.drafter_passes, drafted.drafter_read, drafted.source = 4, 3, "model"
    policy.observe(drafted)
    assert policy.evidence.realised["model"] == pytest.approx(3.0)
    assert prices.realised("model") == pytest.approx(0.5)  # a model draft's rate halved against a plain step's
    assert prices.realised("lookup") == 1.0  # not yet timed in a batch: as priced
    members[0].others = ()
    assert prices.realised("model") == 1.0  # alone the prices are the run's own


def test_a_stall_counts_as_at_most_outlier_times_what_was_realised_so_far():
    members = shared_batch(2)
    policy = make(members[0], settings=AutoSettings())
    plain = policy.prices.verify_ms(1)
    policy.observe(Cycle.plain(0, plain))
    policy.observe(Cycle.plain(0, 5000 * plain))  # kernels compiling at first use
    assert policy.evidence.realised[""] == pytest.approx((0.95 + 4.0) / (0.95 + 1.0))


def test_what_a_kind_realised_is_over_its_recent_cycles_not_the_last_one():
    """On a GPU a queued pass's wait lands in whichever cycle reads it first: plain steps alternating 0.2 and 1.8 times
    their price realise about their price, not whichever came last."""
    members = shared_batch(2)
    policy = make(members[0], settings=AutoSettings())
    plain = policy.prices.verify_ms(1)
    for i in range(40):
        policy.observe(Cycle.plain(0, (0.2 if i % 2 else 1.8) * plain))
    assert policy.evidence.realised[""] == pytest.approx(1.0, abs=0.05)


def test_pinned_costs_learn_nothing_realised():
    members = shared_batch(2)
    policy = make(members[0])  # learn_costs False: the replay and tests pin every cost
    policy.observe(Cycle.plain(0, 1000.0))
    assert policy.evidence.realised == {}


def test_a_model_draft_that_pays_by_its_price_parks_where_the_batch_realises_it_at_thrice_its_price():
    """bv (docs/results.md): on an H200 open chat drafted in a batch at 0.34-0.73x speculation off. Its prices
    saw the drafter steps and the pass, not the members' Python in every round the batch held for them."""
    settings = AutoSettings(learn_costs=False, prior=0.95)
    evidence = Evidence()
    assert make(batch_of(2)[0], settings=settings, evidence=evidence).choose({"model": 8})[0] == "model"
    realised(evidence, {"": 1.0, "model": 3.0})
    assert make(batch_of(2)[0], settings=settings, evidence=evidence).choose({"model": 8}) == ("", 0)
    assert make(None, settings=settings, evidence=evidence).choose({"model": 8})[0] == "model"  # alone: as priced


def test_a_copy_still_drafts_where_lookup_realises_half_again_its_price():
    """Beside one other member a copy is worth about twice a plain round on these costs: it pays for a penalty that
    parks a guess worth less."""
    evidence = lookup_evidence(0.9)
    policy = make(batch_of(2)[0], evidence=evidence)
    source, k = policy.choose(Offer({"lookup": 16}, match=24))
    assert source == "lookup" and policy.lookup_rates(k, 24)[k] > 1.5 * policy.rates()[0]
    realised(evidence, {"": 1.0, "lookup": 1.5})
    source, k = policy.choose(Offer({"lookup": 16}, match=24))
    assert source == "lookup" and k >= 8
    guess = make(batch_of(2)[0], evidence=lookup_evidence(0.6))
    assert guess.choose({"lookup": 16})[0] == "lookup"
    realised(guess.evidence, {"": 1.0, "lookup": 1.5})
    assert guess.choose({"lookup": 16}) == ("", 0)


def test_drafting_never_priced_up_for_realising_better_than_a_plain_step():
    evidence = Evidence()
    realised(evidence, {"": 2.0, "model": 1.0})
    policy = make(batch_of(2)[0], evidence=evidence)
    assert policy.prices.realised("model") == 1.0


def test_prices_far_off_cut_a_draft_by_at_most_outlier_times():
    """Before a pair's costs are measured a plain step's price may be hundreds of times its wall time (a first pass
    that compiled): what plain steps then realise cuts a draft at most OUTLIER times."""
    evidence = Evidence()
    realised(evidence, {"": 0.002, "lookup": 1.0})
    policy = make(batch_of(2)[0], evidence=evidence)
    assert policy.prices.realised("lookup") == 0.25


def test_plain_steps_pull_a_parked_kind_back_toward_them_so_that_it_is_tried_again():
    members = shared_batch(2)
    policy = make(members[0], settings=AutoSettings())
    policy.evidence.saw_realised("model", 3.0, 1.0)
    plain = policy.prices.verify_ms(1)
    for _ in range(100):
        policy.observe(Cycle.plain(0, plain))
    assert policy.evidence.realised[""] == pytest.approx(1.0)
    assert policy.evidence.realised["model"] == pytest.approx(1.0 + 2.0 * 0.99**100)
    assert policy.evidence.realised_ms["model"] == pytest.approx([1.0 + 2.0 * 0.99**100, 1.0])
