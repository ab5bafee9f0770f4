"""A strategy is two settings: the translation and the k policy. Today's names (auto, tli, baseline …) still read
and still name every run; tli with adaptive k can be asked for; a name that contradicts its halves is refused.
No models, no mlx."""

from __future__ import annotations

import pytest

from uag.core.config import (
    K_POLICIES,
    MODES,
    SPECULATIVE,
    TRANSLATIONS,
    GenerationConfig,
    adaptive_k,
    split_strategy,
    strategy_name,
)
from uag.core.policy import AdaptiveK, FixedK, make_policy
from uag.errors import InputError


@pytest.mark.parametrize(
    ("name", "translation", "k_policy"),
    [
        ("baseline", "baseline", "fixed"),
        ("none", "none", "fixed"),
        ("context", "context", "fixed"),
        ("tli", "tli", "fixed"),
        ("auto", "context", "adaptive"),
        ("tli+auto", "tli", "adaptive"),
        ("naive+auto", "naive", "adaptive"),
    ],
)
def test_a_strategy_name_reads_as_its_translation_and_k_policy_and_back(name, translation, k_policy):
    config = GenerationConfig.parse(strategy=name, k=4)
    assert (config.translation, config.k_policy, config.k) == (translation, k_policy, 4)
    assert config.strategy == name == strategy_name(translation, k_policy)
    assert adaptive_k(name) == (k_policy == "adaptive") and config.speculative == (name != "baseline")


def test_every_name_offered_round_trips_and_no_two_name_the_same_settings():
    halves = {split_strategy(name) for name in MODES}
    assert len(halves) == len(MODES) and None not in halves
    for translation in TRANSLATIONS:
        for k_policy in K_POLICIES if translation != "baseline" else ("fixed",):
            assert GenerationConfig(translation, k_policy=k_policy).strategy in MODES
    assert set(SPECULATIVE) == set(MODES) - {"baseline"}
    assert [split_strategy(bad) for bad in ("context+auto", "auto+tli", "tli+", "identity", "")] == [None] * 5


def test_the_fields_are_the_translation_and_the_k_policy_and_the_first_is_still_positional():
    assert GenerationConfig() == GenerationConfig("context", 2, k_policy="fixed")
    assert GenerationConfig("tli", 4).k == 4  # the k policy is keyword-only: positional k keeps its place
    assert GenerationConfig(k_policy="adaptive").strategy == "auto"
    assert not GenerationConfig("baseline").speculative


def test_tli_with_adaptive_k_is_accepted_and_drives_the_adaptive_policy():
    for config in (
        GenerationConfig.parse(strategy="tli", k_policy="adaptive", k=6),
        GenerationConfig.parse(strategy="tli+auto", k=6),
        GenerationConfig("tli", 6, k_policy="adaptive").validate(),
    ):
        assert (config.translation, config.strategy) == ("tli", "tli+auto")
        policy = make_policy(config)
        assert isinstance(policy, AdaptiveK) and policy.k_max == 6
    assert make_policy(GenerationConfig.parse(strategy="tli", k=6)) == FixedK(6)
    assert isinstance(make_policy(GenerationConfig.parse(strategy="auto", k=6)), AdaptiveK)


def test_replace_with_a_strategy_sets_both_halves():
    auto = GenerationConfig.parse(strategy="auto", k=8)
    assert auto.replace(strategy="baseline") == GenerationConfig("baseline", 8)  # the target alone: fixed k
    assert auto.replace(strategy="tli").k_policy == "fixed"
    assert auto.replace(strategy="tli+auto").translation == "tli"
    assert auto.replace(strategy="tli", k_policy="adaptive").strategy == "tli+auto"
    assert auto.replace(k=4).strategy == "auto"  # no strategy given: both halves kept


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (dict(strategy="auto", k_policy="fixed"), "strategy 'auto' means k policy adaptive, not 'fixed'"),
        (dict(strategy="tli+auto", k_policy="fixed"), "strategy 'tli+auto' means k policy adaptive, not 'fixed'"),
        (dict(strategy="auto", translation="tli"), "strategy 'auto' means translation context, not 'tli'"),
        (dict(strategy="naive", translation="context"), "strategy 'naive' means translation naive, not 'context'"),
        (dict(strategy="baseline", k_policy="adaptive"), "k policy adaptive needs a drafter"),
        (dict(translation="baseline", k_policy="adaptive"), "k policy adaptive needs a drafter"),
        (dict(strategy="context+auto"), "strategy must be one of baseline, none, naive, context, tli, auto"),
        (dict(strategy=None), "strategy must be one of"),
        (dict(translation="auto"), "translation must be one of baseline, none, naive, context, tli (got 'auto')"),
        (dict(k_policy="sometimes"), "k policy must be one of fixed, adaptive (got 'sometimes')"),
    ],
)
def test_a_strategy_that_contradicts_its_halves_is_refused_in_one_line(raw, message):
    with pytest.raises(InputError) as err:
        GenerationConfig.parse(**raw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_strategy_that_agrees_with_its_halves_is_taken():
    assert GenerationConfig.parse(strategy="auto", k_policy="adaptive", translation="context").strategy == "auto"
    assert GenerationConfig.parse(strategy="tli", translation="tli").k_policy == "fixed"
