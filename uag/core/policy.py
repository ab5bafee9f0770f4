"""How many tokens to draft next: a fixed k, or the k that maximises the expected rate. No mlx.

`AdaptiveK` keeps, per target position i of a proposal, a decaying estimate of the chance that the
target accepts it given that it accepted positions 1..i−1, and the cost of a cycle from a calibrated
`CostProfile`, refined with the run's own timings. The profile's costs are scaled by how fast this run's
target passes actually are (the median ratio over the widths it has timed): a profile measured on a
quiet machine still ranks the draft lengths right on a busy one, and one measured under load does not
make a quiet run look expensive. Each cycle it picks

    k* = argmax over k in 0..k_max of  E(k) / cost(k),     E(k) = 1 + Σ_{j ≤ n(k)} Π_{i ≤ j} p_i

where n(k) is the number of target tokens k drafter tokens translate into (tracked online) and k = 0 is
a plain target step ("parked"). Before the drafter can draft it must read what it has not seen (the
prompt, then each parked stretch); that backlog is charged to drafting, spread over the tokens the run
has left to write, so a short run parks where reading the prompt would cost more than drafting could
save (`backlog_ms`). While parked, now and then the drafter catches up on the stretch it missed in one
pass and its guesses there are checked against what the target wrote (a rehearsal, uag.core.drafters): a
draft holds as long as the guesses are right, so the stretch replays every draft it could have had
(`replay_drafts`), and that evidence decides whether to draft again — no draft is verified, no target
pass widened. Reading is what the next draft would do anyway; a rehearsal waits until its reading costs
at most `REHEARSAL_BUDGET` of the parked stretch it ends (the prompt, on the first, included), and where
the drafter reads a token for more than that share of a target step, it never rehearses. Each rehearsal
that leaves it parked doubles the least gap to the next (`rehearse_every`, up to `STRETCH_MAX`). Parked,
auto costs what the target alone costs, plus at most that budget, less as the gaps grow.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from uag.core.config import LOOKUP
from uag.core.costmodel import CostProfile
from uag.core.records import Cycle, Rehearsal

MODEL = "model"

DEFAULT_K_MAX = 8
DECAY = 0.9  # weight kept by older observations per update (half-life ≈ 6.6 cycles)
PRIOR = 0.5  # acceptance assumed for the first position before any evidence
PRIOR_WEIGHT = 1.0  # pseudo-observations pulling each position toward the one before it
REHEARSE_EVERY = 16  # parked steps between rehearsals, at the least
STRETCH_MAX = 128  # the most plain steps in a row before deciding again
REHEARSAL_BUDGET = 0.03  # the most a rehearsal may cost, as a share of the parked (target-alone) stretch it ends
EMA = 0.2  # weight of a new timing in the running cost estimates
LOOKUP_MS = 0.02  # what a lookup is assumed to cost before one was timed (it is a dictionary lookup)


@dataclass
class FixedK:
    """Always the same draft length (the study's setting)."""

    k: int

    def next_k(self) -> int:
        return self.k

    def choose(self, offer: Mapping[str, int]) -> tuple[str, int]:
        """Lookup where it has a match (it costs nothing), else the model; a plain step when neither drafts."""
        source = LOOKUP if LOOKUP in offer else MODEL if MODEL in offer else ""
        return (source, min(self.k, offer[source])) if source else ("", 0)

    def plain_steps(self) -> int:
        return 1

    def begin(self, unread: int, budget: int | None = None) -> None:
        pass

    def observe(self, cycle: Cycle) -> None:
        pass

    def wants_rehearsal(self) -> bool:
        return False  # it never parks

    def rehearsed(self, rehearsal: Rehearsal) -> None:
        pass


@dataclass
class AdaptiveK:
    """The draft length with the best expected tokens per millisecond, re-decided every cycle."""

    k_max: int = DEFAULT_K_MAX
    profile: CostProfile | None = None  # measured costs (uag.study.calibrate); None: learn them from the run
    r: float = 0.1  # drafter/target cost ratio to assume before any drafter step was timed
    rehearse_every: int = REHEARSE_EVERY
    prior: float = PRIOR  # acceptance assumed for the first position before any evidence
    accepted: list[float] = field(default_factory=list)  # decayed counts per target position
    rejected: list[float] = field(default_factory=list)
    expansion: float = 1.0  # target tokens per drafter token (cross-tokenizer translation)
    verify_ms: dict[int, float] = field(default_factory=dict)  # running estimate per width w
    drafter_ms: float | None = None  # one drafter pass in a drafting cycle
    read_ms: float | None = None  # drafter time per token it reads to catch up (prompt, parked stretch)
    overhead_ms: float | None = None  # translate + re-sync per drafting cycle
    unread: int = 0  # committed tokens the drafter has not read (its prompt, then each parked step)
    parked_for: int = 0  # plain steps since the policy last drafted or rehearsed
    rehearsal_gap: int = 0  # least parked steps before the next rehearsal: rehearse_every, doubled by each
    #                         rehearsal that left it parked (up to STRETCH_MAX), reset when it drafts
    learn_costs: bool = True  # False: keep the profile's costs, never the run's own timings (tests pin them)
    lookup_accepted: list[float] = field(default_factory=list)  # the same counts for lookup proposals
    lookup_rejected: list[float] = field(default_factory=list)
    lookup_ms: float = LOOKUP_MS
    scale: float = 1.0  # this run's target pass times ÷ the profile's (1 without a profile or when pinned)
    remaining: int | None = None  # tokens the run has yet to write (None: unknown)

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1 (got {self.k_max})")
        self.rehearsal_gap = self.rehearsal_gap or self.rehearse_every

    # --- estimates -------------------------------------------------------------------------------------
    def acceptances(self, n: int, source: str = MODEL) -> list[float]:
        """Estimated P(position i accepted | positions before it accepted) for i = 0..n−1, per source.

        Decayed counts, shrunk toward the previous position's estimate: later positions are tried only
        after earlier ones were accepted, so they have little evidence of their own.
        Example: no evidence -> [0.5, 0.5]; 10 accepts at position 0 only -> [10.5/11, 10.5/11]
        """
        accepted, rejected = self._counts(source)
        out, prior = [], self.prior
        for i in range(n):
            a = accepted[i] if i < len(accepted) else 0.0
            b = rejected[i] if i < len(rejected) else 0.0
            prior = (a + PRIOR_WEIGHT * prior) / (a + b + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def _counts(self, source: str) -> tuple[list[float], list[float]]:
        if source == LOOKUP:
            return self.lookup_accepted, self.lookup_rejected
        return self.accepted, self.rejected

    def acceptance(self, i: int) -> float:
        return self.acceptances(i + 1)[i]

    def expected_tokens(self, n: int, acceptances: list[float] | None = None) -> float:
        """Tokens a cycle commits on average when it proposes n target tokens.

        Example: p = 0.5 at every position, n = 2 -> 1 + 0.5 + 0.25 = 1.75
        """
        total, survive = 1.0, 1.0
        for p in (acceptances or self.acceptances(n))[:n]:
            survive *= p
            total += survive
        return total

    def target_ms(self, w: int) -> float | None:
        """Cost of a target pass over w tokens: own timings first, then the profile, then extrapolation."""
        if w in self.verify_ms:
            return self.verify_ms[w]
        if self.profile is not None:
            return self.profile.target_at(w) * self.scale
        if not self.verify_ms:
            return None
        known = sorted(self.verify_ms)
        base = self.verify_ms[known[0]]
        if len(known) == 1:  # assume a k-token pass costs 10 % more per extra token until we know
            return base * (1 + 0.1 * (w - known[0]))
        lo, hi = known[0], known[-1]
        slope = max(0.0, (self.verify_ms[hi] - self.verify_ms[lo]) / (hi - lo))
        return self.verify_ms[lo] + slope * (w - lo) if w > lo else base

    def proposal_length(self, k: int) -> int:
        return max(1, round(self.expansion * k)) if k else 0

    def cycle_ms(self, k: int) -> float | None:
        n = self.proposal_length(k)
        verify = self.target_ms(n + 1)
        if verify is None:
            return None
        if k == 0:
            return verify
        return k * self.drafter_step_ms(verify) + self.cycle_overhead_ms() + verify

    def drafter_step_ms(self, fallback: float) -> float:
        """One drafter pass: own timings first, then the profile, then r × a target step (or `fallback`)."""
        if self.drafter_ms is not None:
            return self.drafter_ms
        if self.profile is not None:
            return self.profile.drafter_ms * self.scale
        return self.r * (self.target_ms(1) or fallback)

    def cycle_overhead_ms(self) -> float:
        """Translation and re-sync per drafting cycle."""
        if self.overhead_ms is not None:
            return self.overhead_ms
        return self.profile.translate_ms if self.profile is not None else 0.0

    def read_ms_per_token(self) -> float:
        """What the drafter takes to read one token while catching up: measured on earlier catch-ups;
        until then the target's cost per extra token of a wide pass, scaled by drafter step / target step.

        Example: target 10 ms for 1 token, 14 ms for 9; drafter step 5 ms -> 0.5 ms × 0.5 = 0.25 ms
        """
        if self.read_ms is not None:
            return self.read_ms
        step = self.target_ms(1)
        if not step:
            return 0.0
        wide = max([*self.verify_ms, *(self.profile.target_ms if self.profile else ())])
        per_token = max(0.0, ((self.target_ms(wide) or step) - step) / (wide - 1)) if wide > 1 else 0.1 * step
        return per_token * self.drafter_step_ms(step) / step

    def rehearsal_wait(self) -> float:
        """Parked steps (since the policy last drafted or rehearsed) before the next rehearsal: at least
        the backed-off gap, and enough that its reading costs at most REHEARSAL_BUDGET of the stretch;
        math.inf when no stretch is long enough (the drafter reads a token for more than the budget's
        share of a target step). It costs a drafter pass, plus reading the backlog from before the
        stretch (the prompt, on the first) and one token per parked step.

        Example: target step 450 ms, drafter step 65 ms, 3 ms a token read, a 40-token prompt unread
        -> ceil((65 + 120) / (13.5 − 3)) = 18; a 400-token prompt -> ceil((65 + 1200) / 10.5) = 121
        """
        step = self.target_ms(1)
        if step is None or step <= 0:
            return self.rehearsal_gap
        read = self.read_ms_per_token()
        room = REHEARSAL_BUDGET * step - read  # budget per parked step left after reading that step's token
        if room <= 0:
            return math.inf
        backlog = max(0, self.unread - self.parked_for)
        return max(self.rehearsal_gap, math.ceil((self.drafter_step_ms(step) + read * backlog) / room))

    def wants_rehearsal(self) -> bool:
        """Parked long enough that the drafter may catch up and show whether drafting would pay."""
        return self.parked_for > 0 and self.parked_for >= self.rehearsal_wait()

    def rehearsed(self, rehearsal: Rehearsal) -> None:
        """Learn from a rehearsal: what reading cost, and how the drafts the stretch could have had fared."""
        if self.learn_costs and rehearsal.read:
            self.read_ms = _ema(self.read_ms, rehearsal.ms / rehearsal.read)
        self.unread = self.parked_for = 0
        if not rehearsal.hits:
            return
        expansion = rehearsal.target_tokens / len(rehearsal.hits) if rehearsal.target_tokens else self.expansion
        for tried, kept in replay_drafts(rehearsal.hits, self.k_max, expansion):
            _count(self.accepted, self.rejected, tried, kept)
        if self.best_k() == 0:  # still parked: rehearse half as often (over a long run, its cost fades)
            self.rehearsal_gap = min(2 * self.rehearsal_gap, STRETCH_MAX)

    def rates(self) -> dict[int, float]:
        """Expected tokens per millisecond for each k (empty until a cost is known). Where the drafter
        has a backlog to read first, drafting's rate includes it, spread over the tokens left to write."""
        acceptances = self.acceptances(self.proposal_length(self.k_max))
        out = {}
        for k in range(self.k_max + 1):
            ms = self.cycle_ms(k)
            if ms:
                out[k] = self.expected_tokens(self.proposal_length(k), acceptances) / ms
        backlog = self.backlog_ms()
        if backlog and self.remaining:
            out = {k: rate if k == 0 else self.remaining / (backlog + self.remaining / rate) for k, rate in out.items()}
        return out

    def backlog_ms(self) -> float:
        """What the drafter must spend reading before it can draft: its prompt, then each parked stretch.

        A run that drafts pays it once, so it counts against drafting only where the tokens left to write
        are too few to earn it back. Example: a 32-token Polish run with an English-only drafter, which
        reads the prompt as ~100 tokens (2 target steps on our CPU) and would save a few percent at best."""
        return self.unread * self.read_ms_per_token() if self.unread > 1 else 0.0

    # --- decisions -------------------------------------------------------------------------------------
    def best_k(self) -> int | None:
        """The k with the highest expected rate (ties to the shorter draft); None before any timing."""
        rates = self.rates()
        if 0 not in rates:
            return None
        return max(rates, key=lambda k: (rates[k], -k))

    def next_k(self) -> int:
        best = self.best_k()
        if best is None:
            return 0  # time one plain target step first: every decision is relative to it
        if best > 0:
            self.parked_for, self.rehearsal_gap = 0, self.rehearse_every
        return best

    def lookup_rates(self, k_max: int) -> dict[int, float]:
        """Expected tokens per millisecond of a lookup proposal of k tokens (it costs a lookup and the wider pass)."""
        acceptances = self.acceptances(k_max, LOOKUP)
        out = {}
        for k in range(1, k_max + 1):
            verify = self.target_ms(k + 1)
            if verify:
                out[k] = self.expected_tokens(k, acceptances) / (self.lookup_ms + verify)
        return out

    def choose(self, offer: Mapping[str, int]) -> tuple[str, int]:
        """The source and draft length with the best expected rate among what `offer` holds
        (source -> the most it can propose); ("", 0) for a plain target step."""
        best = ("", 0)
        rates = self.rates()
        if 0 not in rates:
            return best  # time one plain target step first: every decision is relative to it
        if MODEL in offer:
            k = min(self.next_k(), offer[MODEL])
            if k:
                best = (MODEL, k)
        if LOOKUP in offer:
            lookup = self.lookup_rates(min(self.k_max, offer[LOOKUP]))
            k = max(lookup, key=lambda k: (lookup[k], -k), default=0)
            current = rates[best[1]] if best[0] == MODEL and best[1] in rates else rates[0]
            if k and lookup[k] > current:
                return LOOKUP, k
            # Not chosen: its evidence ages, so that a source that failed once is tried again later.
            for counts in self._counts(LOOKUP):
                counts[:] = [c * DECAY for c in counts]
        return best

    def plain_steps(self) -> int:
        """Plain target steps to take in a row after `next_k()` returned 0: up to the next rehearsal (at
        most STRETCH_MAX: the decision is revisited as the run's own timings come in)."""
        if self.best_k() is None:
            return 1
        return max(1, min(STRETCH_MAX, self.rehearsal_wait() - self.parked_for))

    def begin(self, unread: int, budget: int | None = None) -> None:
        """A run starts: the drafter has `unread` prompt tokens to read before its first draft, and the run
        has `budget` tokens to write (None: unknown)."""
        self.unread, self.remaining = unread, budget

    def observe(self, cycle: Cycle) -> None:
        """Learn from a finished cycle: which positions were accepted, and what each phase cost."""
        if self.remaining is not None:
            self.remaining = max(0, self.remaining - cycle.emitted)
        w = len(cycle.proposed_ids) + 1
        if self.learn_costs or not (self.profile and w in self.profile.target_ms):
            self.verify_ms[w] = _ema(self.verify_ms.get(w), cycle.verify_ms)
        if self.learn_costs and self.profile is not None:
            self.scale = statistics.median(ms / self.profile.target_at(v) for v, ms in self.verify_ms.items())
        if cycle.k == 0:
            self.parked_for += 1
            self.unread += 1
            return
        if cycle.source == LOOKUP:  # the model drafter reads these tokens later, as if parked
            self.parked_for += cycle.emitted
            self.unread += cycle.emitted
            if self.learn_costs:
                self.lookup_ms = _ema(self.lookup_ms, cycle.draft_ms + cycle.translate_ms)
            _count(self.lookup_accepted, self.lookup_rejected, len(cycle.proposed_ids), cycle.accepted)
            return
        self.unread = 0
        passes = cycle.drafter_passes if self.learn_costs else 0
        if passes and cycle.drafter_read <= 2 * passes + 1:
            self.drafter_ms = _ema(self.drafter_ms, cycle.draft_ms / passes)
        elif passes:  # it first caught up on the prompt or a parked stretch: what reading a token costs
            caught_up = cycle.draft_ms - passes * self.drafter_step_ms(cycle.draft_ms / passes)
            self.read_ms = _ema(self.read_ms, max(0.0, caught_up) / (cycle.drafter_read - passes))
        if self.learn_costs:
            self.overhead_ms = _ema(self.overhead_ms, cycle.translate_ms + cycle.resync_ms)
        if cycle.draft_ids:
            self.expansion = _ema(self.expansion, max(len(cycle.proposed_ids), 1) / len(cycle.draft_ids))
        _count(self.accepted, self.rejected, len(cycle.proposed_ids), cycle.accepted)


def replay_drafts(hits: list[bool], k: int, expansion: float = 1.0) -> list[tuple[int, int]]:
    """The drafts of k drafter tokens that drafting through a stretch would have made, from the drafter's
    guesses there (`hits[i]`: its guess at drafter position i was the next token), as (target positions
    proposed, target positions kept). A draft from position j holds while the guesses from j on are
    right; then the target writes one token of its own (1 / expansion drafter tokens: `expansion` is
    target tokens per drafter token) and the next draft starts after it. A draft still undecided when
    the stretch ends is left out.

    Example: hits = [T, T, F, T, F, F, T, T, T], k = 2 -> [(2, 2), (2, 1), (2, 0), (2, 2)]
    (drafts from positions 0, 3, 5 and 6: kept 2, then 1 — position 4 was wrong — then 0, then 2)
    """
    out, j = [], 0
    tried = max(1, round(k * expansion))
    step = max(1, round(1 / expansion)) if expansion > 0 else 1
    while j < len(hits):
        held = 0
        while held < k and j + held < len(hits) and hits[j + held]:
            held += 1
        if held < k and j + held == len(hits):
            break
        out.append((tried, tried if held == k else min(tried, int(held * expansion))))
        j += held + step
    return out


def _count(accepted: list[float], rejected: list[float], tried: int, kept: int) -> None:
    """Decay the counts of every position the target looked at, then count this cycle's outcome there."""
    for i in range(min(tried, kept + 1)):
        while len(accepted) <= i:
            accepted.append(0.0)
            rejected.append(0.0)
        accepted[i] *= DECAY
        rejected[i] *= DECAY
        if i < kept:
            accepted[i] += 1
        else:
            rejected[i] += 1


def _ema(old: float | None, new: float) -> float:
    if old is None or not math.isfinite(old):
        return new
    return (1 - EMA) * old + EMA * new
