"""How many tokens to draft next: a `Policy`. `FixedK` always drafts k (the study's setting); `AdaptiveK`
(k_policy "adaptive", as strategy "auto") drafts, each cycle, the source and k with the best expected tokens per ms:

    k* = argmax over k in 0..k_max of  E(k) / cost(k),     E(k) = 1 + Σ_{j ≤ n(k)} Π_{i ≤ j} p_i

from its `Evidence` (the chances p_i), its `Prices` (uag.core.evidence) and its `AutoSettings`; k = 0 parks (plain
target steps, now and then a rehearsal). Why each part is there, and what it earns: docs/how-it-works.md, `auto`.
No mlx. Example: make_policy(GenerationConfig(k_policy="adaptive", k=8), profile).choose({"model": 8})
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from uag.core.config import GRAMMAR, LOOKUP
from uag.core.costmodel import CostProfile
from uag.core.evidence import MODEL, Evidence, Prices, ema, expected_tokens
from uag.core.lookup import BAND_FLOORS, COPY_GROWTH, branch_room, match_band
from uag.core.records import Cycle, Offer, Passed, Rehearsal, Sharing

if TYPE_CHECKING:
    from uag.core.config import GenerationConfig


@dataclass(frozen=True)
class AutoSettings:
    """What `AdaptiveK` is tuned by, apart from what a run learns: its constants, and one switch per mechanism
    (each can be switched off on its own: benchmarks/policy_replay.py --ablate; docs/how-it-works.md)."""

    prior: float = 0.5  # acceptance assumed for a draft where no run of the pair has been seen
    rehearse_every: int = 16  # parked steps between rehearsals, at the least
    stretch_max: int = 128  # the most plain steps in a row before deciding again
    rehearsal_budget: float = 0.03  # the most a rehearsal may cost, as a share of the parked stretch it ends
    carry: float = 3.0  # the most observations a run inherits from earlier runs (its own soon outweigh them)
    learn_costs: bool = True  # False: keep the profile's costs, never the run's own timings (tests pin them)
    confidence_bands: bool = True  # a draft's chance from its confidence band's verdicts (off: the confidence)
    stop_rule: bool = True  # the drafter stops where one more draft is not worth it (off: it drafts the k chosen)
    rehearsals: bool = True  # parked, the drafter now and then catches up and shows whether drafting would pay
    band_floors: bool = True  # a long lookup match is trusted at least its band's floor (lookup.BAND_FLOORS)
    slow_start: bool = True  # a lookup proposal past k reaches at most COPY_GROWTH times its match (off: as far
    #   as the verify curve pays, LOOKUP_REACH)
    carried: bool = True  # a run opens from what earlier runs of the pair taught (off: from the prior)
    first_look: bool = True  # a run parked before its drafter saw any of its text rehearses early where what it
    #   would learn is worth the reading (off: only as `rehearsal_budget` allows)


# The names --ablate takes (benchmarks/policy_replay.py, auto_vs_fixed.py): the switches of `AutoSettings`.
MECHANISMS = ("confidence_bands", "stop_rule", "rehearsals", "band_floors", "slow_start", "carried", "first_look")

# Points at which `AdaptiveK.first_look_ms` prices the model's unknown chance (midpoints of equal steps of it)
LOOK_POINTS = 20

# Asked by a model drafter after each draft, with its confidence in every draft so far: None to draft on, or how
# many of them to propose (`AdaptiveK.enough`). Without one, a drafter drafts the k asked, pipelined.
StopRule = Callable[[Sequence[float]], "int | None"]


class Policy(Protocol):
    """What the engine (uag.core.engine.speculative_steps) and the sharded target's `RankPolicy` ask of a
    draft-length policy. `k_policy` is what the run's record says, as GenerationConfig names it: "fixed" or
    "adaptive"."""

    k_policy: str

    def begin(self, unread: int, budget: int | None = None) -> None:
        """A run starts: the drafter has `unread` prompt tokens to read first; `budget` tokens to write."""

    def choose(self, offer: Mapping[str, int], left: int | None = None) -> tuple[str, int]:
        """The source and k of the next cycle among what `offer` holds (source -> the most it can propose),
        ("", 0) for plain target steps; never more than `left` − 1 drafts (`within`)."""

    def stop_rule(self, source: str, k: int) -> StopRule | None:
        """How the drafter of the cycle `choose` picked (`source`, at most `k` drafts) should decide its draft's
        length as it drafts (None: the k chosen)."""

    def plain_steps(self) -> int:
        """Plain target steps to take in a row after `choose` returned ("", 0)."""

    def observe(self, cycle: Cycle) -> None:
        """Learn from a finished cycle or plain step."""

    def wants_rehearsal(self) -> bool:
        """Parked long enough that the drafter should catch up and show whether drafting would pay."""

    def reconsider(self) -> bool:
        """End the parked stretch now: what it was decided under changed (the batch it runs in)."""

    def heeds(self, offer: Mapping[str, int]) -> bool:
        """Whether the lookup match `offer` holds ends a parked stretch, to decide again."""

    def passed_over(self) -> Passed | None:
        """The lookup proposal the last `choose` passed over, where it parked or drafted otherwise; else None."""

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
    config: GenerationConfig,
    profile: CostProfile | None = None,
    r: float = 0.1,
    evidence: Evidence | None = None,
    settings: AutoSettings | None = None,
    sharing: Sharing | None = None,
) -> Policy:
    """Fixed k, or for k_policy "adaptive" (with any translation) the adaptive policy with k ≤ config.k, seeded
    by `profile` (the pair's measured costs on this machine, uag.costs.profiles) and `evidence` (what earlier runs
    of the pair taught, updated in place by this one) when there are, tuned by `settings` (None: the defaults);
    `sharing`: how a server batches the run's target passes with other requests' (None: run alone)."""
    if config.k_policy != "adaptive":
        return FixedK(config.k)
    return AdaptiveK(
        k_max=config.k,
        profile=profile,
        r=r,
        evidence=evidence,
        settings=settings or AutoSettings(),
        sharing=sharing,
    )


@dataclass
class FixedK:
    """Always the same draft length (the study's setting). It has no evidence: it never parks."""

    k: int
    k_policy: ClassVar[str] = "fixed"

    def choose(self, offer: Mapping[str, int], left: int | None = None) -> tuple[str, int]:
        """Lookup where it has a match (it costs nothing), else the model; a plain step when neither drafts."""
        source = LOOKUP if LOOKUP in offer else MODEL if MODEL in offer else ""
        return within((source, min(self.k, offer[source])) if source else ("", 0), left)

    def plain_steps(self) -> int:
        return 1

    def stop_rule(self, source: str, k: int) -> StopRule | None:
        return None

    def begin(self, unread: int, budget: int | None = None) -> None:
        pass

    def observe(self, cycle: Cycle) -> None:
        pass

    def wants_rehearsal(self) -> bool:
        return False

    def reconsider(self) -> bool:
        return False

    def heeds(self, offer: Mapping[str, int]) -> bool:
        return True

    def passed_over(self) -> Passed | None:
        return None  # lookup is taken wherever it matches

    def rehearsed(self, rehearsal: Rehearsal) -> None:
        pass


@dataclass
class AdaptiveK:
    """The draft length with the best expected tokens per millisecond, re-decided every cycle."""

    k_policy: ClassVar[str] = "adaptive"
    k_max: int  # the most a cycle drafts: config.k (make_policy)
    profile: CostProfile | None = None  # measured costs (uag.costs.calibrate); None: learn them from the run
    r: float = 0.1  # drafter/target cost ratio to assume before any drafter step was timed
    evidence: Evidence | None = None  # what it starts from and learns into (uag.core.evidence); None: nothing yet
    settings: AutoSettings = field(default_factory=AutoSettings)
    sharing: Sharing | None = None  # a server's batch: the run's target passes shared with others' (priced so)
    prices: Prices = field(init=False)  # what each phase of a cycle costs (uag.core.evidence)
    # --- this run's state: `begin` sets it, `observe` and `rehearsed` update it
    unread: int = field(default=0, init=False)  # committed tokens the drafter has not read (prompt, parked steps)
    parked_for: int = field(default=0, init=False)  # plain steps since the policy last drafted or rehearsed
    rehearsal_gap: int = field(default=0, init=False)  # least parked steps before the next rehearsal (backed off)
    parked_beside: int = field(default=0, init=False)  # batched: the other members when the stretch began
    remaining: int | None = field(default=None, init=False)  # tokens the run has yet to write (None: unknown)
    declined_lookup: int | None = field(default=None, init=False)  # the decision in flight passed a lookup match
    #   over (the band of its match; -1 unknown): `observe` ages lookup's evidence for it
    rehearses: bool = field(default=True, init=False)  # the last decision was offered a model drafter: only a
    #   model catches up on a parked stretch (lookup's index reads every token as it comes)
    passed: int | None = field(default=None, init=False)  # the band of the lookup match the last decision passed
    #   over (-1: unknown), which the stretch it opened goes on past (`heeds`)
    last_passed: Passed | None = field(default=None, init=False)  # the lookup proposal the last `choose` passed over
    decided: dict[int, float] | None = field(default=None, init=False)  # the rates the last `choose` decided by,
    #   until a parked stretch starts from them (`plain_steps`)
    opening: bool = field(default=False, init=False)  # the prompt pass is next: a model drafter with a backlog
    #   does not draft in it, so that its reading of the prompt never delays the first token (it reads the prompt
    #   at its first draft, or in a rehearsal)
    looked: bool = field(default=False, init=False)  # the model drafter has drafted or rehearsed on this run's text
    look_at: float | None = field(default=None, init=False)  # parked steps before a first look (`first_look`), once
    #   decided; math.inf: none

    def __post_init__(self):
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1 (got {self.k_max})")
        self.evidence = Evidence() if self.evidence is None else self.evidence
        self.prices = Prices(self.profile, self.evidence, self.r, self.settings.learn_costs, self.sharing)
        self.rehearsal_gap = self.settings.rehearse_every
        if self.sharing is not None and self.profile is not None:  # the batch's passes, cut as this machine runs them
            self.sharing.prior_rows = self.profile.fixed_tokens()

    # --- what a proposal earns and costs -----------------------------------------------------------------
    def acceptances(self, n: int, source: str = MODEL, match: int | None = None) -> list[float]:
        """Estimated P(position i accepted | positions before it accepted) for i = 0..n−1. The model's: the
        chance its drafter's confidence gives a draft not yet made (`Evidence.mean_chance`), per target token;
        the prior before it has drafted. Lookup's: its counts per position; for a match of known length, the
        chance of the copy's length at each position (`Evidence.copy_chances`: the 2-3-token band leaning on
        lookup's first position, each longer band on the shorter one's or its floor, `lookup.BAND_FLOORS`)."""
        if source == MODEL:
            mean = self.evidence.mean_chance(self.settings.confidence_bands)
            return [self.settings.prior if mean is None else mean ** (1 / self.evidence.expansion)] * n
        chances = self.evidence.lookup.chances(n, self.settings.prior)
        if match is not None and n:
            floors = BAND_FLOORS if self.settings.band_floors else None
            return self.evidence.copy_chances(match, n, chances[0], floors)
        return chances

    def acceptance(self, i: int, source: str = MODEL) -> float:
        return self.acceptances(i + 1, source)[i]

    def backlog_ms(self) -> float:
        """What reading its backlog (its prompt, then each parked stretch) adds to the drafter's next pass.
        A run that drafts pays it once, so it counts against drafting only where the tokens left to write
        are too few to earn it back."""
        return self.prices.reading_ms(self.unread)

    def rates(self, chance: float | None = None) -> dict[int, float]:
        """Expected tokens per millisecond for each k (empty until a cost is known). Batched with other requests,
        the whole batch's: this request's tokens and the others' over its cycle's time (`Prices.cycle_ms`). The
        batch holds the target's passes while a member drafts with a model, so the others commit only in the
        pass that verifies the draft: a draft pays only where it earns more than the batch loses waiting on its
        drafter steps and its wider pass; alone, the run's own. Where the drafter has a backlog to read first,
        drafting's rate includes it, spread over the tokens left to write. Batched, a draft's rate is cut by what
        drafting cycles have realised of their prices in the batch, against plain steps (`Prices.realised`).
        `chance`: price the model's drafts as though each were kept with that chance and the backlog were read
        (what a rehearsal might show: `first_look_ms`); None, as the evidence has it.

        Example: a pass over n tokens costs 28 + n ms, drafter steps 2 ms, α 0.4 -> alone: k = 1 1.4 / 32 >
                 k = 0 1 / 29 (it drafts); beside three parked members: k = 1 (1.4 + 3) / (2 + 36) = 0.116 <
                 k = 0 (1 + 3) / 32 = 0.125 (it parks: all four wait on its drafter step and its wider pass)
        """
        prices = self.prices
        n = prices.proposal_length(self.k_max)
        if chance is None:
            acceptances, backlog = self.acceptances(n), self.backlog_ms() if self.remaining else 0.0
        else:
            acceptances, backlog = [chance ** (1 / self.evidence.expansion)] * n, 0.0
        others = prices.others_tokens()
        plain_alike = prices.common_ms(1) if prices.batched else None
        realised = prices.realised(MODEL)  # batched: what drafting realises of its price, against a plain step
        out = {}
        for k in range(self.k_max + 1):
            ms = prices.cycle_ms(k)
            if ms:
                own = expected_tokens(acceptances[: prices.proposal_length(k)])
                spread = backlog * own / self.remaining if k and backlog else 0.0  # the backlog's share per cycle
                out[k] = (own + others) / (ms + spread)
                if k and 0 in out and prices.batched:
                    drafting = k * prices.drafter_step_ms(ms) + prices.cycle_overhead_ms()
                    out[k] = self.alike(out[k], out[0], own, prices.proposal_length(k) + 1, drafting, plain_alike)
                if k:
                    out[k] *= realised
        return out

    def alike(
        self, rate: float, plain: float, own: float, w: int, drafting_ms: float = 0.0, plain_alike: float | None = None
    ) -> float:
        """A batched draft's rate, at most what it would gain over a plain step were every member to propose
        alike (`Prices.common_ms`): priced only against the others' proposals, a draft that rides in their
        padding looks free to each member of a batch that drafts, and none of them would park first.

        Example: a pass over n tokens costs 3 + n, α 0.5, four members each drafting 2: beside the others, one
        more draft of 2 pays (7 / 15 > 6.25 / 15); alike, 1.75 / 15 < 1 / 7: the four park (4 tokens in 7 ms
        against 7 in 15). `plain_alike`: `Prices.common_ms(1)` where the caller has it (it prices many k at once).
        """
        plain_alike = self.prices.common_ms(1) if plain_alike is None else plain_alike
        ms = self.prices.common_ms(w, drafting_ms)
        return rate if not (plain_alike and ms) else min(rate, plain * own * plain_alike / ms)

    def lookup_rates(self, k_max: int, match: int | None = None, branched: bool = False) -> dict[int, float]:
        """Expected tokens per millisecond of a lookup proposal of k tokens (it costs a lookup and the wider
        pass), from a match of `match` tokens (None: unknown). A `branched` proposal's pass also reads its other
        continuations (lookup.branch_room(k) rows), which it pays for by its own tokens: what a branch might
        add is not counted, so they ride along only where the proposal pays for their rows."""
        acceptances = self.acceptances(k_max, LOOKUP, match)
        others = self.prices.others_tokens()  # batched: the others' tokens in the round it widens (`rates`)
        plain = (1 + others) / (self.prices.verify_ms(1) or math.inf) if self.prices.batched else 0.0
        plain_alike = self.prices.common_ms(1) if plain else None
        realised = self.prices.realised(LOOKUP)
        out, expected, survive = {}, 1.0, 1.0  # expected_tokens(acceptances[:k]), grown one position at a time
        for k in range(1, k_max + 1):
            survive *= acceptances[k - 1]
            expected += survive
            w = k + 1 + (branch_room(k) if branched else 0)
            verify = self.prices.verify_ms(w)
            if verify:
                out[k] = (expected + others) / (self.evidence.lookup_ms + verify)
                if plain:
                    out[k] = self.alike(out[k], plain, expected, w, self.evidence.lookup_ms, plain_alike)
                out[k] *= realised
        return out

    def copy_reach(self, offered: int, match: int | None) -> int:
        """How far a lookup proposal may reach: past k_max (lookup.LOOKUP_REACH) only as far as COPY_GROWTH times
        the tokens its match runs back, so that a copy's proposals grow as the copy goes on (a slow start: a match
        of 4 proposes at most k_max, one of 20 up to 40, then 64) and a short match's guess never pays for a pass
        as wide as a copy's. Where a band's evidence comes from copies of whole files, a 4-token match that
        holds for 10 tokens in an edit's new lines looks like one of them (docs/how-it-works.md, auto).

        Example: k_max 16: copy_reach(64, 4) -> 16;  copy_reach(64, 20) -> 40;  copy_reach(64, None) -> 16
        """
        if not self.settings.slow_start:
            return offered
        return min(offered, max(self.k_max, COPY_GROWTH * (match or 0)))

    # --- the decision ------------------------------------------------------------------------------------
    def best_k(self, rates: dict[int, float] | None = None) -> int | None:
        """The k with the highest expected rate (ties to the shorter draft); None before any timing. `rates`: the
        ones just computed (`rates()` prices every k against the batch: a member decides often)."""
        rates = self.rates() if rates is None else rates
        if 0 not in rates:
            return None
        return max(rates, key=lambda k: (rates[k], -k))

    def next_k(self, rates: dict[int, float] | None = None) -> int:
        """The model's next draft length: 0 parks (also before any timing: a plain step is timed first)."""
        return self.best_k(rates) or 0

    def choose(self, offer: Mapping[str, int], left: int | None = None) -> tuple[str, int]:
        """The source and draft length with the best expected rate among what `offer` holds
        (source -> the most it can propose; an `Offer` also says how far lookup's match runs back);
        ("", 0) for a plain target step. Where drafting with the model pays, with the stop rule it may draft
        up to what the offer holds: its drafter stops where `enough` says."""
        self.passed, self.last_passed, self.rehearses = None, None, MODEL in offer
        rates = self.decided = self.rates()
        if 0 not in rates:
            return "", 0  # time one plain target step first: every decision is relative to it
        deferred = self.opening and self.unread > 0  # the prompt pass: the drafter's reading would delay it
        model_k = self.next_k(rates) if MODEL in offer and not deferred else 0  # the draft length it pays best for
        reach = (offer[MODEL] if self.settings.stop_rule else model_k) if model_k else 0
        cap = within((MODEL, reach), left)[1]
        self.declined_lookup = None
        if LOOKUP in offer:
            match = offer.match if isinstance(offer, Offer) and offer.match else None
            branched = isinstance(offer, Offer) and offer.branched
            lookup = self.lookup_rates(self.copy_reach(offer[LOOKUP], match), match, branched)
            k = max(lookup, key=lambda k: (lookup[k], -k), default=0)
            chosen = rates[model_k if cap else 0]
            if k and lookup[k] > chosen:
                decision = within((LOOKUP, k), left)
                self._proposing(decision[1] + 1, expected_tokens(self.acceptances(decision[1], LOOKUP, match)))
                return decision
            self.declined_lookup = self.passed = -1 if match is None else match_band(match)
            if k:
                self.last_passed = self._passed(lookup[k], chosen, k, match, branched)
        if not cap:
            self._proposing(1, 1.0)
            return "", 0
        n = self.prices.proposal_length(min(model_k, cap))  # the stop rule's drafts: about what k pays for
        self._proposing(n + 1, expected_tokens(self.acceptances(n)) / (min(model_k, cap) + 1))
        return MODEL, cap

    def _passed(self, rate: float, chosen: float, k: int, match: int | None, branched: bool) -> Passed:
        """The lookup proposal of k tokens `choose` passed over (its `rate` below the `chosen` one), as it priced it."""
        prices, expected = self.prices, expected_tokens(self.acceptances(k, LOOKUP, match))
        cycle_ms = self.evidence.lookup_ms + (prices.verify_ms(k + 1 + (branch_room(k) if branched else 0)) or 0.0)
        others = prices.others_tokens()
        uncapped = prices.realised(LOOKUP) * (expected + others) / cycle_ms if cycle_ms > 0 else math.inf
        gain = rate / chosen if chosen > 0 else math.inf
        plain_ms = prices.verify_ms(1) or 0.0
        capped = rate < uncapped * (1 - 1e-9)
        return Passed(match or 0, k, expected, gain, prices.size, cycle_ms, plain_ms, others, capped)

    def _proposing(self, width: int, tokens: float) -> None:
        """Batched: tell the batch what this request's next target pass reads, and its tokens per round."""
        if self.sharing is not None:
            self.sharing.proposing(width, tokens)

    def stop_rule(self, source: str, k: int) -> StopRule | None:
        """For the model's cycle of at most k drafts, `enough` at the rate this decision expects; without the
        stop rule, a rule that never stops (the k chosen, its drafts' confidence still heard)."""
        if source != MODEL:
            return None
        if not self.settings.stop_rule:
            return lambda confidences: None
        rates = self.decided if self.decided is not None else self.rates()  # the `choose` just made, as it saw them
        pace = max(rates.values(), default=0.0)
        return lambda confidences: self.enough(confidences, pace, k)

    def enough(self, confidences: Sequence[float], pace: float, cap: int) -> int | None:
        """The model drafter's stop rule: after each draft, with its confidence in every draft so far, None to
        draft another, else how many of them to propose (never more than `cap`). Each draft's chance of being
        kept is read from its confidence (`Evidence.kept_chance`); time is worth `pace` (tokens per ms, the rate
        the cycle was chosen for), so proposing n drafts is worth its expected tokens less pace × the target's
        pass over them. It drafts on while one more draft (at the chance drafts have had, then proposing the
        best of what it has), or several more at their mean chance, are worth more than their drafter passes.

        Example: drafts of confidence 0.95 then 0.05 -> propose 1 (the second would cost its verification and
        is hardly ever kept); a first draft of confidence 0.05 -> 0 (a plain step: what it read is not lost)
        """
        evidence, prices, bands = self.evidence, self.prices, self.settings.confidence_bands
        survive, kept = 1.0, []
        for q in confidences:
            survive *= evidence.kept_chance(q, bands)
            kept.append(survive)
        j = len(kept)

        # n drafts kept are expansion × n target tokens (Polish in an English drafter's tokens: fewer)
        def worth(n: int, drafts: float) -> float:
            return 1 + evidence.expansion * drafts - pace * prices.verify_ms(prices.proposal_length(n) + 1)

        now = [worth(n, sum(kept[:n])) for n in range(j + 1)]
        best = max(range(j + 1), key=lambda n: (now[n], -n))
        if j >= cap:
            return best
        # one more drafter pass: batched, a round in which the whole batch waits (`pace` is the batch's)
        step = pace * prices.drafter_step_ms(prices.target_ms(1) or 0.0)
        nxt = evidence.next_chances(bands) or [(1.0, self.acceptance(0))]
        total, sure = sum(w for w, _ in nxt), sum(kept)
        last = kept[-1] if kept else 1.0
        one = sum(w * max(now[best], worth(j + 1, sure + last * c)) for w, c in nxt) / total - step
        mean = sum(w * c for w, c in nxt) / total
        deeper = max(
            worth(j + m, sure + last * sum(mean**i for i in range(1, m + 1))) - m * step for m in range(1, cap - j + 1)
        )
        return None if max(one, deeper) > now[best] else best

    # --- parked: plain steps, and now and then a rehearsal -------------------------------------------------
    def rehearsal_wait(self) -> float:
        """Parked steps (since the policy last drafted or rehearsed) before the next rehearsal: at least the
        backed-off gap, and enough that its one drafter pass, over the backlog from before the stretch (the
        prompt, on the first) and one token per parked step, costs at most the settings' rehearsal budget of
        the stretch; math.inf when no stretch is long enough (a token read costs more than that share of a step).
        Batched, the rehearsal waits a round of the others' passes, and each of their rounds waits on its drafter
        pass: the budget is the batch's, shared by its members. Sooner where a first look pays (`first_look`).

        Example: target step 450 ms, drafter step 65 ms, 3 ms a token read, a 40-token prompt unread
        -> 65 + 3 × (40 + s − 1) <= 13.5 s from s = 18 on; a 400-token prompt -> s = 121
        """
        budgeted = self._budgeted_wait()
        return budgeted if self.looked or self.look_at is None else min(budgeted, self.look_at)

    def _budgeted_wait(self) -> float:
        prices, settings = self.prices, self.settings
        step, waits = prices.verify_ms(1), prices.round_ms()  # batched: a round, and the one its rehearsal waits
        if not settings.rehearsals:
            return math.inf
        if step is None or step <= 0:
            return self.rehearsal_gap
        budget = settings.rehearsal_budget * step / prices.size  # batched, every member's round waits on its
        #   drafter pass: the budget is shared
        over = lambda s: self.rehearsal_ms(s, step, waits) - budget * s  # noqa: E731
        lo, hi = self.rehearsal_gap, 64 * settings.stretch_max  # reading grows linearly past the measured widths
        if over(lo) <= 0:
            return lo
        if over(hi) > 0:
            return math.inf
        while hi - lo > 1:  # the least s where the budget covers the pass
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if over(mid) <= 0 else (mid, hi)
        return hi

    def rehearsal_ms(self, s: int, step: float, waits: float) -> float:
        """What a rehearsal after `s` parked steps costs: one drafter pass over the backlog from before the stretch (the
        prompt, on the first) and the stretch, and the round of the others' passes it waits (`waits`, 0 alone); `step`,
        a target step (the drafter's when it has no timing of its own: `Prices.drafter_step_ms`)."""
        prices = self.prices
        return prices.drafter_step_ms(step) + waits + prices.reading_ms(max(0, self.unread - self.parked_for) + s)

    def first_look(self) -> float:
        """Parked steps before a first rehearsal, for a run whose model drafter has seen none of its text (no draft,
        no rehearsal): the rehearsal gap, where what that rehearsal may show is worth its reading (`first_look_ms`
        against a drafter pass over the backlog and the stretch, and the round it waits), else math.inf (the
        rehearsal budget alone paces it, `rehearsal_wait`). A run opens from other texts' evidence, which a look at
        its own may overturn: a short reply parked on it never reached the budget's first rehearsal and never drafted
        where the model would have paid (docs/results.md, dl). Decided once a run (`plain_steps`).

        Example: the 0.5B coder pair on a CPU (a step 378 ms, a drafter step 142 ms, ~10 ms a token read), evidence
        of chance 0.55 carried, a 90-token prompt unread, 64 tokens to write -> after 16 steps a look costs 1.06 s
        and may save 1.38 s: 16;  carried chance 0.3: 0.30 s, math.inf;  0.3 with 400 tokens to write: 2.37 s, 16
        """
        prices, settings = self.prices, self.settings
        if not (settings.first_look and settings.rehearsals) or self.looked:
            return math.inf
        s = max(self.rehearsal_gap, self.parked_for + 1)
        horizon = self.remaining if self.remaining is not None else settings.stretch_max
        left, step = horizon - (s - self.parked_for), prices.verify_ms(1)
        if left <= 1 or not step:
            return math.inf
        return s if self.first_look_ms(left) > self.rehearsal_ms(s, step, prices.round_ms()) else math.inf

    def first_look_ms(self, left: int) -> float:
        """What a look at the run's own text is expected to save over the `left` tokens it then has to write. The
        model's chance of a kept draft here is unknown until its drafter reads this text; the evidence the run opened
        with weighs what its drafter's drafts and guesses showed, at most `carry` observations (`Evidence.carry`), so
        the chance is taken as Beta-distributed about the evidence's mean with that weight. Wherever a chance would
        make drafting beat a plain step (`rates(chance)`), the look saves the difference over `left` tokens (batched,
        with the others' tokens made beside them); elsewhere nothing. Before the pair's drafter has drafted or
        rehearsed at all, the chance is taken about the settings' prior with the weight of one observation: a drafter
        that the prior parks (one that costs 0.38 of a target step) would otherwise never be tried.

        Example: the pair of `first_look`'s: a plain step makes a token in 378 ms, drafting at chance 0.7 in 343 ms,
        at 0.9 in 276 ms; a mean of 0.3 over 3 observations -> 296 ms over 48 tokens, 0.55 -> 1,383 ms
        """
        evidence, settings = self.evidence, self.settings
        mean = evidence.mean_chance(settings.confidence_bands)
        mean = settings.prior if mean is None else mean
        weight = max(1.0, min(sum(evidence.drafted), settings.carry))  # what it has seen, at most what a run carries
        a, b = max(mean, 1e-3) * weight, max(1 - mean, 1e-3) * weight
        saved = total = 0.0
        for i in range(LOOK_POINTS):  # each step's share of the weight: exact for x^(a-1), then for (1-x)^(b-1)
            lo, hi = i / LOOK_POINTS, (i + 1) / LOOK_POINTS
            mass = (hi**a - lo**a) / a * ((1 - lo) ** b - (1 - hi) ** b) / b / (hi - lo)
            rates = self.rates((lo + hi) / 2)  # a plain step's rate, at 0, is the same at every chance
            plain = rates.get(0)
            if not plain:
                return 0.0
            drafting = max((rate for k, rate in rates.items() if k), default=0.0)
            saved += mass * (1 / plain - 1 / drafting) if drafting > plain else 0.0
            total += mass
        return left * (1 + self.prices.others_tokens()) * saved / total

    def plain_steps(self) -> int:
        """Plain target steps to take in a row after choosing none: up to the next rehearsal (at most the
        settings' stretch_max: the decision is revisited as the run's own timings come in)."""
        opening, self.opening = self.opening and self.unread > 0, False
        self.parked_beside = len(self.sharing.others) if self.sharing is not None else 0
        decided, self.decided = self.decided, None
        if self.best_k(decided) is None or opening:  # after a deferred opening the model may draft from the next token
            return 1
        if not self.rehearses:
            return self.settings.stretch_max
        if self.look_at is None:
            self.look_at = self.first_look()
        return max(1, min(self.settings.stretch_max, self.rehearsal_wait() - self.parked_for))

    def wants_rehearsal(self) -> bool:
        return self.rehearses and self.parked_for > 0 and self.parked_for >= self.rehearsal_wait()

    def reconsider(self) -> bool:
        """Batched: a member joined or left since the stretch began, so it ends and the policy decides again (a
        request parked under load drafts again once the batch shrinks)."""
        return self.sharing is not None and len(self.sharing.others) != self.parked_beside

    def heeds(self, offer: Mapping[str, int]) -> bool:
        """A lookup match ends a parked stretch, unless the decision that opened it passed over a match in the same band
        or a longer one: a copy's match grows a token a step, and deciding again at every step costs a member a decision
        a token (a batch of 8 deciding so ran slower than speculation off: docs/results.md, bn). A match of a longer
        band, the batch changing (`reconsider`), a rehearsal or the stretch's end decide again.

        Example: passed over a 5-token match (band 1) -> heeds a 6-token match: False; a 9-token one (band 2): True
        """
        match = offer.match if isinstance(offer, Offer) and offer.match else None
        return self.passed is None or (-1 if match is None else match_band(match)) > self.passed

    def passed_over(self) -> Passed | None:
        return self.last_passed

    # --- learning ------------------------------------------------------------------------------------------
    def begin(self, unread: int, budget: int | None = None) -> None:
        """A run starts: the drafter has `unread` prompt tokens to read before its first draft, and the run
        has `budget` tokens to write (None: unknown). Earlier runs' evidence becomes this run's prior."""
        if self.settings.carried:
            self.evidence.carry(self.settings.carry)
        else:
            self.evidence.forget()
        self.unread, self.remaining, self.parked_for = unread, budget, 0
        self.rehearsal_gap, self.declined_lookup, self.opening = self.settings.rehearse_every, None, True
        self.passed, self.looked, self.look_at = None, False, None

    def rehearsed(self, rehearsal: Rehearsal) -> None:
        """Learn from a rehearsal: what reading cost, and how sure the drafter was of its guesses."""
        self.prices.time_rehearsal(rehearsal, self.prices.alone_since_last())
        self.unread = self.parked_for = 0
        self.looked = True
        self.evidence.saw_guesses(rehearsal.confidence)
        # Still parked: rehearse half as often (over a long run, its cost fades); drafting again: as at first.
        gap = self.settings.rehearse_every
        self.rehearsal_gap = min(2 * self.rehearsal_gap, self.settings.stretch_max) if not self.next_k() else gap

    def observe(self, cycle: Cycle) -> None:
        """Learn from a finished cycle: which drafts the target kept, and what each phase cost."""
        evidence, self.opening, alone = self.evidence, False, self.prices.alone_since_last()
        if self.remaining is not None:
            self.remaining = max(0, self.remaining - cycle.emitted)
        if self.declined_lookup is not None:  # passed over: a source that failed once is tried again later
            evidence.lookup.age()
            if self.declined_lookup >= 0:
                evidence.lookup_bands[self.declined_lookup].age()
            self.declined_lookup = None
        self.prices.time_verify(cycle, alone)
        if cycle.k == 0 or cycle.source in (LOOKUP, GRAMMAR):  # the model drafter reads these tokens later
            self.parked_for += cycle.emitted
            self.unread += cycle.emitted
            if cycle.k and cycle.source == LOOKUP:
                self.prices.time_lookup(cycle)
                evidence.lookup.add(len(cycle.proposed_ids), cycle.accepted)
                if cycle.match:
                    evidence.saw_copy(cycle.match, len(cycle.proposed_ids), cycle.accepted)
            return
        self.unread, self.parked_for, self.rehearsal_gap, self.looked = 0, 0, self.settings.rehearse_every, True
        self.prices.time_drafting(cycle, alone)
        if cycle.draft_ids:
            evidence.expansion = ema(evidence.expansion, max(len(cycle.proposed_ids), 1) / len(cycle.draft_ids))
        if cycle.confidence:  # drafts the target kept, in drafter tokens (the proposal's share of them); a draft
            # that translated into no target token kept nothing: a miss, or auto would keep paying for drafts
            # that the translation strips
            n, proposed = len(cycle.draft_ids), len(cycle.proposed_ids)
            kept = n if proposed and cycle.accepted >= proposed else cycle.accepted * n // max(1, proposed)
            evidence.saw_drafts(cycle.confidence, kept, n)
