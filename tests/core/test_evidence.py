"""What auto learns about a pair, kept per pair and machine beside its profile, and how it is reset; the
calibration that times costs the way runs spend them (tiny models: what is checked is the shape, not the speed)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.support.tiny_models import tiny_pair
from uag.core.costmodel import CostProfile
from uag.core.evidence import Counts, Evidence, confidence_band
from uag.core.lookup import BAND_FLOORS
from uag.costs import calibrate as calibration
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
    target_key,
)
from uag.models.store import Pair, check_pair


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A user cache of the test's own."""
    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_pair(target: str = "org/target", drafter: str = "org/drafter", dtype: str = "float32") -> Pair:
    """What a key needs of a loaded pair, without loading models."""
    model = lambda name: SimpleNamespace(name=name, dtype=dtype, weight_bytes=1000)  # noqa: E731
    return Pair(model(target), model(drafter), shared_vocabulary=False)


def learned() -> Evidence:
    evidence = Evidence(lookup=Counts([1.0], [2.0]), expansion=0.8, drafter_ms=3.0)
    evidence.saw_copy(20, tried=8, kept=7)  # 7 tokens of a copy of 20-26 kept, the 8th (27) not: the 16-31 band
    evidence.saw_drafts([0.95, 0.5, 0.1], kept=1, proposed=3)  # the model's drafts: how sure, how they fared
    return evidence


def test_evidence_keeps_what_earlier_runs_accepted_but_not_their_costs():
    back = Evidence.from_dict(json.loads(json.dumps(learned().to_dict())))
    assert back.lookup == learned().lookup and back.expansion == 0.8
    assert back.lookup_bands == learned().lookup_bands  # lookup's per band of match length (uag.core.lookup)
    assert back.confidence == learned().confidence and back.drafted == learned().drafted  # the model's per band
    assert back.drafter_ms is None and back.verify_ms == {}  # costs are the calibration's, relearned in a run


@pytest.mark.parametrize(
    "bad",
    [
        {"lookup": {"accepted": [1.0], "rejected": []}},
        {"lookup": {"accepted": [-1.0], "rejected": [1.0]}},
        {"lookup": {"accepted": ["nan"], "rejected": [1.0]}},
        {"lookup": {"accepted": [], "rejected": []}, "expansion": 0},
        {**Evidence().to_dict(), "lookup_bands": [{"accepted": [], "rejected": []}]},  # bands another version had
        {**Evidence().to_dict(), "lookup_bands": [{"accepted": [1.0], "rejected": [-1.0]}] * 4},
        {**Evidence().to_dict(), "confidence": [{"accepted": [], "rejected": []}] * 3},  # bands of another version
        {**Evidence().to_dict(), "drafted": [-1.0] * 7},
    ],
)
def test_damaged_evidence_is_refused(bad):
    with pytest.raises(ValueError):
        Evidence.from_dict(bad)


def test_evidence_saved_before_lookup_had_bands_still_opens_a_run():
    saved = {k: v for k, v in learned().to_dict().items() if k not in ("lookup_bands", "confidence", "drafted")}
    saved["model"] = {"accepted": [2.5], "rejected": [0.5]}  # the model's counts per position: no longer read
    back = Evidence.from_dict(saved)
    assert back.lookup == learned().lookup and back.lookup_bands == Evidence().lookup_bands
    assert back.confidence == Evidence().confidence and back.mean_chance() is None  # as if the model never drafted


def test_evidence_saved_with_lookup_s_bands_per_position_keeps_their_first():
    """Files saved before lookup's verdicts were per copied token held each band's counts per proposal position;
    the first position is the same verdict (is the next token of a copy that long kept?), the others are not."""
    saved = {**Evidence().to_dict(), "lookup_bands": [{"accepted": [4.0, 3.0], "rejected": [1.0, 1.0]}] * 6}
    back = Evidence.from_dict(saved)
    assert back.lookup_bands == [Counts([4.0], [1.0])] * 6


def test_a_copy_s_token_is_judged_by_the_length_the_copy_has_reached():
    """Position i of a proposal from a match of m tokens continues a copy of m + i: a 2-token guess whose first
    token is kept is a 3-token match at its second, and past 8 a copy (docs/how-it-works.md, auto)."""
    evidence = Evidence()
    evidence.saw_copy(2, tried=16, kept=3)  # lengths 2, 3 (band 0), 4 kept; 5 rejected (band 1)
    assert [(c.accepted, c.rejected) for c in evidence.lookup_bands[:3]] == [
        ([pytest.approx(1.9)], [0.0]),
        ([pytest.approx(0.9)], [1.0]),  # length 4 kept, then (decayed) length 5 rejected
        ([], []),
    ]
    short = (1.9 + 0.5) / (1.9 + 1)  # band 0's verdicts and the prior's one pseudo-observation
    assert evidence.copy_chances(2, 3, 0.5) == pytest.approx([short, short, (0.9 + short) / (1.9 + 1)])
    rejected = Evidence()
    for _ in range(4):
        rejected.saw_copy(2, tried=8, kept=0)
    chances = rejected.copy_chances(2, 16, 0.5, BAND_FLOORS)
    assert chances[:6] == pytest.approx([0.0 + 0.5 * 1 / (rejected.lookup_bands[0].rejected[0] + 1)] * 6)
    assert chances[6:14] == pytest.approx([0.8] * 8) and chances[14:] == pytest.approx([0.9] * 2)  # floors: 8+, 16+
    assert rejected.copy_chances(2, 16, 0.5) == pytest.approx([chances[0]] * 16)  # no floors: leaning on band 0


def test_a_draft_s_chance_is_its_confidence_until_the_target_s_verdicts_on_its_band_say_otherwise():
    evidence = Evidence()
    assert [confidence_band(q) for q in (0.1, 0.2, 0.85, 0.99)] == [0, 1, 4, 6]
    assert evidence.kept_chance(0.9) == pytest.approx(0.9) and evidence.mean_chance() is None
    evidence.saw_drafts([0.92, 0.93, 0.3], kept=0, proposed=2)  # the first rejected: the second never judged
    band = evidence.confidence[confidence_band(0.92)]
    assert (band.accepted[0], band.rejected[0]) == (0.0, 1.0)
    assert evidence.kept_chance(0.92) == pytest.approx((0 + 2 * 0.92) / 3)
    assert evidence.confidence[confidence_band(0.3)].accepted == []  # drafted, never proposed: no verdict
    assert sum(evidence.drafted) == pytest.approx(1 + 0.9 + 0.81)  # all three drafts say how sure it tends to be
    # a rehearsal's guesses say how sure the drafter is on this text, never how the target judges its drafts
    evidence.saw_guesses([0.05] * 30)
    assert evidence.mean_chance() < 0.15 and evidence.confidence[0].accepted == []


def test_a_new_run_keeps_how_confidence_reads_but_only_a_few_drafts_of_how_sure_the_last_text_made_it():
    evidence = Evidence()
    for _ in range(20):
        evidence.saw_drafts([0.99, 0.98], kept=2, proposed=2)
    verdicts = [c.to_dict() for c in evidence.confidence]
    evidence.carry(3.0)
    assert sum(evidence.drafted) == pytest.approx(3.0)
    assert [c.to_dict() for c in evidence.confidence] == verdicts


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


def test_calibrate_reset_forgets_without_loading_models(cache, capsys):
    pair = fake_pair()
    save_evidence(pair, learned())
    assert calibration.main(["--target", "org/target", "--drafter", "org/drafter", "--reset"]) == 0
    assert "removed" in capsys.readouterr().out and find_evidence(pair) is None
    assert calibration.main(["--target", "org/target", "--drafter", "org/drafter", "--reset"]) == 0
    assert "nothing saved for org/target ← org/drafter" in capsys.readouterr().out


def test_calibrate_reset_of_a_hybrid_forgets_its_model_pair_and_of_lookup_the_target_s_own(cache, capsys):
    pair = fake_pair()
    save_evidence(pair, learned())
    assert calibration.main(["--target", "org/target", "--drafter", "lookup+org/drafter", "--reset"]) == 0
    assert find_evidence(pair) is None
    save_evidence(target_key(pair.target), learned())
    assert calibration.main(["--target", "org/target", "--drafter", "lookup", "--reset"]) == 0
    assert find_evidence(target_key(pair.target)) is None


@pytest.mark.slow
def test_calibrate_lookup_saves_the_target_s_verify_curve_where_auto_looks_for_it(store, cache, capsys):
    """`uag calibrate --drafter lookup` (it once asked for a model folder named lookup): the target alone is
    timed, and the profile lands under the key prompt lookup's auto runs read (uag.costs.pair)."""
    from uag.core.drafters import DrafterChoice
    from uag.costs.pair import profile_for

    target, _ = tiny_pair("qwen2.5", "mistral-v1")
    argv = ["--target", str(target), "--drafter", "lookup", "--context", "32", "--max-width", "3", "--repeats", "1"]
    assert calibration.main(argv) == 0
    assert "saved" in capsys.readouterr().out
    saved = find_calibration(target_key(store.get(str(target))))
    assert set(saved.profile.target_ms) == {1, 2, 3} and saved.profile.drafter_ms == 0.0
    measured = lambda *a, **kw: pytest.fail("a saved lookup profile is measured again")  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "calibrate_target", measured)
        assert profile_for(store.get(str(target)), DrafterChoice(lookup=True)).target_ms == saved.profile.target_ms


@pytest.mark.slow
def test_a_calibration_times_what_a_run_spends(store, cache):
    """Tiny random models: every cost the policy prices a run by is measured and saved; the drafter's reading
    curve never falls, the verify curve is kept as measured (the engine verifies exactly what it proposes)."""
    target, drafter = tiny_pair("qwen2.5", "mistral-v1")
    pair = check_pair(store.get(str(target)), store.get(str(drafter)))
    said = []
    result = calibration.calibrate(pair, context=64, widths=range(1, 5), repeats=1, progress=said.append)
    profile = result.profile
    assert set(profile.target_ms) == {1, 2, 3, 4} and profile.drafter_ms > 0
    assert set(profile.read_ms) == {n for n in calibration.READ_WIDTHS if n <= 64}  # passes over the cached text
    assert all(math.isfinite(ms) and ms > 0 for ms in profile.target_ms.values())
    widths = sorted(profile.read_ms)
    assert all(profile.read_ms[a] <= profile.read_ms[b] for a, b in zip(widths, widths[1:]))
    assert result.key["method"] == METHOD and any("drafter step" in line for line in said)
    assert "drafter pass over n tokens: 1: " in calibration.summary(result)


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


def test_in_a_batch_a_pass_is_priced_and_learned_by_the_tokens_of_the_whole_pass():
    """Batched with others (uag.runtime.batching), auto prices w as the pass every sequence of the batch would make
    with it, and learns the time of the pass it ran in (every sequence padded to the widest) by that pass's width."""
    from uag.core.evidence import Prices
    from uag.core.records import Cycle, Sharing

    profile = CostProfile(target_ms={1: 100.0, 4: 130.0, 16: 200.0, 64: 500.0}, drafter_ms=10.0, translate_ms=0.0)
    prices = Prices(profile, Evidence(), learn=False)
    alone = [prices.target_ms(w) for w in (1, 16)]
    assert alone == [100.0, 200.0]
    shared = Sharing()
    shared.shared(size=4, widest=16, ms=480.0)  # three others, the widest of them 16 tokens

    batched = Prices(profile, prices.evidence, learn=False, sharing=shared)
    plain, draft = batched.target_ms(1), batched.target_ms(16)
    batched.learn = True
    batched.time_verify(Cycle.plain(0, verify_ms=2000.0))  # the wait for the others: not the pass's cost
    assert plain == 130.0 and draft == 500.0  # 4 × 1 and 4 × 16 tokens: the batch's pass at either width
    assert prices.evidence.verify_ms == {64: 480.0}  # the pass it ran in: 4 × 16 (the widest other), in 480 ms
    assert prices.target_ms(1) != 500.0  # the request's own prices, not passed the batch's sharing: alone again


def test_a_tree_pass_is_timed_at_the_rows_it_read():
    """A tree pass reads every branch's nodes: its time is that width's, not the kept branch's (a 16-row pass on a
    CPU whose curve dips at 16 would otherwise be priced as a 23-row one)."""
    from uag.core.evidence import Prices
    from uag.core.records import Cycle

    prices = Prices(None, Evidence())
    tree = Cycle(
        index=0,
        k=15,
        draft_ids=[],
        proposed_ids=list(range(15)),
        accepted=15,
        emitted=16,
        verify_ms=1900.0,
        source="lookup",
        branches=3,
        nodes=22,
    )
    prices.time_verify(tree)
    prices.time_verify(replace(tree, branches=1, nodes=0, verify_ms=1000.0))
    assert prices.evidence.verify_ms == {23: 1900.0, 16: 1000.0}
