"""The app's "Costs on this machine": the verify-cost figure, the saved-profile view, calibrating from the app."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from uag.app.session import Session
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.costs.profiles import Calibration, find_calibration, profile_key, profile_path, save
from uag.models.store import ModelStore, Pair
from uag.runtime.access import Access
from uag.runtime.pair import Loaded
from uag.runtime.worker import MLXWorker
from uag.study.plots import verify_cost

# w = 9 is far too slow for k = 8 to pay at any acceptance. k = 1: cycle 1 + 0.5 + 11.5 = 13 ms, plain step
# 10 ms, so a cycle must commit 1.3 tokens: α* = 30% (the study's 1 + k·α tokens, as calibrate saves).
PROFILE = CostProfile(
    {1: 10.0, 2: 11.5, 3: 12.0, 4: 13.0, 5: 15.0, 9: 200.0}, drafter_ms=1.0, translate_ms=0.5, form="study"
)
MEASURED_AT = "2025-01-02T03:04:05+00:00"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A user cache of the test's own, so that profiles saved or found here never touch the real one."""
    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class _NoWorker:
    current = None
    max_batch = 1  # as a worker that runs one job at a time

    def submit(self, *args, **kwargs):
        raise AssertionError("this must not reach the worker")


def _as_loaded(pair: Pair) -> Loaded:
    return Loaded(pair.target, DrafterChoice(model=pair.drafter), pair)


def _fake_pair(target: str = "org/target", drafter: str = "org/drafter") -> Pair:
    """What a profile key and r need of a loaded pair, without loading models."""
    return Pair(
        SimpleNamespace(name=target, dtype="float32", weight_bytes=1000),
        SimpleNamespace(name=drafter, dtype="4-bit (bfloat16)", weight_bytes=70),
        shared_vocabulary=False,
    )


# --- the figure ------------------------------------------------------------------------------------------------


def test_verify_cost_draws_the_measured_times_a_drafter_step_and_whole_cycles():
    fig = verify_cost(PROFILE, title="costs")
    target, drafter, cycle, plain = fig.data
    assert list(target.x) == [1, 2, 3, 4, 5, 9] and list(target.y) == [10.0, 11.5, 12.0, 13.0, 15.0, 200.0]
    assert target.mode == "lines+markers" and "%{y:.2f} ms" in target.hovertemplate
    assert list(drafter.x) == [1, 9] and list(drafter.y) == [1.0, 1.0] and drafter.line.dash == "dash"
    # A cycle of k drafts sits at w = k + 1: k drafter steps + translation + the target's pass over k + 1.
    assert list(cycle.x) == [2, 3, 4, 5, 9] and list(cycle.customdata) == [1, 2, 3, 4, 8]
    assert list(cycle.y) == pytest.approx([13.0, 14.5, 16.5, 19.5, 208.5])
    assert list(plain.y) == [10.0, 20.0, 30.0, 40.0, 50.0, 90.0] and plain.visible == "legendonly"
    assert fig.layout.title.text == "costs"


# --- the view of a saved profile -------------------------------------------------------------------------------


def test_cost_view_does_not_load_a_pair_to_look():
    session = Session(worker=_NoWorker())
    view = session.cost_view("demo-target", "demo-drafter")
    assert view.figure is None and view.calibration is None and session.store.loaded == []
    assert "not loaded yet" in view.caption and "Calibrate this pair" in view.caption


def test_cost_view_without_then_with_a_saved_profile(cache):
    session = Session(worker=_NoWorker())
    pair = _fake_pair()
    session.host.pairs[("org/target", "org/drafter")] = _as_loaded(pair)  # as if a comparison had loaded it

    missing = session.cost_view("org/target", "org/drafter")
    assert missing.figure is None
    assert "No cost profile for org/target ← org/drafter on this machine" in missing.caption
    assert "Calibrate this pair" in missing.caption and "--" not in missing.caption  # the app's words, no flags

    path = save(Calibration(profile_key(pair), PROFILE, MEASURED_AT, 256))
    assert path.is_relative_to(cache)
    view = session.cost_view(" org/target ", "org/drafter")
    assert view.calibration.profile == PROFILE and [t.name for t in view.figure.data][0] == "target pass over w tokens"
    assert "**Measured 2025-01-02 03:04 UTC**" in view.caption and "256 tokens in the cache" in view.caption
    assert "r = 0.100 by time (0.070 by the weights' bytes)" in view.caption
    assert "k = 1: 30% · k = 2: " in view.caption and "k = 8: unreachable" in view.caption
    assert "k = 4: 24%" in view.caption  # a cycle of 19.5 ms must commit 1.95 tokens: α* = 0.95 / 4
    assert "drafter 4-bit (bfloat16)" in view.caption and "`auto`" in view.caption


def test_a_damaged_profile_is_reported_not_raised(cache):
    session = Session(worker=_NoWorker())
    pair = _fake_pair()
    session.host.pairs[("org/target", "org/drafter")] = _as_loaded(pair)
    path = profile_path(profile_key(pair))
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    view = session.cost_view("org/target", "org/drafter")
    assert view.figure is None and "damaged and could not be read" in view.caption and "Error" not in view.caption


def test_auto_reads_a_damaged_profile_as_none_and_a_saved_one_as_it_is(cache, monkeypatch, caplog):
    """The one reader of a pair's saved costs (uag.costs.pair, behind uag.saved_profile and the app's
    Loaded): a damaged file is logged and read as none, so auto measures again instead of failing."""
    from uag.costs import pair as pair_costs

    pair = _fake_pair()
    monkeypatch.setattr(pair_costs, "check_pair", lambda target, drafter: pair)  # a fake pair: nothing to check
    path = profile_path(profile_key(pair))
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert pair_costs.saved_profile(pair.target, DrafterChoice(model=pair.drafter)) is None
    assert _as_loaded(pair).saved_profile() is None and "could not be read" in caplog.text
    save(Calibration(profile_key(pair), PROFILE, MEASURED_AT, context=256))
    assert _as_loaded(pair).saved_profile() == PROFILE == find_calibration(pair).profile
    assert pair_costs.saved_profile(pair.target, None) is None


# --- calibrating from the app ----------------------------------------------------------------------------------


def test_calibrate_follows_the_remote_rules_before_reaching_the_worker():
    session = Session(worker=_NoWorker())
    (update,) = session.calibrate_pair("org/unknown", "demo-drafter", access=Access(remote=True))
    assert update.state == "error" and "not available to remote users" in update.status and update.view is None
    (update,) = session.calibrate_pair("demo-target", "/tmp/drafter", access=Access(remote=True, remote_models="any"))
    assert update.state == "error" and "not a hub id" in update.status


@pytest.fixture
def tiny_session():
    from tests.support.tiny_models import tiny_pair

    session = Session(store=ModelStore(), worker=MLXWorker(name="test-calibrate"))
    yield session, *map(str, tiny_pair())
    session.worker.close(timeout=30)


def test_calibrate_pair_measures_saves_and_shows_the_profile(cache, tiny_session):
    session, target, drafter = tiny_session
    updates = list(session.calibrate_pair(target, drafter, context=32, widths=(1, 2, 3), repeats=1))
    final = updates[-1]
    assert final.state == "done", final.status
    assert any("target, 2 new token(s)" in u.status for u in updates[:-1])
    assert any(u.status.startswith(f"Calibrating {target} ← {drafter}: Loading the target") for u in updates)
    profile = final.view.calibration.profile
    assert list(profile.target_ms) == [1, 2, 3] and profile.drafter_ms > 0
    assert list(final.view.figure.data[0].x) == [1, 2, 3] and "by the weights' bytes" in final.view.caption
    # Saved in the user cache, where the app's view and the auto strategy find it.
    (saved,) = (cache / "profiles").glob("*.json")
    assert str(saved) in final.status
    again = session.cost_view(target, drafter)
    assert again.calibration == final.view.calibration and again.figure is not None
    assert find_calibration(session.host.pairs[(target, drafter)].pair).profile == profile


def test_a_stopped_calibration_saves_nothing(cache, tiny_session):
    session, target, drafter = tiny_session
    updates = session.calibrate_pair(target, drafter, owner="tab-1", context=32, widths=(1, 2), repeats=1)
    first = next(updates)  # "Loading the target …": the measurement has not started
    assert first.state == "running" and session.stop("tab-1")
    final = list(updates)[-1]
    assert final.state == "stopped" and final.view is None and "nothing was saved" in final.status
    assert not (cache / "profiles").exists()
    assert not session.stop("tab-1")
    assert "No cost profile" in session.cost_view(target, drafter).caption  # loaded now, still uncalibrated
