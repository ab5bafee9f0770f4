"""The job runner every long request goes through: cancel on close, per-client share (refused or held back), time
budget."""

from __future__ import annotations

import threading
import time

import pytest

from uag.runtime.jobs import JobRunner, Status, Tick, Waiting, failure, tell
from uag.runtime.worker import Busy, MLXWorker


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
        tell(job, "converting the demo model once")
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


def test_beyond_its_share_a_client_waits_and_another_client_goes_between(worker):
    """Four requests at once from one client under per_client 2: none refused; the third and fourth are held back
    until the client's first ones end, so a second client's request queued meanwhile runs before them."""
    runner, gate, order = JobRunner(worker, per_client=2, heartbeat_s=0.02), threading.Event(), []

    def blocker(job):
        gate.wait(10)
        yield "open"

    def record(job, name):
        order.append(name)
        yield name

    holder = runner.run(blocker, label="holder")
    assert isinstance(next(holder), Tick)  # the worker is held
    mine = [runner.run(record, f"A{i}", label=f"A{i}", client="A", wait=True) for i in range(1, 5)]
    for items in mine:
        assert isinstance(next(items), Waiting)
    assert runner.queued("A") == 2 and runner.held("A") == 2
    other = runner.run(record, "B1", label="B1", client="B", wait=True)
    assert isinstance(next(other), Waiting) and runner.queued("B") == 1
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: list(i)})) for i in (*mine, other)]
    for thread in threads:
        thread.start()
    gate.set()
    list(holder)
    for thread in threads:
        thread.join(10)
    assert order == ["A1", "A2", "B1", "A3", "A4"]
    assert [results[items][-1] for items in (*mine, other)] == ["A1", "A2", "A3", "A4", "B1"]
    assert runner.queued("A") == runner.held("A") == runner.queued("B") == 0


def test_a_held_job_closed_never_runs_and_the_next_in_line_takes_its_place(worker):
    runner, gate, ran = JobRunner(worker, per_client=1, heartbeat_s=0.02), threading.Event(), []

    def held(job, name):
        gate.wait(10)
        ran.append(name)
        yield name

    first, second, third = (runner.run(held, n, label=n, client="A", wait=True) for n in ("1", "2", "3"))
    for items in (first, second, third):
        next(items)
    assert runner.held("A") == 2
    second.close()  # its client left while it was held back
    assert runner.held("A") == 1
    gate.set()
    assert list(first)[-1] == "1" and list(third)[-1] == "3"
    assert ran == ["1", "3"] and runner.queued("A") == runner.held("A") == 0


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


@pytest.mark.parametrize("shared", [False, True])
def test_an_idle_worker_keeps_nothing_of_the_jobs_it_ran(shared):
    """A server idle after a request must not hold that request's job, and through it its models and caches."""
    import gc
    import weakref

    class Payload:
        pass

    def job(_job, payload):
        yield "done"

    worker = MLXWorker(name="test-idle", max_batch=4 if shared else 1)
    payload = Payload()
    gone = weakref.ref(payload)
    assert list(worker.submit(job, payload, shared=shared)) == ["done"]
    del payload
    deadline = time.monotonic() + 10
    while gc.collect() is not None and gone() is not None:
        assert time.monotonic() < deadline, "the idle worker still holds the job it ran"
        time.sleep(0.02)
    worker.close(timeout=10)
