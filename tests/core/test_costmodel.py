"""Cost model: Leviathan's E and measured profiles. Expected values are worked by hand."""

import doctest
import json

import numpy as np
import pytest

from uag.core import costmodel
from uag.core.costmodel import CostProfile, expected_tokens
from uag.core.records import Cycle
from uag.core.speedup import break_even_leviathan, speedup

R, C = 0.07, 0.185  # the study's M2 Pro numbers


def parametric(r: float, c: float, target_ms1: float = 1.0, *, form: str = "study") -> CostProfile:
    """The study's model as a measured profile: a drafter step costs r target steps, translation is free (the
    fitted c absorbs it), a verification over w = k + 1 tokens 1 + c·k² steps; so cycle_ms(k) / target_ms[1]
    = 1 + k·r + c·k² for k < 16 (beyond the table the profile extrapolates linearly)."""
    table = {w: target_ms1 * (1.0 + c * (w - 1) ** 2) for w in range(1, 17)}
    return CostProfile(target_ms=table, drafter_ms=r * target_ms1, form=form)


def test_docstring_examples():
    failures, _ = doctest.testmod(costmodel)
    assert failures == 0


# --- Leviathan ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 2, 5, 8])
def test_expected_tokens_ends(k):
    assert expected_tokens(0.0, k) == 1.0
    assert expected_tokens(1.0, k) == k + 1
    # Near 1 the closed form cancels; the polynomial must not.
    assert expected_tokens(1 - 1e-12, k) == pytest.approx(k + 1, abs=1e-9)


def test_expected_tokens_values():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75, abs=1e-15)
    assert expected_tokens(0.8, 3) == pytest.approx((1 - 0.8**4) / 0.2, rel=1e-12)
    got = expected_tokens(np.array([0.0, 0.5, 1.0]), np.array([2, 2, 3]))
    np.testing.assert_allclose(got, [1.0, 1.75, 4.0])
    with pytest.raises(ValueError):
        expected_tokens(1.2, 2)


# --- measured profiles --------------------------------------------------------------------------------------
def test_measured_profile_by_hand():
    p = CostProfile({1: 10.0, 3: 12.0, 4: 14.0}, drafter_ms=1.0, translate_ms=0.5)
    assert p.target_at(2) == 11.0  # interpolated
    assert p.target_at(6) == 18.0  # extrapolated at 2 ms per token
    assert p.cycle_ms(0) == 10.0  # plain target step
    assert p.cycle_ms(2) == 2 + 0.5 + 12
    assert p.cycle_ms(4) == 4 + 0.5 + 16
    assert p.cycle_ms(2, w=4) == 2 + 0.5 + 14  # translation gave 3 target tokens
    assert p.baseline_rate() == 0.1
    # Leviathan (default): E(0.5, 2) = 1.75 tokens in 14.5 ms vs 1 token in 10 ms
    assert p.expected_rate(0.5, 2) == pytest.approx(1.75 / 14.5)
    assert p.speedup(0.5, 2) == pytest.approx(17.5 / 14.5)


def test_profile_never_gets_cheaper_beyond_table():
    p = CostProfile({1: 10.0, 2: 9.0}, drafter_ms=1.0)
    assert p.target_at(5) == 9.0


def test_profile_rejects_bad_tables():
    with pytest.raises(ValueError):
        CostProfile({2: 10.0}, drafter_ms=1.0)  # no w = 1
    with pytest.raises(ValueError):
        CostProfile({1: -1.0}, drafter_ms=1.0)
    with pytest.raises(ValueError):
        CostProfile({1: 1.0}, drafter_ms=1.0, form="quadratic")


@pytest.mark.parametrize("k", range(0, 9))
def test_parametric_profile_cycle_cost(k):
    p = parametric(R, C, target_ms1=25.0)
    assert p.cycle_ms(k) / p.target_ms[1] == pytest.approx(1 + k * R + C * k * k, rel=1e-12)


@pytest.mark.parametrize("k", range(1, 9))
def test_parametric_profile_matches_study(k):
    p = parametric(R, C, target_ms1=40.0)
    alphas = np.linspace(0, 1, 11)
    np.testing.assert_allclose(p.speedup(alphas, k), (1 + k * alphas) / (1 + k * R + C * k * k), rtol=1e-12)
    np.testing.assert_allclose(p.speedup(alphas, k), speedup(alphas, k, R, C), rtol=1e-12)
    alpha_star = R + C * k
    if alpha_star <= 1:
        assert p.break_even(k) == pytest.approx(alpha_star, abs=1e-9)
    else:
        assert p.break_even(k) is None


@pytest.mark.parametrize("k", range(1, 9))
def test_parametric_profile_matches_leviathan(k):
    p = parametric(R, C, form="leviathan")
    for alpha in (0.0, 0.3, 0.7, 1.0):
        assert p.speedup(alpha, k) == pytest.approx(expected_tokens(alpha, k) / (1 + k * R + C * k * k), rel=1e-12)
    expected = break_even_leviathan(k, R, C)
    if expected is None:
        assert p.break_even(k) is None
    else:
        assert p.break_even(k) == pytest.approx(expected, abs=1e-9)


def test_best_k():
    p = parametric(R, C)
    # The cheapest break-even is k = 1 at 0.07 + 0.185 = 0.255; below it nothing pays.
    assert p.best_k(0.2, 8) == 0
    assert p.best_k(0.0, 8) == 0
    # α = 0.9: k = 1 gives 1.9 / 1.255 = 1.514, k = 2 gives 2.8 / 1.88 = 1.489, k = 3 gives 3.7 / 2.875
    assert p.best_k(0.9, 8) == 1
    # A cheaper verifier makes longer drafts worth it: c = 0.01, α = 0.9
    # -> rate (1 + 0.9k) / (1 + 0.07k + 0.01k²)
    cheap = parametric(R, 0.01)
    rates = [(1 + 0.9 * k) / (1 + 0.07 * k + 0.01 * k * k) for k in range(9)]
    assert cheap.best_k(0.9, 8) == rates.index(max(rates))
    assert cheap.best_k(0.9, 8) > 1


def test_profile_json_round_trip():
    p = CostProfile({1: 20.5, 2: 21.0, 5: 30.25, 16: 80.0}, drafter_ms=1.5, translate_ms=0.3, form="study")
    back = CostProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p
    assert back.target_at(3) == p.target_at(3)
    with_reading = CostProfile({1: 20.0, 4: 26.0}, drafter_ms=2.0, read_ms={1: 2.1, 16: 5.0, 64: 11.0})
    assert CostProfile.from_dict(json.loads(json.dumps(with_reading.to_dict()))) == with_reading
    saved_before = {k: v for k, v in with_reading.to_dict().items() if k != "read_ms"}  # no reading curve yet
    assert CostProfile.from_dict(saved_before).read_ms is None


# --- what a run measures: a profile prices the cycles a run recorded ------------------------------------------

# Verification over w tokens, a drafter step while drafting, and one drafter pass over n tokens, in ms.
MEASURED = CostProfile(
    {1: 100.0, 2: 110.0, 3: 125.0, 5: 150.0}, drafter_ms=12.0, translate_ms=1.0, read_ms={1: 12.5, 9: 16.5, 41: 28.5}
)


def recorded(k, proposed, *, source="model", read=0, passes=None):
    """A cycle as the engine records it (timings irrelevant: the profile prices it)."""
    passes = k if passes is None else passes
    return Cycle(0, k, [0] * k, [0] * proposed, 0, 1, drafter_passes=passes, drafter_read=read, source=source)


def test_reading_n_tokens_is_one_batched_pass_not_n_steps():
    assert MEASURED.drafter_pass(9) == 16.5 and MEASURED.drafter_pass(5) == pytest.approx(14.5)
    assert MEASURED.drafter_pass(81) == pytest.approx(28.5 + 40 * (12.0 / 32))  # past the curve: its last slope
    assert MEASURED.reading_ms(41) == pytest.approx(28.5 - 12.5) and MEASURED.reading_ms(1) == 0.0
    # without a measured curve: a step plus, per extra token, the target's cost per extra token of its widest
    # pass ((150 − 100) / 4) scaled by drafter step / target step (12 / 100)
    estimated = CostProfile(MEASURED.target_ms, drafter_ms=12.0)
    assert estimated.drafter_pass(41) == pytest.approx(12.0 + 40 * 12.5 * 0.12)


@pytest.mark.parametrize(
    "cycle, ms",
    [
        (recorded(0, 0), 100.0),  # a plain step
        (recorded(0, 0, read=41, passes=1), 100.0 + 28.5),  # one that ended with a rehearsal reading 41 tokens
        (recorded(2, 2, read=2), 2 * 12.0 + 1.0 + 125.0),  # k = 2, each pass reading one token
        (recorded(2, 4, read=2), 2 * 12.0 + 1.0 + 150.0),  # translated into 4 target tokens: w = 5
        # its first pass read 40 tokens (41 read by 2 passes): 16.5 + 31 × 12 / 32 for the pass, less a step
        (recorded(2, 2, read=41), 2 * 12.0 + (16.5 + 31 * 12 / 32 - 12.5) + 1.0 + 125.0),
        (recorded(3, 3, source="lookup"), 0.02 + 137.5),  # a lookup and the pass over w = 4
    ],
)
def test_a_profile_prices_each_recorded_cycle_as_the_run_spent_it(cycle, ms):
    assert MEASURED.price(cycle) == pytest.approx(ms)


def test_a_width_between_the_tables_entries_is_priced_as_np_interp_prices_it():
    rng = np.random.default_rng(7)
    for _ in range(200):
        widths = np.unique(np.concatenate([[1], rng.integers(2, 70, size=rng.integers(1, 12))]))
        times = np.cumsum(rng.uniform(0.1, 50.0, size=len(widths)))  # any positive times, rising or not below
        times = rng.permutation(times) if rng.random() < 0.3 else times
        profile = CostProfile(dict(zip(widths.tolist(), times.tolist())), drafter_ms=1.0)
        for w in range(1, int(widths[-1])):
            assert profile.target_at(w) == float(np.interp(w, widths, times)), (widths, times, w)
