"""A pair's saved costs and auto's evidence, kept per pair and machine side by side: found again, damaged,
forgotten, a profile timed another way; auto opening from them and judging the profile by the run
(uag.costs.profiles, uag.costs.pair)."""

from __future__ import annotations

import logging

import pytest

from tests.support.saved_costs import fake_pair, learned
from uag.core.costmodel import CostProfile
from uag.core.evidence import Evidence
from uag.costs.profiles import (
    METHOD,
    Calibration,
    evidence_path,
    find_calibration,
    find_evidence,
    forget,
    profile_key,
    profile_path,
    save,
    save_evidence,
)
from uag.models.store import Pair


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A user cache of the test's own."""
    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_evidence_is_kept_per_pair_and_machine_and_found_again(cache):
    pair, other = fake_pair(), fake_pair(drafter="org/other")
    assert find_evidence(pair) is None
    path = save_evidence(pair, learned())
    assert path == evidence_path(profile_key(pair)) and path.parent == cache / "evidence"
    assert find_evidence(pair).confidence == learned().confidence and find_evidence(other) is None
    assert find_evidence(fake_pair(dtype="bfloat16")) is None  # another dtype accepts differently


def test_a_damaged_evidence_file_is_ignored_and_logged(cache, caplog):
    pair = fake_pair()
    save_evidence(pair, learned()).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert find_evidence(pair) is None
    assert "damaged auto evidence" in caplog.text and "--reset" in caplog.text


def saved_both(pair: Pair) -> list:
    """A profile and evidence saved for the pair; their paths."""
    profile = CostProfile({1: 10.0, 2: 11.0}, drafter_ms=1.0)
    return [
        save(Calibration(profile_key(pair), profile, "2026-11-25T00:00:00+00:00", 256)),
        save_evidence(pair, learned()),
    ]


def test_forget_removes_the_pair_profile_and_evidence_and_nothing_else(cache):
    pair, other = fake_pair(), fake_pair(drafter="org/other")
    kept, gone = saved_both(other), saved_both(pair)
    assert sorted(forget("org/target", "org/drafter")) == sorted(gone)
    assert not any(p.exists() for p in gone) and all(p.exists() for p in kept)
    assert find_calibration(pair) is None and find_evidence(pair) is None
    assert forget("org/target", "org/drafter") == []


def test_a_profile_timed_another_way_is_not_found_so_auto_measures_again(cache):
    pair = fake_pair()
    old_key = {k: v for k, v in profile_key(pair).items() if k != "method"}
    save(Calibration(old_key, CostProfile({1: 10.0}, drafter_ms=1.0), "2026-11-01T00:00:00+00:00", 256))
    assert profile_key(pair)["method"] == METHOD and profile_path(old_key) != profile_path(profile_key(pair))
    assert find_calibration(pair) is None
    assert evidence_path(old_key) == evidence_path(profile_key(pair))  # what runs accepted outlives it


@pytest.mark.slow
def test_auto_opens_from_the_pair_s_saved_evidence_and_saves_what_it_learned(demo_pair, cache, monkeypatch):
    """Through the API (what the CLI and the app run): an auto run starts from what earlier runs of the pair
    accepted on this machine, and leaves what it learned for the next one; evidence a caller passes is the
    caller's to keep (the server keeps its own per pair)."""
    import uag.api
    import uag.costs.pair
    from uag.core.config import GenerationConfig
    from uag.core.drafters import DrafterChoice
    from uag.costs.pair import evidence_key

    target, _ = demo_pair
    lookup = DrafterChoice(lookup=True)
    key = evidence_key(target, lookup)
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=12)
    profile = CostProfile({w: 10.0 + w for w in range(1, 6)}, drafter_ms=0.0)
    prompt = "one two three four five six. one two three four five six. one two three four five six. one two"
    assert find_evidence(key) is None
    run = uag.api.generate(target, lookup, prompt, config, profile=profile)
    first = find_evidence(key)
    assert run.proposed > 0 and sum(first.lookup.accepted) + sum(first.lookup.rejected) > 0

    opened_with, kept = [], []
    engine, keep = uag.api._stream, uag.costs.pair.keep_evidence
    opening = lambda *a, **kw: opened_with.append((kw["evidence"], kw["evidence"].to_dict())) or engine(*a, **kw)  # noqa: E731
    monkeypatch.setattr(uag.api, "_stream", opening)
    monkeypatch.setattr(uag.costs.pair, "keep_evidence", lambda *a: kept.append(a) or keep(*a))
    events = uag.api.stream(target, lookup, prompt, config, profile=profile)
    next(events)
    events.close()  # stopped early: what it saw is still kept
    evidence, as_opened = opened_with[0]
    assert as_opened == first.to_dict() and kept == [(key, evidence)]

    mine = Evidence()
    before = evidence_path(key).read_text()
    uag.api.generate(target, lookup, prompt, config, profile=profile, evidence=mine)
    assert evidence_path(key).read_text() == before and sum(mine.lookup.accepted) > 0


@pytest.mark.parametrize(("scale", "off"), [(0.3, True), (0.6, False), (1.0, False), (1.9, False), (2.5, True)])
def test_a_profile_a_run_showed_stale_is_kept_and_judged_off(cache, scale, off):
    """A profile calibrated on a busier (or quieter) machine than this one now: judged off after an auto run whose
    own target passes ran at under half or over twice its times, and kept (never removed: a server measures it
    again in the background, `uag calibrate` at the terminal)."""
    from uag.costs.pair import judge_profile

    pair = fake_pair()
    busy = CostProfile({1: 495.0, 2: 520.0}, drafter_ms=390.0)
    saved = Calibration(profile_key(pair), busy, "2026-11-25T04:38:47+00:00", 256)
    save(saved)
    evidence = Evidence()
    evidence.scale = scale
    assert (judge_profile(saved, evidence) is not None) is off
    assert find_calibration(pair) == saved


@pytest.mark.parametrize(("scale", "context", "off"), [(2.3, 2800, False), (2.3, 400, True), (0.3, 2800, True)])
def test_a_run_over_a_cache_far_longer_than_the_profiles_is_not_judged_slower(cache, scale, context, off):
    """A coding agent's 2,800-token head makes every pass dearer than a profile timed over 256 tokens: that is not a
    stale profile (measuring again at 256 would find the same times); slower at a like cache is, and faster is at any
    cache."""
    from uag.costs.pair import judge_profile

    saved = Calibration(profile_key(fake_pair()), CostProfile({1: 610.0, 2: 700.0}, drafter_ms=0.0), "2026-12-02", 256)
    evidence = Evidence()
    evidence.scale = scale
    assert (judge_profile(saved, evidence, context) is not None) is off


@pytest.mark.parametrize(("generated", "off"), [(2, False), (15, False), (16, True), (None, True)])
def test_a_run_of_a_few_tokens_does_not_call_a_profile_off(cache, generated, off):
    """A client's 2-token probe times one short prompt pass: too little to tell the machine's speed (it read 0.45×
    the profile's times and set off a measurement the next request had to stop); 16 tokens or more are judged."""
    from uag.costs.pair import judge_profile

    saved = Calibration(profile_key(fake_pair()), CostProfile({1: 610.0, 2: 700.0}, drafter_ms=0.0), "2026-12-02", 256)
    evidence = Evidence()
    evidence.scale = 0.45
    assert (judge_profile(saved, evidence, 40, generated) is not None) is off
