"""Serving over a sharded target: rank 0 takes the requests, every rank runs each one in lockstep.

    mlx.launch --hostfile hosts.json -- python -m uag serve --shard tensor --target T --drafter lookup

`uag serve --shard` starts on every rank. Each joins the group and loads its shard on the MLX worker thread
(MLX arrays and streams belong to the thread that made them, and rank 0's server runs every job on that
thread). Rank 0 then serves HTTP: its `Host` (uag.runtime.host) runs requests through `Leader.stream`,
which first tells the other ranks what to run — the prompt's ids and the `GenerationConfig` — and then runs
`stream_sharded` with them (uag.distributed.sharded), so that every rank verifies and commits the same
tokens. The other ranks `follow`: wait for rank 0's word, run what it says, wait again.

Rank 0's word is one fixed-width integer `all_sum` ([op, a, b, …], the others add zeros), then for a request
the payload (ids and settings as integers):
- RUN a b: a request of `a` prompt ids and `b` bytes of settings (JSON), which follow.
- CALIBRATE: rank 0 measures a pair's costs for `auto` (uag.costs.calibrate), which takes every rank's passes;
  the others time the same passes (`calibrate_target`, the target side of every calibration) and discard them.
  At startup, and while the server is idle for a pair without costs or whose costs a run found off (the
  host's CostKeeper, uag.runtime.keeper, through `Leader.measure`): never inside a request.
- WAIT a: rank 0 is about to load a drafter: the next word may take `a` seconds.
- HEARTBEAT: nothing to run; rank 0 is alive.
- SHUTDOWN: rank 0 is stopping (Ctrl-C, SIGTERM): the others leave their loop and exit 0.

The idle wait. A follower waits for rank 0's next word in a collective, with its watchdog armed; rank 0
sends a HEARTBEAT whenever it has said nothing for `HEARTBEAT_S` seconds. An unbounded wait would
be simpler, but then a follower whose rank 0 hangs or whose link goes silent (a cable pulled: no socket is
closed, so MLX's ring never raises) would wait forever, and rank 0 would learn that a follower died only
when the next request failed. With heartbeats every idle wait is bounded (`--shard-timeout`, or what a WAIT
announced), and rank 0 hears within seconds that a follower is gone: it then stops serving with one line
naming it, instead of answering every request with an error. Rank 0's own watchdog is armed only while it
is inside a collective: idle, it waits for nobody. (MLX's ring polls its sockets while a collective waits,
so an idle follower keeps a core busy either way, as mlx_lm.server's ranks do.)

Cancel (a client that leaves, the time budget, a stop string) reaches every rank at the next decision
(uag.distributed.decisions: STOP); a baseline run, which has no decisions, exchanges go-on or stop after
each token (`stop_checks`). Rank 0 never stops reading a run early: a consumer that closes the stream makes
it stop every rank and read to that end. Conversation caches are not kept across requests (each request
reads its whole prompt): the ranks' caches would have to be kept and evicted alike on every rank.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict

import mlx.core as mx

from uag.core.config import DrafterSpec, GenerationConfig
from uag.core.drafters import DrafterChoice, load_drafter_choice
from uag.core.engine import prompt_ids
from uag.core.records import Event
from uag.costs.calibrate import QUICK, calibrate, calibrate_target
from uag.distributed.collective import Link, RankLost, RanksDisagree, others
from uag.distributed.decisions import STOP, Stopped, message_width
from uag.distributed.sharded import (
    LOAD_TIMEOUT_S,
    Ranks,
    check_sharded,
    connect,
    generate_sharded,
    load_sharded,
    stream_sharded,
)
from uag.errors import ModelError, UserError
from uag.models.store import LoadedModel, ModelStore, check_pair

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # rank 0, idle, says it is alive this often
RUN, CALIBRATE, WAIT, HEARTBEAT, SHUTDOWN = 11, 12, 13, 14, 15  # rank 0's words (never 0: all ranks add theirs)
WORD = 4  # integers in a word: [op, a, b, 0]

Progress = Callable[[str], None]


def join(name: str, shard: str, *, connect_timeout_s: float, timeout_s: float, progress: Progress | None = None):
    """(Ranks, this rank's shard of the target `name`): every rank's start, on the thread that will run MLX."""
    ranks = connect(connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)
    try:
        target = load_sharded(name, shard, ranks, progress=progress if ranks.rank == 0 else None)
    except BaseException:
        ranks.close()
        raise
    target.name = f"{name}@{shard}x{ranks.size}"  # its own costs, saved apart from the whole target's
    return ranks, target


# --- the other ranks ---------------------------------------------------------------------------------


def follow(ranks: Ranks, target: LoadedModel) -> int:
    """A rank other than 0: run rank 0's requests in lockstep until it says SHUTDOWN; returns the runs made.
    A request that rank 0 refused the same way (bad settings) is skipped; a lost rank ends the loop (RankLost)."""
    link = Link(ranks.group, WORD, ranks.watchdog)
    limit, runs = LOAD_TIMEOUT_S, 0  # at first rank 0 may still be loading its drafters
    while True:
        link.phase = "waiting for rank 0's next request"
        ranks.watchdog.arm(
            limit,
            f"error: rank {ranks.rank}: no word from rank 0 for {limit:g} s while waiting "
            "for requests: it exited, hangs, or the link is down",
        )
        op, a, b, _ = link.exchange(None)
        ranks.watchdog.arm(0, "")
        limit = ranks.timeout_s
        if op == SHUTDOWN:
            return runs
        if op == WAIT:
            limit = float(a)
        elif op == CALIBRATE:
            with _bounded(ranks, link, "measuring the target's costs"):
                calibrate_target(target, **QUICK)
        elif op == RUN:
            zeros = mx.zeros(a + b, dtype=mx.int32)
            payload = link.collect(lambda: mx.distributed.all_sum(zeros, group=ranks.group))  # noqa: B023
            settings = json.loads(bytes(payload[a:]).decode("utf-8"))
            config = GenerationConfig(**settings["config"])
            try:
                generate_sharded(
                    target, None, payload[:a], config, ranks, check_every=settings["check_every"], stop_checks=True
                )
                runs += 1
            except (RankLost, RanksDisagree):
                raise
            except (UserError, Stopped):
                pass  # the same refusal as rank 0's at the same point, or rank 0 failed alone and stopped the run
        elif op != HEARTBEAT:
            raise RuntimeError(f"rank {ranks.rank}: rank 0 sent an unknown word {op} (different uag versions?)")


# --- rank 0 ----------------------------------------------------------------------------------------------


class Leader:
    """Rank 0 of a sharded server: the `stream` and `measure` its host runs and measures pairs with
    (uag.runtime.host's `Streams` and uag.runtime.keeper's `Measures`), the store that hands out the sharded
    target, the drafters loaded before serving, heartbeats, and the last word.

    Every method that sends a word runs on the MLX worker thread (`worker`), as does `prepare`. `lost` holds the
    error once a rank is gone; `on_lost` (set by the server) is called then, from the worker thread, to stop
    serving."""

    def __init__(self, ranks: Ranks, target: LoadedModel, worker, *, check_every: int = 0):
        self.ranks, self.target, self.worker, self.check_every = ranks, target, worker, check_every
        self.link = Link(ranks.group, WORD, ranks.watchdog)
        self.lost: UserError | None = None
        self.on_lost: Callable[[], None] | None = None
        self.lockstep = False  # every rank is inside the same run or calibration: target passes may run
        self._last_word = time.monotonic()
        self._ended = False
        self._closing = threading.Event()
        target.model = _RankZeroShard(target.model, self)

    # --- what the server calls -------------------------------------------------------------------------
    def store(self, name: str, **kw) -> ShardedStore:
        """A model store in which the target `name` (as the server was asked for it) is this sharded one."""
        return ShardedStore(self, name, **kw)

    def stream(
        self,
        target: LoadedModel,
        drafter: DrafterChoice | None,
        prompt: str | Sequence[int],
        config: GenerationConfig,
        *,
        cancel: threading.Event | None = None,
        caches=None,
        profile=None,
        evidence=None,
        seams=None,
        sharing=None,
    ) -> Iterator[Event]:
        """`uag.core.engine.stream`'s signature (what the host calls, once per request, with the prompt read and
        checked and `auto`'s inputs opened as every front end's: uag.runtime.pair, uag.runtime.host.Host.open_auto),
        over the shards. `caches` is not used: every request reads its whole prompt, and `cached_tokens` is 0.
        `seams` and `sharing` are never given: `serve --shard` refuses --auto-off and --max-batch."""
        assert seams is None and sharing is None, "a sharded server runs auto as shipped, one request at a time"
        assert target is self.target, (target.name, self.target.name)
        check_sharded(config, drafter, 0)  # before the others hear of it: a refusal leaves nobody waiting
        if config.speculative and drafter.model is not None:
            check_pair(target, drafter.model)
        ids = prompt_ids(target, prompt, chat=config.chat) if isinstance(prompt, str) else list(prompt)
        settings = json.dumps({"config": asdict(config), "check_every": self.check_every}).encode("utf-8")
        stop = _Either(cancel)
        self._say([RUN, len(ids), len(settings)], [*ids, *settings])
        finished = started = False
        self.lockstep = True
        try:
            events = stream_sharded(
                target,
                drafter,
                ids,
                config,
                self.ranks,
                profile=profile,
                evidence=evidence,
                check_every=self.check_every,
                cancel=stop,
                stop_checks=True,
            )
            started = True
            try:
                for event in events:  # noqa: UP028  not `yield from`: closing this stream must not close the run
                    yield event
                finished = True
            finally:
                if not finished and self.lost is None:
                    stop.set()  # the consumer left (a stop string, an error): every rank stops at the next decision
                    for _ in events:
                        pass
        except (RankLost, RanksDisagree) as err:
            self._lose(err)
            raise
        except Exception as err:
            if started or not isinstance(err, UserError):  # not a refusal that every rank made alike
                self._abandon(config.k)
            raise
        finally:
            self.lockstep = False
            self.ranks.watchdog.arm(0, "")  # also after a refusal between the agreement and the first pass
            self._last_word = time.monotonic()

    def prepare(self, store: ModelStore, drafters: Sequence[str], progress: Progress | None = None) -> None:
        """Load the drafters the server offers before serving (the host then measures the pairs without costs
        over the shards, through `measure`: uag.runtime.host.Host.measure_missing)."""
        for text in drafters:
            load_drafter_choice(store, DrafterSpec.parse(text), progress=progress)

    def measure(self, target: LoadedModel, choice: DrafterChoice, *, progress=None, cancel=None):
        """One quick calibration of the pair over the shards (the host's `measure`): CALIBRATE, then every rank
        times the target's passes with rank 0. `cancel` is not asked: rank 0 cannot stop part way alone, the
        others would wait in a pass it never takes (a request waits for the whole measurement, seconds)."""
        assert target is self.target, (target.name, self.target.name)
        self._say([CALIBRATE])
        with self._lockstep(), _bounded(self.ranks, self.link, "measuring the target's costs"):
            # The target's passes come first in either calibration, as in calibrate_target: the same on every rank.
            if choice.model is None:
                return calibrate_target(self.target, progress=progress, **QUICK)
            return calibrate(check_pair(self.target, choice.model), progress=progress, **QUICK)

    def keep_in_touch(self) -> None:
        """From now on a HEARTBEAT goes out whenever rank 0 has said nothing for `HEARTBEAT_S` (a thread queues it
        on the worker)."""
        threading.Thread(target=self._heartbeats, name="uag-shard-heartbeat", daemon=True).start()

    def close(self, timeout_s: float | None = None) -> None:
        """The last word (SHUTDOWN), after the job in progress; then leave the group. Bounded: ranks that are
        gone or slow are left to their own watchdogs."""
        self._closing.set()
        if self.lost is None and not self._ended:

            def last(_job):
                self._say([SHUTDOWN])
                self._ended = True
                yield

            job = self.worker.submit(last, label="telling the other ranks to stop")
            if not job.wait(self.ranks.timeout_s if timeout_s is None else timeout_s):
                job.cancel()
        self.ranks.close()

    # --- on the worker thread --------------------------------------------------------------------------
    def expect_silence(self, seconds: float) -> None:
        """Rank 0 is about to work alone (loading a drafter) for up to `seconds`: the others wait that long."""
        self._say([WAIT, int(seconds)])

    def _abandon(self, k: int) -> None:
        """Rank 0 failed on its own inside a run (a bug in drafting, say) while the others went on to the next
        decision: STOP ends the run there for them too, and the server goes on. Best effort: had they been
        inside a pass, the watchdog ends the wait."""
        ranks = self.ranks
        ranks.watchdog.arm(
            ranks.timeout_s,
            f"error: rank 0: {others(0, ranks.size)} did not take rank 0's stop "
            f"within {ranks.timeout_s:g} s after rank 0 failed in a run",
        )
        try:
            Link(ranks.group, message_width(k), ranks.watchdog).exchange([STOP])
        except RankLost as err:
            self._lose(err)  # said by the server; the run's own error is the one to raise
        finally:
            ranks.watchdog.arm(0, "")

    def _say(self, word: list[int], payload: Sequence[int] = ()) -> None:
        if self.lost is not None:
            raise self.lost
        if self._ended:
            raise RuntimeError("the other ranks were told to stop")
        ranks = self.ranks
        ranks.watchdog.arm(
            ranks.timeout_s,
            f"error: rank 0: {others(0, ranks.size)} did not take rank 0's word "
            f"within {ranks.timeout_s:g} s (it exited, hangs, or the link is down)",
        )
        self.link.phase = "telling the other ranks what to run"
        try:
            self.link.exchange(word)
            if payload:
                data = mx.array(list(payload), dtype=mx.int32)
                self.link.collect(lambda: mx.distributed.all_sum(data, group=ranks.group))
        except RankLost as err:
            self._lose(err)
            raise
        finally:
            ranks.watchdog.arm(0, "")
        self._last_word = time.monotonic()

    def _heartbeats(self) -> None:
        def beat(_job):
            if not self._closing.is_set() and self.lost is None:
                try:
                    self._say([HEARTBEAT])
                except UserError:
                    pass  # lost: _say said so (on_lost)
            yield

        pending = None  # one heartbeat at a time, queued behind whatever the worker does (a run says more)
        while not self._closing.wait(HEARTBEAT_S / 5):
            silent = time.monotonic() - self._last_word >= HEARTBEAT_S
            if silent and self.lost is None and (pending is None or pending.done.is_set()):
                pending = self.worker.submit(beat, label="keeping the ranks in touch")

    def _lose(self, err: UserError) -> None:
        if self.lost is None:
            self.lost = err
            if self.on_lost is not None:
                self.on_lost()

    @contextmanager
    def _lockstep(self) -> Iterator[None]:
        self.lockstep = True
        try:
            yield
        except RankLost as err:
            self._lose(err)
            raise
        finally:
            self.lockstep = False
            self._last_word = time.monotonic()


class ShardedStore(ModelStore):
    """The server's model store on rank 0: the sharded target under the name it was asked for (never loaded
    whole, never unloaded), drafters as usual, each first load announced to the other ranks (WAIT)."""

    def __init__(self, leader: Leader, name: str, **kw):
        super().__init__(**kw)
        self.leader = leader
        self.target_identity = self.identity(name)

    def has(self, name: str, dtype: str | None = None) -> bool:
        return self.identity(name) == self.target_identity or super().has(name, dtype)

    def __contains__(self, name: str) -> bool:
        return self.identity(name) == self.target_identity or super().__contains__(name)

    def get(self, name: str, *, dtype: str | None = None, progress=None, keep=()) -> LoadedModel:
        if self.identity(name) == self.target_identity:
            if dtype is not None and self.key(name, dtype) != self.key(name):
                raise ModelError("--shard loads the target as stored: no dtype can be asked for")
            return self.leader.target
        if not super().has(name, dtype):
            self.leader.expect_silence(LOAD_TIMEOUT_S)
        return super().get(name, dtype=dtype, progress=progress, keep=keep)


class _RankZeroShard:
    """Rank 0's shard of the target. A pass that the other ranks do not take at the same time would leave their
    collectives unmatched (a hang, or sums of unrelated tensors), so one outside a run or a calibration that
    every rank takes part in is refused (uag.costs.calibrate on a pair's first use, a near-tie check)."""

    def __init__(self, model, leader: Leader):
        self._model, self._leader = model, leader

    def __call__(self, *args, **kwargs):
        if not self._leader.lockstep:
            raise ModelError(
                "--shard: this would run the sharded target on rank 0 alone, which the other ranks cannot follow "
                "(a reply's near-tie check cannot run sharded)"
            )
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class _Either:
    """Set when rank 0's job is cancelled or when its stream's consumer left (`RankPolicy` reads `is_set`)."""

    def __init__(self, cancel: threading.Event | None):
        self.cancel, self.left = cancel, threading.Event()

    def set(self) -> None:
        self.left.set()

    def is_set(self) -> bool:
        return self.left.is_set() or (self.cancel is not None and self.cancel.is_set())


@contextmanager
def _bounded(ranks: Ranks, link: Link, what: str) -> Iterator[None]:
    """One long step that every rank takes together (a calibration): bounded by the watchdog, a lost peer named."""
    link.phase = what
    ranks.watchdog.arm(
        LOAD_TIMEOUT_S,
        f"error: rank {ranks.rank}: {others(ranks.rank, ranks.size)} stopped "
        f"answering while {what} (no progress for {LOAD_TIMEOUT_S:g} s)",
    )
    try:
        yield
    except RuntimeError as err:
        if not str(err).startswith(("[ring]", "[jaccl]", "[mpi]", "[distributed]")):
            raise
        raise link.lost(err) from None
    finally:
        ranks.watchdog.arm(0, "")
