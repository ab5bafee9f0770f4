"""auto's costs are never measured inside a server request: a pair without a profile, or whose profile a run found
off, is measured in the background while the MLX worker is idle, stops for a request, at most once per interval,
and a busy machine's measurement is never saved over a quieter one's. Fakes throughout: a fake target, a
scripted engine stream, a fake measurement, injected machine loads (no model, no real calibration)."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

import uag.costs.calibrate
import uag.costs.pair
import uag.costs.profiles
import uag.runtime.keeper
from tests.support.server_scripted import Scripted
from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.core.evidence import Evidence
from uag.core.records import Run
from uag.costs.pair import evidence_key, keep_measured, open_auto, why_short
from uag.costs.profiles import (
    Calibration,
    MachineLoad,
    decayed,
    find_calibration,
    find_evidence,
    profile_path,
    replaces,
    save,
    short_of_copies,
    target_key,
    why_measure_again,
)
from uag.models.store import ModelStore
from uag.runtime.host import Host
from uag.runtime.jobs import JobRunner
from uag.runtime.keeper import CostKeeper, Wanted, due
from uag.runtime.pair import Loaded, chars_per_token
from uag.runtime.worker import MLXWorker
from uag.server.errors import APIError
from uag.server.protocol import Request, ServerDefaults
from uag.server.service import Service

QUIET, BUSY = MachineLoad(0.3, 0.2, 2), MachineLoad(1.2, 1.7, 2)
SAVED = CostProfile({1: 300.0, 2: 320.0, 65: 960.0}, drafter_ms=0.0)  # measured when the machine was slower
MEASURED = CostProfile({1: 100.0, 2: 110.0, 65: 320.0}, drafter_ms=0.0)
SHORT = CostProfile({w: 300.0 + 20.0 * (w - 1) for w in range(1, 10)}, drafter_ms=0.0)  # timed to width 9 only


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def now_quiet(monkeypatch):
    """The machine's load now, as the server reads it: quiet (the test machine's real load varies)."""
    monkeypatch.setattr(uag.costs.profiles, "machine_load", lambda start=None: QUIET)
    monkeypatch.setattr(uag.costs.pair, "machine_load", lambda start=None: QUIET)
    monkeypatch.setattr(uag.runtime.keeper, "machine_load", lambda start=None: QUIET)


@pytest.fixture
def no_calibration(monkeypatch):
    """Any real calibration fails the test."""
    for name in ("calibrate", "calibrate_target"):
        monkeypatch.setattr(uag.costs.calibrate, name, lambda *a, **kw: pytest.fail("a calibration ran"))


class Tokenizer:
    """A tokenizer whose longest vocabulary entry is 4 characters; `encode` counts its calls."""

    has_chat_template = False

    def __init__(self):
        self.encoded = 0

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "ab": 1, "abcd": 2}

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return list(range(1, 1 + (len(text) + 3) // 4))


def fake_target(context: int = 4096):
    return SimpleNamespace(
        name="org/target", dtype="float32", tokenizer=Tokenizer(), context_length=context, weight_bytes=1000
    )


def calibration(profile: CostProfile, load: MachineLoad | None, target=None) -> Calibration:
    return Calibration(target_key(target or fake_target()), profile, "2026-11-25T04:38:47+00:00", 256, load)


REPLY = "Warszawa, stolica i największe miasto Polski, leży nad Wisłą."


def request(prompt: str = "Stolica Polski to", **kw) -> Request:
    config = GenerationConfig(k_policy="adaptive", k=4, max_tokens=4)
    return Request("completion", model="org/target", config=config, drafter="lookup", prompt=prompt, **kw)


class Stream:
    """The engine's stream with its signature: a scripted reply; the run's target passes are found to take
    `scale` × the profile's (what `AdaptiveK` writes into the evidence)."""

    def __init__(self, scale: float):
        self.scale, self.profiles = scale, []

    def __call__(self, target, drafter, ids, config, *, cancel=None, caches=None, profile=None, evidence=None):
        self.profiles.append(profile)
        if evidence is not None and profile is not None:
            evidence.scale = self.scale
        run = Run("baseline", target.name, prompt_ids=list(ids), max_tokens=config.max_tokens)
        return Scripted._events(run, REPLY)  # 21 tokens: a run long enough to judge the profile by (JUDGED_TOKENS)


class Measure:
    """A pair's measurement: `MEASURED` at a quiet load, counted; `hold` keeps it going until cancelled."""

    def __init__(self, hold: bool = False):
        self.calls, self.hold, self.stopped = 0, hold, 0

    def __call__(self, target, choice, *, progress=None, cancel=None):
        self.calls += 1
        if self.hold and self.calls == 1:
            while not cancel():
                time.sleep(0.01)
            self.stopped += 1
            raise uag.costs.calibrate.MeasurementStopped
        return calibration(MEASURED, QUIET, target)


def service(measure, stream, *, budget_s: float | None = 60.0, load_s: float = 0.0) -> Service:
    """A Service, on a host that measures off the requests' path (as `uag serve`'s), on a fake target whose pair
    (with prompt lookup) is always loaded."""
    target, choice = fake_target(), DrafterChoice(lookup=True)
    defaults = ServerDefaults(model="org/target", drafter="lookup", drafters=("lookup",))
    runner = JobRunner(MLXWorker(), budget_s=budget_s)
    host = Host(ModelStore(), runner, target="org/target", stream=stream, measure=measure, off_path=True)
    served = Service(host, defaults, cache_bytes=0)

    def open_pair(*_args, **_kw):
        time.sleep(load_s)
        return Loaded(target, choice, None)

    host.open, host.loaded, host.holds = open_pair, lambda drafter: (target, choice), lambda drafter: True
    served.costs.settle_s, served.costs.poll_s = 0.3, 0.01
    return served


def ask(served: Service, req: Request | None = None) -> list:
    return list(served.runner.run(served.job, req or request(), label="an API request"))


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# --- what decides: pure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("scale", "off"), [(0.3, True), (0.6, False), (1.0, False), (1.9, False), (2.5, True)])
def test_a_run_finds_saved_costs_off_beyond_twice_either_way(scale, off):
    assert (why_measure_again(scale, QUIET, lambda: QUIET) is not None) is off


def test_a_quiet_moment_that_disagrees_with_a_busy_measurement_asks_for_another():
    assert "measured at load 1.70 on 2 cores" in why_measure_again(0.7, BUSY, lambda: QUIET)
    assert why_measure_again(0.7, QUIET, lambda: QUIET) is None  # no quieter than the measurement: within noise
    assert why_measure_again(0.9, BUSY, lambda: QUIET) is None  # quieter, but the passes agree
    assert why_measure_again(0.7, BUSY, lambda: MachineLoad(1.6, 1.6, 2)) is None  # busy now too
    assert why_measure_again(0.7, None, lambda: QUIET) is None  # an old file: its load unknown


def test_the_load_is_read_only_where_the_verdict_depends_on_it():
    def unread():
        raise AssertionError("the load was read")

    assert why_measure_again(0.3, BUSY, unread) is not None  # off beyond twice whatever the load
    assert why_measure_again(0.9, BUSY, unread) is None  # the passes agree
    assert why_measure_again(0.7, None, unread) is None  # nothing to compare the load with


def test_a_busy_measurement_is_never_saved_over_a_quieter_one():
    assert replaces(BUSY, None)  # nothing saved: a busy measurement beats none
    assert replaces(QUIET, calibration(SAVED, BUSY)) and replaces(QUIET, calibration(SAVED, None))
    assert not replaces(BUSY, calibration(SAVED, QUIET))
    assert not replaces(BUSY, calibration(SAVED, None))  # saved before loads were recorded: kept
    assert replaces(BUSY, calibration(SAVED, MachineLoad(1.9, 1.9, 2)))  # the saved one was busier still
    assert replaces(None, calibration(SAVED, QUIET))  # a system without a load average: the newer one


def test_a_verify_curve_short_of_a_copy_s_pass_is_said_and_any_measurement_replaces_it():
    """Past its widest width a curve is extrapolated from its last two: one that stops short of the pass a lookup
    copy makes (65) misprices copies, so even a busy measurement is saved over it; a model-only drafter never
    proposes that far."""
    assert short_of_copies(SHORT) == "its verify curve stops at width 9, short of a copy's 65"
    assert short_of_copies(SAVED) is None and short_of_copies(MEASURED) is None
    assert not replaces(BUSY, calibration(SAVED, QUIET)) and replaces(BUSY, calibration(SHORT, QUIET))
    model = SimpleNamespace(name="org/drafter", dtype="float32")
    assert why_short(calibration(SHORT, QUIET), DrafterChoice(lookup=True)) is not None
    assert why_short(calibration(SHORT, QUIET), DrafterChoice(lookup=True, model=model)) is not None
    assert why_short(calibration(SHORT, QUIET), DrafterChoice(model=model)) is None
    assert why_short(calibration(SAVED, QUIET), DrafterChoice(lookup=True)) is None
    assert why_short(None, DrafterChoice(lookup=True)) is None


def test_uag_calibrate_times_the_widths_a_copy_reaches_unless_told_to_stop_sooner():
    from uag.costs.calibrate import DEFAULT_WIDTHS, build_parser, widths_to

    assert widths_to(build_parser().parse_args([]).max_width) == list(DEFAULT_WIDTHS)
    assert max(DEFAULT_WIDTHS) == 65 and max(uag.costs.calibrate.QUICK["widths"]) == 65
    assert widths_to(40) == [*range(1, 17), 24, 33, 40] and widths_to(3) == [1, 2, 3]


def test_a_pair_is_measured_again_at_most_once_per_interval():
    assert due(None, 5.0)
    assert not due(100.0, 699.0, 600.0) and due(100.0, 700.0, 600.0)


def test_the_process_s_own_share_of_the_load_decays_as_the_load_average_does():
    assert decayed(0.0, 1.0, 60.0) == pytest.approx(0.632, abs=1e-3)
    assert decayed(1.0, 0.0, 60.0) == pytest.approx(0.368, abs=1e-3)
    assert decayed(0.5, 0.5, 3.0) == pytest.approx(0.5)


# --- what is saved ---------------------------------------------------------------------------------------------


def test_an_old_profile_without_a_load_still_loads_and_a_new_one_keeps_it(cache):
    old = calibration(SAVED, None).to_dict()
    assert "machine_load" not in old  # as files were saved before loads were recorded
    assert Calibration.from_dict(old).load is None and Calibration.from_dict(old).profile == SAVED
    save(calibration(SAVED, BUSY))
    assert find_calibration(target_key(fake_target())).load == BUSY


def test_keep_measured_keeps_a_quieter_profile_and_says_why(cache):
    target = fake_target()
    save(calibration(SAVED, QUIET))
    kept, line = keep_measured(calibration(MEASURED, BUSY), target)
    assert not kept and "measured at load 0.30 on 2 cores" in line and "load 1.70" in line
    assert find_calibration(target_key(target)).profile == SAVED
    saved, line = keep_measured(calibration(MEASURED, QUIET), target)
    assert saved and "target step 100.0 ms (was 300.0)" in line
    assert find_calibration(target_key(target)).profile == MEASURED


def test_the_api_keeps_a_profile_a_run_found_off_and_warns_once(cache, now_quiet, no_calibration, caplog):
    """uag.api.stream / generate (and so the CLI): the profile stays; one warning line names the fix."""
    target, lookup = fake_target(), DrafterChoice(lookup=True)
    save(calibration(SAVED, QUIET))
    auto = open_auto(target, lookup)
    assert auto.profile == SAVED and auto.engine_kwargs() == {"profile": SAVED, "evidence": auto.evidence}
    auto.evidence.scale = 1 / 3  # the run's passes took a third of the saved times
    with caplog.at_level(logging.WARNING, logger="uag.costs.pair"):
        auto.finish()
    (line,) = [r.getMessage() for r in caplog.records if "org/target" in r.getMessage()]  # not other tests' servers
    assert "took 0.33× the saved times" in line and "uag calibrate --target org/target --drafter lookup" in line
    assert profile_path(target_key(target)).exists()


def test_the_api_says_once_that_a_short_verify_curve_prices_copies_by_extrapolation(
    cache, now_quiet, no_calibration, caplog, monkeypatch
):
    """The CLI, the API and the app: the saved curve is used (nothing is measured inside a run) and one warning line
    per process names the fix."""
    monkeypatch.setattr(uag.costs.pair, "_said_short", set())
    target, lookup = fake_target(), DrafterChoice(lookup=True)
    save(calibration(SHORT, QUIET))
    with caplog.at_level(logging.WARNING, logger="uag.costs.pair"):
        autos = [open_auto(target, lookup) for _ in range(2)]
    assert [auto.profile for auto in autos] == [SHORT, SHORT]
    (line,) = [r.getMessage() for r in caplog.records if "org/target" in r.getMessage()]
    assert "stops at width 9, short of a copy's 65" in line and "extrapolation" in line
    assert "uag calibrate --target org/target --drafter lookup" in line


# --- the server ------------------------------------------------------------------------------------------------


def test_a_stale_profile_does_not_stall_a_request_and_is_measured_again_once_when_idle(
    cache, now_quiet, no_calibration, caplog
):
    measure, stream = Measure(), Stream(scale=1 / 3)
    served = service(measure, stream)
    worker = served.runner.worker
    save(calibration(SAVED, QUIET))
    path = profile_path(target_key(fake_target()))
    release = threading.Event()

    def hold(_job):  # other work holding the worker: the app's run, the next request
        release.wait(30)
        yield

    with caplog.at_level(logging.INFO, logger="uag.runtime"):
        items = served.runner.run(served.job, request(), label="an API request")
        first = next(items)
        held = worker.submit(hold, label="other work")  # queued behind the request, before its run ends
        done = [first, *items][-1]
        assert done.finish == "stop" and stream.profiles == [SAVED] and path.exists()
        time.sleep(1.0)  # the keeper waits while the worker is busy: nothing measured, nothing queued behind it
        assert measure.calls == 0 and worker.backlog == 0 and [w.reason for w in served.costs.pending]
        release.set()
        held.wait(5)
        assert wait_for(lambda: measure.calls == 1 and not served.costs.pending)
    assert find_calibration(target_key(fake_target())).profile == MEASURED
    messages = [r.getMessage() for r in caplog.records]
    assert sum("measuring them again in the background" in m for m in messages) == 1, messages
    assert any("saved the costs of org/target ← lookup measured at load 0.30 on 2 cores" in m for m in messages)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="uag.runtime"):
        ask(served)  # the same verdict again within the interval: not measured again, said once
        ask(served)
        time.sleep(0.8)
    assert measure.calls == 1 and stream.profiles[-1] == MEASURED
    (line,) = [r.getMessage() for r in caplog.records if "org/target" in r.getMessage()]  # not other tests' servers
    assert "measured 0 min ago, so not again before 10 min have passed" in line


def test_a_request_without_a_profile_runs_without_one_and_schedules_its_measurement(cache, now_quiet, no_calibration):
    measure, stream = Measure(), Stream(scale=1.0)
    served = service(measure, stream)
    done = ask(served)[-1]
    assert done.finish == "stop" and stream.profiles == [None]
    assert wait_for(lambda: measure.calls == 1) and find_calibration(target_key(fake_target())) is not None


def test_a_background_measurement_stops_for_a_request_and_starts_again_when_idle():
    worker, measure = MLXWorker(), Measure(hold=True)
    started = threading.Event()

    def measured(job, wanted, cancel):
        try:
            started.set()
            measure(None, None, cancel=cancel)
        except uag.costs.calibrate.MeasurementStopped:
            return False
        return True

    keeper = CostKeeper(worker, measured, lambda wanted: True, settle_s=0.05, poll_s=0.01)
    wanted = Wanted({"target": "t", "drafter": "lookup"}, "lookup", "no costs are saved for it yet")
    assert keeper.want(wanted) == "scheduled"
    assert started.wait(10)

    def answer(_job):
        yield "a reply"

    request_job = worker.submit(answer, label="a request")
    assert request_job.wait(5)  # it waited one of the measurement's passes, not the measurement
    assert wait_for(lambda: measure.calls == 2 and not keeper.pending)
    assert measure.stopped == 1
    assert keeper.want(wanted) == "deferred" and keeper.want(wanted) == ""  # within the interval: said once


def test_a_measurement_that_requests_keep_stopping_waits_longer_each_time():
    """An agent pauses between its requests (its tools run): a measurement stopped by one waits for twice the idle
    time before it starts again, so that it is not in the next request's way at every turn."""
    assert [uag.runtime.keeper.settle_after(n, 2.0, 120.0) for n in (0, 1, 3, 9)] == [2.0, 4.0, 16.0, 120.0]
    worker, starts = MLXWorker(), []

    def measured(job, wanted, cancel):
        starts.append(time.monotonic())
        while not cancel():
            time.sleep(0.01)
        return False

    keeper = CostKeeper(worker, measured, lambda wanted: True, settle_s=0.2, poll_s=0.01)
    keeper.want(Wanted({"target": "t", "drafter": "lookup"}, "lookup", "no costs are saved for it yet"))

    def answer(_job):
        yield "a reply"

    for stops in range(2):
        assert wait_for(lambda n=stops + 1: len(starts) == n)
        request_job = worker.submit(answer, label="a request")
        assert request_job.wait(5)
        idle_from = time.monotonic()
        assert wait_for(lambda n=stops + 2: len(starts) == n)
        assert starts[-1] - idle_from >= 0.2 * 2 ** (stops + 1) * 0.9  # twice the last idle wait, then four times
    keeper.close()


def test_the_time_budget_starts_when_the_job_does(cache, now_quiet):
    """Loading that outlasts --time-budget ends the request with a 503 before anything is generated."""
    served = service(Measure(), Stream(scale=1.0), budget_s=0.2, load_s=0.6)
    with pytest.raises(APIError) as err:
        ask(served)
    assert err.value.status == 503 and err.value.code == "timeout" and "--time-budget" in err.value.message


def test_a_prompt_too_long_for_any_tokenisation_is_refused_before_tokenising():
    served = service(Measure(), Stream(scale=1.0))
    target = fake_target(context=10)  # at most 4 characters a token: 40 characters
    with pytest.raises(APIError) as err:
        served.prompt(Loaded(target, None, None), request("x" * 41))
    assert err.value.status == 400 and err.value.code == "context_length_exceeded" and target.tokenizer.encoded == 0
    chat = Request(
        "chat", model="m", config=GenerationConfig(), drafter=None, messages=({"role": "user", "content": "y" * 41},)
    )
    with pytest.raises(APIError, match="41 characters"):
        served.prompt(Loaded(target, None, None), chat)
    assert served.prompt(Loaded(target, None, None), request("x" * 36)) and target.tokenizer.encoded == 1
    assert chars_per_token(SimpleNamespace()) is None  # a tokenizer that lists no vocabulary: no bound


def test_the_step_time_survives_a_profile_found_off_and_is_learned_without_one(cache):
    served = service(Measure(), Stream(scale=1.0))
    target, run = fake_target(), Run("context", "org/target", k_policy="adaptive")
    evidence = Evidence(verify_ms={1: 42.0})
    assert served.step_time(target, DrafterChoice(lookup=True), run, evidence).ms == 42.0
    save(calibration(SAVED, QUIET))
    assert served.step_time(target, DrafterChoice(lookup=True), run, evidence).ms == 300.0


def test_start_up_measures_the_offered_pairs_without_costs(cache, now_quiet, no_calibration):
    measure, said = Measure(), []
    served = service(measure, Stream(scale=1.0))
    served.preload(progress=said.append).wait(10)
    assert measure.calls == 1 and find_calibration(target_key(fake_target())).profile == MEASURED
    served.preload().wait(10)
    assert measure.calls == 1  # saved: not measured again


def test_a_short_verify_curve_is_measured_again_at_start_up_and_after_a_request_even_on_a_busy_machine(
    cache, no_calibration, monkeypatch, caplog
):
    busy = lambda start=None: BUSY  # noqa: E731
    monkeypatch.setattr(uag.costs.profiles, "machine_load", busy)
    monkeypatch.setattr(uag.costs.pair, "machine_load", busy)
    monkeypatch.setattr(uag.runtime.keeper, "machine_load", busy)
    save(calibration(SHORT, QUIET))
    measure = Measure()
    served = service(measure, Stream(scale=1.0))
    served.preload().wait(10)
    assert measure.calls == 1 and find_calibration(target_key(fake_target())).profile == MEASURED

    save(calibration(SHORT, QUIET))  # saved again while the server runs (say, by `uag calibrate --max-width 9`)
    stream = Stream(scale=1.0)
    served = service(measure := Measure(), stream)
    with caplog.at_level(logging.WARNING, logger="uag.runtime"):
        done = ask(served)[-1]
        assert done.finish == "stop" and stream.profiles == [SHORT]  # the request ran on what was saved
        assert wait_for(lambda: measure.calls == 1 and not served.costs.pending)
    assert find_calibration(target_key(fake_target())).profile == MEASURED
    assert any("stops at width 9, short of a copy's 65; measuring them again" in r.getMessage() for r in caplog.records)


def test_the_server_says_what_it_still_does_at_start_up_until_a_request_stops_its_measurement(
    cache, now_quiet, no_calibration
):
    measure = Measure(hold=True)  # measures until a request comes in
    served = service(measure, Stream(scale=1.0))
    assert served.starting() is None  # nothing started: nothing to wait for
    started = served.preload()
    assert wait_for(lambda: measure.calls == 1)
    assert served.starting() == "measuring auto's costs (stops for a request)"
    assert ask(served)[-1].finish == "stop"
    assert started.wait(10) and served.starting() is None and measure.stopped == 1


def test_others_busy_counts_the_machines_cpu_time_less_this_process():
    from uag.costs.profiles import OthersBusy

    clock, busy, own = [0.0], [10.0], [1.0]

    def two_seconds(_):  # the first reading's window: 3 CPU-s busy in 2 s, 1 of them this process's
        clock[0], busy[0], own[0] = 2.0, 13.0, 2.0

    others = OthersBusy(busy=lambda: busy[0], own=lambda: own[0], clock=lambda: clock[0], sleep=two_seconds)
    assert others.now() == pytest.approx(1.0)  # others kept one core busy
    clock[0] += 0.1
    busy[0] = 20.0
    assert others.now() == pytest.approx(1.0)  # too short a window: the last reading again
    clock[0] += 3.9
    busy[0], own[0] = 21.0, 10.0  # 4 s of a measurement: this process busy on both cores, nobody else
    assert others.now() == pytest.approx(0.0)


def test_the_busy_time_is_read_from_proc_stat(monkeypatch, tmp_path):
    import builtins

    from uag.costs import profiles

    stat = tmp_path / "stat"
    stat.write_text("cpu  4705 150 1120 16250 520 0 20 0 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    real_open = builtins.open
    monkeypatch.setattr(
        builtins, "open", lambda path, *a, **k: real_open(stat if path == "/proc/stat" else path, *a, **k)
    )
    monkeypatch.setattr(profiles.os, "sysconf", lambda name: 100)
    assert profiles._busy_s() == pytest.approx(59.95)


def test_an_ablated_server_runs_its_auto_settings_and_leaves_the_saved_evidence_alone(cache, now_quiet):
    """`--auto-off`: each request's run gets the settings (Seams.auto) and opens from the pair's saved evidence,
    which it neither saves over nor judges; as shipped, the run gets no seams and the evidence is saved."""
    from uag.core.policy import AutoSettings

    seen = []

    def stream(target, drafter, ids, config, *, cancel=None, caches=None, profile=None, evidence=None, **kw):
        seen.append((kw.get("seams"), evidence))
        evidence.expansion = 1.25  # what the run learned
        run = Run("baseline", target.name, prompt_ids=list(ids), max_tokens=config.max_tokens)
        return Scripted._events(run, "Warszawa.")

    key = evidence_key(fake_target(), DrafterChoice(lookup=True))
    ablated = service(Measure(), stream)
    ablated.host.auto = AutoSettings(stop_rule=False)
    ask(ablated), ask(ablated)
    assert [s.auto for s, _ in seen] == [AutoSettings(stop_rule=False)] * 2
    assert seen[0][1] is seen[1][1]  # one evidence across the server's requests, kept in the process
    assert find_evidence(key) is None  # nothing saved for the pair's next process
    seen.clear()
    ask(service(Measure(), stream))
    assert seen[0][0] is None and find_evidence(key).expansion == 1.25


def test_under_uag_serve_the_app_and_the_api_follow_one_cost_policy(cache, now_quiet, no_calibration, monkeypatch):
    """`uag serve` builds one host for the API and the app at /ui: a pair without costs is measured inside neither
    front end's request (each runs without costs and schedules the measurement for an idle moment), and both learn
    into one Evidence."""
    import uag.server.main as main
    from tests.support.server import serve_args
    from uag.app.settings import Settings

    mounted, seen, measure = [], [], Measure()

    def stream(target, drafter, ids, config, *, cancel=None, caches=None, profile=None, evidence=None):
        seen.append((profile, evidence))
        run = Run("baseline", target.name, prompt_ids=list(ids), max_tokens=config.max_tokens)
        return Scripted._events(run, "Warszawa.")

    monkeypatch.setattr(main, "_mount_ui", lambda app, session, service, key: mounted.append(session))
    # a target of its own: other tests' keepers, still measuring "org/target" in the background, save into this cache
    settings = serve_args(
        "--target", "org/ui-target", "--drafter", "lookup", "--drafters", "lookup", "--max-batch", "1"
    )
    _, served = main.build(settings, store=ModelStore(), stream=stream, measure=measure)
    (session,) = mounted
    host = served.host
    assert session.host is host and session.runner is served.runner
    target, choice = fake_target(), DrafterChoice(lookup=True)
    target.name = "org/ui-target"
    host.open = lambda *_args, **_kw: Loaded(target, choice, None)
    host.loaded, host.holds = lambda drafter: (target, choice), lambda drafter: True
    host.costs.settle_s, host.costs.poll_s = 30.0, 0.01  # the keeper holds off while both front ends run

    updates = list(session.compare("Stolica Polski to", Settings(target="org/ui-target", drafter="lookup")))
    assert updates[-1].state == "done", updates[-1]
    assert measure.calls == 0 and [w.drafter for w in host.costs.pending] == ["lookup"]  # not in /ui's run
    assert ask(served)[-1].finish == "stop"
    assert measure.calls == 0 and len(host.costs.pending) == 1  # nor in the API's: the same pair, still waiting
    autos = [(profile, evidence) for profile, evidence in seen if evidence is not None]
    assert len(autos) == 2 and autos[0][0] is None and autos[1][0] is None  # both ran without costs
    assert autos[0][1] is autos[1][1] and list(host.evidence.values()) == [autos[0][1]]  # one Evidence per pair
    host.costs.settle_s = 0.3
    assert wait_for(lambda: measure.calls == 1 and not host.costs.pending)  # measured once, while idle
