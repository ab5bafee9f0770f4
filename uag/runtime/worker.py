"""One thread for all MLX work, fed by a queue.

MLX streams are bound to the thread that created them, while a web server steps a handler's generator
on whichever thread is free. So the app never touches a model outside this worker: a handler submits a
generator function, the worker runs it on its own thread, and the handler reads what it yields through a
`queue.Queue`. Jobs run one at a time, in submission order, so users are served in turn and no run's
timing is disturbed by another's; except jobs submitted `shared` (a server's requests), which run together,
up to `max_batch` at once, each in a greenlet of this thread, their passes batched (uag.runtime.batching).
A job that is not shared waits for the running shared ones to end, and none joins them meanwhile.

    worker = MLXWorker()
    job = worker.submit(count, 3)        # def count(job, n): yield from range(n)
    list(job)                            # -> [0, 1, 2]

A job function is called as ``fn(job, *args)``. It polls ``job.cancelled`` (a `threading.Event`; pass it
as ``cancel=`` to `uag.core.engine.stream`, which checks it between cycles) and may hand items back from
callbacks with ``job.emit(item)`` (model-loading progress). An exception it raises is re-raised in the
consumer. A consumer that stops reading (breaks out, or is closed by the web server) cancels the job.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from uag.errors import UserError
from uag.runtime.batching import Batch, RoundTimes

log = logging.getLogger(__name__)

_DONE = object()  # end of a job's items
TICK = object()  # yielded by `Job.items(heartbeat)` when nothing came for `heartbeat` seconds


class Busy(UserError):
    """The client already has as many jobs queued or running as it may (and its job was not to wait), or the
    request would not fit beside those running now."""


class Job:
    """A unit of work for the worker, and the consumer's view of what it yields."""

    def __init__(self, fn: Callable[..., Any], args: tuple, label: str, shared: bool = False):
        self.label = label
        self.shared = shared  # may run together with other shared jobs (uag.runtime.batching)
        self.cancelled = threading.Event()  # set by cancel(); the job function polls it
        self.started = threading.Event()  # the worker has picked the job up
        self.done = threading.Event()  # the job function has returned (or raised, or was skipped)
        self.progress = ""  # the job's latest progress line ("converting the demo model…"), for those who wait
        self.out_of_time = False  # cancelled by its time budget, not by a person
        self.cut: str | None = None  # why the server stopped it: "time_budget", or "stalled" (no progress)
        self.reading = False  # reading a prompt: one pass nothing stops midway, never judged stalled
        self.moved = time.monotonic()  # its last sign of progress: an item handed over, or `progressed()`
        self.queued_at = time.perf_counter()  # where a request's time to first token counts from (GET /metrics)
        self._fn, self._args = fn, args
        self._items: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._timer: threading.Timer | None = None
        self._watch: threading.Timer | None = None

    def __repr__(self) -> str:
        state = "done" if self.done.is_set() else "running" if self.started.is_set() else "queued"
        return f"<Job {self.label!r} {state}{' cancelled' if self.cancelled.is_set() else ''}>"

    def cancel(self) -> None:
        """Ask the job to stop at its next check (a queued job is skipped altogether)."""
        self.cancelled.set()

    def emit(self, item: Any) -> None:
        """Hand an item to the consumer (for callbacks inside the job function; thread-safe)."""
        self.moved = time.monotonic()
        self._items.put(item)

    def limit(self, seconds: float | None) -> None:
        """Cancel the job `seconds` from now (its time budget), marking it `out_of_time`; None: no limit."""
        if seconds is None or self.done.is_set():
            return

        def expire() -> None:
            if not self.done.is_set():
                self.out_of_time, self.cut = True, self.cut or "time_budget"
                self.cancel()

        self._timer = threading.Timer(seconds, expire)
        self._timer.daemon = True
        self._timer.start()

    def progressed(self) -> None:
        """A sign of progress (a token, a prompt read): the stall guard (`watch`) counts from here."""
        self.moved = time.monotonic()

    def watch(self, seconds: float | None) -> None:
        """Cancel the job once it has made no progress for `seconds` (its stall guard), marking it `out_of_time`
        and cut "stalled"; None: no guard. A prompt read (`reading`) is never judged: nothing stops it midway."""
        if seconds is None or self.done.is_set():
            return
        self.progressed()

        def check() -> None:
            if self.done.is_set():
                return
            idle = time.monotonic() - self.moved
            if idle >= seconds and not self.reading:
                self.out_of_time, self.cut = True, self.cut or "stalled"
                self.cancel()
                return
            self._watch = threading.Timer(seconds - idle if idle < seconds else seconds, check)
            self._watch.daemon = True
            self._watch.start()

        self._watch = threading.Timer(seconds, check)
        self._watch.daemon = True
        self._watch.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def __iter__(self) -> Iterator[Any]:
        """The job's items as they come, on any thread; then its exception, if it raised one."""
        return self.items()

    def items(self, heartbeat: float | None = None) -> Iterator[Any]:
        """As `iter(job)`, but yields `TICK` whenever nothing came for `heartbeat` seconds, so that a
        consumer driven by a web server hands control back often (and can be closed while the job works)."""
        finished = False
        try:
            while True:
                try:
                    item = self._items.get(timeout=heartbeat)
                except queue.Empty:
                    yield TICK
                    continue
                if item is _DONE:
                    break
                yield item
            finished = True
            if self._error is not None:
                raise self._error
        finally:
            if not finished:  # the consumer left early: nobody wants the rest
                self.cancel()

    # --- on the worker thread ------------------------------------------------------------------
    def abandon(self, err: BaseException) -> None:
        """End a job that can run no further (the batch it ran in failed): its consumer gets `err`."""
        if not self.done.is_set():
            self._error = err
            self._items.put(_DONE)
            self.done.set()

    def _run(self) -> None:
        self.started.set()
        try:
            if not self.cancelled.is_set():
                items = self._fn(self, *self._args)
                if not inspect.isgenerator(items):
                    raise TypeError(f"a job function must be a generator function (got {self._fn!r})")
                try:
                    for item in items:
                        self.moved = time.monotonic()
                        self._items.put(item)
                finally:
                    items.close()  # on this thread, so MLX state is released where it was made
        except BaseException as err:  # handed to the consumer, who decides what the user sees
            if not self.done.is_set():
                self._error = err
        finally:
            for timer in (self._timer, self._watch):
                if timer is not None:
                    timer.cancel()
            self._items.put(_DONE)
            self.done.set()


class MLXWorker:
    """A daemon thread that runs submitted jobs first in, first out: one at a time, or, where they are `shared`,
    up to `max_batch` together."""

    def __init__(self, name: str = "uag-mlx", *, max_batch: int = 1):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1 (got {max_batch})")
        self.max_batch = max_batch
        self.round_times = RoundTimes()  # where the batch's rounds spend this thread's time, every batch's (/metrics)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._current: Job | None = None
        self._running: list[Job] = []  # the shared jobs running together now
        self.batch = None  # the uag.runtime.batching.Batch while shared jobs run
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, label: str | None = None, shared: bool = False) -> Job:
        """Queue ``fn(job, *args)``; iterate the returned `Job` for what it yields. A `shared` job may run
        together with other shared ones, its model passes batched with theirs (`uag.runtime.batching.share`)."""
        if not self._thread.is_alive():
            raise RuntimeError("the MLX worker has been closed")
        job = Job(fn, args, label or getattr(fn, "__name__", "job"), shared)
        self._jobs.put(job)
        return job

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a plain function on the worker and return its result (blocking, in turn with the jobs)."""

        def once(_job: Job) -> Iterator[Any]:
            yield fn(*args)

        (result,) = self.submit(once, label=getattr(fn, "__name__", "call"))
        return result

    @property
    def current(self) -> Job | None:
        """The job running now, if any (the longest running one, where several run together)."""
        return self._current or next((job for job in self._running if not job.done.is_set()), None)

    @property
    def running(self) -> int:
        """Jobs running now (more than one only while shared jobs run together)."""
        return sum(not job.done.is_set() for job in self._running) or int(self._current is not None)

    @property
    def backlog(self) -> int:
        """Jobs waiting to start."""
        return self._jobs.qsize()

    @property
    def alone(self) -> bool:
        """Whether the job asking runs by itself, with none waiting to start: where a slow write on this thread
        (auto's evidence, the caches kept on disk) stalls no other request."""
        return self.running <= 1 and not self.backlog

    def ahead_of(self, job: Job) -> int:
        """How many queued jobs will start before `job` (0 when it is next, or not queued)."""
        with self._jobs.mutex:
            waiting = [j for j in self._jobs.queue if j is not None]
        return waiting.index(job) if job in waiting else 0

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        batch = self.batch = self._new_batch()
        solo, closing = None, False
        while not (closing and solo is None and not batch):
            while solo is None and not closing and not batch.full:  # admit what may run now
                self._running = [job for job in self._running if not job.done.is_set()]  # none kept while idle
                try:
                    job = self._jobs.get(block=not batch)
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                elif job.shared:
                    self._running.append(job)
                    batch = self._batched(batch, batch.join, job)
                else:
                    solo = job  # runs once the shared jobs running now are done; none joins them meanwhile
                job = None  # an idle worker, blocked on the queue, must not keep the last job (and its models) alive
            if batch:
                batch = self._batched(batch, batch.round)
            elif solo is not None:
                self._current = solo
                try:
                    solo._run()
                finally:
                    self._current, solo = None, None
            self._running = [job for job in self._running if not job.done.is_set()]

    def _batched(self, batch, step: Callable[..., None], *args: Any):
        """Run one step of the batch; where batching itself fails (a bug), its requests fail and a new batch starts."""

        try:
            step(*args)
            return batch
        except Exception as err:
            log.error("the batch of %d requests failed", len(batch), exc_info=err)
            batch.fail(err)
            for job in self._running:  # any that did not end when told
                job.abandon(err)
            self.batch = self._new_batch()
            return self.batch

    def _new_batch(self) -> Batch:
        batch = Batch(self.max_batch, times=self.round_times)
        batch.queued = lambda: not self._jobs.empty()  # a lone member yields at its next pass once a job waits
        return batch
