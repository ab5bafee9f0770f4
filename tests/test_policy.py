"""The adaptive draft length (no models): it speculates when drafts pay, parks when they do not."""

import math

import pytest

from uag.costmodel import CostProfile
from uag.policy import PROBE_BUDGET, PROBE_GAP_MAX, AdaptiveK, FixedK
from uag.records import Cycle

CHEAP_DRAFTER = CostProfile({1: 10.0, 2: 10.5, 3: 11.0, 5: 12.0, 9: 14.0}, drafter_ms=0.5, translate_ms=0.1)
COSTLY_DRAFTER = CostProfile({1: 10.0, 2: 15.0, 5: 30.0, 9: 50.0}, drafter_ms=6.0, translate_ms=0.1)


def cycle(k: int, proposed: int, accepted: int, *, verify_ms=10.0, draft_ms=None) -> Cycle:
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
    )


def test_expected_tokens_follows_the_per_position_acceptance():
    policy = AdaptiveK(k_max=4)
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)  # the 50 % prior
    for _ in range(40):
        policy.observe(cycle(2, 2, 2))
    assert policy.acceptance(0) > 0.9 and policy.acceptance(1) > 0.9
    assert policy.expected_tokens(2) > 2.7


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


def test_low_acceptance_parks_and_probes_now_and_then():
    policy = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, probe_every=5)
    for _ in range(30):
        policy.observe(cycle(2, 2, 0, verify_ms=15.0))
    decisions = []
    for _ in range(20):
        k = policy.next_k()
        decisions.append(k)
        policy.observe(cycle(k, k, 0, verify_ms=10.0 if k == 0 else 15.0))
    assert decisions.count(0) >= 15 and 1 in decisions  # parked, with probes
    assert all(k <= 1 for k in decisions)


def test_a_probe_that_succeeds_brings_speculation_back():
    policy = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, probe_every=4)
    for _ in range(20):
        policy.observe(cycle(2, 2, 0, verify_ms=10.5))
    assert policy.best_k() == 0
    for _ in range(6):  # the text turned predictable
        policy.observe(cycle(1, 1, 1, verify_ms=10.5))
        policy.observe(cycle(2, 2, 2, verify_ms=11.0))
    assert policy.next_k() >= 2


def test_parked_policy_asks_for_a_stretch_of_plain_steps_until_the_next_probe():
    policy = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, probe_every=8)
    for _ in range(30):
        policy.observe(cycle(2, 2, 0, verify_ms=15.0))
    assert policy.next_k() == 0
    assert policy.plain_steps() == 8 - policy.parked_for


def test_each_failed_probe_doubles_the_wait_for_the_next_and_speculating_resets_it():
    policy = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, probe_every=8)
    for _ in range(30):
        policy.observe(cycle(2, 2, 0, verify_ms=15.0))
    decisions = []
    for _ in range(8 + 1 + 16 + 1 + 32 + 1):
        k = policy.next_k()
        decisions.append(k)
        policy.observe(cycle(k, k, 0, verify_ms=10.0 if k == 0 else 10.5))  # cheap probes: within budget
    probes = [i for i, k in enumerate(decisions) if k]
    assert probes == [8, 25, 58]
    assert policy.probe_gap == 64
    for _ in range(8):  # the text turned predictable: speculation resumes and probing starts over
        policy.observe(cycle(2, 2, 2, verify_ms=11.0))
    assert policy.next_k() > 0 and policy.probe_gap == 8


def test_probes_of_a_slow_drafter_wait_until_they_cost_at_most_the_budget():
    policy = AdaptiveK(k_max=4, profile=COSTLY_DRAFTER, probe_every=4)
    for _ in range(30):
        policy.observe(cycle(2, 2, 0, verify_ms=15.0, draft_ms=12.0))  # 6 ms per drafter pass
    policy.observe(cycle(0, 0, 0, verify_ms=10.0))
    # until a catch-up was timed: 2 drafter passes + translation (measured: 0) + a 2-token verification
    # (profile: 15) - the plain step
    extra = 2 * 6.0 + 0.0 + 15.0 - 10.0
    assert policy.probe_wait() == math.ceil(extra / (PROBE_BUDGET * 10.0)) > policy.probe_gap
    caught_up = cycle(1, 1, 0, verify_ms=15.0, draft_ms=60.0)
    caught_up.drafter_read = 40  # it read a parked stretch first: timed as a catch-up, not as a drafter pass
    policy.observe(caught_up)
    assert policy.drafter_ms == pytest.approx(6.0) and policy.catch_up_ms == 60.0
    assert policy.probe_wait() == PROBE_GAP_MAX  # (60 + 0 + 5) / 0.3 > 128


def test_the_wait_between_probes_is_capped():
    policy = AdaptiveK(k_max=4, profile=CHEAP_DRAFTER, probe_every=4)
    for _ in range(30):
        policy.observe(cycle(2, 2, 0, verify_ms=15.0))
    for _ in range(2000):
        k = policy.next_k()
        policy.observe(cycle(k, k, 0, verify_ms=10.0 if k == 0 else 15.0))
    assert policy.probe_gap == PROBE_GAP_MAX


def test_measured_costs_override_the_profile():
    policy = AdaptiveK(k_max=2, profile=CHEAP_DRAFTER)
    assert policy.target_ms(3) == 11.0
    policy.observe(cycle(2, 2, 1, verify_ms=30.0))
    assert policy.target_ms(3) == 30.0


def test_fixed_k_never_changes():
    policy = FixedK(3)
    policy.observe(cycle(3, 3, 0))
    assert policy.next_k() == 3 and policy.plain_steps() == 1


def test_k_max_must_be_positive():
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(k_max=0)
