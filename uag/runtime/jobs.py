"""Running a user's request on the MLX worker: the one skeleton every long request shares.

`JobRunner.run` submits a job function, says what the request waits for while other work holds the
worker, hands over what the job yields (with a heartbeat, so that a web server can close the consumer at
any time), and cancels the job whenever the consumer stops reading: the Stop button, an API client's
cancel, a client that went away. It also keeps each client to its share of the worker's queue (beyond it
a job is refused, or held back until one of the client's ends) and starts each job's time budget (none by
default in `uag serve`) and its stall guard (no progress for `DEFAULT_STALL_S`).
`failure` turns an exception into the line a user sees: a `UserError` is theirs to fix; anything else is
a bug, logged with its traceback and shown as an internal error. Standard library only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from uag.errors import UserError
from uag.runtime.worker import TICK, Busy, Job, MLXWorker

log = logging.getLogger(__name__)

DEFAULT_PER_CLIENT = 2  # jobs one client may have queued or running at once
DEFAULT_BUDGET_S = 300.0  # the app's generation time per run (`uag app --time-budget`); `uag serve` sets none
DEFAULT_STALL_S = 600.0  # a request that makes no progress this long is stopped (a stall, never a long reply)
HEARTBEAT_S = 0.25  # the consumer gets control back at least this often


@dataclass(frozen=True)
class Status:
    """A progress line from the worker ("Loading the target …")."""

    text: str


@dataclass(frozen=True)
class Waiting:
    """The request is queued behind other work: what holds the worker, and for how long we have waited."""

    seconds: float
    ahead: int  # jobs queued before this one
    current: str  # what the worker is doing now ("" when it is between jobs)

    @property
    def text(self) -> str:
        doing = f": {self.current}" if self.current else ""
        queue = f"; {self.ahead} more request{'s' * (self.ahead != 1)} before yours" if self.ahead else ""
        return f"Waiting for the MLX worker{doing}{queue}… {self.seconds:.0f} s"


@dataclass(frozen=True)
class OutOfTime:
    """The job was stopped by its time budget of `seconds`, not by a person."""

    seconds: float


@dataclass(frozen=True)
class Tick:
    """Nothing new from the job for a moment (the consumer may refresh its clock, or be closed)."""


def tell(job: Job, text: str) -> None:
    """Tell a job's progress from inside it: to its consumer, and to anyone waiting behind it."""
    job.progress = text
    job.emit(Status(text))


def failure(err: BaseException, doing: str) -> str:
    """The line a user sees when `doing` ("run", "calibrate") failed: theirs to fix, or an internal error.

    Example: failure(InputError("the prompt is empty"), "run") -> "**Cannot run:** the prompt is empty"
    """
    if isinstance(err, UserError):
        return f"**Cannot {doing}:** {err}"
    log.error("%s failed with an internal error", doing, exc_info=err)
    return (
        f"**Internal error** (cannot {doing}): this is a bug in the app, not your input. It keeps serving; "
        "the details are in its log."
    )


class JobRunner:
    """Submits users' jobs to the one MLX worker, within each client's share and each job's time budget.

    A client has at most `per_client` jobs on the worker's queue (queued or running). Beyond that a job is
    refused (`Busy`), or, with `wait=True`, held back here, not yet queued, until one of the client's jobs ends:
    so another client's job never waits behind more than `per_client` of one client's.
    """

    def __init__(
        self,
        worker: MLXWorker,
        *,
        per_client: int = DEFAULT_PER_CLIENT,
        budget_s: float | None = DEFAULT_BUDGET_S,
        heartbeat_s: float = HEARTBEAT_S,
        stall_s: float | None = DEFAULT_STALL_S,
    ):
        if per_client < 1:
            raise ValueError(f"per_client must be at least 1 (got {per_client})")
        self.worker = worker
        self.per_client = per_client
        self.budget_s = budget_s  # None: none
        self.stall_s = stall_s  # None: no stall guard
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)  # a client's job ended: its next held job may go
        self._clients: Counter[str] = Counter()  # jobs on the worker's queue, per client
        self._held: dict[str, deque[object]] = {}  # jobs held back, per client, first come first
        self._owned: dict[str, Job] = {}

    def run(
        self,
        fn: Callable[..., Iterator[Any]],
        *args: Any,
        label: str,
        client: str | None = None,
        owner: str | None = None,
        wait: bool = False,
        shared: bool = False,
    ) -> Iterator[Any]:
        """Queue `fn(job, *args)` and yield `Waiting` until it starts, then its items and a `Tick` whenever
        none came for a heartbeat; then raise what it raised. When `client` has its share queued or running:
        Busy, or with `wait` held back (yielding `Waiting`) until one of its jobs ends.

        `shared`: the job may run together with other shared jobs (uag.runtime.worker.MLXWorker).
        `owner` (a browser tab) lets `stop(owner)` cancel it from another request. Closing this generator
        cancels the job (a queued or held job never starts; a running one stops at its next check).
        """
        started = time.monotonic()
        submit = partial(self.worker.submit, fn, *args, label=label, shared=shared)
        job, ticket = self._enter(client, wait, submit)
        if job is None:
            try:
                while (job := self._take_turn(client, ticket, submit)) is None:
                    yield self._waiting(started, self.worker.backlog + self._place(client, ticket))
            except BaseException:
                self._withdraw(client, ticket)
                raise
        if owner:
            with self._lock:
                self._owned[owner] = job
        try:
            while not job.started.wait(self.heartbeat_s):  # another user's run, or the start-up preload, goes first
                yield self._waiting(started, self.worker.ahead_of(job))
            for item in job.items(self.heartbeat_s):
                yield Tick() if item is TICK else item
        finally:
            job.cancel()  # a no-op when it is done; stops it when the consumer left early
            if owner:
                with self._lock:
                    if self._owned.get(owner) is job:
                        del self._owned[owner]
            self._release(client)

    def limit(self, job: Job) -> None:
        """Start `job`'s time budget and its stall guard from now (a job function calls it first)."""
        job.limit(self.budget_s)
        job.watch(self.stall_s)

    def reason(self, job: Job) -> str:
        """Why the server stopped `job` (`job.cut`), in words a client reads."""
        if job.cut == "stalled":
            return f"stopped after making no progress for {self.stall_s:g} s (a stalled request)"
        return f"stopped by the server's time budget of {self.budget_s:g} s per request (--time-budget)"

    def stop(self, owner: str | None) -> bool:
        """Cancel `owner`'s job within a cycle; False when it has none."""
        with self._lock:
            job = self._owned.get(owner) if owner else None
        if job is None:
            return False
        job.cancel()
        return True

    def queued(self, client: str) -> int:
        """Jobs `client` has on the worker's queue now (queued or running)."""
        with self._lock:
            return self._clients[client]

    def held(self, client: str) -> int:
        """Jobs of `client` held back beyond its share, waiting for one of its jobs to end."""
        with self._lock:
            return len(self._held.get(client, ()))

    def _waiting(self, started: float, ahead: int) -> Waiting:
        current = self.worker.current
        doing = " — ".join(filter(None, (current.label, current.progress))) if current else ""
        return Waiting(time.monotonic() - started, ahead, doing)

    def _enter(self, client: str | None, wait: bool, submit: Callable[[], Job]) -> tuple[Job | None, object]:
        """(the job, queued on the worker and counted against `client`'s share, None) when the share allows;
        else (None, its ticket in the client's line of held jobs) with `wait`, and Busy without."""
        if client is None:
            return submit(), None
        with self._lock:
            count = self._clients[client]
            if count < self.per_client and not self._held.get(client):
                job = submit()  # under the lock: a client's jobs reach the worker in the order they came
                self._clients[client] += 1
                return job, None
            if not wait:
                raise Busy(
                    f"you already have {count} request{'s' * (count != 1)} queued "
                    f"or running, the most this app takes from one client: wait for one to finish, or stop it"
                )
            ticket = object()
            self._held.setdefault(client, deque()).append(ticket)
            return None, ticket

    def _take_turn(self, client: str, ticket: object, submit: Callable[[], Job]) -> Job | None:
        """Wait up to a heartbeat for `ticket` to lead its client's line while the client is under its share;
        then the job, queued on the worker and counted against the share (None: not yet)."""
        with self._turn:
            line = self._held[client]

            def ready() -> bool:
                return line[0] is ticket and self._clients[client] < self.per_client

            if not self._turn.wait_for(ready, self.heartbeat_s):
                return None
            line.popleft()
            if not line:
                del self._held[client]
            self._turn.notify_all()  # the next in line may go too, if the share allows
            job = submit()
            self._clients[client] += 1
            return job

    def _place(self, client: str, ticket: object) -> int:
        """How many of the client's held jobs go before this one."""
        with self._lock:
            line = self._held.get(client, ())
            return line.index(ticket) if ticket in line else 0

    def _withdraw(self, client: str, ticket: object) -> None:
        """A held job's consumer left: it leaves the line without ever being queued."""
        with self._turn:
            line = self._held.get(client)
            if line is not None and ticket in line:
                line.remove(ticket)
                if not line:
                    del self._held[client]
                self._turn.notify_all()

    def _release(self, client: str | None) -> None:
        if client is None:
            return
        with self._turn:
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]
            self._turn.notify_all()


def watched(job: Job, events: Iterator[Any]) -> Iterator[Any]:
    """The engine's `events` of `job`'s run, each one progress for its stall guard (`Job.watch`); the prompt read
    before the first is `reading`. Closing this closes `events` (the engine's `finally` leaves the caches exact)."""
    job.reading = True
    try:
        for event in events:
            job.reading = False
            job.progressed()
            yield event
    finally:
        job.reading = False
        events.close()
