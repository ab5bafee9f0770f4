"""What auto has learned about a pair: per source and target position the acceptance counts, the target
tokens per drafter token, and the running cost estimates (`Evidence`); and how a rehearsal's guesses replay
the drafts a parked stretch could have had (`replay_drafts`). `uag.core.policy.AdaptiveK` decides by it and
updates it in place; a caller that keeps it (the server per pair, uag.costs.profiles per pair and machine)
starts the next run with what this one learned. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from uag.core.config import LOOKUP
from uag.core.costmodel import LOOKUP_MS
from uag.core.lookup import MATCH_BANDS

MODEL = "model"

DECAY = 0.9  # weight kept by older observations per update (half-life ≈ 6.6 cycles)
PRIOR_WEIGHT = 1.0  # pseudo-observations pulling each position toward the one before it
CARRY = 3.0  # the most observations per position a run inherits from earlier runs (its own soon outweigh them)
BAND_WEIGHT = 1.0  # pseudo-observations pulling a lookup match band's estimate toward all of lookup's
# Bands of a model draft's confidence (the drafter's probability of the token it drafted): where each ends.
# What the target keeps follows it closely (SmolLM2 drafting for Qwen2.5-Coder-1.5B at k = 4, 12 code prompts:
# 14 % kept below 0.2, 42-47 % at 0.2-0.6, 73 % at 0.6-0.8, 84-90 % above; on Polish most drafts fall below 0.4 and
# 6 of 57 there were kept, 14 of 16 above 0.8; docs/benchmarks.md).
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

    def chances_toward(self, priors: list[float]) -> list[float]:
        """Like `chances`, but each position shrunk toward its own `priors[i]` (a broader estimate of the same
        position) with BAND_WEIGHT pseudo-observations.

        Example: no counts -> priors; 4 rejected at position 0, priors [0.8] -> [0.8 / 5] = [0.16]
        """
        out = []
        for i, prior in enumerate(priors):
            a = self.accepted[i] if i < len(self.accepted) else 0.0
            b = self.rejected[i] if i < len(self.rejected) else 0.0
            out.append((a + BAND_WEIGHT * prior) / (a + b + BAND_WEIGHT))
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
    """What auto has learned about one pair: per source the acceptance `Counts`, the target tokens per
    drafter token, and the running cost estimates. `AdaptiveK` starts from it and updates it in place, so a
    caller that keeps it (the server per pair, uag.costs.profiles per pair and machine) starts the next run
    with what this one learned."""

    model: Counts = field(default_factory=Counts)
    lookup: Counts = field(default_factory=Counts)
    # lookup's, per band of how far its match ran back (uag.core.lookup.match_band): its drafts from a
    # match of 2-3 tokens fare worse than from one of 16; each band leans on `lookup` until it has its own
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

    def counts(self, source: str) -> Counts:
        return self.lookup if source == LOOKUP else self.model

    def kept_chance(self, q: float) -> float:
        """The chance that the target keeps a model draft of confidence q (its position's earlier drafts kept):
        its band's evidence, leaning on q itself where that is thin.

        Example: no evidence -> q;  q = 0.9 and its band kept 1 of 4 -> (1 + 2 × 0.9) / (4 + 2) ≈ 0.47
        """
        counts = self.confidence[confidence_band(q)]
        a, b = (counts.accepted[0], counts.rejected[0]) if counts.accepted else (0.0, 0.0)
        return (a + CONFIDENCE_WEIGHT * q) / (a + b + CONFIDENCE_WEIGHT)

    def next_chances(self) -> list[tuple[float, float]]:
        """What a draft not yet made is worth: (weight, chance kept) per confidence band, weighted by how
        often drafts fell there (decayed); [] before the model has drafted."""
        edges = (0.0, *CONFIDENCE_BANDS, 1.0)
        return [(w, self.kept_chance((edges[i] + edges[i + 1]) / 2)) for i, w in enumerate(self.drafted) if w > 0]

    def saw_drafts(self, confidences: list[float], kept: int, proposed: int) -> None:
        """A model cycle's drafts: each one's confidence, and how the first `proposed` of them fared (the
        first `kept` kept, the next one not: later ones were never judged)."""
        for i, q in enumerate(confidences):
            self._count_confidence(q)
            if i < proposed and i <= kept:
                self.confidence[confidence_band(q)].add(1, int(i < kept))

    def mean_chance(self) -> float | None:
        """The chance that the target keeps a model draft not yet made: `next_chances` averaged (None before
        the model has drafted or rehearsed)."""
        chances = self.next_chances()
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

    def carry(self) -> None:
        """A new run starts from this: what earlier runs accepted weighs at most `CARRY` cycles per position, and
        how sure the drafter was at most `CARRY` drafts (the next text may differ). The bands' verdicts stay as
        they are: their decay already holds each to about ten."""
        for counts in (self.model, self.lookup, *self.lookup_bands):
            counts.limit(CARRY)
        total = sum(self.drafted)
        if total > CARRY:
            self.drafted[:] = [w * CARRY / total for w in self.drafted]

    def to_dict(self) -> dict[str, Any]:
        """What is worth keeping across processes: acceptance and expansion. Costs are the calibration's
        (a later process may run under another load); they are relearned within a run."""
        return {
            "model": self.model.to_dict(),
            "lookup": self.lookup.to_dict(),
            "lookup_bands": [c.to_dict() for c in self.lookup_bands],
            "confidence": [c.to_dict() for c in self.confidence],
            "drafted": list(self.drafted),
            "expansion": self.expansion,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Evidence:
        counts = {s: Counts.from_dict(data[s]) for s in (MODEL, LOOKUP)}
        if not all(c.valid() for c in counts.values()):
            raise ValueError("evidence counts must be non-negative, one accepted and one rejected per position")
        expansion = float(data.get("expansion", 1.0))
        if not (math.isfinite(expansion) and expansion > 0):
            raise ValueError(f"evidence expansion must be positive (got {expansion!r})")
        evidence = cls(model=counts[MODEL], lookup=counts[LOOKUP], expansion=expansion)
        bands = data.get("lookup_bands")  # absent in files saved before the bands: they start empty
        if bands is not None:
            bands = [Counts.from_dict(b) for b in bands]
            if len(bands) != len(MATCH_BANDS) + 1 or not all(c.valid() for c in bands):
                raise ValueError(f"evidence lookup_bands must be {len(MATCH_BANDS) + 1} valid counts")
            evidence.lookup_bands = bands
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
