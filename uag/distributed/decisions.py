"""One decision per cycle, shared: rank 0 decides and drafts, every rank acts on the same decision.

The engine (uag.core.engine.speculative_steps) asks its policy for (source, k) and its drafter for a
proposal. On a sharded target these two seams carry rank 0's choices to every rank:

- `RankPolicy.choose` on rank 0 asks rank 0's own policy (fixed or auto), and for a cycle has rank 0's
  drafter propose right away, so that the decision and the proposal travel together in ONE integer
  `all_sum` (uag.distributed.collective.Link): [op, a, b, n, ids…], padded to 4 + 4·k. Every rank returns the same
  (source, k) to the engine, and the same stretch length from `plain_steps`.
- `LeaderDrafter` (rank 0) hands that ready draft to the cycle; `FollowerDrafter` (other ranks) hands
  the received one. Both keep the committed tokens for the debug check (`check_every`).

A plain stretch (PLAIN, its length; the first one reads the prompt), a cycle (CYCLE; the first one is
verified by the prompt pass) and rank 0's cancel (STOP: every rank raises `Stopped` at the same
decision) are the only messages.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from uag.core.anatomy import Loss
from uag.core.config import LOOKUP
from uag.core.drafters import Draft, Drafter, lookup_offer
from uag.core.lookup import NgramIndex
from uag.core.policy import MODEL, Policy, StopRule
from uag.core.records import Offer, Rehearsal
from uag.distributed.collective import Link, Watchdog

PROPOSAL_SPAN = 4  # a proposal travels in at most 4·k target ids (translation can split drafter tokens)

# The decision message: [op, a, b, n, ids…]. PLAIN: a = stretch length. CYCLE: a = source, b = k, n ids.
PLAIN, CYCLE, STOP = 2, 3, 4
HEADER = 4
SOURCES = (MODEL, LOOKUP)


def message_width(k_max: int) -> int:
    """Integers in one decision message. Example: message_width(4) -> 20"""
    return HEADER + PROPOSAL_SPAN * k_max


class Stopped(Exception):
    """Rank 0 stopped the run (its cancel event): every rank ends it at the same decision."""


class LeaderDrafter:
    """Rank 0's drafter, behind the seam: drafts when `RankPolicy` decides (so that the decision and the
    proposal travel together) and hands that draft to the cycle."""

    def __init__(self, inner: Drafter, watchdog: Watchdog):
        self.inner, self.watchdog = inner, watchdog
        self.name, self.translation = inner.name, inner.translation
        self.committed: list[int] = []
        self.pending: Draft | None = None

    def start(self, prompt: Sequence[int]) -> int:
        self.committed = list(prompt)
        return self.inner.start(prompt)

    def offer(self, k_max: int) -> Offer:
        offer = self.inner.offer(k_max)
        offer.branched = False  # the ranks verify one proposal (`RankPolicy._decide` drops its branches)
        return offer

    def propose(self, source: str, k: int, budget: int, stop: StopRule | None = None) -> Draft:
        draft, self.pending = self.pending, None
        assert draft is not None and draft.source == source and len(draft.proposed) <= budget, (draft, source, k)
        return draft

    def loss(self, draft: Draft, accepted: int, written: Sequence[int]) -> Loss:
        return self.inner.loss(draft, accepted, written)

    def commit(self, draft: Draft | None, new: Sequence[int]) -> bool:
        self.committed += new
        self.watchdog.progress()
        return self.inner.commit(draft, new)

    def rehearse(self) -> Rehearsal | None:
        return self.inner.rehearse()

    def restore(self) -> None:
        self.inner.restore()


class FollowerDrafter:
    """A rank other than 0: it drafts nothing and proposes what rank 0 sent. Where rank 0 drafts by lookup
    it keeps the same n-gram index, so that it ends a plain stretch where rank 0 does (the stretch ends when
    a lookup match turns up: a function of the committed tokens, which every rank shares)."""

    name = translation = "relayed from rank 0"

    def __init__(self, lookup: bool, watchdog: Watchdog):
        self.lookup, self.watchdog = lookup, watchdog
        self.committed: list[int] = []
        self.pending: Draft | None = None
        self.index = NgramIndex()

    def start(self, prompt: Sequence[int]) -> int:
        self.committed, self.index = list(prompt), NgramIndex()
        if self.lookup:
            self.index.extend(prompt)
        return 0

    def offer(self, k_max: int) -> Offer:
        return lookup_offer(self.index, k_max) if self.lookup else Offer()

    def propose(self, source: str, k: int, budget: int, stop: StopRule | None = None) -> Draft:
        draft, self.pending = self.pending, None
        assert draft is not None and draft.source == source, (draft, source)
        return draft

    def loss(self, draft: Draft, accepted: int, written: Sequence[int]) -> Loss:
        return Loss()  # only rank 0, which drafted, knows where its drafts went

    def commit(self, draft: Draft | None, new: Sequence[int]) -> bool:
        self.committed += new
        if self.lookup:
            self.index.extend(new)
        self.watchdog.progress()
        return False

    def rehearse(self) -> Rehearsal | None:
        return None  # only rank 0 drafts

    def restore(self) -> None:
        pass


class RankPolicy:
    """The policy on every rank (a `uag.core.policy.Policy`): rank 0's own policy (`inner`) decides, one
    exchange carries the decision (and a cycle's proposal) to all, and every rank returns the same (source, k)
    and stretch length to the engine. Other ranks have no policy of their own: `k_policy` says which rank 0 runs.
    With `check_every` = N, every N decisions the ranks compare hashes of their committed tokens."""

    def __init__(
        self,
        link: Link,
        drafter: LeaderDrafter | FollowerDrafter,
        inner: Policy | None,
        *,
        k_policy: str = "",
        check_every: int = 0,
        cancel: threading.Event | None = None,
    ):
        self.link, self.drafter, self.inner = link, drafter, inner
        self.k_policy = inner.k_policy if inner is not None else k_policy
        self.check_every, self.cancel = check_every, cancel
        self.decisions = 0
        self._stretch = 1

    def begin(self, unread: int, budget: int | None = None) -> None:
        if self.inner is not None:
            self.inner.begin(unread, budget)

    def observe(self, cycle) -> None:
        if self.inner is not None:
            self.inner.observe(cycle)

    def plain_steps(self) -> int:
        return self._stretch

    def stop_rule(self, source: str, k: int) -> StopRule | None:
        return None  # rank 0 drafted already, by its own policy's rule (`_decide`)

    def wants_rehearsal(self) -> bool:
        return self.inner is not None and self.inner.wants_rehearsal()  # rank 0's drafter reads; nobody waits

    def rehearsed(self, rehearsal: Rehearsal) -> None:
        self.inner.rehearsed(rehearsal)

    def reconsider(self) -> bool:
        return False  # a sharded target serves one request at a time: no batch to change

    def heeds(self, offer) -> bool:
        return True  # every rank ends its stretch where a match turns up: only rank 0 decides, from its offer

    def passed_over(self):
        return self.inner.passed_over() if self.inner is not None else None  # rank 0's, which decided

    def choose(self, offer, left: int | None = None) -> tuple[str, int]:
        message = self._decide(offer, left) if self.link.rank == 0 else None
        tic = time.perf_counter()
        op, a, b, n, *ids = self.link.exchange(message)
        self.decisions += 1
        if self.check_every and self.decisions % self.check_every == 0:
            self.link.check_agreement(self.drafter.committed, f"at decision {self.decisions}")
        if op == STOP:
            raise Stopped
        if op == PLAIN:
            self._stretch = a
            return "", 0
        assert op == CYCLE, (op, a, b, n)
        if self.link.rank == 0:  # the exchange is part of what drafting costs here (auto's overhead)
            self.drafter.pending.sync_ms += (time.perf_counter() - tic) * 1000
        else:
            self.drafter.pending = Draft(SOURCES[a], ids[:n])
        return SOURCES[a], b

    def _decide(self, offer, left: int | None) -> list[int]:
        """Rank 0: the inner policy's choice within the tokens `left` to write, and the draft it calls for."""
        if self.decisions and self.cancel is not None and self.cancel.is_set():  # the first token is written
            return [STOP]
        source, k = self.inner.choose(offer, left)
        if k == 0:
            return [PLAIN, self.inner.plain_steps()]
        budget = k * PROPOSAL_SPAN if left is None else left - 1
        draft = self.drafter.inner.propose(source, k, budget, self.inner.stop_rule(source, k))
        k = draft.length(k)  # where auto's rule stopped the drafter: the drafts it made
        # Rank 0 verifies exactly what the others receive (a translation longer than 4·k is cut: still lossless).
        draft.proposed, draft.branches = draft.proposed[: self.link.width - HEADER], []  # the others get one
        self.drafter.pending = draft
        return [CYCLE, SOURCES.index(source), k, len(draft.proposed), *draft.proposed]
