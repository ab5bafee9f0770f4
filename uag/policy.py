"""How many tokens to draft next: a fixed k, or the k that maximises the expected rate. No mlx.

`AdaptiveK` keeps, per target position i of a proposal, a decaying estimate of the chance that the
target accepts it given that it accepted positions 1..i−1, and the cost of a cycle from a calibrated
`CostProfile`, refined with the run's own timings. Each cycle it picks

    k* = argmax over k in 0..k_max of  E(k) / cost(k),     E(k) = 1 + Σ_{j ≤ n(k)} Π_{i ≤ j} p_i

where n(k) is the number of target tokens k drafter tokens translate into (tracked online) and k = 0 is
a plain target step ("parked"). While parked it drafts one token after `probe_every` steps, so it
notices when drafts start to pay again; each probe that leaves it parked doubles the gap to the next
(up to `PROBE_GAP_MAX`), and no gap is so short that probes cost more than `PROBE_BUDGET` of the
target's own rate (a drafter nearly as slow as the target probes rarely). Parked, auto costs what the
target alone costs, plus at most that budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from uag.costmodel import CostProfile
from uag.records import Cycle

DEFAULT_K_MAX = 8
DECAY = 0.9  # weight kept by older observations per update (half-life ≈ 6.6 cycles)
PRIOR = 0.5  # acceptance assumed for the first position before any evidence
PRIOR_WEIGHT = 1.0  # pseudo-observations pulling each position toward the one before it
PROBE_EVERY = 16  # parked steps before the first probe
PROBE_GAP_MAX = 128  # parked steps between probes after repeated failed probes
PROBE_BUDGET = 0.03  # the most probing may cost, as a share of the parked (target-alone) rate
EMA = 0.2  # weight of a new timing in the running cost estimates


@dataclass
class FixedK:
    """Always the same draft length (the study's setting)."""

    k: int

    def next_k(self) -> int:
        return self.k

    def plain_steps(self) -> int:
        return 1

    def observe(self, cycle: Cycle) -> None:
        pass


@dataclass
class AdaptiveK:
    """The draft length with the best expected tokens per millisecond, re-decided every cycle."""

    k_max: int = DEFAULT_K_MAX
    profile: CostProfile | None = None  # measured costs (uag.calibrate); None: learn them from the run
    r: float = 0.1  # drafter/target cost ratio to assume before any drafter step was timed
    probe_every: int = PROBE_EVERY
    accepted: list[float] = field(default_factory=list)  # decayed counts per target position
    rejected: list[float] = field(default_factory=list)
    expansion: float = 1.0  # target tokens per drafter token (cross-tokenizer translation)
    verify_ms: dict[int, float] = field(default_factory=dict)  # running estimate per width w
    drafter_ms: float | None = None  # one drafter pass in a drafting cycle
    catch_up_ms: float | None = None  # the draft phase of a cycle whose drafter first read a long stretch
    overhead_ms: float | None = None  # translate + re-sync per drafting cycle
    parked_for: int = 0
    probe_gap: int = 0  # parked steps before the next probe (probe_every, doubled by each failed probe)
    probing: bool = False

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1 (got {self.k_max})")
        self.probe_gap = self.probe_gap or self.probe_every

    # --- estimates -------------------------------------------------------------------------------------
    def acceptances(self, n: int) -> list[float]:
        """Estimated P(position i accepted | positions before it accepted) for i = 0..n−1.

        Decayed counts, shrunk toward the previous position's estimate: later positions are tried only
        after earlier ones were accepted, so they have little evidence of their own.
        Example: no evidence -> [0.5, 0.5]; 10 accepts at position 0 only -> [10.5/11, 10.5/11]
        """
        out, prior = [], PRIOR
        for i in range(n):
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            b = self.rejected[i] if i < len(self.rejected) else 0.0
            prior = (a + PRIOR_WEIGHT * prior) / (a + b + PRIOR_WEIGHT)
            out.append(prior)
        return out

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
            return self.profile.target_at(w)
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
            return self.profile.drafter_ms
        return self.r * (self.target_ms(1) or fallback)

    def cycle_overhead_ms(self) -> float:
        """Translation and re-sync per drafting cycle."""
        if self.overhead_ms is not None:
            return self.overhead_ms
        return self.profile.translate_ms if self.profile is not None else 0.0

    def probe_wait(self) -> int:
        """Parked steps before the next probe: the backed-off gap, and never so few that probing costs
        more than PROBE_BUDGET of the parked rate. A probe's extra cost is the drafter catching up on
        the parked stretch (measured on earlier probes; until then twice a drafter pass) plus a 2-token
        verification, less the plain step it replaces."""
        step = self.target_ms(1)
        if step is None or step <= 0:
            return self.probe_gap
        catch_up = self.catch_up_ms if self.catch_up_ms is not None else 2 * self.drafter_step_ms(step)
        extra = catch_up + self.cycle_overhead_ms() + (self.target_ms(2) or step) - step
        return min(PROBE_GAP_MAX, max(self.probe_gap, math.ceil(extra / (PROBE_BUDGET * step))))

    def rates(self) -> dict[int, float]:
        """Expected tokens per millisecond for each k (empty until a cost is known)."""
        acceptances = self.acceptances(self.proposal_length(self.k_max))
        out = {}
        for k in range(self.k_max + 1):
            ms = self.cycle_ms(k)
            if ms:
                out[k] = self.expected_tokens(self.proposal_length(k), acceptances) / ms
        return out

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
            self.parked_for, self.probe_gap = 0, self.probe_every
            return best
        if self.parked_for >= self.probe_wait():
            self.parked_for, self.probing = 0, True
            return 1  # a probe: is the drafter paying again?
        return 0

    def plain_steps(self) -> int:
        """Plain target steps to take in a row after `next_k()` returned 0, before deciding again."""
        return 1 if self.best_k() is None else max(1, self.probe_wait() - self.parked_for)

    def observe(self, cycle: Cycle) -> None:
        """Learn from a finished cycle: which positions were accepted, and what each phase cost."""
        w = len(cycle.proposed_ids) + 1
        self.verify_ms[w] = _ema(self.verify_ms.get(w), cycle.verify_ms)
        if cycle.k == 0:
            self.parked_for += 1
            return
        probe, self.probing = self.probing, False
        if cycle.drafter_passes and cycle.drafter_read <= 2 * cycle.drafter_passes + 1:
            self.drafter_ms = _ema(self.drafter_ms, cycle.draft_ms / cycle.drafter_passes)
        elif cycle.drafter_passes:  # it first caught up on the prompt or a parked stretch: what probes cost
            self.catch_up_ms = _ema(self.catch_up_ms, cycle.draft_ms)
        self.overhead_ms = _ema(self.overhead_ms, cycle.translate_ms + cycle.resync_ms)
        if cycle.draft_ids:
            self.expansion = _ema(self.expansion, max(len(cycle.proposed_ids), 1) / len(cycle.draft_ids))
        tried = len(cycle.proposed_ids)
        for i in range(min(tried, cycle.accepted + 1)):
            while len(self.accepted) <= i:
                self.accepted.append(0.0)
                self.rejected.append(0.0)
            self.accepted[i] *= DECAY
            self.rejected[i] *= DECAY
            if i < cycle.accepted:
                self.accepted[i] += 1
            else:
                self.rejected[i] += 1
        if probe and self.best_k() == 0:  # the probe did not pay: wait twice as long for the next one
            self.probe_gap = min(2 * self.probe_gap, PROBE_GAP_MAX)


def _ema(old: float | None, new: float) -> float:
    if old is None or not math.isfinite(old):
        return new
    return (1 - EMA) * old + EMA * new
