"""The sharded target's policy seam: rank 0's own policy decides within the budget, every rank acts alike."""

import threading
from types import SimpleNamespace

import pytest

from uag.core.config import GenerationConfig
from uag.core.drafters import Draft
from uag.core.policy import FixedK, make_policy
from uag.distributed.decisions import LeaderDrafter, RankPolicy, Stopped, message_width


class OneRankLink:
    """Rank 0's side of the decision exchange, alone: what it sends is what every rank receives."""

    rank, width = 0, message_width(8)

    def exchange(self, message):
        return [*message, *[0] * (self.width - len(message))]


class Proposing:
    """A drafter that proposes k target tokens, or as many as the budget allows."""

    name, translation = "proposing", "identity"

    def propose(self, source, k, budget):
        return Draft(source, list(range(min(k, budget))))


def test_rank_0_decides_and_drafts_within_the_tokens_left_by_the_policy_own_clamp():
    leader = LeaderDrafter(Proposing(), watchdog=SimpleNamespace(progress=lambda: None))
    policy = RankPolicy(OneRankLink(), leader, FixedK(4), cancel=threading.Event())
    assert policy.name == "fixed"
    assert policy.choose({"model": 8}, left=10) == ("model", 4) and leader.pending.proposed == [0, 1, 2, 3]
    assert policy.choose({"model": 8}, left=3) == ("model", 2) and leader.pending.proposed == [0, 1]
    assert policy.choose({"model": 8}, left=1) == ("", 0) and policy.plain_steps() == 1
    policy.cancel.set()  # rank 0's cancel: every rank stops at the next decision
    with pytest.raises(Stopped):
        policy.choose({"model": 8}, left=10)
    follower = RankPolicy(OneRankLink(), leader, None, name=make_policy(GenerationConfig(strategy="auto")).name)
    assert follower.name == "auto"
