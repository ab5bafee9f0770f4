"""What one draft → verify cycle costs and commits: measured cost profiles and expected tokens. No mlx.

A cycle: the drafter proposes k tokens (k drafter steps), they are translated, and the target verifies them
in one forward pass over w = k + 1 new tokens. Costs are in units of one plain target step (one token), or in
milliseconds as a `CostProfile` measured them. A cycle commits 1 + k·α tokens when α is the measured
acceptance rate (the study's form), or, when α is the chance that each draft token is accepted, independently,
with acceptance stopping at the first rejection (Leviathan et al.)::

    E(α, k) = (1 − α^(k+1)) / (1 − α) = 1 + α + … + α^k  ≤  1 + k·α

``form="study"`` / ``"leviathan"`` picks the numerator. The study's parametric S(α, k) and break-even α* are
uag.core.speedup; the link term of a target sharded over ranks is at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Form = Literal["study", "leviathan"]
FORMS: tuple[str, ...] = ("study", "leviathan")

_BISECT_TOL = 1e-13


def scalar_or_array(x: np.ndarray) -> float | np.ndarray:
    """A 0-d result as a plain float, anything else as the array."""
    return float(x) if np.ndim(x) == 0 else x


def check_form(form: str) -> None:
    """Raise ValueError unless `form` is one of FORMS."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} (got {form!r})")


def draft_lengths(k: Any) -> np.ndarray:
    """`k` (a number or an array of them) as validated draft lengths: non-negative whole numbers, int64."""
    kk = np.asarray(k)
    if kk.dtype.kind not in "iuf" or np.any(kk < 0) or np.any(kk != np.round(kk)):
        raise ValueError(f"draft length k must be a non-negative integer (got {k!r})")
    return kk.astype(np.int64)


def expected_tokens(alpha: Any, k: Any) -> float | np.ndarray:
    """Leviathan's expected tokens per cycle E(α, k) = (1 − α^(k+1)) / (1 − α) = 1 + α + … + α^k.

    Summed as the polynomial, so it is exact at α = 0 and α → 1 (no 0/0). Broadcasts over α and k.
    Example: E(0, k) = 1, E(1, k) = k + 1, E(0.5, 2) = 1 + 0.5 + 0.25 -> 1.75
    >>> expected_tokens(0.5, 2)
    1.75
    >>> expected_tokens([0.0, 1.0], 3).tolist()
    [1.0, 4.0]
    """
    a = np.asarray(alpha, dtype=float)
    if np.any((a < 0) | (a > 1)):
        raise ValueError(f"acceptance α must lie in [0, 1] (got {alpha!r})")
    kk = draft_lengths(k)
    a, kk = np.broadcast_arrays(a, kk)
    k_max = int(kk.max()) if kk.size else 0
    # Horner from the top power down; terms above each element's own k are masked out.
    total = np.zeros(a.shape)
    for i in range(k_max, -1, -1):
        total = total * a + (i <= kk)
    return scalar_or_array(total)


def _bisect_increasing(f, lo: float = 0.0, hi: float = 1.0) -> float | None:
    """Smallest x in [lo, hi] with f(x) >= 0 for an increasing f; None if f(hi) < 0."""
    if f(lo) >= 0:
        return lo
    if f(hi) < 0:
        return None
    while hi - lo > _BISECT_TOL:
        mid = 0.5 * (lo + hi)
        if f(mid) >= 0:
            hi = mid
        else:
            lo = mid
    return hi


# --- measured costs -----------------------------------------------------------------------------------------
LOOKUP_MS = 0.02  # what a prompt lookup costs (a dictionary lookup), where none was timed


@dataclass(slots=True)
class CostProfile:
    """Measured costs of one target × drafter pair on one machine, in milliseconds, timed as a run spends them
    (uag.costs.calibrate): ``target_ms[w]`` is the target's verification over w new tokens with a filled
    cache (a plain step is w = 1; verifying k drafts is w = k + 1), ``drafter_ms`` one drafter step while
    drafting, ``read_ms[n]`` one drafter pass over n new tokens (reading a prompt or a parked stretch in
    one batched pass: a fixed cost and a small one per token, not n steps; None in profiles saved before
    it was measured: then estimated). ``form`` picks the tokens a cycle is expected to commit: Leviathan's
    E(α, k) (default) or the study's 1 + k·α.

    Example: target 10 ms/step, 12 ms for w = 3, drafter 1 ms, translation 0.5 ms:
    cycle_ms(2) = 2·1 + 0.5 + 12 = 14.5;  E(0.8, 2) = 2.44 tokens -> 2.44 / 14.5 vs 1 / 10 -> speedup 1.68
    >>> p = CostProfile({1: 10.0, 2: 11.0, 3: 12.0}, drafter_ms=1.0, translate_ms=0.5)
    >>> p.cycle_ms(2), round(p.speedup(0.8, 2), 2)
    (14.5, 1.68)
    """

    target_ms: dict[int, float]
    drafter_ms: float
    translate_ms: float = 0.0
    form: str = "leviathan"
    read_ms: dict[int, float] | None = None

    def __post_init__(self) -> None:
        check_form(self.form)
        self.target_ms = _curve(self.target_ms, "target_ms")
        if self.read_ms is not None:
            self.read_ms = _curve(self.read_ms, "read_ms")
        for name in ("drafter_ms", "translate_ms"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite non-negative number (got {value!r})")
            setattr(self, name, value)

    def target_at(self, w: int) -> float:
        """Target forward time for w new tokens: the table, linear interpolation between its entries, and
        beyond the widest entry the slope of the last two (never falling: wider passes do not get cheaper).

        Example: {1: 10, 3: 12, 4: 14} -> w = 2: 11 (interpolated), w = 6: 18 (slope 2 ms per token)
        >>> CostProfile({1: 10.0, 3: 12.0, 4: 14.0}, drafter_ms=1.0).target_at(6)
        18.0
        """
        return _at(self.target_ms, w)

    def fixed_tokens(self) -> float:
        """What a target pass costs beside its tokens, in tokens' worth: one token's pass over what each token more
        adds (the curve's widest entry against one token), between 1 and 1000 (a flat curve: a token costs nothing
        measurable). A batch cuts its members' proposals into passes by it (uag.core.records.groups) until it has
        timed passes of its own: a GPU running a small model has room for hundreds of tokens in a pass, a CPU for
        tens, a large model on either for a few.

        Example: {1: 10, 9: 14} -> 10 / 0.5 = 20 tokens
        >>> CostProfile({1: 10.0, 9: 14.0}, drafter_ms=1.0).fixed_tokens()
        20.0
        """
        wide = max(self.target_ms)
        per_token = (self.target_at(wide) - self.target_at(1)) / (wide - 1) if wide > 1 else 0.0
        return 1000.0 if per_token <= 0 else min(max(self.target_at(1) / per_token, 1.0), 1000.0)

    def drafter_pass(self, n: int) -> float:
        """One drafter pass over n new tokens: the measured reading curve, or without one a step plus, per
        extra token, what the target's wide passes cost per extra token scaled by drafter step / target step.

        Example: target 10 ms for 1 token, 14 ms for 9 (0.5 ms per extra token); drafter step 5 ms
        -> a pass over 41 tokens: 5 + 40 × 0.5 × 5 / 10 = 15 ms
        >>> CostProfile({1: 10.0, 9: 14.0}, drafter_ms=5.0).drafter_pass(41)
        15.0
        """
        if self.read_ms is not None:
            return _at(self.read_ms, n)
        widths = list(self.target_ms)
        wide = widths[-1]
        per_token = (self.target_ms[wide] - self.target_ms[1]) / (wide - 1) if wide > 1 else 0.1 * self.target_ms[1]
        return self.drafter_ms + max(0, int(n) - 1) * max(0.0, per_token) * self.drafter_ms / self.target_ms[1]

    def reading_ms(self, n: int) -> float:
        """What reading n tokens adds to the drafter pass that reads them (nothing for n <= 1): the prompt on
        the first draft, a parked stretch on the next. Example: as above, n = 41 -> 15 − 5 = 10 ms"""
        return max(0.0, self.drafter_pass(n) - self.drafter_pass(1)) if n > 1 else 0.0

    def cycle_ms(self, k: int, w: int | None = None, read: int = 1) -> float:
        """One cycle: k drafter steps (the first reading `read` tokens: its pending token and any backlog)
        + translation + a target pass over w (default k + 1) tokens.

        k = 0 is a plain target step: target_ms[1], no drafter and no translation. Pass w when translation
        yields a different number of target tokens than k (w = proposed + 1).
        """
        k = int(draft_lengths(k))
        if k == 0:
            return self.target_at(w or 1)
        return k * self.drafter_ms + self.reading_ms(read) + self.translate_ms + self.target_at(w or k + 1)

    def price(self, cycle: Any, lookup_ms: float = LOOKUP_MS) -> float:
        """What a recorded cycle (uag.core.records.Cycle) costs by this profile: a model draft as `cycle_ms`
        with the width it verified and what its first drafter pass read; a lookup's proposal a lookup and
        the target's pass; a plain step one target step, plus one drafter pass over what a rehearsal read
        where it ended one. Summed over a run's cycles it predicts the run's time (benchmarks/cost_truth.py).

        Example: the class example's profile (no read curve: a token read costs 1 ms per extra target token
        × drafter step / target step = 0.1 ms); k = 2 drafts that translate into 3 target tokens, the first
        pass reading 2 tokens -> 2 × 1 + 0.1 + 0.5 + target_at(4) = 13 -> 15.6
        >>> from types import SimpleNamespace as Cycle
        >>> p = CostProfile({1: 10.0, 2: 11.0, 3: 12.0}, drafter_ms=1.0, translate_ms=0.5)
        >>> round(p.price(Cycle(k=2, source="model", proposed_ids=[7, 8, 9], drafter_passes=2, drafter_read=3)), 9)
        15.6
        """
        w = len(cycle.proposed_ids) + 1
        if cycle.k and cycle.source == "model":
            first = max(1, cycle.drafter_read - (cycle.drafter_passes - 1))  # the passes after it read one each
            return self.cycle_ms(cycle.drafter_passes or cycle.k, w, first)
        ms = self.target_at(w) + (lookup_ms if cycle.k else 0.0)
        return ms + (self.drafter_pass(cycle.drafter_read) if cycle.drafter_read else 0.0)

    def tokens_per_cycle(self, alpha: Any, k: int) -> float | np.ndarray:
        """Expected committed tokens per cycle under this profile's form (1 for k = 0)."""
        k = int(draft_lengths(k))
        if self.form == "study":
            return scalar_or_array(1.0 + k * np.asarray(alpha, dtype=float))
        return expected_tokens(alpha, k)

    def expected_rate(self, alpha: Any, k: int) -> float | np.ndarray:
        """Expected tokens per millisecond with draft length k (k = 0: the baseline rate)."""
        return scalar_or_array(np.asarray(self.tokens_per_cycle(alpha, k)) / self.cycle_ms(k))

    def baseline_rate(self) -> float:
        """Tokens per millisecond of plain target decoding: 1 / target_ms[1]."""
        return 1.0 / self.target_ms[1]

    def speedup(self, alpha: Any, k: int) -> float | np.ndarray:
        """Expected rate with draft length k over the baseline rate."""
        return scalar_or_array(np.asarray(self.expected_rate(alpha, k)) / self.baseline_rate())

    def break_even(self, k: int) -> float | None:
        """Smallest α in [0, 1] with speedup(α, k) >= 1 (bisection); None if even α = 1 does not pay."""
        return _bisect_increasing(lambda a: self.speedup(a, k) - 1.0)

    def best_k(self, alpha: float, k_max: int) -> int:
        """The draft length in 0..k_max with the highest expected rate (ties go to the smaller k).

        Returns 0 (plain target decoding) when α is below every k's break-even.
        """
        rates = [float(self.expected_rate(alpha, k)) for k in range(int(k_max) + 1)]
        return int(np.argmax(rates))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; width keys become strings."""
        out = {
            "target_ms": {str(w): ms for w, ms in self.target_ms.items()},
            "drafter_ms": self.drafter_ms,
            "translate_ms": self.translate_ms,
            "form": self.form,
        }
        if self.read_ms is not None:
            out["read_ms"] = {str(n): ms for n, ms in self.read_ms.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostProfile:
        read = data.get("read_ms")
        return cls(
            target_ms={int(w): float(ms) for w, ms in data["target_ms"].items()},
            drafter_ms=float(data["drafter_ms"]),
            translate_ms=float(data.get("translate_ms", 0.0)),
            form=data.get("form", "leviathan"),
            read_ms=None if read is None else {int(n): float(ms) for n, ms in read.items()},
        )


def _curve(table: Any, name: str) -> dict[int, float]:
    """A width → milliseconds table, checked (w = 1 present, positive finite times) and sorted by width."""
    out = {int(w): float(ms) for w, ms in dict(table).items()}
    if 1 not in out or any(w < 1 or not math.isfinite(ms) or ms <= 0 for w, ms in out.items()):
        raise ValueError(f"{name} needs w = 1 and positive finite times for integer w >= 1 (got {table!r})")
    return dict(sorted(out.items()))


def _at(table: dict[int, float], w: int) -> float:
    """The table (sorted by width, w = 1 in it: `_curve`) at width w: exact, interpolated, or past the widest entry
    at the slope of the last two.

    Plain Python, as `np.interp` computes it, and without copying the table: auto prices every width it weighs, for
    every member of a batch, every round (tens of thousands of calls a second on a GPU), where numpy's per-call
    overhead was most of the cost, and then listing a calibration's widths at every call 1.6 % of a batching
    server's worker (docs/results.md, de).
    """
    w = int(w)
    if w < 1:
        raise ValueError(f"w must be >= 1 (got {w})")
    ms = table.get(w)
    if ms is not None:
        return ms
    last = reversed(table)
    widest = next(last)
    if w < widest:
        lo = 1
        for hi in table:  # from the narrowest: the first entry past w, and the one before it
            if hi > w:
                return (table[hi] - table[lo]) / (hi - lo) * (w - lo) + table[lo]
            lo = hi
    before = next(last, None)
    if before is None:
        return table[widest]
    return table[widest] + max(0.0, (table[widest] - table[before]) / (widest - before)) * (w - widest)


# --- a target sharded over a link ---------------------------------------------------------------------------
def collectives_per_pass(shard: str, layers: int, ranks: int) -> int:
    """Collectives one target forward pass waits on, sharded over `ranks` (mlx-lm 0.32): tensor parallel,
    two all_sum per layer (attention and MLP outputs); pipeline, a hand-over between each pair of stages
    and the final all_gather of the hidden state.

    Example: collectives_per_pass("tensor", 80, 2) -> 160;  collectives_per_pass("pipeline", 80, 2) -> 2
    >>> collectives_per_pass("tensor", 80, 2), collectives_per_pass("pipeline", 80, 4)
    (160, 4)
    """
    if shard == "tensor":
        return 2 * layers
    if shard == "pipeline":
        return ranks
    raise ValueError(f"shard must be 'tensor' or 'pipeline' (got {shard!r})")


def link_ms(passes: float, hops: float, latency_ms: float) -> float:
    """The link term: what `passes` target passes of `hops` collectives each spend waiting on a link of
    `latency_ms` per collective. Example: 48 passes × 4 hops × 0.3 ms -> 57.6 ms
    >>> round(link_ms(48, 4, 0.3), 6)
    57.6
    """
    return float(passes) * float(hops) * float(latency_ms)


def over_link(profile: CostProfile, hops: int, latency_ms: float, exchanges: int = 1) -> CostProfile:
    """The same pair with the target sharded over a link: every target pass pays hops × latency, and
    every drafting cycle `exchanges` more collectives (rank 0 sharing its proposal). A verification over
    k + 1 tokens pays the same round trips as one token, so the link favours speculation.

    Example: target 10 ms, link 0.3 ms × 160 hops = 48 ms per pass -> a step costs 58 ms
    >>> p = over_link(CostProfile({1: 10.0, 5: 11.0}, drafter_ms=1.0), hops=160, latency_ms=0.3)
    >>> round(p.target_ms[1], 6), round(p.target_ms[5], 6), round(p.translate_ms, 6)
    (58.0, 59.0, 0.3)
    """
    if hops < 0 or exchanges < 0 or not math.isfinite(latency_ms) or latency_ms < 0:
        raise ValueError(f"hops, exchanges and latency_ms must be >= 0 (got {hops}, {exchanges}, {latency_ms})")
    extra = hops * latency_ms
    return CostProfile(
        target_ms={w: ms + extra for w, ms in profile.target_ms.items()},
        drafter_ms=profile.drafter_ms,
        translate_ms=profile.translate_ms + exchanges * latency_ms,
        form=profile.form,
        read_ms=profile.read_ms,
    )


def sharded_speedup(
    baseline_ms: float,
    baseline_passes: float,
    speculative_ms: float,
    speculative_passes: float,
    exchanges: float,
    hops: float,
    latency_ms: float,
) -> float:
    """Speedup over a slower link predicted from two runs measured over a fast one: each run's time grows
    by its link term (speculation also pays one exchange per decision).

    Example: baseline 1000 ms in 48 passes, speculative 800 ms in 20 passes + 20 exchanges, 4 hops, 1 ms
    -> (1000 + 192) / (800 + 80 + 20) = 1.324…
    >>> round(sharded_speedup(1000, 48, 800, 20, 20, 4, 1.0), 3)
    1.324
    """
    slow_baseline = baseline_ms + link_ms(baseline_passes, hops, latency_ms)
    slow_speculative = speculative_ms + link_ms(speculative_passes, hops, latency_ms) + exchanges * latency_ms
    return slow_baseline / slow_speculative
