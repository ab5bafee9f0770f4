"""`uag calibrate`: costs timed the way runs spend them, saved where auto looks for them, and reset (tiny models: what
is checked is the shape, not the speed)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from tests.support.saved_costs import fake_pair, learned
from tests.support.tiny_models import tiny_pair
from uag.core.costmodel import CostProfile
from uag.costs import calibrate as calibration
from uag.costs.profiles import (
    METHOD,
    find_calibration,
    find_evidence,
    save_evidence,
    target_key,
)
from uag.models.store import check_pair


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A user cache of the test's own."""
    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


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


# Verification on the 2-core CPU, Qwen2.5-Coder-1.5B ← SmolLM2, float32 + OpenBLAS (uag calibrate, 2026-11-26,
# least of 5 rounds): OpenBLAS prices 9-13 new tokens above 16.
CODER_CPU = {
    1: 320.0,
    2: 413.2,
    3: 511.3,
    4: 602.4,
    5: 615.8,
    6: 612.3,
    7: 643.8,
    8: 650.1,
    9: 730.4,
    10: 824.6,
    11: 932.1,
    12: 1031.6,
    13: 921.2,
    14: 791.4,
    15: 684.5,
    16: 571.6,
}


@pytest.mark.parametrize("monotone", [False, True])
def test_calibrated_verify_curve_keeps_its_measured_shape(monkeypatch, monotone):
    """The engine verifies exactly the tokens proposed, so the profile prices each width as measured (the least
    of the rounds); only the drafter's reading curve is made non-decreasing. Made non-decreasing, this curve
    priced 9 tokens at the 16-token pass's 572 ms, not the 730 ms measured."""
    from uag.costs import calibrate

    calls = {w: 0 for w in CODER_CPU}  # per width: the warm-up, then rounds at 2x, 1x and +50 ms of the curve

    def passes(model, cache, ids, width, n, run_pass, cancel=None):
        calls[width] += 1
        seen = calls[width]
        return [[10 * CODER_CPU[width], 2 * CODER_CPU[width], CODER_CPU[width], CODER_CPU[width] + 50][seen - 1]] * n

    monkeypatch.setattr(calibrate, "_time_passes", passes)
    curve = calibrate.target_curve(None, [], list(range(64)), CODER_CPU, 3, lambda _: None, monotone=monotone)
    envelope = {w: min(v for u, v in CODER_CPU.items() if u >= w) for w in CODER_CPU}
    assert curve == (envelope if monotone else CODER_CPU)
    assert CostProfile(curve, drafter_ms=45.4).target_at(9) == (571.6 if monotone else 730.4)


def test_filling_the_cache_stops_between_its_passes_for_a_request():
    """A server's measurement reads its context a few tokens a pass, asking `cancel` before each: a request that
    comes in waits for one short pass, not for the whole context's read."""
    passes = []
    model = SimpleNamespace(
        tokenizer=SimpleNamespace(encode=lambda text: list(range(len(text)))),
        make_cache=list,
        model=lambda tokens, cache: passes.append(tokens.shape[-1]),
    )
    with pytest.raises(calibration.MeasurementStopped):
        calibration.filled_cache(model, 100, cancel=lambda: len(passes) >= 2)
    assert passes == [calibration.FILL_CHUNK] * 2
    passes.clear()
    _, ids = calibration.filled_cache(model, 100)
    assert len(ids) == 100 and sum(passes) == 100 and max(passes) == calibration.FILL_CHUNK
