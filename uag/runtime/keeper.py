"""Measuring a pair's costs off every request's path: `CostKeeper` measures the costs auto decides by, for a pair
with none saved or whose saved ones a run found off, on the MLX worker only while it is idle, stops for a request
and measures a pair at most once per interval (`due`). `measure_wanted` is the one measurement every front end's
host makes (`uag.runtime.host.Host`): the pair's quick calibration (`uag.costs.pair.measure_costs`, or a sharded
target's over its ranks: any `Measures`), kept unless the saved one was measured quieter.

    keeper = CostKeeper(worker, measure, ready)
    keeper.want(Wanted(key, "lookup+demo-drafter", "no costs are saved for it yet"))   # -> "scheduled"
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from uag.costs.calibrate import MeasurementStopped
from uag.costs.pair import keep_measured, measure_costs, read_calibration
from uag.costs.profiles import machine_load, others_load, pair_name, replaces
from uag.runtime.worker import Job, MLXWorker

log = logging.getLogger(__name__)

REMEASURE_S = 600.0  # a pair's costs are measured at most this often: a few busy minutes cause no storm
SETTLE_S = 2.0  # the worker idle this long before a background measurement starts
SETTLE_MOST_S = 120.0  # the longest idle a measurement that requests keep stopping waits for (`settle_after`)
POLL_S = 0.25  # how often the keeper looks at the worker
LOAD_EVERY_S = 5.0  # how often it reads the load, so that this process's own share follows its work
PROGRESS_EVERY_S = 3.0  # a start-up measurement's progress on the console, at most this often


class Measures(Protocol):
    """A pair's quick calibration: `uag.costs.pair.measure_costs`, or a sharded target's over its ranks
    (`uag.distributed.serving.Leader.measure`). `cancel`, asked between passes, stops it by raising
    `uag.costs.calibrate.MeasurementStopped`; the result is not saved (`uag.costs.pair.keep_measured` decides)."""

    def __call__(
        self,
        target: Any,
        choice: Any,
        *,
        progress: Callable[[str], None] | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> Any: ...


def due(last_s: float | None, now_s: float, interval_s: float = REMEASURE_S) -> bool:
    """Whether a pair last measured at `last_s` (None: not by this server) may be measured again at `now_s`.

    Example: due(None, 5.0) -> True;  due(100.0, 400.0, 600.0) -> False;  due(100.0, 700.0, 600.0) -> True
    """
    return last_s is None or now_s - last_s >= interval_s


def settle_after(stops: int, settle_s: float = SETTLE_S, most_s: float = SETTLE_MOST_S) -> float:
    """How long the worker must have been idle before a pair's measurement starts, once requests have stopped it
    `stops` times: twice as long after each stop, so that a client pausing between requests (an agent running its
    tools) does not find a measurement in its way, and wait one of its passes, at every turn.

    Example: settle_after(0) -> 2.0;  settle_after(3) -> 16.0;  settle_after(9) -> 120.0
    """
    return min(settle_s * 2**stops, most_s)


@dataclass(frozen=True)
class Wanted:
    """A pair whose costs are to be measured: its profile key, the drafter as a request named it, and why."""

    key: dict
    drafter: str | None
    reason: str

    @property
    def name(self) -> str:
        return json.dumps(self.key, sort_keys=True)


class CostKeeper:
    """Measures the server's pairs' costs off every request's path. A pair with none saved, or whose saved ones a
    run found off, is measured on the MLX worker only once it has been idle (nothing queued or running) for
    `settle_s`; `measure(job, wanted, cancel)` runs there, asks `cancel` between passes (True once a request is
    queued: it stops, and starts again at an idle moment twice as long as the last, `settle_after`) and returns
    True once the pair is done with (measured, kept, or not worth measuring now), False to try again later. A pair
    is measured at most once per `interval_s`; `ready(wanted)` says whether its models are loaded (none is loaded
    for a measurement). At the process's exit a measurement in progress is stopped and waited for (MLX aborts the
    process when it exits in the middle of a pass on another thread)."""

    def __init__(
        self,
        worker: MLXWorker,
        measure: Callable[[Job, Wanted, Callable[[], bool]], bool],
        ready: Callable[[Wanted], bool],
        *,
        interval_s: float = REMEASURE_S,
        settle_s: float = SETTLE_S,
        poll_s: float = POLL_S,
    ):
        self.worker, self.measure, self.ready = worker, measure, ready
        self.interval_s, self.settle_s, self.poll_s = interval_s, settle_s, poll_s
        self._pending: dict[str, Wanted] = {}
        self._last: dict[str, float] = {}  # pair -> when this server last measured it (time.monotonic)
        self._deferred: set[str] = set()  # pairs wanted again within their interval, and said so
        self._stops: dict[str, int] = {}  # pair -> times requests stopped its measurement since it last finished
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._running: Job | None = None  # the job measuring now, if any
        atexit.register(self.close)

    def want(self, wanted: Wanted) -> str:
        """Measure `wanted` when the worker is idle, unless it is waiting already or was measured less than
        `interval_s` ago: "scheduled", "waiting", "deferred" (measured lately; said once per interval) or ""
        (deferred, and said already)."""
        with self._lock:
            name, last = wanted.name, self._last.get(wanted.name)
            if name in self._pending:
                return "waiting"
            if not due(last, time.monotonic(), self.interval_s):
                if name in self._deferred:
                    return ""
                self._deferred.add(name)
                return "deferred"
            self._pending[name] = wanted
        self.start()
        self._wake.set()
        return "scheduled"

    def start(self) -> None:
        """Start watching the worker (and reading the load every few seconds, so that this process's own share
        of it is known when a measurement needs it); `want` starts it too."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="uag-serve-costs", daemon=True)
                self._thread.start()

    def measured(self, key: dict) -> None:
        """The pair was just measured (or judged) elsewhere (the start-up job): its interval starts now."""
        with self._lock:
            self._last[json.dumps(key, sort_keys=True)] = time.monotonic()
            self._deferred.discard(json.dumps(key, sort_keys=True))

    def since(self, key: dict) -> float | None:
        """Seconds since this server last measured the pair; None if it has not."""
        last = self._last.get(json.dumps(key, sort_keys=True))
        return None if last is None else time.monotonic() - last

    @property
    def pending(self) -> list[Wanted]:
        with self._lock:
            return list(self._pending.values())

    def counts(self) -> dict[str, int]:
        """Its state for `GET /metrics` (uag.server.metrics): pairs measured by this server, pairs waiting to be
        measured (no costs saved, or the saved ones found off), pairs found off again within their interval, and
        whether it is measuring now (0 or 1)."""
        running = self._running
        with self._lock:
            return {
                "measured": len(self._last),
                "scheduled": len(self._pending),
                "deferred": len(self._deferred),
                "measuring": int(running is not None and running.started.is_set() and not running.done.is_set()),
            }

    def cancel_for(self, job: Job) -> Callable[[], bool]:
        """What a measurement on `job` asks between passes: True once a request is queued behind it, the job is
        cancelled, or the keeper is closing."""
        self._running = job
        return lambda: job.cancelled.is_set() or self.worker.backlog > 0 or self._closing.is_set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Measure nothing more; stop a measurement in progress at its next pass and wait for it."""
        self._closing.set()
        self._wake.set()
        running = self._running
        if running is not None and running.started.is_set():
            running.wait(timeout_s)

    def _loop(self) -> None:
        idle_since, read_load = None, 0.0
        while not self._closing.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            now = time.monotonic()
            if now >= read_load:
                others_load()
                read_load = now + LOAD_EVERY_S
            busy = self.worker.current is not None or self.worker.backlog
            ready = [] if busy else [wanted for wanted in self.pending if self.ready(wanted)]
            if not ready:
                idle_since = None
                continue
            idle_since = now if idle_since is None else idle_since
            with self._lock:
                settled = [
                    w for w in ready if now - idle_since >= settle_after(self._stops.get(w.name, 0), self.settle_s)
                ]
            if settled and not self._closing.is_set():
                self._run(settled[0])
                idle_since = None

    def _run(self, wanted: Wanted) -> None:
        job = self.worker.submit(
            self._job,
            wanted,
            label=f"measuring auto's costs for {wanted.key['target']} ← {wanted.key['drafter']} (stops for a request)",
        )
        try:
            (done,) = list(job)
        except Exception:
            log.error("measuring auto's costs failed; not tried again for this pair", exc_info=True)
            done = True
        with self._lock:
            if not done:  # a request stopped it: it waits for a longer idle moment next time
                self._stops[wanted.name] = self._stops.get(wanted.name, 0) + 1
                return
            self._pending.pop(wanted.name, None)
            self._stops.pop(wanted.name, None)
            self._last[wanted.name] = time.monotonic()
            self._deferred.discard(wanted.name)

    def _job(self, job: Job, wanted: Wanted) -> Iterator[bool]:
        if self.worker.backlog:  # a request came in between the look and the submission: it goes first
            yield False
            return
        yield self.measure(job, wanted, self.cancel_for(job))


def every(say: Callable[[str], None], seconds: float) -> Callable[[str], None]:
    """`say`, at most once every `seconds` (the first line at once)."""
    last = [-float("inf")]

    def throttled(text: str) -> None:
        if time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            say(text)

    return throttled


def measure_wanted(
    target: Any,
    choice: Any,
    wanted: Wanted,
    *,
    measure: Measures = measure_costs,
    cancel: Callable[[], bool],
    job: Job,
    progress: Callable[[str], None] | None = None,
    interval_s: float = REMEASURE_S,
) -> bool:
    """Measure the loaded pair (target, choice) that `wanted` names and keep its costs: True once done with it
    (measured and saved, or kept because the saved costs were measured quieter, or not measured because the
    machine is busy now and they were), False when a request stopped the measurement (`cancel`). `progress`: the
    console at start-up (at most every `PROGRESS_EVERY_S`); the job's own progress line is always kept."""
    name, saved, now = pair_name(wanted.key), read_calibration(wanted.key), machine_load()
    if saved is not None and not replaces(now, saved):
        log.info(
            "not measuring auto's costs for %s now: the machine is busy (%s) and the saved ones were "
            "measured at %s; tried again after %g min",
            name,
            now,
            saved.load,
            interval_s / 60,
        )
        return True
    log.info(
        "measuring auto's costs for %s (%s)%s", name, wanted.reason, "; a request stops it" if progress is None else ""
    )
    tell = None if progress is None else every(progress, PROGRESS_EVERY_S)

    def said(text: str) -> None:
        job.progress = text
        if tell is not None:
            tell(f"{name}: {text}")

    tic = time.monotonic()
    try:
        calibration = measure(target, choice, progress=said, cancel=cancel)
    except MeasurementStopped:
        log.info(
            "stopped measuring auto's costs for %s: a request came in (measured when the server is idle again)", name
        )
        return False
    kept, line = keep_measured(calibration, target)
    (log.info if kept else log.warning)("%s (in %.0f s)", line, time.monotonic() - tic)
    return True
