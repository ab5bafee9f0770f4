"""Members of a batch that park under load and draft again as it shrinks stay lossless (issue 52, item 3): four
requests of a tiny random target run through the real engine in one `Batch` (uag.runtime.batching), each under an
`auto` that prices its lookup drafts against the whole batch (costs pinned CPU-like, lookup's acceptance pinned at
one half: the decisions depend on the load alone). Beside three others a lookup match is passed over; once the
three short ones have left, the long one drafts from its matches; every member's greedy tokens equal the target
alone's."""

from __future__ import annotations

import pytest

from tests.support.tiny_models import build_tiny, unshare
from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.core.engine import Seams, generate, stream
from uag.core.evidence import MODEL
from uag.core.policy import AdaptiveK, AutoSettings
from uag.runtime.batching import Batch, share, sharing_now
from uag.runtime.worker import Job

# 3 + n ms a pass over n tokens, every width in the table (pinned: no width is learned from the run's passes):
COSTS = CostProfile({n: 3.0 + n for n in range(1, 130)}, drafter_ms=1.0, translate_ms=0.0)
# alone a lookup guess of one half pays (1.5 / 5 > 1 / 4); beside three others it pays neither on its own
# (4.5 / 11 < 4 / 7) nor were all four to draft alike (1.5 / 11 < 1 / 7)


class HalfKept(AdaptiveK):
    """auto with lookup's acceptance pinned at one half, whatever the random target keeps; it notes, at each
    decision where lookup had a match, how many others the batch held and whether it drafted."""

    decisions: list

    def acceptances(self, n, source=MODEL, match=None):
        return [0.5] * n if source != MODEL else super().acceptances(n, source, match)

    def choose(self, offer, left=None):
        decision = super().choose(offer, left)
        if "lookup" in offer:
            self.decisions.append((len(self.sharing.others), decision[0] == "lookup"))
        return decision


@pytest.fixture(scope="module")
def target(store):
    loaded = store.get(str(build_tiny("llama", "llama-3.2", seed=11, tie_embeddings=False)))
    yield loaded
    unshare(loaded)


def member(job, target, ids: list[int], max_tokens: int, out: dict, name: str):
    """One request: the engine's stream under auto, priced against the batch this job runs in."""
    policy = HalfKept(k_max=4, profile=COSTS, settings=AutoSettings(learn_costs=False), sharing=sharing_now())
    policy.decisions = out.setdefault("decisions", {}).setdefault(name, [])
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=max_tokens)
    for event in stream(target, DrafterChoice(lookup=True), ids, config, seams=Seams(policy=policy)):
        out[name] = event.run
        yield len(event.run.token_ids)


def test_members_park_under_load_draft_as_the_batch_shrinks_and_match_the_target_alone(target):
    base = [5, 17, 23, 42, 8, 99, 61, 5, 17, 23, 42, 8, 99, 61]
    requests = {  # name: (prompt ids, max_tokens): three short, one long
        "short-a": (base * 2, 12),
        "short-b": ([7, 3, *base], 12),
        "short-c": ([9, *base], 12),
        "long": (base * 3, 48),
    }
    alone = {
        name: generate(target, None, ids, GenerationConfig("baseline", max_tokens=n)).token_ids
        for name, (ids, n) in requests.items()
    }
    share(target, "target")
    out: dict = {}
    batch = Batch(max_size=4)
    batch.queued = lambda: True  # as under load: a member alone still waits for its rounds
    jobs = [Job(member, (target, ids, n, out, name), name, shared=True) for name, (ids, n) in requests.items()]
    for job in jobs:
        batch.join(job)
    while batch:
        batch.round()
    for job in jobs:
        list(job)  # raises what the job raised
    decisions = out.pop("decisions")
    assert {name: run.token_ids for name, run in out.items()} == alone
    beside = [drafted for name in requests for others, drafted in decisions[name] if others == 3]
    alone_then = [drafted for others, drafted in decisions["long"] if not others]
    assert beside and not any(beside)  # every match passed over while four ran: parked, a token a round
    assert alone_then and all(alone_then)  # the long one drafts from its matches once it is alone
    assert any(c.source == "lookup" for c in out["long"].cycles)
