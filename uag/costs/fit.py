"""Fitting the study's cost model to observations: c from per-run speedups. No mlx.

The model itself is uag.core.speedup (S(α, k), α*) and uag.core.costmodel (Leviathan's E); uag.study.analyze
and the app's history fit it to measured runs here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from uag.core.costmodel import Form, check_form, draft_lengths, expected_tokens


@dataclass(frozen=True, slots=True)
class CFit:
    """A fit of the verification-cost coefficient c to observed speedups."""

    c: float
    rmse: float  # root mean squared residual, in speedup units
    r2: float  # 1 − SS_res / SS_tot (nan when the observed speedups do not vary)
    n: int  # observations used (non-finite rows are dropped)
    form: str


def fit_c_from_speedups(alpha: Any, k: Any, speedup: Any, r: Any, *, form: Form = "study") -> CFit:
    """Least-squares c from per-run (α, k, speedup) observations, r fixed: one r for every run, or one per run
    (runs of one served pair differ in how much of their drafting the drafter's model did; lookup's costs 0).

    Minimises Σ (speedup − N(α, k) / (1 + k·r + c·k²))², N = 1 + k·α (``form="study"``) or E(α, k)
    (``"leviathan"``). Starts from the linearised fit (N / speedup = 1 + k·r + c·k² is linear in c) and
    refines it with scipy's least_squares. Rows with k = 0 carry no information on c.
    """
    from scipy.optimize import least_squares  # comes with statsmodels; imported here to keep imports light

    check_form(form)
    a, kk, s = (np.asarray(x, dtype=float).ravel() for x in (alpha, k, speedup))
    if not (len(a) == len(kk) == len(s)):
        raise ValueError(f"alpha, k and speedup differ in length ({len(a)}, {len(kk)}, {len(s)})")
    keep = np.isfinite(a) & np.isfinite(kk) & np.isfinite(s)
    rr = np.asarray(r, dtype=float).ravel() if np.ndim(r) else np.full(a.shape, float(r))
    if rr.shape != a.shape or not np.all(np.isfinite(rr)):
        raise ValueError(f"r must be one finite number or one per run ({len(a)}), got {np.size(r)} values")
    a, kk, s, rr = a[keep], draft_lengths(kk[keep]), s[keep], rr[keep]
    if not np.any(kk > 0):
        raise ValueError("fit_c_from_speedups needs at least one finite observation with k > 0")
    numerator = np.asarray(1.0 + kk * a if form == "study" else expected_tokens(np.clip(a, 0, 1), kk))
    k2 = kk.astype(float) ** 2
    base = 1.0 + kk * rr

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
