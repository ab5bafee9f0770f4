"""Continuous batching on the one MLX worker: a request that arrives while others run joins them at their next
pass, and leaves when it is done.

Each shared job runs in a greenlet of its own on the worker's thread (MLX arrays and streams stay on the thread
that made them), and its engine runs unchanged: where it calls a model the batch shares (`SharedModel`), the call
hands its pass to the `Batch` and waits. The batch lets every member run up to its next pass (drafting, checking,
detokenising: what each does on its own), then runs one pass per model for all of them and hands each member its
rows. Plain KV caches are kept merged between passes (`uag.core.kept_caches`: a member's cache becomes a row of
the batch's storage at its first batched pass and plain again when it reads, runs alone or its run ends; a lookup
tree is a row of the pass like any other: `SharedModel.verify`); other
caches are merged afresh for each pass (`uag.core.passes.batched_pass`). A pass over more than `READ` tokens (a
prompt being read; on a GPU more than `Batch.narrow`, up to `read_chunk`) runs on plain caches, in chunks of
`read_chunk` tokens while others decode, one chunk per round, so that a long prompt does not freeze the other
streams; reads waiting together share a pass where that costs less than one each (`_read`). A member that runs
alone makes exactly the calls it would make outside a batch, on its own plain cache.

    batch = Batch(max_size=4)
    batch.join(job)          # a Job whose function calls models wrapped in SharedModel
    while batch: batch.round()
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import greenlet
import mlx.core as mx

from uag.core.evidence import OUTLIER
from uag.core.kept_caches import KeptCaches, packs
from uag.core.passes import PREFILL_STEP, batched_pass, mergeable
from uag.core.records import FIXED_ROWS, Sharing, groups
from uag.core.sampling import Picks, greedy_picks
from uag.core.verify import Tree

log = logging.getLogger(__name__)

READ = 32  # a pass over more tokens than this is a read (a prompt, a catch-up): on plain caches, in chunks; where a
# pass's tokens cost little beside the pass (a GPU running a small model), up to READ_CHUNK tokens ride in it (narrow)
READ_CHUNK = 128  # tokens of a read per round while other members decode
LOST = "its cache was lost with a batched pass that failed"
HOLD_ROUNDS = 16  # rounds the target's passes wait at most while members draft with a model (Batch.round)


class Cancelled(Exception):
    """A batch run to its end gave way (`Batch.run_all`'s `cancel`)."""


class SharedModel:
    """A model that requests running in a `Batch` share: their calls to it become the batch's passes. Called from
    anywhere else (the app, calibration, a request run alone) it is the model itself; every attribute is the
    model's. `role` "target" passes are the ones a request's `Sharing` (and so `auto`) hears about."""

    def __init__(self, model: Any, role: str):
        self.inner, self.role = model, role

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, inputs, cache=None, **kwargs):
        member = greenlet.getcurrent()
        if not isinstance(member, Member) or cache is None or kwargs or inputs.shape[0] != 1:
            return self.inner(inputs, cache=cache, **kwargs)
        if member.batch.solo():  # nobody to batch with, nobody waiting to join: the pass runs here and now
            member.batch.hand_back(cache)  # its own plain cache again, as outside a batch
            if self.role == "target":
                member.sharing.shared(1, 0, None)
            member.sharing.solo = True
            return self.inner(inputs, cache=cache)
        return member.waits(Pass(self, inputs, cache))

    def alone(self) -> bool:
        """Whether a call made now is the model's own: outside a batch, or from a member running alone in it
        (`Batch.solo`); only then may a caller change the model for one pass (a tree pass's rope: uag.core.passes,
        which asks it as a `uag.core.passes.Shareable`). A member alone gets its own plain caches back here, as its
        passes would, so that what it asks of them next (a tree pass needs plain KV caches) sees them as it would
        outside a batch."""
        member = greenlet.getcurrent()
        if not isinstance(member, Member):
            return True
        if not member.batch.solo():
            return False
        for cache in list(member.adopted):
            member.batch.hand_back(cache)
        return True

    def verify(self, inputs, cache: list, tree: Tree | None = None, greedy: bool = True):
        """A verifying pass (uag.core.passes.verify_pass): with others, its batch reads it on the caches it keeps
        merged, beside theirs (`KeptCaches.run`; a tree's nodes at their depths), and where `greedy` reads the
        target's pick at each of its tokens with the pass (`Batch._decode`). The logits of [pending, *proposal or
        nodes], and the picks; None where there are none (read as a read of its own, or a proposal run as the
        model's own call, `__call__`: outside a batch or alone in it): the caller picks."""
        member = greenlet.getcurrent()
        if tree is None and (not isinstance(member, Member) or member.batch.solo()):
            return self(inputs, cache=cache), None
        if not isinstance(member, Member):
            raise RuntimeError("a tree pass is handed to a batch only by a member running in it (SharedModel.alone)")
        return member.waits(Pass(self, inputs, cache, tree=tree, verifying=True, greedy=greedy))


def share(loaded: Any, role: str) -> None:
    """Make a loaded model's `model` a `SharedModel` (once; in place: every holder of the model shares it)."""
    if not isinstance(loaded.model, SharedModel):
        loaded.model = SharedModel(loaded.model, role)


@dataclass(eq=False)
class Pass:
    """One member's call of a shared model, waiting for the batch to run it."""

    model: SharedModel
    inputs: Any  # (1, w) token ids
    cache: list
    read: int = 0  # tokens of a read run so far
    logits: list = field(default_factory=list)  # a read's chunks' logits
    tree: Tree | None = None  # a tree pass: the proposals its tokens after the pending one are (never a read)
    verifying: bool = False  # handed by SharedModel.verify: served as (logits, the target's picks or None)
    greedy: bool = False  # the target picks each row by its argmax: the batch reads the picks with the pass

    @property
    def width(self) -> int:
        return int(self.inputs.shape[-1])


class Member(greenlet.greenlet):
    """A job running in the batch: its greenlet, and how its target passes were shared (`Sharing`)."""

    def __init__(self, job: Any, parent: greenlet.greenlet, batch: Batch):
        super().__init__(self._main, parent)
        self.job, self.sharing, self.batch = job, Sharing(), batch
        self.adopted: list[list] = []  # its cache lists that are rows of the batch's kept caches now

    def _main(self, *_start) -> None:
        self.job._run()

    def waits(self, waiting: Pass) -> Any:
        """Hand `waiting` to the batch and wait for the round that runs it: what the request times of that pass then
        holds the round's other work too (the others' passes and reads, their Python), so its auto learns no cost of
        its own from it (`Sharing.rounds`, uag.core.evidence.Prices.alone_since_last)."""
        self.sharing.rounds += 1
        self.sharing.solo = False
        return self.parent.switch(waiting)


def handed_back() -> None:
    """The running request's caches made plain KV caches again, where they are rows of its batch's kept caches: at
    its run's end, before they are stored for the conversation's next turn (in memory, on disk)."""
    member = greenlet.getcurrent()
    if isinstance(member, Member):
        for cache in list(member.adopted):
            member.batch.hand_back(cache)


def sharing_now() -> Sharing | None:
    """The running request's `Sharing` when it runs in a batch (its engine's `auto` is passed it, and its report
    says it); None for a request run alone, outside any batch."""
    member = greenlet.getcurrent()
    return member.sharing if isinstance(member, Member) else None


class Batch:
    """The members running now and the passes they wait on; `round()` runs one pass per shared model."""

    def __init__(
        self,
        max_size: int = 4,
        *,
        read_chunk: int = READ_CHUNK,
        clock: Callable[[], float] = time.perf_counter,
        times: RoundTimes | None = None,
    ):
        if max_size < 1:
            raise ValueError(f"a batch holds at least one request (got {max_size})")
        self.max_size, self.read_chunk, self.clock = max_size, read_chunk, clock
        self.times = RoundTimes(clock) if times is None else times  # where its rounds' time goes (GET /metrics)
        self.waiting: dict[Member, Pass] = {}  # every live member, at the pass it waits on
        self.members: list[Member] = []  # every member not yet ended
        self.costs = PassCosts()
        self.held = 0  # rounds in a row the target's passes waited for members drafting with a model
        self.kept: dict[int, KeptCaches] = {}  # per model: its members' plain KV caches, kept merged
        self.lost: list[KeptCaches] = []  # kept caches a failed pass left unknown, until their rows are handed back
        self.ahead: tuple[KeptCaches, list] | None = None  # the last pass queued, not yet waited for; its logits
        # queue passes of one token a row rather than wait for them (round): on a GPU; on a CPU the device is the
        # cores the members' Python runs on, and a pass queued beside it ran no faster (benchmarks/batch_rounds.py)
        self.pipelined = mx.default_device() == mx.gpu
        # pack a pass's rows into one sequence rather than pad them to the widest (KeptCaches.run): on a CPU, where
        # every token a pass computes costs its share, a pass over [17, 1, 1, 1] then costs 20 tokens, not 68 or
        # two passes; on a GPU padding costs little beside a pass and each row's attention would be a launch
        self.packing = not self.pipelined
        self.history: list[tuple[float, int]] = []  # (time, members) at each change, for the Server tab
        self.queued: Callable[[], bool] = lambda: False  # whether a job waits to start (the worker's queue)

    def __len__(self) -> int:
        """Members not yet ended (one running alone between rounds included)."""
        return len(self.members)

    @property
    def full(self) -> bool:
        return len(self.members) >= self.max_size

    def fixed_rows(self) -> float:
        """What a target pass costs beside its tokens, in tokens (how `groups` cuts a round into passes): fitted to
        the batch's timed passes (`PassCosts`); until they span two widths, what its members' calibrations say
        (`Sharing.prior_rows`, their median), else FIXED_ROWS. On a GPU the one-token passes are queued, not timed,
        so a batch parked throughout has only its calibrations to go by."""
        priors = [m.sharing.prior_rows for m in self.members if m.sharing.prior_rows is not None]
        return self.costs.fixed_rows(statistics.median(priors) if priors else None)

    def _priced(self) -> float:
        """`fixed_rows` now, told to every member (what its auto prices its proposals by, as the batch cuts passes)."""
        fixed_rows = self.fixed_rows()
        for member in self.members:
            member.sharing.fixed_rows = fixed_rows
            member.sharing.packed = self.packing
        return fixed_rows

    def solo(self) -> bool:
        """One member and no job waiting to start: its passes need not wait for a round (nothing to batch them
        with): a request alone runs as it would without batching, and yields at its next pass once one arrives."""
        return len(self.members) == 1 and not self.queued()

    def join(self, job: Any) -> None:
        """Start a job as a member: it runs up to its first shared pass (or to its end)."""
        member = Member(job, greenlet.getcurrent(), self)
        member.sharing.fixed_rows = self.fixed_rows()
        self.members.append(member)
        self._met()
        with self.times.part("members"):
            self._resume(member, None)
        self._noted()

    def run_all(self, jobs: list, cancel: Callable[[], bool] = lambda: False) -> bool:
        """Join `jobs` as under load (every member waits for its rounds: `queued`) and run rounds until all of them
        end; False where `cancel()`, asked before every round, stopped them first (each member ends with `Cancelled`).
        A failure of the batch itself ends every member with it and is raised. What each job returned or raised is
        the job's, as where a worker runs them (uag.runtime.worker.Job).

            batch = Batch(max_size=4)
            batch.run_all([Job(request, (i,), str(i), shared=True) for i in range(4)])
        """
        self.queued = lambda: True
        try:
            for job in jobs:
                self.join(job)
            while self:
                if cancel():
                    self.fail(Cancelled())
                    return False
                self.round()
        except BaseException as err:
            self.fail(err)
            raise
        return True

    def round(self) -> None:
        """One pass per shared model for the members waiting on it (reads: a chunk of each read the pass serves), then
        every member served runs on to its next pass.

        While some members draft with a model, the target's narrow passes wait for them: a member drafting k tokens
        makes k drafter passes before its next target pass, so a target pass served every round would hold only the
        members that happen to be between drafts (on an H200, a mean of 2 of 4 requests: docs/results.md, bd). The
        drafter's passes are the cheap ones; held until no member drafts, every member's verification shares one
        target pass. They are held only while at least as many members draft as wait on the target: one member
        drafting with a model beside members that copy with lookup or decode plainly would hold them all through its
        k drafter passes a cycle, to save one target pass (docs/results.md, cz). Reads are never held, nor a
        parked member's rehearsal (its next target pass verifies nothing), nor a target pass for more than HOLD_ROUNDS
        rounds in a row (a model one pair drafts with may be another's target).

        On a GPU, a pass of one token a row on the kept caches (members decoding plainly, a drafter's steps) is
        queued rather than waited for, as mlx-lm's generate_step and BatchGenerator queue their next step: each member
        reads the token it sampled a round ago, streams it and asks for its next pass while the device computes
        this one, and the next pass is queued behind it before the batch waits for it (`_settle`). Waited for at
        once, the device would idle through every member's Python between passes. Such passes are not timed (their
        time is spent in the members)."""
        self.times.begin()
        fixed_rows = self._priced()
        narrow = self.narrow(fixed_rows)
        by_model: dict[int, list[Member]] = {}
        served: list[tuple[Member, Any, BaseException | None]] = []
        for member, waiting in self.waiting.items():
            if any(kept.holds(waiting.cache) for kept in self.lost):
                served.append((member, None, RuntimeError(LOST)))
            else:
                by_model.setdefault(id(waiting.model), []).append(member)
        drafters = sum(
            self.waiting[m].model.role != "target" and self.waiting[m].width <= narrow and not m.sharing.rehearsing
            for members in by_model.values()
            for m in members
        )
        ready = sum(
            self.waiting[m].model.role == "target" and self._decodes(self.waiting[m], narrow)
            for members in by_model.values()
            for m in members
        )
        drafting = self.held < HOLD_ROUNDS and drafters > 0 and drafters >= ready
        self.held = self.held + 1 if drafting else 0
        for members in by_model.values():
            held = drafting and self.waiting[members[0]].model.role == "target"
            decoding = [] if held else [m for m in members if self._decodes(self.waiting[m], narrow)]
            for member in members if held else ():
                member.sharing.held += 1
            reading = [m for m in members if not self._decodes(self.waiting[m], narrow)]
            with self.times.part("passes"):
                for group in self._cut([self.waiting[m] for m in decoding], fixed_rows):
                    served += self._decode([decoding[i] for i in group])
                if reading:
                    served += self._read(reading, alone=not decoding and len(by_model) == 1)
        with self.times.part("members"):
            for member, logits, error in served:
                self._resume(member, logits, error)
        if served:
            self._noted()
        self.times.end(bool(self.members))

    def narrow(self, fixed_rows: float) -> int:
        """The widest pass that runs beside the others' on the kept caches rather than as a read: READ tokens, or
        where a pass costs more than that many tokens' worth beside its tokens (`fixed_rows`: a GPU running a small
        model, hundreds), as many as that, up to `read_chunk`. A conversation's next turn (its new message: 29-44
        tokens on the bundled edit turns) then rides in the batch's pass, rather than running a pass of its own on a
        plain cache, handed back out of the kept caches and adopted again (docs/results.md, de)."""
        return max(READ, min(self.read_chunk, int(fixed_rows)))

    def _cut(self, passes: list[Pass], fixed_rows: float) -> list[list[int]]:
        """The passes a round runs for one model's narrow passes: one, where the batch packs them (`packed`), else cut
        where padding to the widest costs more than a pass of their own (`groups`)."""
        if not passes:
            return []
        if self._packed(passes):
            return [list(range(len(passes)))]
        return groups([p.width for p in passes], fixed_rows)

    def _packed(self, passes: list[Pass]) -> bool:
        """Whether these passes run packed (`packing`): rows of one proposal each (a tree's pass is padded) and of
        different widths (rows alike pad nothing, and one batched attention costs no more than one a row:
        docs/results.md, di), of a model whose attention can (`uag.core.kept_caches.packs`), on
        caches the batch keeps."""
        if not self.packing or len({p.width for p in passes}) < 2 or any(p.tree is not None for p in passes):
            return False
        return packs(passes[0].model.inner) and all(KeptCaches.keepable(p.cache) for p in passes)

    @staticmethod
    def _decodes(waiting: Pass, narrow: int) -> bool:
        """A narrow pass (`Batch.narrow`), or a tree's (verifying, whatever its width): not a read."""
        return waiting.width <= narrow or waiting.tree is not None

    def _decode(self, members: list[Member]) -> list[tuple[Member, Any, BaseException | None]]:
        """The members' narrow passes: one batched pass on the caches kept merged (plain KV caches, and a member
        whose cache is a row already), or merged for this pass (other caches mlx-lm merges), else one pass each. A
        failed pass fails the members it served (their engines clean up); the others go on, except after a pass
        that failed part way on the kept caches, which fails every member holding a row of them at its next pass
        (`lost`: their caches come back empty, so that no later turn trusts them)."""
        passes = [self.waiting[m] for m in members]
        trees = [p.tree for p in passes]
        keepable = all(KeptCaches.keepable(p.cache) for p in passes)
        if any(trees) and not keepable:  # a tree is read on kept caches: those that cannot be rows pass apart
            if len(members) == 1:  # tree_ready allows none such: a tree read as one proposal would be wrong
                return [(members[0], None, RuntimeError("a tree pass needs caches its batch can keep merged"))]
            apart = [[m] for m, t in zip(members, trees) if t is not None]
            apart += [plain] if (plain := [m for m, t in zip(members, trees) if t is None]) else []
            return [served for part in apart for served in self._decode(part)]
        model = passes[0].model
        tic = self.clock()
        kept = self.kept.get(id(model))
        rows = kept is not None and any(kept.holds(p.cache) for p in passes)
        keep = (len(passes) > 1 or rows or any(trees)) and keepable
        merged = keep or (len(passes) > 1 and all(mergeable(p.cache) for p in passes))
        packed = keep and self._packed(passes)
        picking = any(p.greedy for p in passes)  # the target's picks read with the pass: no read-back a member
        queued = keep and self.pipelined and all(p.width == 1 for p in passes) and not picking  # not waited (round)
        if keep:
            kept = self.kept.setdefault(id(model), KeptCaches())
            try:
                out = kept.run(
                    model.inner,
                    [self._adopted(kept, m, p.cache) for m, p in zip(members, passes)],
                    [p.inputs for p in passes],
                    wait=not (queued or picking),
                    trees=trees,
                    packed=packed,
                )
            except Exception as err:
                log.warning("a batched pass over %d requests failed", len(passes), exc_info=True)
                if kept.broken:
                    self._lose(kept)
                elif not kept:
                    del self.kept[id(model)]
                return [(m, None, err) for m in members]
            if self._settle() is kept:  # the pass queued before this one failed, and this one read what it wrote
                return [(m, None, RuntimeError(LOST)) for m in members]
            if queued:
                self.ahead = (kept, out)
            picks = _picks(passes, out)
            if picking:
                try:  # the pass, waited for with the picks
                    _evaluated([], [], picks)
                except Exception as err:
                    log.warning("a batched pass over %d requests failed on the device", len(passes), exc_info=True)
                    kept.broken = True
                    self._lose(kept)
                    return [(m, None, err) for m in members]
        elif merged:
            try:
                out = batched_pass(model.inner, [p.inputs for p in passes], [p.cache for p in passes])
                picks = _picks(passes, out)
                _evaluated(out, passes, picks)
            except Exception as err:
                log.warning("a batched pass over %d requests failed", len(passes), exc_info=True)
                return [(m, None, err) for m in members]
        else:
            out, picks = [], []
            for p in passes:
                try:
                    logits = model.inner(p.inputs, cache=p.cache)
                    pick = _picks([p], [logits])
                    if len(passes) > 1 or p.greedy:
                        _evaluated([logits], [p], pick)
                except Exception as err:
                    logits, pick = err, [None]
                out.append(logits)
                picks += pick
        ms = (self.clock() - tic) * 1000 if len(passes) > 1 and not queued else None
        if merged and ms is not None and model.role == "target":
            tokens = sum(p.width for p in passes) if packed else len(passes) * max(p.width for p in passes)
            self.costs.observe(tokens, ms)
            self._priced()
        if model.role == "target":
            for m in members:
                widest = max((p.width for other, p in zip(members, passes) if other is not m), default=0)
                m.sharing.shared(len(passes), widest, ms)
        return [
            (m, None, x) if isinstance(x, Exception) else (m, (x, pick and pick.read()) if p.verifying else x, None)
            for m, p, x, pick in zip(members, passes, out, picks)
        ]

    def _read(self, members: list[Member], alone: bool) -> list[tuple[Member, Any, BaseException | None]]:
        """One chunk of the reads of the members waiting on one (all of a lone read when nobody else waits); each
        member's logits once its read is done. Several reads share one pass (`batched_pass`: their plain caches
        merged for it) where `groups` finds one pass cheaper than one each, as mlx-lm prefills a wave of prompts
        together; the others wait for later rounds. Beside members decoding, each reads `read_chunk` tokens a
        round; with nobody decoding, the pass reads up to PREFILL_STEP tokens over all of them."""
        for member in members:  # read on its own plain cache: a long read's slots would be every row's holes
            self.hand_back(self.waiting[member].cache)
        if len(members) == 1 or not all(mergeable(self.waiting[m].cache) for m in members):
            members, chunk = members[:1], (math.inf if alone else self.read_chunk)
        else:
            chunk = max(self.read_chunk, PREFILL_STEP // len(members)) if alone else self.read_chunk
            widths = [min(self.waiting[m].width - self.waiting[m].read, chunk) for m in members]
            members = [members[i] for i in next(g for g in groups(widths, self.fixed_rows()) if 0 in g)]
        reads = [self.waiting[m] for m in members]
        ends = [min(p.width, p.read + chunk) for p in reads]
        chunks = [p.inputs[:, p.read : end] for p, end in zip(reads, ends)]
        try:
            if len(reads) == 1:
                logits = [reads[0].model.inner(chunks[0], cache=reads[0].cache)]
            else:
                logits = batched_pass(reads[0].model.inner, chunks, [p.cache for p in reads])
            mx.eval([c.state for p in reads for c in p.cache])
        except Exception as err:
            if len(reads) > 1:
                log.warning("a batched read over %d requests failed", len(reads), exc_info=True)
            return [(m, None, err) for m in members]
        widths, served = [end - p.read for p, end in zip(reads, ends)], []
        for member, waiting, end, out in zip(members, reads, ends, logits):
            waiting.logits.append(out)
            waiting.read = end
            if end < waiting.width:
                continue
            done = waiting.logits[0] if len(waiting.logits) == 1 else mx.concatenate(waiting.logits, axis=1)
            if waiting.model.role == "target":
                widest = max((w for p, w in zip(reads, widths) if p is not waiting), default=0)
                member.sharing.shared(len(reads), widest, None)
            served.append((member, (done, None) if waiting.verifying else done, None))
        return served

    def fail(self, err: BaseException) -> None:
        """End every member with `err` (batching itself failed): each engine's `finally` runs, and its job ends."""
        for member in self.members:
            if not member.dead:
                try:
                    member.throw(err)
                except Exception:  # it raised out of its job (a bug of its own): nothing more to end
                    log.debug("a member raised while it was ended", exc_info=True)
        self._settle()
        for kept in [*self.kept.values(), *self.lost]:
            for cache in [owner for owner in kept.owners if owner is not None]:
                kept.hand_back(cache)
        self.members, self.waiting, self.kept, self.lost, self.ahead = [], {}, {}, [], None
        self.times.stopped()

    def _settle(self) -> KeptCaches | None:
        """Wait for the pass queued last (`ahead`), if any; where computing it failed, its kept caches are lost
        (`lost`: every member holding a row of them fails at its next pass, as after a pass that raised), and
        returned."""
        if self.ahead is None:
            return None
        kept, logits = self.ahead
        self.ahead = None
        try:  # its logits, not the storage: the storage's arrays are the next pass's now (it wrote into them)
            mx.eval(logits)
        except Exception:
            log.warning("a batched pass over %d requests failed on the device", len(logits), exc_info=True)
            kept.broken = True
            self._lose(kept)
            return kept
        return None

    def _lose(self, kept: KeptCaches) -> None:
        """Kept caches a failed pass left unknown: out of `kept`, into `lost` until their rows are handed back."""
        self.kept = {key: k for key, k in self.kept.items() if k is not kept}
        self.lost += [] if kept in self.lost else [kept]

    def hand_back(self, cache: list) -> None:
        """A member's cache made plain KV caches again where it is a row of the kept caches (a no-op where not);
        a model's kept caches holding no row are dropped."""
        self._settle()
        for kept in [*self.kept.values(), *self.lost]:
            if kept.holds(cache):
                kept.hand_back(cache)
                for member in self.members:
                    member.adopted = [c for c in member.adopted if c is not cache]
        self.kept = {key: kept for key, kept in self.kept.items() if kept}
        self.lost = [kept for kept in self.lost if kept]

    def _adopted(self, kept: KeptCaches, member: Member, cache: list) -> int:
        """The row of the kept caches that holds a member's cache (adopted at its first batched pass)."""
        if not kept.holds(cache):
            member.adopted.append(cache)
        return kept.adopt(cache)

    def _resume(self, member: Member, value: Any, error: BaseException | None = None) -> None:
        """Let a member run on to its next shared pass (or its end)."""
        self.waiting.pop(member, None)
        waiting = member.throw(error) if error is not None else member.switch(value)
        if member.dead:
            for cache in list(member.adopted):  # its caches leave with it, plain again
                self.hand_back(cache)
            self.members.remove(member)
            self._met()
        else:
            if not isinstance(waiting, Pass):
                raise RuntimeError(f"a batched job switched out with {waiting!r} instead of a pass")
            self.waiting[member] = waiting

    def _met(self) -> None:
        """Every member's `Sharing` sees the others now (their auto prices its proposals against theirs)."""
        for member in self.members:
            member.sharing.others = tuple(o.sharing for o in self.members if o is not member)

    def _noted(self) -> None:
        if not self.history or self.history[-1][1] != len(self.members):
            self.history.append((time.time(), len(self.members)))
            del self.history[:-1000]


class RoundTimes:
    """Where a batch's rounds spend the worker's time, summed over every round since it started: `passes` (building
    each pass's graph and waiting for the device), `members` (each member's own work up to its next pass: drafting,
    choosing, detokenising, streaming) and `rest` (the rest of the round and the time since the round before:
    grouping, admitting jobs, waiting for the GIL another thread holds). Each in wall-clock seconds and in the worker
    thread's CPU seconds: a part whose wall time exceeds its CPU time waited (for the device, or the GIL; MLX's CUDA
    backend spins while it waits for the device, which counts as CPU: docs/results.md, bv).

        times.begin(); with times.part("passes"): ...; times.end(running=True)
        times.wall  # {"passes": 1.2, "members": 3.4, "rest": 0.5}
    """

    PARTS = ("passes", "members", "rest")

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.rounds = clock, 0
        self.wall = dict.fromkeys(self.PARTS, 0.0)
        self.cpu = dict.fromkeys(self.PARTS, 0.0)
        self._since: tuple[float, float] | None = None  # (wall, cpu) where the round now counts from
        self._parts = (0.0, 0.0)  # the parts timed since `_since` (a member joining between rounds too): wall, cpu

    def _now(self) -> tuple[float, float]:
        return self.clock(), time.thread_time()

    def begin(self) -> None:
        """A round starts: it counts from the end of the round before, where the batch ran on since (else now)."""
        if self._since is None:
            self._since = self._now()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        wall, cpu = self._now()
        try:
            yield
        finally:
            now_wall, now_cpu = self._now()
            self.wall[name] += now_wall - wall
            self.cpu[name] += now_cpu - cpu
            if self._since is not None:
                self._parts = (self._parts[0] + now_wall - wall, self._parts[1] + now_cpu - cpu)

    def end(self, running: bool) -> None:
        """The round is over; `running`: members remain (the next round counts from here; else from its start)."""
        (wall, cpu), (since_wall, since_cpu) = self._now(), self._since or self._now()
        self.wall["rest"] += max(0.0, wall - since_wall - self._parts[0])
        self.cpu["rest"] += max(0.0, cpu - since_cpu - self._parts[1])
        self.rounds += 1
        self._since, self._parts = ((wall, cpu) if running else None), (0.0, 0.0)

    def stopped(self) -> None:
        """The batch stopped mid-round (it failed): the next round counts from its own start."""
        self._since, self._parts = None, (0.0, 0.0)


class PassCosts:
    """What a batched target pass costs here, fitted as ms = fixed + per_row · padded tokens over the batch's
    recent passes: their ratio, in tokens, is what running one more pass is worth (`groups`). On a CPU a token
    costs much (tens of tokens pay for a pass); on a GPU next to nothing (a pass is worth hundreds)."""

    def __init__(self, prior_rows: float = FIXED_ROWS, keep: int = 64):
        self.prior_rows, self.samples = prior_rows, deque(maxlen=keep)
        self.doubted: tuple[int, float] | None = None  # an outlier waiting for a second like it (`observe`)

    def observe(self, rows: int, ms: float) -> None:
        """A timed pass over `rows` padded tokens. One over OUTLIER times what the fit so far expects of it waits for
        a second like it before either counts: a pass that compiled its kernels at first use (seconds, once:
        uag.core.evidence.learned) tilted the line for the next 64 passes, so that the batch cut every proposal
        into a pass of its own; a machine that really slowed times such passes again and again."""
        fit = self._fit()
        expected = None if fit is None else fit[0] + fit[1] * rows
        if expected is not None and expected > 0 and ms > OUTLIER * expected:
            if self.doubted is None:
                self.doubted = (rows, ms)
                return
            self.samples.append(self.doubted)
        self.doubted = None
        self.samples.append((rows, ms))

    def _fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) of the least-squares line through the samples; None until they span two widths."""
        rows = [r for r, _ in self.samples]
        if len(set(rows)) < 2:
            return None
        slope = statistics.linear_regression(rows, [ms for _, ms in self.samples]).slope
        return statistics.fmean(ms for _, ms in self.samples) - slope * statistics.fmean(rows), slope

    def fixed_rows(self, prior: float | None = None) -> float:
        """fixed / per_row from a least-squares line through the samples; until they span two widths, `prior`
        (None: the one it was made with).

        Example: samples (4, 850), (68, 2580) -> per_row 27.0 ms, fixed 742 ms -> 27.5 tokens
        """
        fit = self._fit()
        if fit is None:
            return self.prior_rows if prior is None else prior
        fixed, slope = fit
        if slope <= 0:
            return 1000.0  # tokens cost nothing measurable: never split
        return min(max(fixed / slope, 1.0), 1000.0)


def _picks(passes: list[Pass], out: list) -> list[Picks | None]:
    """The target's picks at each row of each greedy pass's logits (`Pass.greedy`), built to be evaluated with the
    pass: the members' picks then cost the pass no read-back of their own (on a GPU each was a launch and a wait)."""
    return [greedy_picks(x[0]) if p.greedy and not isinstance(x, Exception) else None for p, x in zip(passes, out)]


def _evaluated(out: list, passes: list[Pass], picks: list[Picks | None] = ()) -> None:
    """Run a shared pass now, while the batch waits on it, rather than in whichever member reads its rows first;
    with its members' picks."""
    mx.eval(out, [c.state for p in passes for c in p.cache], [a for pick in picks if pick for a in pick.arrays])
