"""Empirical break-even (OLS + delta method) and acceptance buckets, checked against direct computations."""

import doctest
import math

import numpy as np
import pytest
from scipy.stats import norm

from uag.study import stats
from uag.study.stats import break_even_ols, bucket_means

A, B, BASE = 8.0, 16.0, 14.7  # true TPS = 8 + 16·α; true α* = 6.7 / 16
TRUE_ALPHA_STAR = (BASE - A) / B


def synthetic(rng, n=50, sigma=1.0):
    alpha = rng.uniform(0.1, 0.7, n)
    return alpha, A + B * alpha + rng.normal(0, sigma, n)


def direct(alpha, tps, base, base_var=0.0, level=0.95):
    """α* and its delta-method interval, by hand: normal equations, σ²(XᵀX)⁻¹, the gradient."""
    n = len(alpha)
    X = np.column_stack([np.ones(n), alpha])
    (a, b), *_ = np.linalg.lstsq(X, tps, rcond=None)
    residuals = tps - X @ np.array([a, b])
    sigma2 = residuals @ residuals / (n - 2)
    cov = sigma2 * np.linalg.inv(X.T @ X)
    alpha_star = (base - a) / b
    grad = np.array([-1 / b, -(base - a) / b**2, 1 / b])
    full = np.zeros((3, 3))
    full[:2, :2] = cov
    full[2, 2] = base_var
    se = math.sqrt(grad @ full @ grad)
    z = norm.ppf(1 - (1 - level) / 2)
    return a, b, alpha_star, se, alpha_star - z * se, alpha_star + z * se


def test_docstring_examples():
    failures, _ = doctest.testmod(stats)
    assert failures == 0


@pytest.mark.parametrize("base_var, level", [(0.0, 0.95), (0.04, 0.95), (0.1, 0.9)])
def test_matches_direct_computation(base_var, level):
    alpha, tps = synthetic(np.random.default_rng(12345))
    got = break_even_ols(alpha, tps, BASE, tps_base_var=base_var, level=level)
    a, b, alpha_star, se, lo, hi = direct(alpha, tps, BASE, base_var, level)
    expected = {"a": a, "b": b, "alpha_star": alpha_star, "se": se, "ci_low": lo, "ci_high": hi}
    for name, value in expected.items():
        assert getattr(got, name) == pytest.approx(value, abs=1e-9), name
    assert got.n == 50
    assert got.note == ""
    assert got.p_b < 1e-6
    r2 = 1 - np.sum((tps - a - b * alpha) ** 2) / np.sum((tps - tps.mean()) ** 2)
    assert got.r2 == pytest.approx(r2, abs=1e-12)


def test_baseline_variance_widens_interval():
    alpha, tps = synthetic(np.random.default_rng(1))
    known = break_even_ols(alpha, tps, BASE)
    estimated = break_even_ols(alpha, tps, BASE, tps_base_var=0.05)
    assert estimated.alpha_star == known.alpha_star
    assert estimated.se**2 == pytest.approx(known.se**2 + 0.05 / known.b**2, rel=1e-12)


def test_coverage_known_baseline():
    rng = np.random.default_rng(2024)
    hits = 0
    for _ in range(400):
        alpha, tps = synthetic(rng)
        fit = break_even_ols(alpha, tps, BASE)
        hits += fit.ci_low <= TRUE_ALPHA_STAR <= fit.ci_high
    assert 0.92 <= hits / 400 <= 0.98


def test_coverage_estimated_baseline():
    # The baseline is the mean of 10 runs with sd 0.5; its variance must enter the interval.
    rng = np.random.default_rng(99)
    hits = 0
    for _ in range(400):
        alpha, tps = synthetic(rng)
        baseline_runs = rng.normal(BASE, 0.5, 10)
        fit = break_even_ols(
            alpha, tps, baseline_runs.mean(), tps_base_var=baseline_runs.var(ddof=1) / len(baseline_runs)
        )
        hits += fit.ci_low <= TRUE_ALPHA_STAR <= fit.ci_high
    assert 0.92 <= hits / 400 <= 0.98


# --- odd data: a note, never an exception -------------------------------------------------------------------
@pytest.mark.parametrize(
    "alpha, tps, reason",
    [
        ([], [], "at least 2"),
        ([0.3], [12.0], "at least 2"),
        ([0.3, 0.3, 0.3], [11.0, 12.0, 13.0], "same α"),
        ([0.1, 0.2, 0.3, 0.4], [14.0, 13.0, 12.0, 11.0], "falls"),
        ([0.1, 0.2, 0.3, 0.4], [12.0, 12.0, 12.0, 12.0], "flat"),
        ([0.1, 0.2, 0.3], [12.0, 13.0], "differ in length"),
        (["x", "y"], [1, 2], "numbers"),
        ([float("nan"), 0.5], [12.0, 13.0], "at least 2"),
    ],
)
def test_odd_data_gives_a_note(alpha, tps, reason):
    fit = break_even_ols(alpha, tps, BASE)
    assert fit.alpha_star is None
    assert not fit.has_interval
    assert reason in fit.note


def test_two_prompts_point_estimate_without_interval():
    fit = break_even_ols([0.2, 0.6], [11.2, 17.6], 14.4)  # line 8 + 16α -> α* = 0.4
    assert fit.alpha_star == pytest.approx(0.4, abs=1e-12)
    assert fit.se is None and not fit.has_interval
    assert "no interval" in fit.note


def test_nan_rows_dropped():
    alpha, tps = synthetic(np.random.default_rng(5), n=20)
    with_gaps = np.append(alpha, [np.nan, 0.5]), np.append(tps, [13.0, np.nan])
    fit = break_even_ols(*with_gaps, BASE)
    clean = break_even_ols(alpha, tps, BASE)
    assert fit.n == 20 and fit.alpha_star == pytest.approx(clean.alpha_star, abs=1e-12)
    assert "dropped 2" in fit.note


def test_unreachable_break_even_is_reported():
    fit = break_even_ols([0.1, 0.2, 0.3, 0.4], [5.0, 6.1, 6.9, 8.0], BASE)  # about 4 + 10α: α* ≈ 1.07
    assert fit.alpha_star > 1
    assert "100 %" in fit.note


def test_bad_baseline_does_not_raise():
    nan = float("nan")
    fit = break_even_ols([0.1, 0.2, 0.3, 0.4], [10.0, 11.1, 11.9, 13.0], nan, tps_base_var=nan)
    assert fit.alpha_star is None and fit.b == pytest.approx(9.8, abs=1e-9)
    assert "not a number" in fit.note


# --- buckets ------------------------------------------------------------------------------------------------
def test_bucket_means_by_hand():
    alpha = [0.05, 0.12, 0.18, 0.3, 0.95, 1.0, float("nan")]
    speedup = [0.5, 0.8, 1.0, 1.2, 2.0, 3.0, 9.0]
    table = bucket_means(alpha, speedup)
    assert list(table.columns) == ["bucket", "lo", "hi", "n", "mean_speedup", "sem"]
    assert table["bucket"].tolist() == ["0–10 %", "10–20 %", "30–40 %", "90–100 %"]
    assert table["n"].tolist() == [1, 2, 1, 2]
    np.testing.assert_allclose(table["lo"], [0.0, 0.1, 0.3, 0.9])
    np.testing.assert_allclose(table["hi"], [0.1, 0.2, 0.4, 1.0])
    np.testing.assert_allclose(table["mean_speedup"], [0.5, 0.9, 1.2, 2.5])
    # sem = sd / √n: sd(0.8, 1.0) = √0.02, / √2 -> 0.1;  sd(2, 3) = √0.5, / √2 -> 0.5
    np.testing.assert_allclose(table["sem"], [np.nan, 0.1, np.nan, 0.5])


def test_bucket_means_keeps_empty_buckets_on_request():
    table = bucket_means([0.25], [1.1], width=0.25, drop_empty=False)
    assert table["bucket"].tolist() == ["0–25 %", "25–50 %", "50–75 %", "75–100 %"]
    assert table["n"].tolist() == [0, 1, 0, 0]
