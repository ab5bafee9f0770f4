"""Running a user's request on the MLX worker: the one skeleton every long request shares.

`JobRunner.run` submits a job function, says what the request waits for while other work holds the
worker, hands over what the job yields (with a heartbeat, so that a web server can close the consumer at
any time), and cancels the job whenever the consumer stops reading: the Stop button, an API client's
cancel, a client that went away. It also holds the per-client limit on queued jobs and starts each job's
time budget. `failure` turns an exception into the line a user sees: a `UserError` is theirs to fix;
anything else is a bug, logged with its traceback and shown as an internal error. Standard library only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from uag.errors import UserError
from uag.runtime.worker import TICK, Job, MLXWorker

log = logging.getLogger(__name__)

DEFAULT_PER_CLIENT = 2  # jobs one client may have queued or running at once
DEFAULT_BUDGET_S = 300.0  # generation time one request may take on the worker (models loading not counted)
HEARTBEAT_S = 0.25  # the consumer gets control back at least this often


class Busy(UserError):
    """The client already has as many jobs queued or running as it may."""


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


def report(job: Job, text: str) -> None:
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
    """Submits users' jobs to the one MLX worker, within each client's limit and each job's time budget."""

    def __init__(
        self,
        worker: MLXWorker,
        *,
        per_client: int = DEFAULT_PER_CLIENT,
        budget_s: float | None = DEFAULT_BUDGET_S,
        heartbeat_s: float = HEARTBEAT_S,
    ):
        if per_client < 1:
            raise ValueError(f"per_client must be at least 1 (got {per_client})")
        self.worker = worker
        self.per_client = per_client
        self.budget_s = budget_s
        self.heartbeat_s = heartbeat_s
        self._lock = threading.Lock()
        self._clients: Counter[str] = Counter()
        self._owned: dict[str, Job] = {}

    def run(
        self,
        fn: Callable[..., Iterator[Any]],
        *args: Any,
        label: str,
        client: str | None = None,
        owner: str | None = None,
    ) -> Iterator[Any]:
        """Queue `fn(job, *args)` and yield `Waiting` until it starts, then its items and a `Tick` whenever
        none came for a heartbeat; then raise what it raised. Busy if `client` is at its limit.

        `owner` (a browser tab) lets `stop(owner)` cancel it from another request. Closing this generator
        cancels the job (a queued job never starts; a running one stops at its next check).
        """
        self._claim(client)
        try:
            job = self.worker.submit(fn, *args, label=label)
        except BaseException:
            self._release(client)
            raise
        if owner:
            with self._lock:
                self._owned[owner] = job
        started = time.monotonic()
        try:
            while not job.started.wait(self.heartbeat_s):  # another user's run, or the start-up preload, goes first
                current = self.worker.current
                doing = " — ".join(filter(None, (current.label, current.progress))) if current else ""
                yield Waiting(time.monotonic() - started, self.worker.ahead_of(job), doing)
            for item in job.items(self.heartbeat_s):
                yield Tick() if item is TICK else item
        finally:
            job.cancel()  # a no-op when it is done; stops it when the consumer left early
            if owner:
                with self._lock:
                    if self._owned.get(owner) is job:
                        del self._owned[owner]
            self._release(client)

    def stop(self, owner: str | None) -> bool:
        """Cancel `owner`'s job within a cycle; False when it has none."""
        with self._lock:
            job = self._owned.get(owner) if owner else None
        if job is None:
            return False
        job.cancel()
        return True

    def queued(self, client: str) -> int:
        """Jobs `client` has queued or running now."""
        with self._lock:
            return self._clients[client]

    def _claim(self, client: str | None) -> None:
        if client is None:
            return
        with self._lock:
            if self._clients[client] >= self.per_client:
                raise Busy(
                    f"you already have {self._clients[client]} request{'s' * (self._clients[client] != 1)} queued "
                    f"or running, the most this app takes from one client: wait for one to finish, or stop it"
                )
            self._clients[client] += 1

    def _release(self, client: str | None) -> None:
        if client is None:
            return
        with self._lock:
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]
