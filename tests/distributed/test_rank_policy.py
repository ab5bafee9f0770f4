"""The sharded target's policy seam: rank 0's own policy decides within the budget, every rank acts alike."""

import threading
from types import SimpleNamespace

import pytest

from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.drafters import Draft
from uag.core.policy import AdaptiveK, FixedK, make_policy
from uag.distributed.decisions import LeaderDrafter, RankPolicy, Stopped, message_width


class OneRankLink:
    """Rank 0's side of the decision exchange, alone: what it sends is what every rank receives."""

    rank, width = 0, message_width(8)

    def exchange(self, message):
        return [*message, *[0] * (self.width - len(message))]


class Proposing:
    """A drafter that proposes k target tokens, or as many as the budget allows."""

    name, translation = "proposing", "identity"

    def propose(self, source, k, budget, stop=None):
        return Draft(source, list(range(min(k, budget))))


def test_rank_0_decides_and_drafts_within_the_tokens_left_by_the_policy_own_clamp():
    leader = LeaderDrafter(Proposing(), watchdog=SimpleNamespace(progress=lambda: None))
    policy = RankPolicy(OneRankLink(), leader, FixedK(4), cancel=threading.Event())
    assert policy.k_policy == "fixed"
    assert policy.choose({"model": 8}, left=10) == ("model", 4) and leader.pending.proposed == [0, 1, 2, 3]
    assert policy.choose({"model": 8}, left=3) == ("model", 2) and leader.pending.proposed == [0, 1]
    assert policy.choose({"model": 8}, left=1) == ("", 0) and policy.plain_steps() == 1
    policy.cancel.set()  # rank 0's cancel: every rank stops at the next decision
    with pytest.raises(Stopped):
        policy.choose({"model": 8}, left=10)
    follower = RankPolicy(
        OneRankLink(), leader, None, k_policy=make_policy(GenerationConfig(k_policy="adaptive")).k_policy
    )
    assert follower.k_policy == "adaptive"


class Confident:
    """A drafter whose drafts come with the given confidences, stopping where the policy's rule says."""

    name, translation = "confident", "identity"

    def __init__(self, confidences):
        self.confidences = confidences

    def propose(self, source, k, budget, stop=None):
        made = []
        for q in self.confidences[:k]:
            made.append(q)
            keep = stop(made) if stop else None
            if keep is not None:
                break
        keep = len(made) if keep is None else keep
        return Draft(source, list(range(keep)), passes=len(made), confidence=made if stop else [])


def test_rank_0_drafts_by_its_auto_policy_stop_rule_and_every_rank_hears_the_drafts_it_made():
    leader = LeaderDrafter(Confident([0.99, 0.98, 0.02, 0.9]), watchdog=SimpleNamespace(progress=lambda: None))
    inner = AdaptiveK(k_max=8, profile=CostProfile({1: 444.0, 2: 504.0, 3: 585.0, 4: 650.0}, drafter_ms=55.0))
    inner.begin(0, 100)
    policy = RankPolicy(OneRankLink(), leader, inner, cancel=threading.Event())
    # the third draft is hardly ever kept: rank 0 proposes two, and k says the three it drafted
    assert policy.choose({"model": 8}, left=50) == ("model", 3) and leader.pending.proposed == [0, 1]
    assert policy.stop_rule("model", 8) is None  # the engine's drafter only hands over what rank 0 drafted


def test_rank_0_prices_a_lookup_proposal_without_branches_since_the_ranks_verify_one():
    """Lookup's offer says when its proposal would bring other continuations (priced by the rows they add,
    uag.core.policy.AdaptiveK.lookup_rates); the ranks send and verify one proposal, so rank 0's offer says not."""
    from uag.core.drafters import LookupDrafter

    inner = LookupDrafter(vocab=None)
    inner.start([1, 2, 3, 1, 2, 4, 1, 2])  # "1 2" occurred twice, followed otherwise
    assert inner.offer(4).branched
    leader = LeaderDrafter(inner, watchdog=SimpleNamespace(progress=lambda: None))
    offer = leader.offer(4)
    assert not offer.branched and offer.match == inner.offer(4).match and dict(offer) == dict(inner.offer(4))
