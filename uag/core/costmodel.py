"""When does speculative decoding pay? Break-even models of one draft → verify cycle. No mlx.

A cycle: the drafter proposes k tokens (k drafter steps), they are translated, and the target verifies them
in one forward pass over w = k + 1 new tokens. Costs are in units of one plain target step (one token).

The study's parametric model (M2 Pro; r = drafter bytes / target bytes ≈ 0.07, fitted c ≈ 0.185)::

    S(α, k) = (1 + k·α) / (1 + k·r + c·k²)        α* = r + c·k      (S = 1)

The numerator is the tokens one cycle commits when α is the measured acceptance rate (accepted / proposed):
k·α accepted draft tokens plus the target's own token. Leviathan et al. instead treat α as the chance that
each draft token is accepted, independently, with acceptance stopping at the first rejection::

    E(α, k) = (1 − α^(k+1)) / (1 − α)            S_L(α, k) = E(α, k) / (1 + k·r + c·k²)

E ≤ 1 + k·α, so the same α breaks even later under Leviathan's form. ``form="study"`` / ``"leviathan"``
picks the numerator wherever both make sense. ``CostProfile`` replaces the parametric denominator with
measured milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Form = Literal["study", "leviathan"]
FORMS: tuple[str, ...] = ("study", "leviathan")

DEFAULT_K_MAX = 8
DEFAULT_W_MAX = 16  # target forward widths a calibration measures: w = 1..16 new tokens

_BISECT_TOL = 1e-13


def _out(x: np.ndarray) -> float | np.ndarray:
    """A 0-d result as a plain float, anything else as the array."""
    return float(x) if np.ndim(x) == 0 else x


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} (got {form!r})")


def _check_k(k: Any) -> np.ndarray:
    kk = np.asarray(k)
    if kk.dtype.kind not in "iuf" or np.any(kk < 0) or np.any(kk != np.round(kk)):
        raise ValueError(f"draft length k must be a non-negative integer (got {k!r})")
    return kk.astype(np.int64)


def cycle_cost(k: Any, r: float, c: float) -> float | np.ndarray:
    """The study's cycle cost in target steps: 1 + k·r + c·k².

    Example: cycle_cost(2, 0.07, 0.185) -> 1.88
    >>> round(cycle_cost(2, 0.07, 0.185), 12)
    1.88
    """
    kk = _check_k(k)
    return _out(1.0 + kk * r + c * kk.astype(float) ** 2)


# --- the study's parametric model ---------------------------------------------------------------------------
def speedup(alpha: Any, k: Any, r: float, c: float) -> float | np.ndarray:
    """The study's S(α, k) = (1 + k·α) / (1 + k·r + c·k²); broadcasts over arrays of α and k.

    Example: speedup(0.5, 2, 0.07, 0.185) = 2 / 1.88 -> 1.0638...
    >>> round(speedup(0.5, 2, 0.07, 0.185), 4)
    1.0638
    >>> speedup([0.0, 1.0], 0, 0.07, 0.185).tolist()  # k = 0 is a plain target step
    [1.0, 1.0]
    """
    a = np.asarray(alpha, dtype=float)
    kk = _check_k(k)
    return _out((1.0 + kk * a) / (1.0 + kk * r + c * kk.astype(float) ** 2))


def break_even(k: Any, r: float, c: float, *, cap: bool = False) -> float | np.ndarray:
    """The study's break-even acceptance α* = r + c·k (where S = 1). Not capped: α* > 1 means speculation
    with this k cannot pay off; ``cap=True`` clips to 1.0 for display, as the paper's Table 7 does.

    Example: break_even(2, 0.07, 0.185) -> 0.44;  break_even(6, 0.07, 0.185) -> 1.18 (1.0 with cap=True)
    >>> round(break_even(2, 0.07, 0.185), 12)
    0.44
    >>> break_even([2, 4, 6, 8], 0.07, 0.185, cap=True).round(12).tolist()
    [0.44, 0.81, 1.0, 1.0]
    """
    kk = _check_k(k)
    alpha_star = r + c * kk.astype(float)
    if cap:
        alpha_star = np.minimum(alpha_star, 1.0)
    return _out(alpha_star)


# --- Leviathan et al. ---------------------------------------------------------------------------------------
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
    kk = _check_k(k)
    a, kk = np.broadcast_arrays(a, kk)
    k_max = int(kk.max()) if kk.size else 0
    # Horner from the top power down; terms above each element's own k are masked out.
    total = np.zeros(a.shape)
    for i in range(k_max, -1, -1):
        total = total * a + (i <= kk)
    return _out(total)


def speedup_leviathan(alpha: Any, k: Any, r: float, c: float) -> float | np.ndarray:
    """Leviathan's expected tokens over the study's cycle cost: E(α, k) / (1 + k·r + c·k²).

    Example: speedup_leviathan(0.5, 2, 0.07, 0.185) = 1.75 / 1.88 -> 0.9309...
    >>> round(speedup_leviathan(0.5, 2, 0.07, 0.185), 4)
    0.9309
    """
    kk = _check_k(k)
    return _out(np.asarray(expected_tokens(alpha, kk)) / (1.0 + kk * r + c * kk.astype(float) ** 2))


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


def break_even_leviathan(k: int, r: float, c: float, *, cap: bool = True) -> float | None:
    """Leviathan's break-even: the α ≥ 0 where E(α, k) = 1 + α + … + α^k equals the cycle cost 1 + k·r + c·k².

    α^k + … + α + (1 − cost) has one sign change, hence exactly one positive root when the cost is above 1
    (a cost at or below 1 pays at any α: 0). With `cap` (default) a root above 1 — no acceptance rate pays —
    is None; without it the root is returned as is, comparable to the study's uncapped α* = r + c·k.
    Example: k = 2 solves 1 + α + α² = 1.88 -> α = (−1 + √4.52) / 2 = 0.5630...; k = 8 -> None (root 1.05…)
    >>> round(break_even_leviathan(2, 0.07, 0.185), 4)
    0.563
    >>> break_even_leviathan(8, 0.07, 0.185) is None, round(break_even_leviathan(6, 0.07, 0.185, cap=False), 3)
    (True, 1.047)
    """
    k = int(_check_k(k))
    cost = 1.0 + k * r + c * k * k
    if cost <= 1:
        return 0.0
    roots = np.roots([1.0] * k + [1.0 - cost])
    alpha = float(max(x.real for x in roots if abs(x.imag) < 1e-9 and x.real > 0))
    return None if cap and alpha > 1 else alpha


# --- fitting c (and r) --------------------------------------------------------------------------------------
def fit_c(points: Iterable[tuple[float, float]], r: float) -> float:
    """Least-squares c in α* = r + c·k from observed (k, α*) pairs, r fixed: c = Σ k(α* − r) / Σ k².

    Example: (2, 0.44), (4, 0.81) with r = 0.07 -> (2·0.37 + 4·0.74) / (4 + 16) = 0.185
    >>> round(fit_c([(2, 0.44), (4, 0.81)], 0.07), 12)
    0.185
    """
    pts = np.asarray(list(points), dtype=float).reshape(-1, 2)
    k, alpha_star = pts[:, 0], pts[:, 1]
    denominator = float(np.sum(k * k))
    if denominator == 0:
        raise ValueError(f"fit_c needs at least one point with k > 0 (got {pts.tolist()})")
    return float(np.sum(k * (alpha_star - r)) / denominator)


def fit_r_c(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (r, c) in α* = r + c·k from observed (k, α*) pairs (ordinary line fit).

    Example: the paper's (2, .44), (4, .81), (6, 1.18), (8, 1.55) -> (0.07, 0.185)
    >>> [round(x, 12) for x in fit_r_c([(2, .44), (4, .81), (6, 1.18), (8, 1.55)])]
    [0.07, 0.185]
    """
    pts = np.asarray(list(points), dtype=float).reshape(-1, 2)
    k, alpha_star = pts[:, 0], pts[:, 1]
    if len(np.unique(k)) < 2:
        raise ValueError(f"fit_r_c needs points at two or more distinct k (got {pts.tolist()})")
    k_mean = k.mean()
    c = float(np.sum((k - k_mean) * (alpha_star - alpha_star.mean())) / np.sum((k - k_mean) ** 2))
    return float(alpha_star.mean() - c * k_mean), c


@dataclass(frozen=True, slots=True)
class CFit:
    """A fit of the verification-cost coefficient c to observed speedups."""

    c: float
    rmse: float  # root mean squared residual, in speedup units
    r2: float  # 1 − SS_res / SS_tot (nan when the observed speedups do not vary)
    n: int  # observations used (non-finite rows are dropped)
    form: str


def fit_c_from_speedups(alpha: Any, k: Any, speedup: Any, r: float, *, form: Form = "study") -> CFit:
    """Least-squares c from per-run (α, k, speedup) observations, r fixed.

    Minimises Σ (speedup − N(α, k) / (1 + k·r + c·k²))², N = 1 + k·α (``form="study"``) or E(α, k)
    (``"leviathan"``). Starts from the linearised fit (N / speedup = 1 + k·r + c·k² is linear in c) and
    refines it with scipy's least_squares. Rows with k = 0 carry no information on c.
    """
    from scipy.optimize import least_squares  # comes with statsmodels; imported here to keep imports light

    _check_form(form)
    a, kk, s = (np.asarray(x, dtype=float).ravel() for x in (alpha, k, speedup))
    if not (len(a) == len(kk) == len(s)):
        raise ValueError(f"alpha, k and speedup differ in length ({len(a)}, {len(kk)}, {len(s)})")
    keep = np.isfinite(a) & np.isfinite(kk) & np.isfinite(s)
    a, kk, s = a[keep], _check_k(kk[keep]), s[keep]
    if not np.any(kk > 0):
        raise ValueError("fit_c_from_speedups needs at least one finite observation with k > 0")
    numerator = np.asarray(1.0 + kk * a if form == "study" else expected_tokens(np.clip(a, 0, 1), kk))
    k2 = kk.astype(float) ** 2
    base = 1.0 + kk * r

    # Linearised start, over rows that say something about c.
    informative = (kk > 0) & (s > 0)
    if np.any(informative):
        y = numerator[informative] / s[informative] - base[informative]
        c0 = float(np.sum(k2[informative] * y) / np.sum(k2[informative] ** 2))
    else:
        c0 = 0.0
    # The cost must stay positive for every observed k.
    c_floor = float(np.max(-base[kk > 0] / k2[kk > 0])) + 1e-9
    c0 = max(c0, c_floor + 1e-6)

    def residuals(p: np.ndarray) -> np.ndarray:
        return s - numerator / (base + p[0] * k2)

    fit = least_squares(residuals, x0=[c0], bounds=([c_floor], [np.inf]), xtol=1e-15, ftol=1e-15, gtol=1e-15)
    res = residuals(fit.x)
    ss_res = float(np.sum(res**2))
    ss_tot = float(np.sum((s - s.mean()) ** 2))
    return CFit(
        c=float(fit.x[0]),
        rmse=math.sqrt(ss_res / len(s)),
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
        n=int(len(s)),
        form=form,
    )


# --- measured costs -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class CostProfile:
    """Measured costs of one target × drafter pair on one machine, in milliseconds.

    ``target_ms[w]`` is one target forward over w new tokens with a filled cache (w = 1 is a plain decode
    step; verifying k drafts is w = k + 1). ``form`` picks the tokens a cycle is expected to commit:
    Leviathan's E(α, k) (default) or the study's 1 + k·α.

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

    def __post_init__(self) -> None:
        _check_form(self.form)
        table = {int(w): float(ms) for w, ms in dict(self.target_ms).items()}
        bad = {w: ms for w, ms in table.items() if w < 1 or not math.isfinite(ms) or ms <= 0}
        if bad or 1 not in table:
            raise ValueError(
                f"target_ms needs w = 1 and positive finite times for integer w >= 1 (got {self.target_ms!r})"
            )
        for name in ("drafter_ms", "translate_ms"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite non-negative number (got {value!r})")
            setattr(self, name, value)
        self.target_ms = dict(sorted(table.items()))

    @classmethod
    def from_parametric(
        cls,
        r: float,
        c: float,
        target_ms1: float = 1.0,
        *,
        w_max: int = DEFAULT_W_MAX,
        form: Form = "study",
    ) -> CostProfile:
        """The study's model as a profile: cycle_ms(k) / target_ms[1] = 1 + k·r + c·k² exactly.

        Mapping: one drafter step costs r target steps, translation is free (the fitted c absorbs it), and
        a verification over w = k + 1 tokens costs 1 + c·k² target steps: target_ms[w] = T1·(1 + c·(w−1)²).
        The table runs to ``w_max``; beyond it ``target_at`` extrapolates linearly, so the profile matches the
        quadratic only for k < w_max. ``form="study"`` reproduces ``speedup``/``break_even``; ``"leviathan"``
        reproduces ``speedup_leviathan``/``break_even_leviathan``.
        """
        if w_max < 1:
            raise ValueError(f"w_max must be >= 1 (got {w_max})")
        table = {w: target_ms1 * (1.0 + c * (w - 1) ** 2) for w in range(1, w_max + 1)}
        return cls(target_ms=table, drafter_ms=r * target_ms1, translate_ms=0.0, form=form)

    def target_at(self, w: int) -> float:
        """Target forward time for w new tokens: the table, linear interpolation between its entries, and
        beyond the widest entry the slope of the last two (never falling: wider passes do not get cheaper).

        Example: {1: 10, 3: 12, 4: 14} -> w = 2: 11 (interpolated), w = 6: 18 (slope 2 ms per token)
        >>> CostProfile({1: 10.0, 3: 12.0, 4: 14.0}, drafter_ms=1.0).target_at(6)
        18.0
        """
        w = int(w)
        if w < 1:
            raise ValueError(f"w must be >= 1 (got {w})")
        if w in self.target_ms:
            return self.target_ms[w]
        widths = list(self.target_ms)
        if w < widths[-1]:
            return float(np.interp(w, widths, list(self.target_ms.values())))
        if len(widths) == 1:
            return self.target_ms[widths[0]]
        w1, w2 = widths[-2], widths[-1]
        slope = max(0.0, (self.target_ms[w2] - self.target_ms[w1]) / (w2 - w1))
        return self.target_ms[w2] + slope * (w - w2)

    def cycle_ms(self, k: int, w: int | None = None) -> float:
        """One cycle: k drafter steps + translation + a target pass over w (default k + 1) tokens.

        k = 0 is a plain target step: target_ms[1], no drafter and no translation. Pass w when translation
        yields a different number of target tokens than k (w = proposed + 1).
        """
        k = int(_check_k(k))
        if k == 0:
            return self.target_at(w or 1)
        return k * self.drafter_ms + self.translate_ms + self.target_at(w or k + 1)

    def tokens_per_cycle(self, alpha: Any, k: int) -> float | np.ndarray:
        """Expected committed tokens per cycle under this profile's form (1 for k = 0)."""
        k = int(_check_k(k))
        if self.form == "study":
            return _out(1.0 + k * np.asarray(alpha, dtype=float))
        return expected_tokens(alpha, k)

    def expected_rate(self, alpha: Any, k: int) -> float | np.ndarray:
        """Expected tokens per millisecond with draft length k (k = 0: the baseline rate)."""
        return _out(np.asarray(self.tokens_per_cycle(alpha, k)) / self.cycle_ms(k))

    def baseline_rate(self) -> float:
        """Tokens per millisecond of plain target decoding: 1 / target_ms[1]."""
        return 1.0 / self.target_ms[1]

    def speedup(self, alpha: Any, k: int) -> float | np.ndarray:
        """Expected rate with draft length k over the baseline rate."""
        return _out(np.asarray(self.expected_rate(alpha, k)) / self.baseline_rate())

    def break_even(self, k: int) -> float | None:
        """Smallest α in [0, 1] with speedup(α, k) >= 1 (bisection); None if even α = 1 does not pay."""
        return _bisect_increasing(lambda a: self.speedup(a, k) - 1.0)

    def best_k(self, alpha: float, k_max: int = DEFAULT_K_MAX) -> int:
        """The draft length in 0..k_max with the highest expected rate (ties go to the smaller k).

        Returns 0 (plain target decoding) when α is below every k's break-even.
        """
        rates = [float(self.expected_rate(alpha, k)) for k in range(int(k_max) + 1)]
        return int(np.argmax(rates))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; target_ms keys become strings."""
        return {
            "target_ms": {str(w): ms for w, ms in self.target_ms.items()},
            "drafter_ms": self.drafter_ms,
            "translate_ms": self.translate_ms,
            "form": self.form,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostProfile:
        return cls(
            target_ms={int(w): float(ms) for w, ms in data["target_ms"].items()},
            drafter_ms=float(data["drafter_ms"]),
            translate_ms=float(data.get("translate_ms", 0.0)),
            form=data.get("form", "leviathan"),
        )


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
    )


def sharded_speedup(
    baseline_ms: float, baseline_passes: float, speculative_ms: float, speculative_passes: float,
    exchanges: float, hops: float, latency_ms: float,
) -> float:  # fmt: skip
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
