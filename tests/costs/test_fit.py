"""Fitting the study's cost model to measured runs: c from per-run speedups, in either form (uag.costs.fit)."""

import doctest

import numpy as np
import pytest

from uag.costs import fit as costfit
from uag.costs.fit import fit_c_from_speedups

R, C = 0.07, 0.185  # the study's M2 Pro numbers


def test_docstring_examples():
    failures, _ = doctest.testmod(costfit)
    assert failures == 0


# --- fitting c from speedups --------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["study", "leviathan"])
@pytest.mark.parametrize("c_true", [0.185, 0.03, 0.4])
def test_fit_c_from_speedups_noiseless(form, c_true):
    rng = np.random.default_rng(7)
    alpha = rng.uniform(0.05, 0.95, 60)
    k = rng.integers(1, 9, 60)
    if form == "study":
        tokens = 1 + k * alpha
    else:  # E as the plain sum 1 + α + … + α^k
        tokens = np.array([sum(a**i for i in range(j + 1)) for a, j in zip(alpha, k)])
    observed = tokens / (1 + k * R + c_true * k**2)
    fit = fit_c_from_speedups(alpha, k, observed, R, form=form)
    assert fit.c == pytest.approx(c_true, abs=1e-6)
    assert fit.rmse < 1e-9
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)
    assert fit.n == 60


def test_fit_c_from_speedups_takes_each_runs_own_r():
    """Served runs of one hybrid differ in how much their drafter's model drafted (lookup's cycles cost 0): with
    each run's r the fit recovers c; with one r for all it does not; a wrong count of r's is refused."""
    rng = np.random.default_rng(11)
    alpha, k = rng.uniform(0.2, 0.95, 40), rng.integers(1, 9, 40)
    r = rng.choice([0.0, 0.1, 0.4], 40)
    observed = (1 + k * alpha) / (1 + k * r + 0.05 * k**2)
    assert fit_c_from_speedups(alpha, k, observed, r).c == pytest.approx(0.05, abs=1e-6)
    assert abs(fit_c_from_speedups(alpha, k, observed, 0.4).c - 0.05) > 0.01
    with pytest.raises(ValueError, match="one per run \\(40\\), got 3 values"):
        fit_c_from_speedups(alpha, k, observed, [0.1, 0.2, 0.3])


def test_fit_c_from_speedups_noisy_is_close():
    rng = np.random.default_rng(3)
    alpha = rng.uniform(0.1, 0.9, 400)
    k = rng.integers(1, 7, 400)
    observed = (1 + k * alpha) / (1 + k * R + C * k**2) + rng.normal(0, 0.02, 400)
    fit = fit_c_from_speedups(alpha, k, observed, R)
    assert fit.c == pytest.approx(C, abs=0.005)
    assert 0.015 < fit.rmse < 0.025
