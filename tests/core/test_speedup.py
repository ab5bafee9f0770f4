"""The study's S(α, k) and break-even α*: its Table 7 and Leviathan's form. Expected values are worked by hand."""

import doctest
import math

import numpy as np
import pytest

from uag.core import speedup as speedup_module
from uag.core.costmodel import expected_tokens
from uag.core.speedup import break_even, break_even_leviathan, speedup

R, C = 0.07, 0.185  # the study's M2 Pro numbers

# Table 7: α* = r + c·k in %, and as printed (capped at 100 %).
TABLE_7 = [(2, 0.44, 0.44), (4, 0.81, 0.81), (6, 1.18, 1.00), (8, 1.55, 1.00)]


def test_docstring_examples():
    failures, _ = doctest.testmod(speedup_module)
    assert failures == 0


@pytest.mark.parametrize("k, alpha_star, printed", TABLE_7)
def test_table_7(k, alpha_star, printed):
    assert break_even(k, R, C) == pytest.approx(alpha_star, abs=1e-12)
    assert break_even(k, R, C, cap=True) == pytest.approx(printed, abs=1e-12)
    # S = 1 at the break-even, by definition.
    assert speedup(alpha_star, k, R, C) == pytest.approx(1.0, abs=1e-12)


def test_break_even_vectorised():
    got = break_even(np.array([2, 4, 6, 8]), R, C, cap=True)
    np.testing.assert_allclose(got, [row[2] for row in TABLE_7], atol=1e-12)


def test_speedup_by_hand():
    # (1 + 2·0.5) / (1 + 2·0.07 + 0.185·4) = 2 / 1.88
    assert speedup(0.5, 2, R, C) == pytest.approx(2 / 1.88, rel=1e-12)
    # (1 + 4·0.9) / (1 + 0.28 + 2.96) = 4.6 / 4.24
    assert speedup(0.9, 4, R, C) == pytest.approx(4.6 / 4.24, rel=1e-12)
    grid = speedup(np.array([[0.0], [1.0]]), np.array([1, 2]), R, C)
    np.testing.assert_allclose(grid, [[1 / 1.255, 1 / 1.88], [2 / 1.255, 3 / 1.88]], rtol=1e-12)


def test_break_even_leviathan_by_hand():
    # k = 2: 1 + α + α² = 1.88 -> quadratic formula
    expected = (-1 + math.sqrt(1 + 4 * 0.88)) / 2
    assert break_even_leviathan(2, R, C) == pytest.approx(expected, abs=1e-12)
    # k = 8: the cycle costs 1 + 0.56 + 11.84 = 13.4 target steps > 9 tokens at α = 1
    assert break_even_leviathan(8, R, C) is None
    assert break_even_leviathan(3, 0.0, 0.0) == 0.0  # a free draft pays at any acceptance
    with pytest.raises(ValueError, match="k >= 1"):
        break_even_leviathan(0, R, C)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("r, c", [(0.07, 0.185), (0.02, 0.05), (0.1, 0.0)])
def test_break_even_leviathan_consistent(k, r, c):
    def leviathan(alpha):  # E(α, k) over the study's cycle cost
        return expected_tokens(alpha, k) / (1 + k * r + c * k * k)

    alpha_star = break_even_leviathan(k, r, c)
    if alpha_star is None:
        assert leviathan(1.0) < 1
        return
    assert leviathan(alpha_star) == pytest.approx(1.0, abs=1e-9)
    # Leviathan's E ≤ 1 + kα, so it breaks even no earlier than the study's form.
    assert alpha_star >= break_even(k, r, c) - 1e-12
