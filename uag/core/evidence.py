"""What a draft earns and costs, as auto knows it. `Evidence`, what it has learned of a pair: how often the target
keeps a model draft per band of the drafter's confidence in it, and how sure its drafts tend to be; lookup's
acceptance per position, and per copied token by the length the copy had reached; target tokens per drafter
token; the run's timings.
`Prices`: what each phase of a cycle costs, from those timings and the pair's calibrated `CostProfile`.
`uag.core.policy.AdaptiveK` decides by both and updates the evidence in place; a caller that keeps it (the
server per pair, uag.costs.profiles per pair and machine) opens the next run with it. No mlx.

Example: Evidence().kept_chance(0.9) -> 0.9 (no verdicts yet: the drafter's confidence itself)
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from uag.core.config import LOOKUP
from uag.core.costmodel import LOOKUP_MS, CostProfile
from uag.core.lookup import MATCH_BANDS, MATCH_CAP, match_band
from uag.core.records import Cycle, Rehearsal, Sharing

MODEL = "model"
PLAIN = ""  # a plain target step's source

EMA = 0.2  # weight of a new timing in the running cost estimates
# a timing counts at most OUTLIER times what was expected of it (`learned`): a pass that compiled its kernels at
# first use (MLX's CUDA backend on a fresh machine) or waited on a page-in is a one-off; learned whole, it stood for
# its width's cost until that width was timed again, and a width priced out is not tried again (docs/results.md,
# bs). A machine that really slowed moves the estimate by up to (1 - EMA) + EMA * OUTLIER times a timing
OUTLIER = 4.0
AGE_REALISED = 0.01  # how far each batched plain step pulls drafting's realised ratios toward its own
# weight kept by a kind's earlier batched cycles at each new one (`Evidence.saw_realised`: about the last 20 count). A
# single cycle's wall time says little on a GPU, where a queued pass's wait lands in whichever cycle reads it first
REALISED_DECAY = 0.95
DECAY = 0.9  # weight kept by older observations per update (half-life ≈ 6.6 cycles)
PRIOR_WEIGHT = 1.0  # pseudo-observations pulling each position toward the one before it
BAND_WEIGHT = 1.0  # pseudo-observations pulling a lookup match band's estimate toward the shorter band's
# Bands of a model draft's confidence (the drafter's probability of the token it drafted): where each ends.
# What the target keeps follows it closely (docs/how-it-works.md#auto-draft-only-as-far-as-pays).
CONFIDENCE_BANDS = (0.2, 0.4, 0.6, 0.8, 0.9, 0.97)
CONFIDENCE_WEIGHT = 2.0  # pseudo-observations pulling a confidence band's estimate toward the confidence itself


def confidence_band(q: float) -> int:
    """Which of the `CONFIDENCE_BANDS` a draft of confidence q falls in, 0 (least sure) to len(CONFIDENCE_BANDS).

    Example: confidence_band(0.1) -> 0;  confidence_band(0.85) -> 4;  confidence_band(0.99) -> 6
    """
    return sum(q >= edge for edge in CONFIDENCE_BANDS)


@dataclass
class Counts:
    """One source's acceptance evidence: per target position of its proposals, the decayed counts of
    proposals that reached it (every position before it kept) and kept it or not."""

    accepted: list[float] = field(default_factory=list)
    rejected: list[float] = field(default_factory=list)

    def add(self, tried: int, kept: int) -> None:
        """Decay the counts of every position the target looked at, then count this outcome there.

        Example: Counts().add(3, 1) -> accepted [1, 0], rejected [0, 1] (position 3 was never looked at)
        """
        for i in range(min(tried, kept + 1)):
            while len(self.accepted) <= i:
                self.accepted.append(0.0)
                self.rejected.append(0.0)
            self.accepted[i] = self.accepted[i] * DECAY + (i < kept)
            self.rejected[i] = self.rejected[i] * DECAY + (i >= kept)

    def age(self) -> None:
        """Older by one observation everywhere (a source not tried while the text moved on)."""
        self.accepted[:] = [c * DECAY for c in self.accepted]
        self.rejected[:] = [c * DECAY for c in self.rejected]

    def limit(self, weight: float) -> None:
        """Scale each position down to at most `weight` observations, keeping its ratio."""
        for i, (a, b) in enumerate(zip(self.accepted, self.rejected)):
            if a + b > weight:
                self.accepted[i], self.rejected[i] = a * weight / (a + b), b * weight / (a + b)

    def chances(self, n: int, prior: float) -> list[float]:
        """P(position i kept | the ones before it kept) for i < n: the counts shrunk toward the previous
        position's estimate (later positions are tried only after earlier ones held: little evidence).

        Example: no counts -> [0.5, 0.5] at prior 0.5; 10 kept at position 0 only -> [10.5/11, 10.5/11]
        """
        out = []
        for i in range(n):
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            b = self.rejected[i] if i < len(self.rejected) else 0.0
            prior = (a + PRIOR_WEIGHT * prior) / (a + b + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def valid(self) -> bool:
        """One accepted and one rejected count per position, each finite and non-negative."""
        counts = [*self.accepted, *self.rejected]
        return len(self.accepted) == len(self.rejected) and all(math.isfinite(c) and c >= 0 for c in counts)

    def to_dict(self) -> dict[str, list[float]]:
        return {"accepted": list(self.accepted), "rejected": list(self.rejected)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Counts:
        return cls([float(x) for x in data["accepted"]], [float(x) for x in data["rejected"]])


@dataclass
class Evidence:
    """What auto has learned about one pair: the model's drafts by confidence, lookup's acceptance `Counts`, the
    target tokens per drafter token, and the running cost estimates. `AdaptiveK` starts from it and updates it
    in place, so a caller that keeps it starts the next run with what this one learned."""

    lookup: Counts = field(default_factory=Counts)
    # lookup's per copied token, by the band of how far the copy ran back when the target judged it
    # (uag.core.lookup.match_band): a proposal from a 2-token match whose first token is kept is a 3-token match
    # at its second, and one from a 16-token match is at 23 by its eighth. The verdicts (one position each: is the
    # next token of a copy that long kept?) are `copy_chances`'s; a token from a 2-3-token match is kept far less
    # often than one from a 16-token match
    lookup_bands: list[Counts] = field(default_factory=lambda: [Counts() for _ in range(len(MATCH_BANDS) + 1)])
    # the model's, per band of the drafter's confidence in a draft (`confidence_band`): whether the target kept
    # a draft of that confidence, wherever in its proposal it stood; and how often drafts fall in each band
    confidence: list[Counts] = field(default_factory=lambda: [Counts() for _ in range(len(CONFIDENCE_BANDS) + 1)])
    drafted: list[float] = field(default_factory=lambda: [0.0] * (len(CONFIDENCE_BANDS) + 1))
    expansion: float = 1.0  # target tokens per drafter token (cross-tokenizer translation)
    verify_ms: dict[int, float] = field(default_factory=dict)  # target pass over w tokens, per w
    drafter_ms: float | None = None  # one drafter pass in a drafting cycle
    read_ms: float | None = None  # what each token read adds to a drafter pass (prompt, parked stretch)
    overhead_ms: float | None = None  # translate + re-sync per drafting cycle
    lookup_ms: float = LOOKUP_MS
    scale: float = 1.0  # this machine's target passes now ÷ the profile's
    # batched, per kind (PLAIN, MODEL, LOOKUP), decayed sums of its cycles' [wall ms, priced ms] (`saw_realised`)
    realised_ms: dict[str, list[float]] = field(default_factory=dict)

    def copy_chances(self, match: int, n: int, prior: float, floors: Sequence[float] | None = None) -> list[float]:
        """P(position i of a lookup proposal kept | the ones before it kept) for i < n, where the proposal's match
        runs `match` tokens back: position i continues a copy of match + i tokens, and has the chance of that
        length's band. A band's chance is its verdicts leaning on the next shorter band's (a longer copy breaks no
        more often), the shortest on `prior`, and on its floor where that is higher (`floors`, one a band; None:
        none), until its own verdicts say otherwise.

        Example: no verdicts, prior 0.5 -> [0.5] * n;  the 2-3 band rejected 4, prior 0.5, floors BAND_FLOORS
                 -> match 2: [0.1] * 6 + [0.8] * 8 + [0.9, …] (0.5 / 5 for lengths 2-3, the 4-7 band leaning on
                 it, 0.8 the floor for 8-15)
        """
        chances, lean = [], prior
        for band, counts in enumerate(self.lookup_bands):
            lean = max(lean, floors[band]) if floors else lean
            a, r = (counts.accepted[0], counts.rejected[0]) if counts.accepted else (0.0, 0.0)
            lean = (a + BAND_WEIGHT * lean) / (a + r + BAND_WEIGHT)
            chances.append(lean)
        return [chances[match_band(min(match + i, MATCH_CAP))] for i in range(n)]

    def saw_copy(self, match: int, tried: int, kept: int) -> None:
        """A lookup proposal's verdicts: of the `tried` tokens it proposed from a match of `match` tokens, the first
        `kept` were kept, the next one not (later ones were never judged), each in its length's band."""
        for i in range(min(tried, kept + 1)):
            self.lookup_bands[match_band(min(match + i, MATCH_CAP))].add(1, int(i < kept))

    def kept_chance(self, q: float, bands: bool = True) -> float:
        """The chance that the target keeps a model draft of confidence q (its position's earlier drafts kept):
        its band's evidence, leaning on q itself where that is thin (`bands` False: q itself).

        Example: no evidence -> q;  q = 0.9 and its band kept 1 of 4 -> (1 + 2 × 0.9) / (4 + 2) ≈ 0.47
        """
        if not bands:
            return q
        counts = self.confidence[confidence_band(q)]
        a, b = (counts.accepted[0], counts.rejected[0]) if counts.accepted else (0.0, 0.0)
        return (a + CONFIDENCE_WEIGHT * q) / (a + b + CONFIDENCE_WEIGHT)

    def next_chances(self, bands: bool = True) -> list[tuple[float, float]]:
        """What a draft not yet made is worth: (weight, chance kept) per confidence band, weighted by how
        often drafts fell there (decayed); [] before the model has drafted."""
        edges = (0.0, *CONFIDENCE_BANDS, 1.0)
        mids = [(edges[i] + edges[i + 1]) / 2 for i in range(len(self.drafted))]
        return [(w, self.kept_chance(mids[i], bands)) for i, w in enumerate(self.drafted) if w > 0]

    def saw_drafts(self, confidences: list[float], kept: int, proposed: int) -> None:
        """A model cycle's drafts: each one's confidence, and how the first `proposed` of them fared (the
        first `kept` kept, the next one not: later ones were never judged)."""
        for i, q in enumerate(confidences):
            self._count_confidence(q)
            if i < proposed and i <= kept:
                self.confidence[confidence_band(q)].add(1, int(i < kept))

    def mean_chance(self, bands: bool = True) -> float | None:
        """The chance that the target keeps a model draft not yet made: `next_chances` averaged (None before
        the model has drafted or rehearsed)."""
        chances = self.next_chances(bands)
        total = sum(w for w, _ in chances)
        return sum(w * c for w, c in chances) / total if total else None

    def saw_guesses(self, confidences: list[float]) -> None:
        """A rehearsal's guesses: how sure the drafter was of each. Whether they hit does not teach the bands:
        a guess is a drafter token, and where the target's tokenizer splits the text otherwise (Polish in an
        English drafter's tokens) a right guess is often a proposal the target would not keep."""
        for q in confidences:
            self._count_confidence(q)

    def _count_confidence(self, q: float) -> None:
        """One more draft or guess of confidence q in the decayed histogram `drafted`."""
        self.drafted[:] = [w * DECAY for w in self.drafted]
        self.drafted[confidence_band(q)] += 1.0

    @property
    def realised(self) -> dict[str, float]:
        """Batched, per kind: what its recent cycles' wall time came to ÷ what they were priced at, the batch's costs
        that no price sees (`Prices.realised`)."""
        return {kind: ms / priced for kind, (ms, priced) in self.realised_ms.items()}

    def saw_realised(self, kind: str, ms: float, priced: float) -> None:
        """A batched cycle of `kind` took `ms` against the `priced` ms it was decided by. Its ratio is over the kind's
        recent cycles (REALISED_DECAY), each counted at most OUTLIER times what the kind realised so far (kernels
        compiling at first use). A plain step then pulls the drafting kinds' ratios AGE_REALISED of the way to its
        own.

        Example: cycles of 10 ms priced at 5, then one of 4 ms priced at 4 -> (0.95 × 10 + 4) / (0.95 × 5 + 4) = 1.54
        """
        ratios = self.realised
        sums = self.realised_ms.setdefault(kind, [0.0, 0.0])
        cap = OUTLIER * priced * ratios.get(kind, 1.0)
        sums[0] = REALISED_DECAY * sums[0] + min(ms, cap)
        sums[1] = REALISED_DECAY * sums[1] + priced
        if kind != PLAIN:
            return
        plain = sums[0] / sums[1]
        for other, (_, other_priced) in self.realised_ms.items():
            if other != PLAIN:
                self.realised_ms[other][0] += AGE_REALISED * (plain - ratios[other]) * other_priced

    def carry(self, weight: float) -> None:
        """A new run starts from this: what lookup accepted weighs at most `weight` cycles per position, and how
        sure the drafter was at most `weight` drafts (the next text may differ). The confidence bands' verdicts
        stay as they are: their decay already holds each to about ten."""
        for counts in (self.lookup, *self.lookup_bands):
            counts.limit(weight)
        total = sum(self.drafted)
        if total > weight:
            self.drafted[:] = [w * weight / total for w in self.drafted]

    def forget(self) -> None:
        """A new run that carries nothing: every acceptance estimate back to its prior (costs are kept)."""
        fresh = Evidence()
        self.lookup, self.lookup_bands = fresh.lookup, fresh.lookup_bands
        self.confidence, self.drafted, self.expansion = fresh.confidence, fresh.drafted, fresh.expansion

    def to_dict(self) -> dict[str, Any]:
        """What is worth keeping across processes: acceptance and expansion. Costs are the calibration's
        (a later process may run under another load); they are relearned within a run."""
        return {
            "lookup": self.lookup.to_dict(),
            "lookup_bands": [c.to_dict() for c in self.lookup_bands],
            "confidence": [c.to_dict() for c in self.confidence],
            "drafted": list(self.drafted),
            "expansion": self.expansion,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evidence:
        """The evidence `to_dict` saved; a file from before the confidence bands may hold the model's counts per
        position too ("model"), which no decision reads any more: they are passed over."""
        lookup = Counts.from_dict(data[LOOKUP])
        if not lookup.valid():
            raise ValueError("evidence counts must be non-negative, one accepted and one rejected per position")
        expansion = float(data.get("expansion", 1.0))
        if not (math.isfinite(expansion) and expansion > 0):
            raise ValueError(f"evidence expansion must be positive (got {expansion!r})")
        evidence = cls(lookup=lookup, expansion=expansion)
        bands = data.get("lookup_bands")  # absent in files saved before the bands: they start empty
        if bands is not None:
            # each band's first position: files from before the per-token verdicts counted a band per proposal
            # and position, and position 0 was the same verdict (the next token of a copy that long)
            bands = [Counts(c.accepted[:1], c.rejected[:1]) for c in map(Counts.from_dict, bands)]
            # a file from before the longer bands (4 of them, 16+ the last): what it learned for 16+ stays with
            # 16-31, the longer bands start empty
            if len(bands) not in (4, len(MATCH_BANDS) + 1) or not all(c.valid() for c in bands):
                raise ValueError(f"evidence lookup_bands must be {len(MATCH_BANDS) + 1} valid counts")
            evidence.lookup_bands[: len(bands)] = bands
        confidence = data.get("confidence")  # absent in files saved before the confidence bands
        if confidence is not None:
            confidence = [Counts.from_dict(c) for c in confidence]
            drafted = [float(w) for w in data.get("drafted", [])]
            n = len(CONFIDENCE_BANDS) + 1
            if len(confidence) != n or not all(c.valid() for c in confidence) or len(drafted) != n:
                raise ValueError(f"evidence confidence must be {n} valid counts and {n} drafted weights")
            if not all(math.isfinite(w) and w >= 0 for w in drafted):
                raise ValueError("evidence drafted weights must be non-negative")
            evidence.confidence, evidence.drafted = confidence, drafted
        return evidence


def expected_tokens(acceptances: Sequence[float]) -> float:
    """Tokens a cycle commits on average when it proposes len(acceptances) target tokens, each kept with its
    chance given the ones before it kept (and the target's own token after them).

    Example: [0.5, 0.5] -> 1 + 0.5 + 0.25 = 1.75
    """
    total, survive = 1.0, 1.0
    for p in acceptances:
        survive *= p
        total += survive
    return total


@dataclass
class Prices:
    """The cost of each phase of a cycle, from the run's own timings first (kept in `evidence`), then the
    `profile`, then guesses (`r`: drafter step ÷ target step). `learn` False keeps the profile's costs and never
    the run's own timings (tests and the replay pin them). `sharing`: how the request's target passes are shared
    with other requests' when a server batches them (uag.runtime.batching); None for a request run alone."""

    profile: CostProfile | None
    evidence: Evidence
    r: float = 0.1
    learn: bool = True
    sharing: Sharing | None = None
    held_seen: int = field(default=0, init=False, repr=False)  # `Sharing.held` at the last batched cycle
    rounds_seen: int = field(default=0, init=False, repr=False)  # `Sharing.rounds` when `alone_since_last` last looked
    _widths: tuple[dict | None, list[int]] = field(default=(None, []), init=False, repr=False)  # `_nearest`'s, sorted

    def target_ms(self, w: int) -> float | None:
        """Cost of a target pass over w tokens: own timings first; then the profile's, anchored at the nearest
        width this run has timed (the profile's shape, the run's level: a server's evidence carries from request
        to request, and passes over a long context cost more than the profile's); then extrapolation.

        Example: profile 450 / 500 ms for 1 / 2 tokens, this run's 2-token passes 700 ms -> w = 1: 630 ms

        Passes batched with other requests' are priced (`verify_ms`) by the tokens the whole pass computes, from
        these costs; they are not learned into them (`time_verify`).
        """
        timed = self.evidence.verify_ms
        if w in timed:
            return timed[w]
        if self.profile is not None:  # its times are positive (CostProfile checks them): any width timed anchors
            if not (self.learn and timed):
                return self.profile.target_at(w) * self.evidence.scale
            near = self._nearest(timed, w)
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

    def _nearest(self, timed: dict[int, float], w: int) -> int:
        """The timed width nearest w (the narrower of two as near). A member prices every k it might propose at every
        cycle, each against every pass of its batch's round (`AdaptiveK.lookup_rates`): a scan of the widths a
        server's evidence has timed was 5 % of its worker's time (docs/results.md, df), a bisection of them sorted
        once is not. Widths are only ever added to `timed`, so its size says when to sort again."""
        of, widths = self._widths
        if of is not timed or len(widths) != len(timed):
            widths = sorted(timed)
            self._widths = (timed, widths)
        i = bisect.bisect_left(widths, w)
        return min(widths[max(0, i - 1) : i + 1], key=lambda v: (abs(v - w), v))

    # --- batched with other requests (a server's): what a proposal costs the whole batch --------------------
    @property
    def batched(self) -> bool:
        """Whether the request runs beside others now (its target passes and its drafting are the batch's)."""
        return self.sharing is not None and bool(self.sharing.others)

    @property
    def size(self) -> int:
        """The requests in the batch now, this one included (1 alone)."""
        return len(self.sharing.others) + 1 if self.batched else 1

    def verify_ms(self, w: int) -> float | None:
        """The target pass that verifies a proposal of w − 1 tokens: alone, `target_ms(w)`; batched, the batch's
        whole round of target passes with this request at w and the others at what they propose
        (`Sharing.pass_tokens`), for every member waits on it.

        Example: a pass costs 28 + n (n tokens); three others plain: w = 1 -> 32;  w = 2 -> 36;  alone: w = 2 -> 30
        """
        if not self.batched:
            return self.target_ms(w)
        return self._round_ms(w)

    def round_ms(self) -> float:
        """A round of the batch in which this request makes no target pass (it rehearses): the others' passes,
        which it waits on (0 alone)."""
        if not self.batched:
            return 0.0
        return self._round_ms(None) or 0.0

    def others_tokens(self) -> float:
        """What the other members commit in a round of target passes (0 alone). While a member drafts with a
        model the batch holds the target's passes (uag.runtime.batching, `Batch.round`): the others commit
        nothing in its drafter rounds, only in the pass that verifies its draft."""
        return self.sharing.others_tokens if self.batched else 0.0

    def common_ms(self, w: int, drafting_ms: float = 0.0) -> float | None:
        """What a cycle costs were every member of the batch to propose as this request does: its drafting
        (drafter steps batched alike) and one pass of size × w tokens (the price every draft had before
        the others' proposals were known). Beside members that propose wide, a draft rides in their padding at
        no cost of its own; this keeps a batch whose members all draft from staying there where none of them
        would pay alone (`AdaptiveK.rates`). Alone: `target_ms(w)` and the drafting."""
        pass_ms = self.target_ms(self.size * w)
        return None if pass_ms is None else drafting_ms + pass_ms

    def _round_ms(self, w: int | None) -> float | None:
        costs = [self.target_ms(n) for n in self.sharing.pass_tokens(w)]
        return None if None in costs else sum(costs)

    def proposal_length(self, k: int) -> int:
        """Target tokens k drafter tokens translate into (`Evidence.expansion`)."""
        return max(1, round(self.evidence.expansion * k)) if k else 0

    def cycle_ms(self, k: int) -> float | None:
        """A cycle of k model drafts: k drafter steps, translation and re-sync, the target's pass over them.
        Batched, the pass is the batch's (`verify_ms`) and the drafter steps are rounds in which the batch holds
        every target pass: the others wait through them (`others_tokens`)."""
        verify = self.verify_ms(self.proposal_length(k) + 1)
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

    # --- learning from the run's own timings ------------------------------------------------------------
    def alone_since_last(self) -> bool:
        """Whether what the request timed since this was last asked is its own work, and from now on, a new span: ask
        it once per cycle or rehearsal learnt (`AdaptiveK.observe`, `rehearsed`). Outside a batch, always; in one,
        only where every pass since then ran as the model's own call, alone in the batch (`Sharing.solo`). A pass
        handed to the batch waits for a round, and the round runs the others' passes, reads and Python too: learnt
        as the request's own, such waits priced a plain step of the coder target at 3.9 s (its calibration: 0.41 s)
        and every draft beside it as nearly free (docs/results.md, dk)."""
        shared = self.sharing
        if shared is None:
            return True
        alone = shared.solo and shared.rounds == self.rounds_seen
        self.rounds_seen = shared.rounds
        return alone

    def time_verify(self, cycle: Cycle, alone: bool = True) -> None:
        """The run's own target timings, and how they compare with the profile's (`Evidence.scale`); a tree pass's
        at the width it read (every branch's nodes), not the kept branch's. A timing counts at most OUTLIER times
        what was expected of it: the width's estimate, or for its first what the profile (anchored at the run's
        other widths) expects (`learned`). `alone` False (`alone_since_last`): the cycle waited on a batch's rounds, and
        its time is not its pass's.

        A wider pass also caps the plain step's price at what it took: a width is learned only where the run passes,
        so a plain step timed while something else held the machine (a burst of load, a download) stayed that dear
        for as long as auto drafted, and drafting, priced against it, looked to pay for as long as it was priced so.
        Only the plain step: a CPU's wider passes are not dearer the wider they are (the coder target's 16-token
        pass took 587 ms, its 9-token ones 750–1,050: docs/results.md), but a one-token pass is the cheapest."""
        evidence, w, ms = self.evidence, (cycle.nodes or len(cycle.proposed_ids)) + 1, cycle.verify_ms
        if (shared := self.sharing) is not None and shared.size > 1:
            self.time_realised(cycle)  # a batched pass: rows over caches of their own cost more than one row of
            return  # their tokens; what the cycle came to against its price is learned instead
        if not alone:  # the only sequence of its pass, but the round held others' work (a read beside it)
            return
        if self.learn or not (self.profile and w in self.profile.target_ms):
            expected = self.target_ms(w) if self.profile is not None else None
            evidence.verify_ms[w] = learned(evidence.verify_ms.get(w), ms, expected)
        if self.learn and w > 1 and evidence.verify_ms.get(1, 0.0) > ms:  # a plain step costs no more than this
            evidence.verify_ms[1] = ms
        if self.learn and self.profile is not None:
            evidence.scale = statistics.median(ms / self.profile.target_at(v) for v, ms in evidence.verify_ms.items())

    def time_realised(self, cycle: Cycle) -> None:
        """A batched cycle: its wall time against what it was priced at, learned per kind (`Evidence.saw_realised`).
        A plain step counts only where the batch held no round of its pass for others' drafting since the last cycle
        (a plain step's price leaves those holds to the drafting member's); each one also pulls the drafting kinds'
        ratios a little toward its own, so that a kind parked for what it once realised is tried again now and then
        (the batch may have changed)."""
        if not self.learn or self.sharing is None:
            return
        held, self.held_seen = self.sharing.held - self.held_seen, self.sharing.held
        w = (cycle.nodes or len(cycle.proposed_ids)) + 1
        if cycle.k == 0:
            if held or cycle.draft_ms:  # waited on others' drafting, or rehearsed: not a plain step's cost
                return
            kind, priced = PLAIN, self.verify_ms(1)
        elif cycle.source == LOOKUP:
            kind, priced = LOOKUP, self.evidence.lookup_ms + (self.verify_ms(w) or 0.0)
        elif cycle.source == MODEL:
            first_read = max(1, cycle.drafter_read - cycle.drafter_passes + 1)  # its first pass caught up on these
            step = self.drafter_step_ms(self.target_ms(1) or 0.0)
            drafting = cycle.drafter_passes * step + self.reading_ms(first_read) + self.cycle_overhead_ms()
            kind, priced = MODEL, drafting + (self.verify_ms(w) or 0.0)
        else:
            return  # what a grammar forces is not a choice auto makes
        if priced and priced > 0 and cycle.ms > 0:
            self.evidence.saw_realised(kind, cycle.ms, priced)

    def realised(self, source: str) -> float:
        """Batched: what a cycle drafting from `source` pays for, relative to its price, as a share of what a plain
        step does: at most 1 (drafting is never priced up for realising better) and at least 1 / OUTLIER (prices
        far off, as before a pair's costs are measured, cut a draft no further). Its price leaves out what the batch
        adds to drafting: every member's Python in the drafter rounds the target's passes are held for, unpipelined
        verifications, wider passes on kept caches. Alone, or until both kinds were timed in a batch, 1.

        Example: plain steps realised 1.2 × their price, model cycles 3.0 × -> a model draft's rate × 0.4;
                 plain 0.01 ×, model 1.0 × -> × 0.25
        """
        if not self.batched:
            return 1.0
        ratios = self.evidence.realised
        plain, drafting = ratios.get(PLAIN), ratios.get(source)
        if plain is None or drafting is None:
            return 1.0
        return max(1 / OUTLIER, min(1.0, plain / drafting))

    def time_lookup(self, cycle: Cycle) -> None:
        if self.learn:
            self.evidence.lookup_ms = ema(self.evidence.lookup_ms, cycle.draft_ms + cycle.translate_ms)

    def time_drafting(self, cycle: Cycle, alone: bool = True) -> None:
        """A model cycle: its drafter steps, or, where its first pass caught up on the prompt or a parked
        stretch, what reading a token costs; translation and re-sync (`alone` as for `time_verify`)."""
        evidence = self.evidence
        if self.batched or not alone:  # its drafter passes waited on the batch's rounds: `cycle_ms` prices those apart
            return
        passes = cycle.drafter_passes if self.learn else 0
        if passes and cycle.drafter_read <= 2 * passes + 1:
            expected = self.profile.drafter_ms * evidence.scale if self.profile is not None else None
            evidence.drafter_ms = learned(evidence.drafter_ms, cycle.draft_ms / passes, expected)
        elif passes:
            caught_up = cycle.draft_ms - passes * self.drafter_step_ms(cycle.draft_ms / passes)
            evidence.read_ms = learned(evidence.read_ms, max(0.0, caught_up) / (cycle.drafter_read - passes))
        if self.learn:
            evidence.overhead_ms = learned(evidence.overhead_ms, cycle.translate_ms + cycle.resync_ms)

    def time_rehearsal(self, rehearsal: Rehearsal, alone: bool = True) -> None:
        """A rehearsal is one drafter pass: a step, and what each token it read added (`alone` as for
        `time_verify`)."""
        if self.learn and rehearsal.read > 1 and not self.batched and alone:
            step = self.drafter_step_ms(self.target_ms(1) or 0.0)
            per_token = max(0.0, rehearsal.ms - step) / (rehearsal.read - 1)
            self.evidence.read_ms = learned(self.evidence.read_ms, per_token)  # as a drafting cycle's catch-up


def learned(old: float | None, new: float, expected: float | None = None) -> float:
    """A running cost estimate after the timing `new`: its EMA with the estimate so far (`old`), the timing counted
    at most OUTLIER times that. A first timing is taken as it is (a profile measured on a busier machine gives way
    to the run's own speed at once), unless it is over OUTLIER times what was `expected` of it (the profile's):
    then it is a one-off, and counts as OUTLIER times the expectation in an EMA that starts from the expectation.

    Example: learned(10.0, 500.0) -> 16.0 (0.8 × 10 + 0.2 × 40);  learned(None, 500.0, 10.0) -> 16.0;
             learned(None, 12.0, 100.0) -> 12.0;  learned(None, 500.0) -> 500.0
    """
    if old is not None and math.isfinite(old) and old > 0:
        return ema(old, min(new, OUTLIER * old))
    if old is None and expected is not None and math.isfinite(expected) and 0 < OUTLIER * expected < new:
        return ema(expected, OUTLIER * expected)
    return ema(old, new)


def ema(old: float | None, new: float) -> float:
    if old is None or not math.isfinite(old):
        return new
    return (1 - EMA) * old + EMA * new
