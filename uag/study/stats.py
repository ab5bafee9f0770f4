"""The study's empirical break-even: OLS of tokens/s on acceptance over prompts, delta-method interval.

Per drafter × dataset, over prompts: TPS = a + b·α. Speculation pays where a + b·α ≥ TPS_base, so the
break-even acceptance is α* = (TPS_base − a) / b. Its standard error comes from the delta method with the
OLS covariance of (a, b) and, when TPS_base is itself a sample mean, its variance:

    ∇α* = (∂/∂a, ∂/∂b, ∂/∂TPS_base) = (−1/b, −(TPS_base − a)/b², 1/b)
    Var(α*) = ∇ᵀ · blockdiag(Cov(a, b), Var(TPS_base)) · ∇

α is a fraction in [0, 1] throughout. These functions run on arbitrary user runs in the app, so odd data
(too few prompts, one α, a flat or falling slope, NaNs) gives a result with a ``note``, never an exception.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd

DEFAULT_LEVEL = 0.95
DEFAULT_BUCKET_WIDTH = 0.10


@dataclass(frozen=True, slots=True)
class BreakEven:
    """OLS fit TPS = a + b·α and the break-even α* = (TPS_base − a) / b with its delta-method interval.

    Fields are None where the data cannot give them; ``note`` says why (empty when all is well).
    α* > 1 means speculation does not pay at any reachable acceptance; α* < 0 means it pays at every α.
    """

    a: float | None
    b: float | None
    alpha_star: float | None
    ci_low: float | None
    ci_high: float | None
    se: float | None
    r2: float | None
    n: int
    p_b: float | None  # two-sided p-value of the slope (t test)
    note: str = ""
    level: float = DEFAULT_LEVEL
    tps_base: float | None = None

    @property
    def has_interval(self) -> bool:
        return self.ci_low is not None and self.ci_high is not None


def _none_if_nan(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def break_even_ols(
    alpha: Any,
    tps: Any,
    tps_base: float,
    *,
    tps_base_var: float = 0.0,
    level: float = DEFAULT_LEVEL,
) -> BreakEven:
    """Fit TPS = a + b·α over prompts and return the break-even α* with a normal-quantile interval.

    ``tps_base_var`` is Var(TPS_base): the squared standard error when the baseline is a mean over runs
    (0 treats it as known). ``level`` is the interval's coverage.

    Example: points on TPS = 8 + 16·α with a baseline of 14.4 -> α* = (14.4 − 8) / 16 = 0.4
    >>> fit = break_even_ols([0.2, 0.3, 0.5, 0.6], [11.2, 12.8, 16.0, 17.6], 14.4)
    >>> round(fit.alpha_star, 12), round(fit.se, 12)
    (0.4, 0.0)
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must lie strictly between 0 and 1 (got {level!r})")
    notes: list[str] = []

    def result(n: int, **fields: Any) -> BreakEven:
        values = dict(a=None, b=None, alpha_star=None, ci_low=None, ci_high=None, se=None, r2=None, p_b=None)
        values.update(fields)
        base = _none_if_nan(tps_base) if _is_number(tps_base) else None
        return BreakEven(n=n, note="; ".join(notes), level=level, tps_base=base, **values)

    try:
        x = np.asarray(alpha, dtype=float).ravel()
        y = np.asarray(tps, dtype=float).ravel()
    except (TypeError, ValueError) as err:
        notes.append(f"alpha and tps must be numbers ({err})")
        return result(0)
    if len(x) != len(y):
        notes.append(f"alpha and tps differ in length ({len(x)} vs {len(y)})")
        return result(0)
    keep = np.isfinite(x) & np.isfinite(y)
    if not keep.all():
        notes.append(f"dropped {int((~keep).sum())} rows with missing α or TPS")
    x, y = x[keep], y[keep]
    n = len(x)
    if n < 2:
        notes.append(f"need at least 2 prompts with α and TPS (got {n})")
        return result(n)
    if np.ptp(x) == 0:
        notes.append(f"all prompts have the same α ({x[0]:.3g}): the slope is not identified")
        return result(n, a=float(y.mean()))

    base_known = _is_number(tps_base) and math.isfinite(float(tps_base))
    var_base = float(tps_base_var) if _is_number(tps_base_var) else float("nan")
    if not math.isfinite(var_base) or var_base < 0:
        notes.append(f"baseline variance {tps_base_var!r} is unusable; treated as 0")
        var_base = 0.0

    import statsmodels.api as sm  # heavy; only the fit needs it

    try:
        a, b, cov, r2, p_b = _fit_line(sm.OLS, x, y)
    except Exception as err:  # noqa: BLE001 - the app must keep going on any data
        notes.append(f"OLS failed: {err}")
        return result(n)

    fields: dict[str, Any] = dict(a=a, b=b, r2=r2, p_b=p_b)
    if not base_known:
        notes.append(f"baseline TPS {tps_base!r} is not a number")
        return result(n, **fields)
    base = float(tps_base)
    # "Flat" = TPS changes by round-off only across the observed α range.
    if not b > 1e-9 * (1.0 + float(np.max(np.abs(y)))) / float(np.ptp(x)):
        trend = "falls" if b < 0 else "is flat"
        notes.append(f"slope b = {b:.3g}: TPS {trend} with α, so there is no break-even")
        return result(n, **fields)

    alpha_star = (base - a) / b
    fields["alpha_star"] = alpha_star
    if alpha_star > 1:
        notes.append("α* > 100 %: speculation does not pay at any acceptance on this fit")
    elif alpha_star < 0:
        notes.append("α* < 0: speculation pays at every acceptance on this fit")
    if cov is None:
        notes.append("only 2 prompts: no residual variance, so no interval")
        return result(n, **fields)
    if p_b is not None and p_b > 1 - level:
        notes.append(f"slope not significant (p = {p_b:.2g}): the delta-method interval is unreliable")

    grad = np.array([-1.0 / b, -(base - a) / b**2])
    variance = float(grad @ cov @ grad) + var_base / b**2
    if not math.isfinite(variance) or variance < 0:
        notes.append("the interval could not be computed")
        return result(n, **fields)
    se = math.sqrt(variance)
    z = NormalDist().inv_cdf(0.5 + level / 2)
    return result(n, **fields, se=se, ci_low=alpha_star - z * se, ci_high=alpha_star + z * se)


def _fit_line(ols: Any, x: np.ndarray, y: np.ndarray) -> tuple[float, float, Any, float | None, float | None]:
    """Fit y = a + b·x with `ols` (statsmodels' OLS) over n ≥ 2 points with distinct x: (a, b, Cov(a, b), R², the
    p-value of b); the covariance and the p-value are None for 2 points (no residual variance).
    Example: x = [0, 1, 2], y = [1, 3, 5] -> a = 1, b = 2"""
    n = len(x)
    design = np.column_stack([np.ones(n), x])  # explicit: add_constant would skip the constant on degenerate x
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        fit = ols(y, design).fit()
        a, b = (float(v) for v in fit.params)
        cov = np.asarray(fit.cov_params(), dtype=float) if n > 2 else None
        r2 = _none_if_nan(fit.rsquared)
        p_b = _none_if_nan(fit.pvalues[1]) if n > 2 else None
    return a, b, cov, r2, p_b


def _is_number(x: Any) -> bool:
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def bucket_means(
    alpha: Any, speedup: Any, width: float = DEFAULT_BUCKET_WIDTH, *, drop_empty: bool = True
) -> pd.DataFrame:
    """Mean speedup per acceptance bucket [lo, hi) (the last bucket includes α = 1), as in the study's
    Tables 6 and 8–10. Columns: bucket ("0–10 %", …), lo, hi, n, mean_speedup, sem (NaN when n < 2).

    Rows with α outside [0, 1] or a missing value are left out; ``drop_empty=False`` keeps buckets with
    n = 0.
    Example: α = 0.12, 0.18 with speedups 0.8, 1.0 -> one row "10–20 %", n = 2, mean 0.9, sem 0.1
    """
    if not 0.0 < width <= 1.0:
        raise ValueError(f"width must lie in (0, 1] (got {width!r})")
    a = np.asarray(alpha, dtype=float).ravel()
    s = np.asarray(speedup, dtype=float).ravel()
    if len(a) != len(s):
        raise ValueError(f"alpha and speedup differ in length ({len(a)} vs {len(s)})")
    keep = np.isfinite(a) & np.isfinite(s) & (a >= 0) & (a <= 1)
    a, s = a[keep], s[keep]

    count = max(1, math.ceil(round(1.0 / width, 9)))
    # Rounded edges so that α = 0.3 lands in 30–40 % despite 3 · 0.1 = 0.30000000000000004.
    edges = np.minimum(np.round(np.arange(count + 1) * width, 12), 1.0)
    index = np.clip(np.searchsorted(edges, a, side="right") - 1, 0, count - 1)

    rows = []
    for i in range(count):
        values = s[index == i]
        if drop_empty and len(values) == 0:
            continue
        lo, hi = float(edges[i]), float(edges[i + 1])
        sem = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
        rows.append(
            {
                "bucket": f"{lo * 100:g}–{hi * 100:g} %",
                "lo": lo,
                "hi": hi,
                "n": len(values),
                "mean_speedup": float(values.mean()) if len(values) else float("nan"),
                "sem": float(sem),
            }
        )
    columns = ["bucket", "lo", "hi", "n", "mean_speedup", "sem"]
    return pd.DataFrame(rows, columns=columns).astype({"n": int})
