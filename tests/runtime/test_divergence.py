"""Greedy divergence told apart from a bug: pure tests with numbers (uag.runtime.divergence, uag.models.dtypes)."""

from __future__ import annotations

import pytest

from uag.errors import InputError
from uag.models.dtypes import amortises, parse_dtype, precision, slow_dtype_note
from uag.runtime.divergence import (
    DIVERGED,
    IDENTICAL,
    NEAR_TIE,
    classify,
    first_difference,
    near_tie_margin,
)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [([5, 6, 7], [5, 6, 9], 2), ([5, 6], [5, 6, 1], 2), ([5, 6], [5, 6], None), ([], [3], 0), ([1], [2], 0)],
)
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected
    assert first_difference(b, a) == expected


def test_identical_outputs_are_identical_whatever_the_margins():
    d = classify([1, 2, 3], [1, 2, 3], dtype="bfloat16", step_margins=[9.0, 9.0, 9.0])
    assert d.kind == IDENTICAL and d.position is None and d.message() == "" and not d.is_bug


def test_injected_near_tie_is_not_a_bug():
    # token 26 (index 25): the target's top two were 0.004 apart in the step and 0.003 in the pass
    baseline = list(range(100, 140))
    speculative = baseline[:25] + [7, 8, 9]
    d = classify(baseline, speculative, dtype="bfloat16", step_margins={25: 0.004}, pass_margins={25: 0.003})
    assert d.kind == NEAR_TIE and not d.is_bug
    assert (d.position, d.baseline_token, d.speculative_token, d.margin) == (25, 125, 7, 0.004)
    text = d.message()
    assert "token 26" in text and "0.004 apart" in text and "bfloat16" in text and "not a bug" in text
    assert d.to_dict()["kind"] == NEAR_TIE and d.to_dict()["message"] == text


def test_injected_real_mismatch_is_a_bug():
    # the target preferred its token by 3.2 logits: no rounding turns that around
    d = classify([1, 2, 3, 4], [1, 2, 9, 4], dtype="bfloat16", step_margins=[5.0, 5.0, 3.2, 1.0], pass_margins=None)
    assert d.kind == DIVERGED and d.is_bug
    assert (d.position, d.baseline_token, d.speculative_token, d.step_margin, d.pass_margin) == (2, 3, 9, 3.2, None)
    text = d.message("x", "y")
    assert "bug" in text and "token 3" in text and "'x' (id 3)" in text and "'y' (id 9)" in text and "3.2" in text


def test_every_known_margin_must_be_close_for_a_near_tie():
    # close in the plain step, clear in the speculative pass: the pass's verdict was not a coin toss
    d = classify([1, 2], [1, 3], dtype="q4", step_margins={1: 0.01}, pass_margins={1: 2.0})
    assert d.kind == DIVERGED and d.margin == 2.0


def test_the_threshold_fits_the_dtype():
    # a gap of 0.1 can turn in bfloat16, not in float32 (whose bound covers what a batched pass on a GPU moves a gap)
    kw = dict(step_margins={0: 0.1}, pass_margins={0: 0.09})
    assert classify([1], [2], dtype="bfloat16", **kw).kind == NEAR_TIE
    assert classify([1], [2], dtype="float32", **kw).kind == DIVERGED
    assert near_tie_margin("4-bit (bfloat16)") == near_tie_margin("q4")
    assert near_tie_margin("float32") < near_tie_margin("bfloat16")
    assert near_tie_margin("3-bit (float16)") > 0  # a dtype not measured still gets a threshold


def test_unknown_margin_or_an_early_stop_is_reported_as_a_bug():
    unknown = classify([1, 2], [1, 3], dtype="bfloat16")
    assert unknown.kind == DIVERGED and "not known" in unknown.message()
    stopped = classify([1, 2], [1, 2, 5], dtype="bfloat16", step_margins={2: 0.0})
    assert stopped.kind == DIVERGED and stopped.baseline_token is None and "stopped" in stopped.message()


def test_margins_as_a_list_read_only_the_first_differing_position():
    d = classify([1, 2, 3], [1, 5, 6], dtype="q8", step_margins=[9.0, 0.02, 9.0], pass_margins=[9.0, 0.01])
    assert d.kind == NEAR_TIE and d.margin == 0.02


@pytest.mark.parametrize(
    ("text", "expected"),
    [("BF16", "bfloat16"), ("4bit", "q4"), ("q8", "q8"), ("float32", "float32"), ("fp16", "float16"), ("", None)],
)
def test_parse_dtype(text, expected):
    assert parse_dtype(text) == expected


def test_parse_dtype_names_the_choices():
    with pytest.raises(InputError, match=r"--target-dtype: unknown dtype 'int3'.*float32, bfloat16, float16, q8, q4"):
        parse_dtype("int3", flag="--target-dtype")


@pytest.mark.parametrize(
    ("described", "expected"),
    [("float32", "float32"), ("4-bit (bfloat16)", "q4"), ("8-bit (float16)", "q8"), ("bfloat16/float32", "bfloat16")],
)
def test_precision_reads_a_loaded_models_dtype(described, expected):
    assert precision(described) == expected


def test_only_float32_amortises_on_a_cpu():
    assert amortises("float32", "cpu") and not amortises("4-bit (bfloat16)", "cpu") and amortises("q4", "metal")
    assert slow_dtype_note("float32", "cpu") is None and slow_dtype_note("q4", "cuda") is None
    assert "only float32" in slow_dtype_note("bfloat16", "cpu")
