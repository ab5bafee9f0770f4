"""When does speculative decoding pay? The study's S(α, k) and break-even α*. No mlx.

Costs are in units of one plain target step (see uag.core.costmodel for one cycle). The study's parametric
model (M2 Pro; r = drafter bytes / target bytes ≈ 0.07, fitted c ≈ 0.185)::

    S(α, k) = (1 + k·α) / (1 + k·r + c·k²)        α* = r + c·k      (S = 1)

Under Leviathan et al.'s expected tokens E(α, k) = 1 + α + … + α^k (uag.core.costmodel.expected_tokens) the
same cycle breaks even later: where E(α, k) = 1 + k·r + c·k² (``break_even_leviathan``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from uag.core.costmodel import draft_lengths, scalar_or_array


def speedup(alpha: Any, k: Any, r: float, c: float) -> float | np.ndarray:
    """The study's S(α, k) = (1 + k·α) / (1 + k·r + c·k²); broadcasts over arrays of α and k.

    Example: speedup(0.5, 2, 0.07, 0.185) = 2 / 1.88 -> 1.0638...
    >>> round(speedup(0.5, 2, 0.07, 0.185), 4)
    1.0638
    >>> speedup([0.0, 1.0], 0, 0.07, 0.185).tolist()  # k = 0 is a plain target step
    [1.0, 1.0]
    """
    a = np.asarray(alpha, dtype=float)
    kk = draft_lengths(k)
    return scalar_or_array((1.0 + kk * a) / (1.0 + kk * r + c * kk.astype(float) ** 2))


def break_even(k: Any, r: float, c: float, *, cap: bool = False) -> float | np.ndarray:
    """The study's break-even acceptance α* = r + c·k (where S = 1). Not capped: α* > 1 means speculation
    with this k cannot pay off; ``cap=True`` clips to 1.0 for display, as the paper's Table 7 does.

    Example: break_even(2, 0.07, 0.185) -> 0.44;  break_even(6, 0.07, 0.185) -> 1.18 (1.0 with cap=True)
    >>> round(break_even(2, 0.07, 0.185), 12)
    0.44
    >>> break_even([2, 4, 6, 8], 0.07, 0.185, cap=True).round(12).tolist()
    [0.44, 0.81, 1.0, 1.0]
    """
    kk = draft_lengths(k)
    alpha_star = r + c * kk.astype(float)
    if cap:
        alpha_star = np.minimum(alpha_star, 1.0)
    return scalar_or_array(alpha_star)


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
    k = int(draft_lengths(k))
    if k == 0:
        raise ValueError("break_even_leviathan needs k >= 1: a plain step drafts nothing")
    cost = 1.0 + k * r + c * k * k
    if cost <= 1:
        return 0.0
    roots = np.roots([1.0] * k + [1.0 - cost])
    alpha = float(max(x.real for x in roots if abs(x.imag) < 1e-9 and x.real > 0))
    return None if cap and alpha > 1 else alpha
