"""How many tokens to draft next: a `Policy`. `FixedK` always drafts k (the study's setting); `AdaptiveK`
(strategy "auto") drafts the k that maximises the expected rate, re-decided every cycle. No mlx.

`AdaptiveK` decides from its `Evidence` (per source and target position i of a proposal, a decaying estimate
of the chance that the target accepts it given that it accepted positions 1..i−1; for the model, the chance
its drafter's confidence gives a draft, below; running cost estimates)
and a calibrated `CostProfile`, scaled by how fast this run's target passes actually are (the median ratio
over the widths it has timed). Each cycle it picks

    k* = argmax over k in 0..k_max of  E(k) / cost(k),     E(k) = 1 + Σ_{j ≤ n(k)} Π_{i ≤ j} p_i

where n(k) is the number of target tokens k drafter tokens translate into (tracked online) and k = 0 is
a plain target step ("parked").

The opening. The first decision is made before this run has any evidence, from what is known: the
profile's costs and the acceptance earlier runs of the pair saw (an `Evidence` the caller kept: the server
per pair, `uag.costs.profiles` per pair and machine), weighing at most `CARRY` cycles so that this run's own
cycles overrule it within a few, both ways; with no earlier run, `PRIOR`. Before the drafter can draft it
must read what it has not seen (the prompt, then each parked stretch), in one batched pass whose cost the
profile measured (`CostProfile.reading_ms`); that backlog is charged to drafting, spread over the tokens
the run has left to write. So a pair that pays at k = 2 drafts from the first token, and one that does not
(a drafter half the target's cost; an English drafter on Polish, once a run has shown it) parks.

How far the model drafts is decided as it drafts. Once `choose` has picked the model, its drafter drafts one
token at a time and asks `enough` after each, with its confidence in every draft so far (its probability of
the token it drafted). How often the target keeps a draft follows that confidence closely, in code and in
Polish, so a draft's chance is read from it (`Evidence.kept_chance`: per band of confidence, the
target's verdicts on the pair's drafts, leaning on the confidence itself where they are few). Proposing the
first n drafts is worth their expected tokens less what the wider target pass costs at the rate the cycle was
chosen for; the drafter drafts on while one more draft (at the chance drafts have had on this text, then
proposing the best of them) or several more are worth more than their drafter passes. So a draft the target
would hardly keep is not proposed, and an unsure first draft ends the cycle as a plain step. The estimate
`choose` decides by is, for the model, that chance of a draft not yet made (`Evidence.mean_chance`: the bands'
chances weighted by how sure the drafter's recent drafts and rehearsal guesses were) at every position.

Prompt lookup's proposals are judged by how far their match runs back (uag.core.lookup.match_band): a
lookup from a match of 2–3 tokens is a guess, one from 16 a copy, and its evidence is kept per band, so that
a weak match drafts short (or gives way to the model, or to a plain step) and a strong one drafts long. A
band with little evidence of its own leans on all of lookup's, but a match of 8 tokens or more never on less
than its floor (uag.core.lookup.BAND_FLOORS): failed guesses must not keep auto from copying.

Parked, now and then the drafter catches up on the stretch it missed in one pass and its guesses there are
checked against what the target wrote (a rehearsal, uag.core.drafters): a draft holds as long as the
guesses are right, so the stretch replays every draft it could have had (`replay_drafts`), and that
evidence decides whether to draft again — no draft is verified, no target pass widened. A rehearsal waits
until its reading costs at most `REHEARSAL_BUDGET` of the parked stretch it ends (the prompt, on the first,
included); where the drafter reads a token for more than that share of a target step, it never rehearses.
Each rehearsal that leaves it parked doubles the least gap to the next (up to `STRETCH_MAX`). Parked, auto
costs what the target alone costs, plus at most that budget, less as the gaps grow.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from uag.core.config import LOOKUP
from uag.core.costmodel import CostProfile
from uag.core.evidence import MODEL, Evidence, replay_drafts
from uag.core.lookup import BAND_FLOORS, match_band
from uag.core.records import Cycle, Offer, Rehearsal

if TYPE_CHECKING:
    from uag.core.config import GenerationConfig

DEFAULT_K_MAX = 8
PRIOR = 0.5  # acceptance assumed for the first position where no run of the pair has been seen
REHEARSE_EVERY = 16  # parked steps between rehearsals, at the least
STRETCH_MAX = 128  # the most plain steps in a row before deciding again
REHEARSAL_BUDGET = 0.03  # the most a rehearsal may cost, as a share of the parked (target-alone) stretch it ends
EMA = 0.2  # weight of a new timing in the running cost estimates

# Asked by a model drafter after each draft, with its confidence in every draft so far: None to draft on, or how
# many of them to propose (`AdaptiveK.enough`). Without one, a drafter drafts the k asked, pipelined.
StopRule = Callable[[Sequence[float]], "int | None"]


class Policy(Protocol):
    """What the engine (uag.core.engine.speculative_steps) and the sharded target's `RankPolicy` ask of a
    draft-length policy. `name` is what the run's record says: "fixed" or "auto"."""

    name: str

    def begin(self, unread: int, budget: int | None = None) -> None:
        """A run starts: the drafter has `unread` prompt tokens to read first; `budget` tokens to write."""

    def choose(self, offer: Mapping[str, int], left: int | None = None) -> tuple[str, int]:
        """The source and k of the next cycle among what `offer` holds (source -> the most it can propose),
        ("", 0) for plain target steps; never more than `left` − 1 drafts (`within`)."""

    def stop_rule(self, source: str) -> StopRule | None:
        """How the drafter of the cycle `choose` picked should decide its draft's length as it drafts (None:
        the k chosen)."""

    def plain_steps(self) -> int:
        """Plain target steps to take in a row after `choose` returned ("", 0)."""

    def observe(self, cycle: Cycle) -> None:
        """Learn from a finished cycle or plain step."""

    def wants_rehearsal(self) -> bool:
        """Parked long enough that the drafter should catch up and show whether drafting would pay."""

    def rehearsed(self, rehearsal: Rehearsal) -> None:
        """Learn from a rehearsal's guesses and what its reading cost."""


def within(decision: tuple[str, int], left: int | None) -> tuple[str, int]:
    """The one budget clamp: a cycle writes its accepted drafts and one token of its own, so with `left`
    tokens to write it drafts at most left − 1 (None: no limit); nothing left to draft is a plain step.

    Example: within(("model", 4), 3) -> ("model", 2);  within(("lookup", 2), 1) -> ("", 0)
    """
    source, k = decision
    if left is not None:
        k = min(k, left - 1)
    return (source, k) if k > 0 else ("", 0)


def make_policy(
    config: GenerationConfig, profile: CostProfile | None = None, r: float = 0.1, evidence: Evidence | None = None
) -> Policy:
    """Fixed k, or for strategy "auto" the adaptive policy with k ≤ config.k, seeded by `profile` (the pair's
    measured costs on this machine, uag.costs.profiles) and `evidence` (what earlier runs of the pair taught,
    updated in place by this one) when there are."""
    if config.strategy != "auto":
        return FixedK(config.k)
    return AdaptiveK(k_max=config.k, profile=profile, r=r, evidence=evidence)


@dataclass
class FixedK:
    """Always the same draft length (the study's setting). It has no evidence: it never parks."""

    k: int
    name: ClassVar[str] = "fixed"

    def choose(self, offer: Mapping[str, int], left: int | None = None) -> tuple[str, int]:
        """Lookup where it has a match (it costs nothing), else the model; a plain step when neither drafts."""
        source = LOOKUP if LOOKUP in offer else MODEL if MODEL in offer else ""
        return within((source, min(self.k, offer[source])) if source else ("", 0), left)

    def plain_steps(self) -> int:
        return 1

    def stop_rule(self, source: str) -> StopRule | None:
        return None

    def begin(self, unread: int, budget: int | None = None) -> None:
        pass

    def observe(self, cycle: Cycle) -> None:
        pass

    def wants_rehearsal(self) -> bool:
        return False

    def rehearsed(self, rehearsal: Rehearsal) -> None:
        pass


@dataclass
class AdaptiveK:
    """The draft length with the best expected tokens per millisecond, re-decided every cycle."""

    name: ClassVar[str] = "auto"
    k_max: int = DEFAULT_K_MAX
    profile: CostProfile | None = None  # measured costs (uag.costs.calibrate); None: learn them from the run
    r: float = 0.1  # drafter/target cost ratio to assume before any drafter step was timed
    rehearse_every: int = REHEARSE_EVERY
    prior: float = PRIOR  # acceptance assumed for the first position before any evidence
    learn_costs: bool = True  # False: keep the profile's costs, never the run's own timings (tests pin them)
    evidence: Evidence | None = None  # what it starts from and learns into (uag.core.evidence); None: nothing yet
    # --- this run's state (`begin` sets it)
    unread: int = field(default=0, init=False)  # committed tokens the drafter has not read (prompt, parked steps)
    parked_for: int = field(default=0, init=False)  # plain steps since the policy last drafted or rehearsed
    rehearsal_gap: int = field(default=0, init=False)  # least parked steps before the next rehearsal (backed off)
    remaining: int | None = field(default=None, init=False)  # tokens the run has yet to write (None: unknown)
    declined_lookup: int | None = field(default=None, init=False)  # the last decision passed a lookup match over
    #                                                                   (the band of its match; -1 unknown)
    pace: float = field(default=0.0, init=False)  # tokens per ms the last decision expected: what time is worth
    cap: int = field(default=0, init=False)  # the most drafts the model's cycle may make (`choose`, `enough`)

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1 (got {self.k_max})")
        self.evidence = Evidence() if self.evidence is None else self.evidence
        self.rehearsal_gap = self.rehearse_every

    # --- estimates -------------------------------------------------------------------------------------
    def acceptances(self, n: int, source: str = MODEL, band: int | None = None) -> list[float]:
        """Estimated P(position i accepted | positions before it accepted) for i = 0..n−1, per source; for a
        lookup match of a known `band` (uag.core.lookup.match_band), that band's evidence, leaning where it
        has little on all of lookup's, or on the band's floor (`BAND_FLOORS`: a long match is a copy) if higher."""
        mean = self.evidence.mean_chance() if source == MODEL else None
        if mean is not None:  # what the drafter's confidence says of a draft to come, per target token
            return [mean ** (1 / self.evidence.expansion)] * n
        chances = self.evidence.counts(source).chances(n, self.prior)
        if source == LOOKUP and band is not None:
            floor = BAND_FLOORS[band]
            return self.evidence.lookup_bands[band].chances_toward([max(p, floor) for p in chances])
        return chances

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
        """Cost of a target pass over w tokens: own timings first; then the profile's, anchored at the nearest
        width this run has timed (the profile's shape, the run's level: passes over a long context cost more
        than the profile's, and a width timed now must not be weighed against one priced from timings of
        another context — a server's evidence carries from request to request); then extrapolation.

        Example: profile 450 / 500 ms for 1 / 2 tokens, this run's 2-token passes 700 ms -> w = 1: 630 ms
        """
        timed = self.evidence.verify_ms
        if w in timed:
            return timed[w]
        if self.profile is not None:
            anchors = [v for v in timed if self.profile.target_at(v) > 0] if self.learn_costs else []
            if not anchors:
                return self.profile.target_at(w) * self.evidence.scale
            near = min(anchors, key=lambda v: (abs(v - w), v))
            return self.profile.target_at(w) * timed[near] / self.profile.target_at(near)
        if not timed:
            return None
        known = sorted(timed)
        base = timed[known[0]]
        if len(known) == 1:  # assume a k-token pass costs 10 % more per extra token until we know
            return base * (1 + 0.1 * (w - known[0]))
        lo, hi = known[0], known[-1]
        slope = max(0.0, (timed[hi] - timed[lo]) / (hi - lo))
        return timed[lo] + slope * (w - lo) if w > lo else base

    def proposal_length(self, k: int) -> int:
        return max(1, round(self.evidence.expansion * k)) if k else 0

    def cycle_ms(self, k: int) -> float | None:
        verify = self.target_ms(self.proposal_length(k) + 1)
        if verify is None or k == 0:
            return verify
        return k * self.drafter_step_ms(verify) + self.cycle_overhead_ms() + verify

    def drafter_step_ms(self, fallback: float) -> float:
        """One drafter pass: own timings first, then the profile, then r × a target step (or `fallback`)."""
        if self.evidence.drafter_ms is not None:
            return self.evidence.drafter_ms
        if self.profile is not None:
            return self.profile.drafter_ms * self.evidence.scale
        return self.r * (self.target_ms(1) or fallback)

    def cycle_overhead_ms(self) -> float:
        """Translation and re-sync per drafting cycle."""
        if self.evidence.overhead_ms is not None:
            return self.evidence.overhead_ms
        return self.profile.translate_ms if self.profile is not None else 0.0

    def reading_ms(self, n: int) -> float:
        """What reading n tokens adds to the one drafter pass that reads them (the prompt, a parked stretch):
        learned from this pair's catch-ups, else the profile's measured reading curve, else the target's cost
        per extra token of a wide pass scaled by drafter step / target step.

        Example: no profile; target 10 ms for 1 token, 14 ms for 9; drafter step 5 ms -> n = 5: 4 × 0.25 = 1 ms
        """
        if n <= 1:
            return 0.0
        if self.evidence.read_ms is not None:
            return self.evidence.read_ms * (n - 1)
        if self.profile is not None:
            return self.profile.reading_ms(n) * self.evidence.scale
        step, widths = self.target_ms(1), sorted(self.evidence.verify_ms)
        if not step:
            return 0.0
        wide = widths[-1] if widths else 1
        per_token = max(0.0, (self.target_ms(wide) - step) / (wide - 1)) if wide > 1 else 0.1 * step
        return (n - 1) * per_token * self.drafter_step_ms(step) / step

    def rehearsal_wait(self) -> float:
        """Parked steps (since the policy last drafted or rehearsed) before the next rehearsal: at least the
        backed-off gap, and enough that its one drafter pass, over the backlog from before the stretch (the
        prompt, on the first) and one token per parked step, costs at most REHEARSAL_BUDGET of the stretch;
        math.inf when no stretch is long enough (a token read costs more than that share of a step).

        Example: target step 450 ms, drafter step 65 ms, 3 ms a token read, a 40-token prompt unread
        -> 65 + 3 × (40 + s − 1) <= 13.5 s from s = 18 on; a 400-token prompt -> s = 121
        """
        step = self.target_ms(1)
        if step is None or step <= 0:
            return self.rehearsal_gap
        budget, backlog = REHEARSAL_BUDGET * step, max(0, self.unread - self.parked_for)
        over = lambda s: self.drafter_step_ms(step) + self.reading_ms(backlog + s) - budget * s  # noqa: E731
        lo, hi = self.rehearsal_gap, 64 * STRETCH_MAX  # reading grows linearly past the measured widths
        if over(lo) <= 0:
            return lo
        if over(hi) > 0:
            return math.inf
        while hi - lo > 1:  # the least s where the budget covers the pass
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if over(mid) <= 0 else (mid, hi)
        return hi

    def backlog_ms(self) -> float:
        """What reading its backlog (its prompt, then each parked stretch) adds to the drafter's next pass.
        A run that drafts pays it once, so it counts against drafting only where the tokens left to write
        are too few to earn it back."""
        return self.reading_ms(self.unread)

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

    def lookup_rates(self, k_max: int, band: int | None = None) -> dict[int, float]:
        """Expected tokens per millisecond of a lookup proposal of k tokens (it costs a lookup and the wider
        pass), from a match of `band` (None: any)."""
        acceptances = self.acceptances(k_max, LOOKUP, band)
        out = {}
        for k in range(1, k_max + 1):
            verify = self.target_ms(k + 1)
            if verify:
                out[k] = self.expected_tokens(k, acceptances) / (self.evidence.lookup_ms + verify)
        return out

    # --- decisions -------------------------------------------------------------------------------------
    def best_k(self) -> int | None:
        """The k with the highest expected rate (ties to the shorter draft); None before any timing."""
        rates = self.rates()
        if 0 not in rates:
            return None
        return max(rates, key=lambda k: (rates[k], -k))

    def next_k(self) -> int:
        """The model's next draft length: 0 parks (also before any timing: a plain step is timed first)."""
        return self.best_k() or 0

    def choose(self, offer: Mapping[str, int], left: int | None = None) -> tuple[str, int]:
        """The source and draft length with the best expected rate among what `offer` holds
        (source -> the most it can propose; an `Offer` also says how far lookup's match runs back);
        ("", 0) for a plain target step. Where drafting with the model pays, it may draft up to what the offer
        holds: its drafter stops where `enough` says."""
        rates = self.rates()
        if 0 not in rates:
            return "", 0  # time one plain target step first: every decision is relative to it
        self.pace = max(rates.values())
        model_k = self.next_k() if MODEL in offer else 0  # the draft length its estimate pays for best
        self.cap = within((MODEL, offer[MODEL]), left)[1] if model_k else 0
        best = (MODEL, self.cap) if self.cap else ("", 0)
        self.declined_lookup = None
        if LOOKUP in offer:
            band = match_band(offer.match) if isinstance(offer, Offer) and offer.match else None
            lookup = self.lookup_rates(min(self.k_max, offer[LOOKUP]), band)
            k = max(lookup, key=lambda k: (lookup[k], -k), default=0)
            if k and lookup[k] > rates[model_k if self.cap else 0]:
                return within((LOOKUP, k), left)
            self.declined_lookup = -1 if band is None else band
        return within(best, left)

    def stop_rule(self, source: str) -> StopRule | None:
        return self.enough if source == MODEL else None

    def enough(self, confidences: Sequence[float]) -> int | None:
        """The model drafter's stop rule: after each draft, with its confidence in every draft so far, None to
        draft another, else how many of them to propose. Each draft's chance of being kept is read from its
        confidence (`Evidence.kept_chance`); time is worth the rate the cycle was chosen for (`pace`), so
        proposing n drafts is worth its expected tokens less pace × the target's pass over them. It drafts on
        while one more draft, with the chance a draft's confidence usually gives (then proposing the best of
        what it has), or several more at their mean chance, are worth more than their drafter passes cost.

        Example: drafts of confidence 0.95 then 0.05 -> propose 1 (the second would cost its verification and
        is hardly ever kept); a first draft of confidence 0.05 -> 0 (a plain step: what it read is not lost)
        """
        survive, kept = 1.0, []
        for q in confidences:
            survive *= self.evidence.kept_chance(q)
            kept.append(survive)
        j = len(kept)

        # n drafts kept are expansion × n target tokens (Polish in an English drafter's tokens: fewer)
        def worth(n: int, drafts: float) -> float:
            return 1 + self.evidence.expansion * drafts - self.pace * self.target_ms(self.proposal_length(n) + 1)

        now = [worth(n, sum(kept[:n])) for n in range(j + 1)]
        best = max(range(j + 1), key=lambda n: (now[n], -n))
        if j >= self.cap:
            return best
        step = self.pace * self.drafter_step_ms(self.target_ms(1) or 0.0)
        nxt = self.evidence.next_chances() or [(1.0, self.acceptance(0))]
        total, sure = sum(w for w, _ in nxt), sum(kept)
        last = kept[-1] if kept else 1.0
        one = sum(w * max(now[best], worth(j + 1, sure + last * c)) for w, c in nxt) / total - step
        mean = sum(w * c for w, c in nxt) / total
        deeper = max(
            worth(j + m, sure + last * sum(mean**i for i in range(1, m + 1))) - m * step
            for m in range(1, self.cap - j + 1)
        )
        return None if max(one, deeper) > now[best] else best

    def plain_steps(self) -> int:
        """Plain target steps to take in a row after choosing none: up to the next rehearsal (at most
        STRETCH_MAX: the decision is revisited as the run's own timings come in)."""
        if self.best_k() is None:
            return 1
        return max(1, min(STRETCH_MAX, self.rehearsal_wait() - self.parked_for))

    def begin(self, unread: int, budget: int | None = None) -> None:
        """A run starts: the drafter has `unread` prompt tokens to read before its first draft, and the run
        has `budget` tokens to write (None: unknown). Earlier runs' evidence becomes this run's prior."""
        self.evidence.carry()
        self.unread, self.remaining, self.parked_for = unread, budget, 0
        self.rehearsal_gap, self.declined_lookup = self.rehearse_every, None

    def wants_rehearsal(self) -> bool:
        return self.parked_for > 0 and self.parked_for >= self.rehearsal_wait()

    def rehearsed(self, rehearsal: Rehearsal) -> None:
        """Learn from a rehearsal: what reading cost, and how the drafts the stretch could have had fared."""
        evidence = self.evidence
        step = self.drafter_step_ms(self.target_ms(1) or 0.0)
        if self.learn_costs and rehearsal.read > 1:  # one pass: a step, and what each token read added
            evidence.read_ms = _ema(evidence.read_ms, max(0.0, rehearsal.ms - step) / (rehearsal.read - 1))
        self.unread = self.parked_for = 0
        evidence.saw_guesses(rehearsal.confidence)
        if rehearsal.hits:
            expansion = rehearsal.target_tokens / len(rehearsal.hits) if rehearsal.target_tokens else evidence.expansion
            for tried, kept in replay_drafts(rehearsal.hits, self.k_max, expansion):
                evidence.model.add(tried, kept)
        # Still parked: rehearse half as often (over a long run, its cost fades); drafting again: as at first.
        self.rehearsal_gap = min(2 * self.rehearsal_gap, STRETCH_MAX) if not self.next_k() else self.rehearse_every

    def observe(self, cycle: Cycle) -> None:
        """Learn from a finished cycle: which positions were accepted, and what each phase cost."""
        evidence = self.evidence
        if self.remaining is not None:
            self.remaining = max(0, self.remaining - cycle.emitted)
        if self.declined_lookup is not None:  # passed over: a source that failed once is tried again later
            evidence.lookup.age()
            if self.declined_lookup >= 0:
                evidence.lookup_bands[self.declined_lookup].age()
            self.declined_lookup = None
        self._time_verify(cycle)
        if cycle.k == 0 or cycle.source == LOOKUP:  # the model drafter reads these tokens later, as if parked
            self.parked_for += cycle.emitted
            self.unread += cycle.emitted
            if cycle.k:
                if self.learn_costs:
                    evidence.lookup_ms = _ema(evidence.lookup_ms, cycle.draft_ms + cycle.translate_ms)
                evidence.lookup.add(len(cycle.proposed_ids), cycle.accepted)
                if cycle.match:
                    evidence.lookup_bands[match_band(cycle.match)].add(len(cycle.proposed_ids), cycle.accepted)
            return
        self.unread, self.parked_for, self.rehearsal_gap = 0, 0, self.rehearse_every
        passes = cycle.drafter_passes if self.learn_costs else 0
        if passes and cycle.drafter_read <= 2 * passes + 1:
            evidence.drafter_ms = _ema(evidence.drafter_ms, cycle.draft_ms / passes)
        elif passes:  # it first caught up on the prompt or a parked stretch: what reading a token costs
            caught_up = cycle.draft_ms - passes * self.drafter_step_ms(cycle.draft_ms / passes)
            evidence.read_ms = _ema(evidence.read_ms, max(0.0, caught_up) / (cycle.drafter_read - passes))
        if self.learn_costs:
            evidence.overhead_ms = _ema(evidence.overhead_ms, cycle.translate_ms + cycle.resync_ms)
        if cycle.draft_ids:
            evidence.expansion = _ema(evidence.expansion, max(len(cycle.proposed_ids), 1) / len(cycle.draft_ids))
        if cycle.confidence:  # drafts the target kept, in drafter tokens (the proposal's share of them)
            n, proposed = len(cycle.draft_ids), len(cycle.proposed_ids)
            kept = n if proposed and cycle.accepted >= proposed else cycle.accepted * n // max(1, proposed)
            evidence.saw_drafts(cycle.confidence, kept, n)
        # A draft that translated into no target token kept nothing: a miss at the first position, or auto would
        # keep paying for drafts that the translation strips (the likely cause of a Polish chat reply through
        # uag serve that drafted 61 model cycles at α 0.13; docs/server.md).
        evidence.model.add(max(1, len(cycle.proposed_ids)), cycle.accepted)

    def _time_verify(self, cycle: Cycle) -> None:
        """The run's own target timings, and how they compare with the profile's (`Evidence.scale`)."""
        evidence, w = self.evidence, len(cycle.proposed_ids) + 1
        if self.learn_costs or not (self.profile and w in self.profile.target_ms):
            evidence.verify_ms[w] = _ema(evidence.verify_ms.get(w), cycle.verify_ms)
        if self.learn_costs and self.profile is not None:
            evidence.scale = statistics.median(ms / self.profile.target_at(v) for v, ms in evidence.verify_ms.items())


def _ema(old: float | None, new: float) -> float:
    if old is None or not math.isfinite(old):
        return new
    return (1 - EMA) * old + EMA * new
