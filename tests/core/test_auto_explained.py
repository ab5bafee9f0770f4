"""An auto run is explained in the draft lengths it chose and the costs it measured, not at its maximum k."""

from __future__ import annotations

from uag.app.compare_view import explain
from uag.core.records import Cycle, Run, Token


def finished(n: int, seconds: float, *, translation: str, cycles=(), k_policy="fixed", k=8) -> Run:
    """A run of n tokens spread evenly over `seconds` after the first."""
    run = Run(translation, "t", None if translation == "baseline" else "d", k=k, k_policy=k_policy)
    run.tokens, run.finish_reason = [Token(i, f"<{i}>", False) for i in range(n)], "length"
    run.first_token_s, run.last_token_s = 100.0, 100.0 + seconds
    run.cycles = list(cycles)
    return run


def drafted(k: int, accepted: int, ms: float) -> Cycle:
    """A model cycle of k drafts (as many target tokens) whose phases took `ms` in all."""
    return Cycle(0, k, [0] * k, [0] * k, accepted, accepted + 1, draft_ms=0.2 * ms, verify_ms=0.8 * ms, source="model")


def test_an_auto_run_is_explained_in_the_k_it_ran_at_the_costs_it_measured():
    # target alone: 100 ms a token. auto (k <= 8) drafted k = 1 three times (125 ms: 1.25 steps for 1 proposed
    # token -> break-even at α* = 25 %) and k = 2 once, and parked for four steps
    baseline = finished(11, 1.0, translation="baseline")
    cycles = [drafted(1, 1, 125.0)] * 3 + [drafted(2, 1, 150.0)] + [Cycle.plain(0, 100.0)] * 4
    auto = finished(11, 0.9, translation="context", cycles=cycles, k_policy="adaptive")
    text = explain(baseline, auto, r=0.07)
    assert "auto drafted k = 1 in 3, k = 2 in 1 cycles." in text
    assert "a k = 1 cycle took 125 ms (1.25 target steps) for 1.0 proposed tokens: break-even at α* = 25%" in text
    assert "for k = 1; this run's α was 80%" in text  # the study's model at the k that ran, not at k = 8
    assert "k = 8" not in text and "auto parked for 4 target steps" in text


def test_a_cycle_dearer_than_its_drafts_can_earn_is_called_unreachable():
    baseline = finished(11, 1.0, translation="baseline")
    slow = finished(11, 2.0, translation="context", cycles=[drafted(2, 1, 400.0)] * 5, k=2)
    assert "(4.00 target steps) for 2.0 proposed tokens: break-even at α* = 150%, unreachable; this run's α" in explain(
        baseline, slow
    )
