"""Continuous batching without a model: the `Batch` scheduler and `MLXWorker(max_batch=N)` on fake models that
record each call as (width, cache) and fake caches without `merge` (so a round's passes run one by one), or with it
and `batched_pass` patched to record the groups. The batch runs in the test's own thread where it can (`Batch`
alone), on the worker's thread where the worker is under test."""

from __future__ import annotations

import itertools
import threading
import time
from types import SimpleNamespace

import greenlet
import mlx.core as mx
import pytest

from uag.core.records import Sharing
from uag.runtime.batching import FIXED_ROWS, READ, Batch, SharedModel, share, sharing_now
from uag.runtime.host import NoRoom, room_for
from uag.runtime.worker import Busy, Job, MLXWorker


class Cache(list):
    """A sequence's KV cache as the batch sees it (a one-layer list): a name, no `merge`."""

    def __init__(self, name: str):
        super().__init__([SimpleNamespace(name=name, state=[])])
        self.name = name


class MergeableCache(Cache):
    def __init__(self, name: str):
        super().__init__(name)
        self[0].merge = self[0].update_and_fetch = None  # what `mergeable` looks for


class Model:
    """A fake model: each call recorded as (width, cache name); logits of shape (1, width, 2). It raises for the
    cache named `fail_for`, and sleeps `pause_s` (a worker that spins on it leaves the CPU to the others)."""

    def __init__(self, fail_for: str | None = None, pause_s: float = 0.0):
        self.calls: list[tuple[int, str]] = []
        self.fail_for, self.pause_s = fail_for, pause_s

    def __call__(self, inputs, cache=None):
        self.calls.append((int(inputs.shape[-1]), cache.name))
        if cache.name == self.fail_for:
            raise RuntimeError(f"the pass over {cache.name} failed")
        time.sleep(self.pause_s)
        return mx.zeros((inputs.shape[0], inputs.shape[-1], 2))


def ids(width: int, rows: int = 1) -> mx.array:
    return mx.zeros((rows, width), dtype=mx.int32)


def passes(job, name: str, plan, log: list, cache=Cache):
    """A member's work: `plan` is (shared model, width) per pass, each with its own cache per model; every result's
    width goes to `log` and out as an item."""
    caches: dict[int, Cache] = {}
    log.append((name, "start"))
    for model, width in plan:
        logits = model(ids(width), cache=caches.setdefault(id(model), cache(f"{name}/{model.role}")))
        log.append((name, int(logits.shape[1])))
        yield logits.shape[1]


def joined(batch: Batch, *members: tuple[str, list], log: list, cache=Cache) -> dict[str, Job]:
    jobs = {name: Job(passes, (name, plan, log, cache), name, shared=True) for name, plan in members}
    batch.queued = lambda: True  # as under load: a member alone still waits for rounds (see test_a_request_alone…)
    for job in jobs.values():
        batch.join(job)
    return jobs


def drained(batch: Batch) -> int:
    rounds = 0
    while batch:
        batch.round()
        rounds += 1
    return rounds


def member(batch: Batch, job: Job):
    return next(m for m in batch.waiting if m.job is job)


@pytest.fixture
def models():
    return SharedModel(Model(), "target"), SharedModel(Model(), "drafter")


def test_a_member_runs_up_to_its_first_pass_then_waits(models):
    target, _ = models
    batch, log = Batch(max_size=4), []
    jobs = joined(batch, ("a", [(target, 1)]), ("b", [(target, 3)]), ("none", []), log=log)
    assert log == [("a", "start"), ("b", "start"), ("none", "start")] and target.inner.calls == []
    assert len(batch) == 2 and [p.width for p in batch.waiting.values()] == [1, 3]
    assert jobs["none"].done.is_set() and list(jobs["none"]) == []  # no shared pass: it ran to its end at join
    assert drained(batch) == 1 and [list(jobs[n]) for n in "ab"] == [[1], [3]]


def test_one_round_serves_every_waiting_member_once_per_model(models):
    """One pass per member per round, grouped by model; the target's passes tell each member how they were shared
    (size, the widest other, the whole pass's time), the drafter's tell nothing. While members draft with a model
    (at least as many as wait on the target), the target's passes wait for them, so that every member's
    verification shares one target pass."""
    target, drafter = models
    batch, log = Batch(max_size=4, clock=itertools.count().__next__), []
    plans = [("a", [(target, 1), (target, 1)]), ("b", [(drafter, 3), (target, 2)]), ("c", [(drafter, 2), (target, 4)])]
    jobs = joined(batch, *plans, log=log)
    a, b, c = (member(batch, jobs[n]) for n in "abc")
    batch.round()
    assert target.inner.calls == [] and drafter.inner.calls == [(3, "b/drafter"), (2, "c/drafter")]
    assert b.sharing.passes == c.sharing.passes == 0 and a.sharing.held == 1
    batch.round()
    assert target.inner.calls == [(1, "a/target"), (2, "b/target"), (4, "c/target")]
    assert (a.sharing.size, a.sharing.widest, a.sharing.pass_ms) == (3, 4, 1000.0)  # the clock ticks 1 s a call
    assert (c.sharing.size, c.sharing.widest) == (3, 2) and jobs["b"].done.is_set() and jobs["c"].done.is_set()
    batch.round()
    assert target.inner.calls[3:] == [(1, "a/target")] and not batch
    assert (a.sharing.passes, a.sharing.largest, b.sharing.passes, b.sharing.widest) == (2, 3, 1, 4)
    assert [list(jobs[n]) for n in "abc"] == [[1, 1], [3, 2], [2, 4]]


def test_round_times_say_where_the_rounds_went():
    """On the batch's clock (here: one that only passes and the gap between two rounds move): each pass's time counts
    as passes, the gap as the rest, members' work that takes none as nothing; every round counted once. A pass
    that waits for the device uses next to no CPU of the worker's."""
    now = [0.0]

    class Ticking(Model):
        def __call__(self, inputs, cache=None):
            now[0] += 0.02  # the pass's 20 ms
            return super().__call__(inputs, cache)

    target = SharedModel(Ticking(), "target")
    batch, log = Batch(max_size=4, clock=lambda: now[0]), []
    joined(batch, ("a", [(target, 1)] * 3), ("b", [(target, 1)] * 3), log=log)
    batch.round()
    now[0] += 0.005  # the worker away between two rounds
    batch.round()
    batch.round()
    times = batch.times
    assert not batch and times.rounds == 3 and len(target.inner.calls) == 6  # one pass each: the caches do not merge
    assert times.wall == {"passes": pytest.approx(6 * 0.02), "members": 0.0, "rest": pytest.approx(0.005)}
    assert times.cpu["passes"] < times.wall["passes"]  # the clock moved 120 ms; the worker's own CPU, a few ms


def test_the_target_waits_for_drafting_members_at_most_hold_rounds(models):
    """A model one pair drafts with may be another's target: a member whose passes all go to a drafter-role model
    never starves the target's passes beyond HOLD_ROUNDS rounds."""
    from uag.runtime.batching import HOLD_ROUNDS

    target, drafter = models
    batch, log = Batch(max_size=4), []
    jobs = joined(batch, ("a", [(target, 1)]), ("b", [(drafter, 1)] * (HOLD_ROUNDS + 5)), log=log)
    for _ in range(HOLD_ROUNDS):
        batch.round()
    assert target.inner.calls == [] and len(drafter.inner.calls) == HOLD_ROUNDS
    assert member(batch, jobs["a"]).sharing.held == HOLD_ROUNDS  # what its auto leaves out of a plain step's cost
    assert member(batch, jobs["b"]).sharing.held == 0
    batch.round()
    assert target.inner.calls == [(1, "a/target")] and jobs["a"].done.is_set()
    drained(batch)
    assert len(list(jobs["b"])) == HOLD_ROUNDS + 5


def test_one_member_drafting_does_not_hold_more_members_waiting_on_the_target(models):
    """The target's passes wait for drafting members only while at least as many draft as wait on the target: one
    member drafting with a model beside two that verify (lookup) or decode plainly holds neither; two drafting beside
    one hold it."""
    target, drafter = models
    batch, log = Batch(max_size=4), []
    jobs = joined(batch, ("a", [(target, 1)]), ("b", [(drafter, 1)] * 3), ("c", [(target, 4)]), log=log)
    batch.round()
    assert sorted(target.inner.calls) == [(1, "a/target"), (4, "c/target")]
    assert drafter.inner.calls == [(1, "b/drafter")] and member(batch, jobs["b"]).sharing.held == 0
    drained(batch)
    assert [list(jobs[n]) for n in "abc"] == [[1], [1, 1, 1], [4]]

    target.inner.calls.clear(), drafter.inner.calls.clear()
    jobs = joined(batch, ("a", [(target, 1)]), ("b", [(drafter, 1)] * 2), ("d", [(drafter, 1)] * 2), log=log)
    batch.round()
    assert target.inner.calls == [] and member(batch, jobs["a"]).sharing.held == 1  # two draft: a waits for them
    drained(batch)
    assert [list(jobs[n]) for n in "abd"] == [[1], [1, 1], [1, 1]]


def test_a_rehearsal_does_not_hold_the_target(models):
    """A parked member's rehearsal is a drafter pass, but its next target pass verifies nothing: the others' target
    passes go on in the same round (held, each rehearsal would cost every member a round)."""
    target, drafter = models
    batch, log = Batch(max_size=4), []
    jobs = joined(batch, ("a", [(target, 1)]), ("b", [(drafter, 9), (target, 1)]), log=log)
    member(batch, jobs["b"]).sharing.rehearsing = True
    batch.round()
    assert target.inner.calls == [(1, "a/target")] and drafter.inner.calls == [(9, "b/drafter")]
    assert member(batch, jobs["b"]).sharing.held == 0
    drained(batch)
    assert [list(jobs[n]) for n in "ab"] == [[1], [9, 1]]


def test_mergeable_caches_make_one_batched_pass(models, monkeypatch):
    import uag.runtime.batching

    target, _ = models
    groups = []

    def recorded(model, inputs, caches):
        groups.append(([int(x.shape[-1]) for x in inputs], [c.name for c in caches]))
        return [model(x, cache=c) for x, c in zip(inputs, caches)]

    monkeypatch.setattr(uag.runtime.batching, "batched_pass", recorded)
    batch, log = Batch(max_size=4), []
    jobs = joined(batch, ("a", [(target, 1), (target, 2)]), ("b", [(target, 5)]), log=log, cache=MergeableCache)
    drained(batch)
    assert groups == [([1, 5], ["a/target", "b/target"])]  # alone, a's second pass is a pass of its own
    assert [list(jobs[n]) for n in "ab"] == [[1, 2], [5]]


def test_reads_share_a_pass_where_one_pass_costs_less_than_one_each(models, monkeypatch):
    """Reads waiting together read a chunk each in one pass where `groups` prices it cheaper (a pass's fixed cost,
    FIXED_ROWS tokens, against the padding): two chunks of 40 share one, but chunks of 40 and 20 do not, nor a
    100-token read whole beside a 34-token one (nobody decodes then: each reads whole); the oldest read goes first,
    the other waits a round."""
    import uag.runtime.batching

    target, _ = models
    shared = []

    def recorded(model, inputs, caches):
        shared.append(([int(x.shape[-1]) for x in inputs], [c.name for c in caches]))
        return [model(x, cache=c) for x, c in zip(inputs, caches)]

    monkeypatch.setattr(uag.runtime.batching, "batched_pass", recorded)
    batch, log = Batch(max_size=4, read_chunk=40), []
    plans = [("d", [(target, 1)] * 2), ("a", [(target, 80)]), ("b", [(target, 60)])]
    jobs = joined(batch, *plans, log=log, cache=MergeableCache)
    drained(batch)
    assert shared == [([40, 40], ["a/target", "b/target"])]  # then 40 and 20 left: apart costs less (92 < 96)
    assert [c for c in target.inner.calls if c[1] != "d/target"][-2:] == [(40, "a/target"), (20, "b/target")]
    assert [list(jobs[n]) for n in "dab"] == [[1, 1], [80], [60]]  # each read's chunks' logits, joined

    target.inner.calls.clear()
    batch, shared[:] = Batch(max_size=4, read_chunk=40), []
    jobs = joined(batch, ("long", [(target, 100)]), ("short", [(target, 34)]), log=log, cache=MergeableCache)
    drained(batch)
    assert shared == [] and target.inner.calls == [(100, "long/target"), (34, "short/target")]


def test_each_member_reads_its_own_sharing(models):
    target, _ = models
    seen = {}

    def reads(job, name):
        seen[name] = sharing_now()
        target(ids(1), cache=Cache(name))
        yield name

    batch = Batch(max_size=2)
    batch.queued = lambda: True
    jobs = [Job(reads, (n,), n, shared=True) for n in "ab"]
    for job in jobs:
        batch.join(job)
    members = {m.job.label: m.sharing for m in batch.waiting}
    drained(batch)
    assert all(seen[n] is members[n] for n in "ab") and seen["a"] is not seen["b"] and sharing_now() is None


def test_a_read_runs_whole_when_nobody_else_waits(models):
    target, _ = models
    batch, log = Batch(max_size=2, read_chunk=16), []
    jobs = joined(batch, ("r", [(target, 100), (target, 1)]), log=log)
    drained(batch)
    assert target.inner.calls == [(100, "r/target"), (1, "r/target")] and list(jobs["r"]) == [100, 1]


def test_a_read_runs_in_chunks_while_others_decode_one_chunk_a_round(models):
    target, _ = models
    batch, log = Batch(max_size=2, read_chunk=40), []
    jobs = joined(batch, ("d", [(target, 1)] * 4), ("r", [(target, 100), (target, 1)]), log=log)
    assert drained(batch) == 4
    d, r = (1, "d/target"), lambda width: (width, "r/target")
    assert target.inner.calls == [d, r(40), d, r(40), d, r(20), d, r(1)]
    assert list(jobs["r"]) == [100, 1]  # the chunks' logits, joined: what one pass over the prompt gives
    r_log = [entry for entry in log if entry[0] == "r"]
    assert r_log == [("r", "start"), ("r", 100), ("r", 1)]


@pytest.mark.parametrize("width, calls", [(READ, [READ]), (READ + 1, [16, 16, 1])])
def test_a_pass_wider_than_read_is_a_read(models, width, calls):
    target, _ = models
    batch, log = Batch(max_size=2, read_chunk=16), []
    joined(batch, ("d", [(target, 1)] * 3), ("x", [(target, width)]), log=log)
    drained(batch)
    assert [w for w, name in target.inner.calls if name == "x/target"] == calls


def test_a_tree_pass_on_caches_the_batch_cannot_keep_fails_its_member_and_the_others_go_on(models):
    """tree_ready allows no such pass; were one to come, read as one proposal its nodes would see their siblings:
    its member gets an error, and the member beside it is served as ever."""
    from uag.core.verify import Tree

    target, _ = models
    batch, log = Batch(max_size=2), []

    def tree(job):
        yield target.verify(ids(3), Cache("tree/target"), Tree.of([[5], [6]]))

    jobs = joined(batch, ("plain", [(target, 1)] * 2), log=log)
    jobs["tree"] = Job(tree, (), "tree", shared=True)
    batch.join(jobs["tree"])
    drained(batch)
    assert list(jobs["plain"]) == [1, 1] and target.inner.calls == [(1, "plain/target")] * 2
    with pytest.raises(RuntimeError, match="caches its batch can keep merged"):
        list(jobs["tree"])


def test_a_failed_pass_reaches_its_members_job_and_the_others_go_on():
    """A read that fails and a pass on another model that fails: each member's consumer raises the error; a member
    whose own function raises ends with it; the members beside them run to their end."""
    target = SharedModel(Model(fail_for="bad-read/target"), "target")
    drafter = SharedModel(Model(fail_for="bad/drafter"), "drafter")
    batch, log = Batch(max_size=4, read_chunk=16), []

    def raises(job):
        target(ids(1), cache=Cache("raises/target"))
        raise ValueError("the member's own failure")
        yield

    plans = [("good", [(target, 1)] * 3), ("bad-read", [(target, 50)]), ("bad", [(drafter, 1), (target, 1)])]
    jobs = joined(batch, *plans, log=log)
    jobs["raises"] = Job(raises, (), "raises", shared=True)
    batch.join(jobs["raises"])
    drained(batch)
    assert list(jobs["good"]) == [1, 1, 1]
    for name, error, message in [
        ("bad-read", RuntimeError, "bad-read"),
        ("bad", RuntimeError, "bad/drafter"),
        ("raises", ValueError, "own failure"),
    ]:
        with pytest.raises(error, match=message):
            list(jobs[name])


def test_a_failed_pass_among_passes_run_one_by_one_fails_only_its_member():
    target = SharedModel(Model(fail_for="bad/target"), "target")
    batch, log = Batch(max_size=4), []
    jobs = joined(batch, ("good", [(target, 1)] * 2), ("bad", [(target, 1)]), log=log)
    drained(batch)
    with pytest.raises(RuntimeError, match="bad/target"):
        list(jobs["bad"])
    assert list(jobs["good"]) == [1, 1]


def test_a_request_alone_runs_its_passes_at_once_and_waits_for_rounds_once_another_is_queued(models):
    """Alone (no other member, no job queued) a member's passes are the model's own calls, with no round between
    them; once a job waits to start, its next pass waits for the round that lets that job join."""
    target, _ = models
    batch, log, queue = Batch(max_size=2), [], []
    batch.queued = lambda: bool(queue)
    alone = Job(passes, ("alone", [(target, 1)] * 2, log, Cache), "alone", shared=True)
    batch.join(alone)
    assert (
        alone.done.is_set()
        and list(alone) == [1, 1]
        and not batch
        and target.inner.calls == [(1, "alone/target"), (1, "alone/target")]
    )
    first = Job(passes, ("first", [(target, 1)] * 3, log, Cache), "first", shared=True)
    queue.append("second")
    batch.join(first)
    assert not first.done.is_set() and len(batch.waiting) == 1  # waits at its first pass: a job is queued
    second = Job(passes, ("second", [(target, 1)], log, Cache), "second", shared=True)
    queue.clear()
    batch.join(second)
    assert drained(batch) >= 1 and list(first) == [1, 1, 1] and list(second) == [1]


def marked(job, plan, seen: list, cache: Cache):
    """A member's work that notes, after each pass, how many of its passes waited for a round and whether its last
    one was the model's own call (`Sharing.rounds`, `Sharing.solo`); `then()` after each pass."""
    sharing = sharing_now()
    for model, width, then in plan:
        model(ids(width), cache=cache)
        seen.append((sharing.rounds, sharing.solo))
        then()
        yield width


def test_a_pass_that_waited_for_a_round_is_marked_so_that_auto_learns_no_cost_from_it(models):
    """A pass handed to the batch waits for a round that also runs the others' work (their passes, reads, Python):
    the member's `Sharing` counts it and says its last pass was not the model's own call, which its auto reads
    before it learns a cost (uag.core.evidence.Prices.alone_since_last). Alone again, a pass is the model's own call."""
    target, _ = models
    batch, queue, seen = Batch(max_size=2), [], {"a": [], "b": []}
    batch.queued = lambda: bool(queue)
    noop = lambda: None  # noqa: E731
    plan = [(target, 1, lambda: queue.append("b")), (target, 1, noop), (target, 1, noop), (target, 1, noop)]
    a = Job(marked, (plan, seen["a"], Cache("a")), "a", shared=True)
    batch.join(a)  # alone: its first pass is the model's own call; then a request queues
    queue.clear()
    b = Job(marked, ([(target, 1, noop)], seen["b"], Cache("b")), "b", shared=True)
    batch.join(b)
    drained(batch)
    assert list(a) == [1] * 4 and list(b) == [1]
    assert seen["a"] == [(0, True), (1, False), (2, False), (2, True)]  # the last: b gone, nobody queued
    assert seen["b"] == [(1, False)]


def test_a_shared_model_called_outside_a_member_is_the_model(models):
    target, _ = models
    target.inner.vocab_size = 7
    assert target.vocab_size == 7  # every attribute is the model's
    assert target(ids(3), cache=Cache("alone")).shape == (1, 3, 2) and target.inner.calls == [(3, "alone")]
    loaded = SimpleNamespace(model=target.inner)
    share(loaded, "target")
    share(loaded, "target")
    assert isinstance(loaded.model, SharedModel) and loaded.model.inner is target.inner  # wrapped once

    def direct(job):  # in a member, a pass the batch cannot share (two rows) is the model's own call, now
        target(ids(2, rows=2), cache=Cache("two-rows"))
        yield "after"

    batch = Batch(max_size=2)
    job = Job(direct, (), "direct", shared=True)
    batch.join(job)
    assert job.done.is_set() and list(job) == ["after"] and target.inner.calls[-1] == (2, "two-rows")


def test_sharing_prices_a_pass_by_the_whole_batch():
    alone = Sharing()
    assert (alone.pass_tokens(5), alone.pass_tokens(None), alone.mean_size, alone.largest) == ([5], [], 1.0, 1)
    four = Sharing(others=(Sharing(), Sharing(), Sharing()))
    assert (four.pass_tokens(1), four.pass_tokens(2), four.pass_tokens(17)) == ([4], [8], [3, 17])  # cut as `groups`
    assert four.pass_tokens(None) == [3] and four.others_tokens == 3.0  # a round it drafts in: the others' pass
    four.others[0].proposing(9, 4.0)
    assert four.pass_tokens(9) == [36] and four.others_tokens == 6.0
    four.shared(4, 9, 12.0)
    four.shared(2, 0, None)
    assert (four.mean_size, four.largest, four.passes, four.size, four.pass_ms) == (3.0, 4, 2, 2, None)
    four.packed = True  # the batch packs its rows (a CPU): one pass of every row's tokens, unpadded
    assert (four.pass_tokens(1), four.pass_tokens(17), four.pass_tokens(None)) == ([12], [28], [11])


def test_every_member_sees_the_others_and_the_batch_s_cost_of_a_pass(models, monkeypatch):
    """The batch keeps each member's `Sharing.others` current as members join and leave, and tells every member
    what a pass costs beside its tokens (`PassCosts.fixed_rows`), which its auto prices proposals with."""
    import uag.runtime.batching

    monkeypatch.setattr(
        uag.runtime.batching,
        "batched_pass",
        lambda model, xs, caches: [model(x, cache=c) for x, c in zip(xs, caches)],
    )
    target, _ = models
    batch, log = Batch(max_size=4), []
    plans = ("a", [(target, 1)] * 3), ("b", [(target, 1)]), ("c", [(target, 1)] * 2)
    jobs = joined(batch, *plans, log=log, cache=MergeableCache)
    a, b, c = (member(batch, jobs[n]) for n in "abc")
    assert a.sharing.others == (b.sharing, c.sharing) and c.sharing.others == (a.sharing, b.sharing)
    batch.costs.observe(4, 850.0)
    batch.costs.observe(68, 2580.0)
    batch.round()  # b ends
    assert a.sharing.others == (c.sharing,) and c.sharing.others == (a.sharing,)
    assert a.sharing.fixed_rows == c.sharing.fixed_rows == batch.costs.fixed_rows() != FIXED_ROWS
    drained(batch)
    assert a.sharing.others == () and not batch


def test_until_it_has_timed_passes_a_batch_cuts_them_as_its_members_calibrations_say(models, monkeypatch):
    """With no timed passes of two widths (on a GPU the one-token passes are queued, never timed), a round is cut into
    passes by the members' calibrated `prior_rows` (their median), not the CPU-like FIXED_ROWS: a GPU's prior of
    hundreds of tokens puts a 17-token proposal in the others' pass, where FIXED_ROWS gives it a pass of its own."""
    import uag.runtime.batching

    target, _ = models
    shared = []

    def recorded(model, inputs, caches):
        shared.append(sorted(int(x.shape[-1]) for x in inputs))
        return [model(x, cache=c) for x, c in zip(inputs, caches)]

    monkeypatch.setattr(uag.runtime.batching, "batched_pass", recorded)
    for priors, passes in [((None, None, None), [[1, 1]]), ((400.0, 600.0, None), [[1, 1, 17]])]:
        batch, log, shared[:] = Batch(max_size=4), [], []
        plans = ("a", [(target, 1)]), ("b", [(target, 1)]), ("c", [(target, 17)])
        jobs = joined(batch, *plans, log=log, cache=MergeableCache)
        for name, prior in zip("abc", priors):
            member(batch, jobs[name]).sharing.prior_rows = prior
        fixed_rows, c = FIXED_ROWS if priors[0] is None else 500.0, member(batch, jobs["c"])
        assert batch.fixed_rows() == fixed_rows
        batch.round()  # every member ends
        assert shared == passes and c.sharing.fixed_rows == fixed_rows and not batch


# --- the worker: shared jobs together, up to max_batch; the rest in turn ----------------------------------------------
def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s  # a bound on the wait, not a claim about speed
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("the worker did not get there")
        time.sleep(0.005)


def spinning(job, model: SharedModel, name: str, stop: threading.Event, log: list):
    """A shared job that makes one-token passes until `stop` is set or it is cancelled."""
    log.append(("start", name))
    cache = Cache(name)
    while not stop.is_set() and not job.cancelled.is_set():
        model(ids(1), cache=cache)
        yield name
    log.append(("end", name))


@pytest.fixture
def spin():
    workers, stops = [], []
    model = SharedModel(Model(pause_s=0.002), "target")

    def start(max_batch: int):
        worker = MLXWorker(name="test-batching", max_batch=max_batch)
        workers.append(worker)
        return worker

    def submit(worker: MLXWorker, name: str, log: list) -> tuple[Job, threading.Event]:
        stop = threading.Event()
        stops.append(stop)
        return worker.submit(spinning, model, name, stop, log, label=name, shared=True), stop

    yield SimpleNamespace(start=start, submit=submit, model=model)
    for stop in stops:
        stop.set()
    for worker in workers:
        worker.close(timeout=10)


def passes_by(model: SharedModel, name: str) -> int:
    return sum(1 for _, cache in list(model.inner.calls) if cache == name)


def test_a_job_not_shared_waits_for_the_shared_ones_and_none_joins_meanwhile(spin):
    worker, log = spin.start(4), []
    a, stop_a = spin.submit(worker, "a", log)
    until(lambda: passes_by(spin.model, "a") > 0)

    def solo(job):
        log.append(("solo", "runs"))
        yield "solo"

    alone = worker.submit(solo, label="solo")
    b, _ = spin.submit(worker, "b", log)
    until(lambda: worker.backlog == 1)  # the worker took the solo job: it holds b back until a is done
    seen = passes_by(spin.model, "a")
    until(lambda: passes_by(spin.model, "a") > seen + 10)
    assert not alone.started.is_set() and not b.started.is_set() and worker.running == 1 and worker.current is a
    stop_a.set()
    assert list(alone) == ["solo"]
    until(lambda: passes_by(spin.model, "b") > 0)
    assert log == [("start", "a"), ("end", "a"), ("solo", "runs"), ("start", "b")]


def test_max_batch_bounds_the_members_and_the_rest_stay_queued(spin):
    worker, log = spin.start(2), []
    (a, stop_a), (b, _), (c, _) = (spin.submit(worker, n, log) for n in "abc")
    until(lambda: passes_by(spin.model, "b") > 10)
    assert worker.running == 2 and len(worker.batch) == 2 and worker.backlog == 1 and not c.started.is_set()
    stop_a.set()
    until(lambda: passes_by(spin.model, "c") > 0)
    assert a.done.is_set() and worker.running == 2 and ("start", "c") in log


def test_a_cancelled_job_leaves_and_a_queued_one_never_joins(spin):
    worker, log = spin.start(2), []
    (a, _), (b, _), (c, _) = (spin.submit(worker, n, log) for n in "abc")
    items = iter(a)
    assert next(items) == "a"
    c.cancel()  # queued behind the full batch
    items.close()  # the consumer leaves: the job is cancelled, and stops at its next check
    until(a.done.is_set)
    until(c.done.is_set)
    seen = passes_by(spin.model, "b")
    until(lambda: passes_by(spin.model, "b") > seen + 10)
    assert worker.running == 1 and len(worker.batch) == 1 and ("start", "c") not in log
    b.cancel()
    assert list(b)[-1] == "b" and worker.call(lambda: "the worker is free") == "the worker is free"


def test_a_broken_batch_fails_its_jobs_and_the_worker_goes_on(spin):
    """A member that switches out with anything but a pass is a bug in batching: every job of the batch fails with
    it, and the worker starts a new batch."""
    worker, log = spin.start(4), []
    a, _ = spin.submit(worker, "a", log)
    until(lambda: passes_by(spin.model, "a") > 0)

    def broken(job):
        greenlet.getcurrent().parent.switch("not a pass")
        yield

    bad = worker.submit(broken, label="broken", shared=True)
    for job in (bad, a):
        with pytest.raises(RuntimeError, match="switched out with 'not a pass'"):
            list(job)
    b, stop_b = spin.submit(worker, "b", log)
    until(lambda: passes_by(spin.model, "b") > 0)
    stop_b.set()
    assert list(b)[-1] == "b" and worker.running == 0


def test_a_broken_batch_leaves_no_member_behind(spin):
    import gc

    from uag.runtime.batching import Member

    worker, log = spin.start(4), []
    a, _ = spin.submit(worker, "a", log)
    until(lambda: passes_by(spin.model, "a") > 0)

    def broken(job):
        greenlet.getcurrent().parent.switch("not a pass")
        yield

    bad = worker.submit(broken, label="broken", shared=True)
    until(a.done.is_set)

    def members() -> list[str]:
        gc.collect()
        return [m.job.label for m in gc.get_objects() if isinstance(m, Member) and m.job in (a, bad) and not m.dead]

    assert worker.call(members) == []


def test_a_batch_and_a_worker_hold_at_least_one():
    with pytest.raises(ValueError, match="at least one request"):
        Batch(max_size=0)
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        MLXWorker(max_batch=0)


# --- memory: is there room for a request beside the batch's ----------------------------------------------------------
def fake_target():
    """A model of 2 layers, 2 KV heads of 8 dims in float32, the second layer a 16-token window: 128 bytes a token
    in the first layer, at most 2,048 in the second."""
    args = SimpleNamespace(num_key_value_heads=2, num_attention_heads=4, head_dim=8, hidden_size=32)
    model = SimpleNamespace(
        args=args,
        parameters=lambda: {"w": mx.zeros((2,), dtype=mx.float32)},
        make_cache=lambda: [SimpleNamespace(), SimpleNamespace(max_size=16)],
    )
    return SimpleNamespace(model=model)


def test_room_for_refuses_a_request_that_would_not_fit_and_lets_a_first_one_in(models):
    target = fake_target()
    need = 2 * (128 * 100 + 128 * 16)  # 100 tokens: the caches, and their copy in a batched pass
    room_for(target, 100, None, available=0)  # nobody running: a first request is let in
    batch = Batch(max_size=4)
    room_for(target, 100, batch, available=0)
    joined(batch, ("a", [(models[0], 1)]), log=[])
    room_for(target, 100, batch, available=need)
    with pytest.raises(NoRoom, match=r"would not fit .* beside the 1 request running now: retry") as refused:
        room_for(target, 100, batch, available=need - 1)
    assert isinstance(refused.value, Busy) and "\n" not in str(refused.value)


def test_room_for_a_model_that_makes_no_caches_of_its_own(models):
    target = fake_target()
    del target.model.make_cache
    target.model.layers = [None, None]  # mlx-lm gives such a model one plain KV cache a layer
    batch = Batch(max_size=4)
    joined(batch, ("a", [(models[0], 1)]), log=[])
    room_for(target, 100, batch, available=2 * 2 * 128 * 100)


@pytest.mark.parametrize(
    ("widths", "fixed", "expected"),
    [
        ([17, 1, 1, 1], 16, [[0], [1, 2, 3]]),  # padding the three plain steps to 17 costs more than a pass
        ([9, 8, 9, 1], 16, [[0, 1, 2, 3]]),
        ([1, 17, 1], 1000, [[0, 1, 2]]),  # a pass worth 1000 tokens (a GPU): never split
        ([17, 1], 0.5, [[0], [1]]),
        ([3], 16, [[0]]),
        ([], 16, []),
    ],
)
def test_passes_are_grouped_where_padding_costs_more_than_a_pass(widths, fixed, expected):
    from uag.runtime.batching import groups

    assert groups(widths, fixed) == expected


def test_the_cost_of_a_pass_in_tokens_is_fitted_from_the_batch_s_own_passes():
    from uag.runtime.batching import FIXED_ROWS, PassCosts

    costs = PassCosts()
    assert costs.fixed_rows() == FIXED_ROWS  # nothing timed yet
    costs.observe(4, 850.0)
    costs.observe(4, 870.0)
    assert costs.fixed_rows() == FIXED_ROWS  # one width: no line through it
    costs.observe(68, 2580.0)
    assert 20 < costs.fixed_rows() < 35
    flat = PassCosts()
    for rows in (4, 16, 64):
        flat.observe(rows, 5.0)  # a token costs nothing measurable
    assert flat.fixed_rows() == 1000.0


def test_a_pass_that_compiled_its_kernels_does_not_tilt_the_batch_s_fit():
    """A pass timed while its kernels compiled (seconds, once) is over OUTLIER times what the fit expects: it counts
    only once a second like it comes (learned whole, it made a token look dear enough that the batch cut every
    proposal into a pass of its own); passes that really are that slow are learned from the second on."""
    from uag.runtime.batching import PassCosts

    costs = PassCosts()
    for rows in (8, 16, 8, 16):
        costs.observe(rows, 10.0 + 0.01 * rows)  # a GPU: a token next to nothing beside a pass
    costs.observe(136, 30_000.0)  # the first pass this wide: its kernels compiled
    assert costs.fixed_rows() > 500 and len(costs.samples) == 4
    costs.observe(136, 11.5)  # the next one as wide, as the line expects
    assert costs.fixed_rows() > 500 and (136, 30_000.0) not in costs.samples
    slow = PassCosts()
    for rows in (8, 16, 8, 16):
        slow.observe(rows, 10.0 + 0.01 * rows)
    slow.observe(136, 300.0)
    slow.observe(136, 310.0)  # a second like it: both count
    assert [ms for rows, ms in slow.samples if rows == 136] == [300.0, 310.0] and slow.fixed_rows() < 10


def test_run_all_runs_jobs_together_to_their_ends_or_until_cancelled(models):
    """`Batch.run_all`, what the start-up warm-up and batch_rounds.py run: every job to its end as under load, each
    member waiting for its rounds; or, where `cancel()` says so before a round, every member ended with `Cancelled`."""
    from uag.runtime.batching import Cancelled

    target, _ = models
    log: list = []
    jobs = [Job(passes, (name, [(target, 1)] * 3, log), name, shared=True) for name in "ab"]
    assert Batch(max_size=2).run_all(jobs)
    assert [list(job) for job in jobs] == [[1, 1, 1], [1, 1, 1]]
    assert len(target.inner.calls) == 6
    rounds = iter(range(100))
    jobs = [Job(passes, (name, [(target, 1)] * 9, log), name, shared=True) for name in "cd"]
    batch = Batch(max_size=2)
    assert not batch.run_all(jobs, cancel=lambda: next(rounds) == 2)
    assert not batch and batch.queued()
    for job in jobs:
        with pytest.raises(Cancelled):
            list(job)


def test_a_pass_whose_evaluation_fails_fails_its_member_alone_where_passes_run_one_each(monkeypatch):
    """Caches the batch can neither keep nor merge run one pass each, each evaluated as it runs; where one's
    evaluation fails (on the device), its member gets the error and the members after it their own rows."""
    import uag.runtime.batching as batching

    failed: list = []

    class Device:
        def __getattr__(self, name):
            return getattr(mx, name)

        def eval(self, *arrays):
            if not failed:
                failed.append(True)
                raise RuntimeError("[metal::malloc] Resource limit exceeded")
            return mx.eval(*arrays)

    monkeypatch.setattr(batching, "mx", Device())
    target = SharedModel(Model(), "target")
    batch, log = Batch(max_size=3), []
    jobs = joined(batch, *[(name, [(target, w)]) for name, w in (("a", 2), ("b", 3), ("c", 4))], log=log)
    drained(batch)
    with pytest.raises(RuntimeError, match="Resource limit exceeded"):
        list(jobs["a"])
    assert failed and list(jobs["b"]) == [3] and list(jobs["c"]) == [4]
