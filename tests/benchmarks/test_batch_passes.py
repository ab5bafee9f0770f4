"""benchmarks/batch_passes.py --margins: the rows and shapes it measures, its arithmetic, and on a tiny float32 target
that a batched pass (kept caches with holes, and merged afresh) stays within rounding of each row's own pass and its
one-token steps — a pass that mixed rows up, or read a row's holes, would move the gaps by whole logits."""

import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import batch_passes as bp  # noqa: E402  (benchmarks/batch_passes.py)

from tests.support.tiny_models import build_tiny  # noqa: E402


@pytest.mark.parametrize(
    ("rows", "context", "expected"), [(3, 512, [512, 384, 256]), (1, 512, [512]), (2, 40, [40, 20])]
)
def test_row_lengths_run_from_the_context_down_to_half_of_it(rows, context, expected):
    assert bp.row_lengths(rows, context) == expected


def test_shapes_are_each_width_then_the_narrowest_and_widest_mixed():
    assert bp.shapes(3, [1, 9]) == [("1", [1, 1, 1]), ("9", [9, 9, 9]), ("1/9", [1, 9, 1])]
    assert bp.shapes(2, [4]) == [("4", [4, 4])]


def test_spread_and_gap_changes():
    assert bp.spread([3e-6, 1e-6, 2e-6]) == (2e-06, 3e-06) and bp.spread([]) is None
    gap, logit = bp.gap_changes(mx.array([[0.0, 3.0, 2.0]]), mx.array([[0.0, 2.9, 2.05]]))
    assert gap == pytest.approx(0.15, abs=1e-6) and logit == pytest.approx(0.1, abs=1e-6)


def test_the_report_says_whether_the_bound_covers_two_runs_batched_differently():
    table = {(2, "1", "kept"): [{"gap": 1e-6, "logit": 2e-6, "steps": 0.03}], (2, "9", "alone"): [{"steps": 3e-6}]}
    assert bp.worst_drift(table) == {"batched_vs_own": 1e-6, "batched_vs_steps": 0.03, "pass_vs_steps": 3e-6}
    text = bp.drift_report(table, "float32", 0.04)
    assert "does NOT cover two runs batched differently (needs >= 0.06)" in text
    assert "covers two runs batched differently (2 x 0.03)" in bp.drift_report(table, "float32", 0.06)


def test_a_batched_pass_moves_a_tiny_float32_targets_gaps_by_rounding_only(store):
    target = store.get(str(build_tiny("llama", "llama-3.2", seed=41, tie_embeddings=False)))
    table = bp.drift(target.model, target.make_cache, [2, 4], [1, 3], context=24, repeats=3)
    labels = ["1", "3", "1/3"]
    assert set(table) == {(b, w, p) for b in (2, 4) for w in labels for p in ("kept", "afresh")} | {
        (b, w, "alone") for b in (2, 4) for w in ("3", "1/3")
    }
    assert all(len(reps) == 3 for reps in table.values())
    worst = bp.worst_drift(table)
    assert 0 <= worst["batched_vs_own"] < 1e-3 and worst["batched_vs_steps"] < 1e-3 and worst["pass_vs_steps"] < 1e-3
    assert max(r["logit"] for (_, _, p), reps in table.items() if p != "alone" for r in reps) < 1e-3
