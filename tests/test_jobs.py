"""The job runner every long request goes through: cancel on close, per-client limit, time budget."""

from __future__ import annotations

import threading
import time

import pytest

from uag.runtime.jobs import Busy, JobRunner, Status, Tick, Waiting, failure, report
from uag.runtime.worker import MLXWorker


@pytest.fixture
def worker():
    w = MLXWorker(name="test-jobs")
    yield w
    w.close(timeout=10)


def _until_cancelled(job, log):
    log.append("started")
    while not job.cancelled.is_set():
        time.sleep(0.01)
        yield "working"
    log.append("cancelled")


def test_closing_the_consumer_cancels_the_running_job(worker):
    runner, log = JobRunner(worker, heartbeat_s=0.05), []
    items = runner.run(_until_cancelled, log, label="long")
    assert next(i for i in items if i == "working") == "working"
    items.close()  # as gradio closes a handler's generator on cancel or disconnect
    assert worker.call(lambda: "next job runs") == "next job runs"  # the worker is free again
    assert log == ["started", "cancelled"]


def test_a_queued_job_closed_before_it_starts_never_runs(worker):
    runner, gate, log = JobRunner(worker, heartbeat_s=0.05), threading.Event(), []

    def blocker(job):
        gate.wait(10)
        yield "done"

    first = runner.run(blocker, label="blocker")
    second = runner.run(_until_cancelled, log, label="queued")
    next(first)  # submitted: the blocker holds the worker (or is about to)
    waiting = next(second)
    assert isinstance(waiting, Waiting) and "Waiting for the MLX worker" in waiting.text
    second.close()
    gate.set()
    assert [i for i in first if not isinstance(i, (Tick, Waiting))] == ["done"]
    assert worker.call(lambda: log) == []


def test_waiting_says_what_holds_the_worker(worker):
    runner, gate = JobRunner(worker, heartbeat_s=0.05), threading.Event()

    def converting(job):
        report(job, "converting the demo model once")
        gate.wait(10)
        yield "ready"

    holder = runner.run(converting, label="preparing the demo models")
    assert next(holder) == Status("converting the demo model once")
    waiting = next(runner.run(lambda job: iter(()), label="mine"))
    assert waiting.text.startswith("Waiting for the MLX worker: preparing the demo models — converting the demo")
    gate.set()
    list(holder)


def test_the_heartbeat_hands_control_back_while_the_job_is_silent(worker):
    runner, gate = JobRunner(worker, heartbeat_s=0.02), threading.Event()

    def silent(job):
        gate.wait(10)
        yield "late"

    items = runner.run(silent, label="silent")
    seen = [next(items) for _ in range(5)]
    assert any(isinstance(i, Tick) for i in seen)
    gate.set()
    assert "late" in list(items)


def test_a_client_may_queue_only_so_many_jobs(worker):
    runner, gate = JobRunner(worker, per_client=2, heartbeat_s=0.05), threading.Event()

    def held(job):
        gate.wait(10)
        yield "done"

    first, second = runner.run(held, label="1", client="203.0.113.9"), runner.run(held, label="2", client="203.0.113.9")
    next(first), next(second)
    assert runner.queued("203.0.113.9") == 2
    with pytest.raises(Busy, match="you already have 2 requests queued or running"):
        next(runner.run(held, label="3", client="203.0.113.9"))
    other = runner.run(held, label="other", client="198.51.100.1")  # another client is not held back
    next(other)
    gate.set()
    for items in (first, second, other):
        list(items)
    assert runner.queued("203.0.113.9") == 0
    assert list(runner.run(held, label="again", client="203.0.113.9"))[-1] == "done"


def test_the_time_budget_stops_a_job_and_says_so(worker):
    def long(job):
        job.limit(0.05)
        while not job.cancelled.is_set():
            time.sleep(0.01)
        yield job.out_of_time

    assert list(JobRunner(worker).run(long, label="long"))[-1] is True


def test_stop_cancels_the_owners_job(worker):
    runner, log = JobRunner(worker, heartbeat_s=0.05), []
    items = runner.run(_until_cancelled, log, label="long", owner="tab-1")
    next(i for i in items if i == "working")
    assert runner.stop("tab-1") and not runner.stop("tab-2")
    list(items)
    assert log == ["started", "cancelled"] and not runner.stop("tab-1")


def test_failure_tells_user_errors_from_bugs(caplog):
    from uag.errors import InputError

    assert failure(InputError("the prompt is empty"), "run") == "**Cannot run:** the prompt is empty"
    message = failure(ZeroDivisionError("division by zero"), "run")
    assert message.startswith("**Internal error**") and "ZeroDivision" not in message and "division" not in message
    assert caplog.records[-1].exc_info[0] is ZeroDivisionError
