"""The one long-lived object every front end holds: the model store, the job runner on the MLX worker, what
`auto` has learned per pair, the shared lookup indexes and the cost keeper. The app's `Session` and the server's
`Service` are adapters over it (`uag serve` builds one `Host` and hands it to both), so a pair loaded, a lesson
learned or a cost measured by one of them is the other's too, and `auto` follows one cost policy for both.

    host = Host(ModelStore(), JobRunner(MLXWorker()), target="demo-target")
    loaded = host.open("demo-target", "lookup+demo-drafter", warm=True)   # on the worker thread
    auto = host.open_auto(loaded, "lookup+demo-drafter")
    with host.running(job, loaded, ids, config, auto=auto) as running:   # in a job on the worker
        for event in running: ...                                              # running.run: the final record

The cost policy: a host that keeps costs off the requests' path (`off_path`: `uag serve`) never measures inside
a request: a pair without costs runs without them and is measured by the `CostKeeper` when the worker is idle;
the app on its own (`uag app`) measures a pair on its first use, inside the run, as the CLI does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

from uag.core.config import DrafterSpec, GenerationConfig
from uag.core.drafters import DrafterChoice
from uag.core.engine import Seams, generate
from uag.core.engine import stream as engine_stream
from uag.core.evidence import Evidence
from uag.core.lookup import SharedIndexes
from uag.core.passes import kv_bytes
from uag.core.policy import AutoSettings
from uag.core.records import Event, Run, Sharing
from uag.core.translate import Translator
from uag.costs.pair import AutoInputs, evidence_key, keep_evidence, open_auto, read_calibration, why_short
from uag.costs.profiles import pair_name
from uag.models.memory import available_bytes
from uag.models.store import LoadedModel, ModelStore
from uag.runtime.batching import Batch, handed_back, share, sharing_now
from uag.runtime.jobs import JobRunner, tell
from uag.runtime.keeper import CostKeeper, Measures, Wanted, measure_wanted
from uag.runtime.pair import Load, Loaded, check_against_target, open_pair
from uag.runtime.warmup import compiles_at_first_use, warm_batch
from uag.runtime.worker import Busy, Job, MLXWorker

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
WARM_UP_PROMPT = "Hello"


class Streams(Protocol):
    """How a host runs a pair: `uag.core.engine.stream`'s signature, or a sharded target's run over its ranks
    (`uag.distributed.serving.Leader.stream`). `seams` is passed only to an ablated auto (`uag serve --auto-off`)
    or the engine's own run (the translator the drafter's check started), `sharing` only to a request batched with
    others."""

    def __call__(
        self,
        target: LoadedModel,
        drafter: Any,
        prompt: Any,
        config: GenerationConfig,
        *,
        cancel: threading.Event | None = None,
        caches: Any = None,
        profile: Any = None,
        evidence: Evidence | None = None,
        seams: Seams | None = None,
        sharing: Sharing | None = None,
    ) -> Iterator[Event]: ...


@dataclass
class Running:
    """One request's run on the host: its events, how its passes were shared with other requests' (None: run
    alone), and its final record once the events have ended."""

    events: Iterator[Event]
    sharing: Sharing | None
    run: Run | None = None

    def __iter__(self) -> Iterator[Event]:
        for event in self.events:
            self.run = event.run
            yield event


class NoRoom(Busy):
    """The request's KV caches would not fit in memory beside those of the requests running now."""


def room_for(target: Any, tokens: int, batch: Batch | None, *, available: int | None = None) -> None:
    """NoRoom unless a request of up to `tokens` tokens fits in memory beside the batch's members: its caches,
    and their copy in each batched pass (`available` replaces what this machine has free: tests)."""
    if batch is None or not batch:
        return
    free = available_bytes() if available is None else available
    need = 2 * kv_bytes(target.model, tokens)
    if free is not None and need > free:
        raise NoRoom(
            f"this request's KV caches ({need / 1e9:.1f} GB with their batched copy) would not fit in the "
            f"{free / 1e9:.1f} GB free beside the {len(batch)} request{'s' * (len(batch) != 1)} running now: "
            "retry when one has finished, or ask for fewer max_tokens"
        )


class Host:
    """What every front end shares: `store`, `runner` (the MLX worker, each client's share, the time budget),
    `evidence` (per pair: the `Evidence` its auto runs share), `memory` (earlier requests' prompts and replies per
    API key and target, that prompt lookup drafts from, of `lookup_memory` tokens or the `memory` another host of
    the same server holds; None: off), `costs` (the `CostKeeper`) and the pairs
    opened here. `target` and the dtypes: the pair a server serves (the app names its own per run). `stream` and
    `measure`: how a pair runs and is measured (a sharded target's over its ranks); `auto`: AutoSettings with parts
    of auto switched off (`uag serve --auto-off`, an ablation; None: as shipped). `off_path`: the cost policy
    (the module's docstring)."""

    def __init__(
        self,
        store: ModelStore,
        runner: JobRunner,
        *,
        target: str | None = None,
        target_dtype: str | None = None,
        drafter_dtype: str | None = None,
        stream: Streams | None = None,
        measure: Measures | None = None,
        auto: AutoSettings | None = None,
        lookup_memory: int = 0,
        memory: SharedIndexes | None = None,
        off_path: bool = False,
    ):
        self.store, self.runner, self.target_name = store, runner, target
        self.target_dtype, self.drafter_dtype = target_dtype, drafter_dtype  # None: as stored
        self.stream: Streams = stream or engine_stream
        self.measure = measure
        self.auto = auto
        self.off_path = off_path
        self.batched = runner.worker.max_batch > 1  # requests run together (`--max-batch`)
        self.evidence: dict[str, Evidence] = {}
        self.unsaved: dict[str, tuple[dict, Evidence]] = {}  # evidence whose write waits for the batch to drain
        self.memory = memory if memory is not None else SharedIndexes(lookup_memory) if lookup_memory > 0 else None
        self.costs = CostKeeper(runner.worker, self._measure, lambda wanted: self.holds(wanted.drafter))
        self.pairs: dict[tuple, Loaded] = {}  # pairs opened here (set on the worker thread)
        self._warm: set[tuple] = set()  # pairs warmed up; touched on the worker thread only
        self._starting: Job | None = None  # `start`'s job: loading the default pair, then measuring its costs
        store.on_evict.append(self._forget)

    @property
    def worker(self) -> MLXWorker:
        return self.runner.worker

    # --- pairs ---------------------------------------------------------------------------------------------
    def open(
        self,
        target: str,
        drafter: str | None,
        *,
        target_dtype: str | None = None,
        drafter_dtype: str | None = None,
        progress: Progress | None = None,
        between: Callable[[], None] | None = None,
        load: Load | None = None,
        warm: bool = False,
    ) -> Loaded:
        """Load the pair and check it (uag.runtime.pair.open_pair, as every front end), keep it here, share its
        models for batching where requests run together, and with `warm` run it once (the first passes through a
        model are slower: allocation, kernel set-up), so that the timings a user compares are fair."""
        loaded = open_pair(
            self.store,
            target,
            drafter,
            target_dtype=target_dtype,
            drafter_dtype=drafter_dtype,
            progress=progress,
            between=between,
            **({} if load is None else {"load": load}),
        )
        key = pair_key(target, drafter, target_dtype, drafter_dtype)
        self.pairs[key] = loaded
        if self.batched:  # requests running together share the models' passes (uag.runtime.batching)
            share(loaded.target, "target")
            if loaded.choice is not None and loaded.choice.model is not None:
                share(loaded.choice.model, "drafter")
        if warm and key not in self._warm:
            (progress or (lambda _: None))("Warming up the pair (once) so that the timings are fair…")
            once = GenerationConfig("context", k=2, max_tokens=4)
            generate(loaded.target, None, WARM_UP_PROMPT, once.replace(strategy="baseline"))
            generate(loaded.target, loaded.drafter, WARM_UP_PROMPT, once)
            self._warm.add(key)
        return loaded

    def open_target(
        self, drafter: str | None, *, progress: Progress | None = None, between: Callable[[], None] | None = None
    ) -> Loaded:
        """`open` the host's target (the one a server serves) with `drafter`, in the host's dtypes."""
        return self.open(
            self.target_name,
            drafter,
            target_dtype=self.target_dtype,
            drafter_dtype=self.drafter_dtype,
            progress=progress,
            between=between,
        )

    def opened(self, target: str, drafter: str, target_dtype=None, drafter_dtype=None) -> Loaded | None:
        """The pair as opened here, if it was and its models are still loaded (loads nothing)."""
        return self.pairs.get(pair_key(target, drafter, target_dtype, drafter_dtype))

    def holds(self, drafter: str | None) -> bool:
        """Whether the host holds the models of its target's pair with `drafter` now (touches none of them)."""
        model = None if drafter is None else DrafterSpec.parse(drafter).model
        return self.store.has(self.target_name, self.target_dtype) and (
            model is None or self.store.has(model, self.drafter_dtype)
        )

    def loaded(self, drafter: str | None) -> tuple[LoadedModel, DrafterChoice | None] | None:
        """(target, `DrafterChoice` or None) when the host holds its target's pair with `drafter` now (`holds`);
        None otherwise. Loads nothing."""
        if not self.holds(drafter):
            return None
        target = self.store.get(self.target_name, dtype=self.target_dtype)
        if drafter is None:
            return target, None
        spec = DrafterSpec.parse(drafter)
        held = None if spec.model is None else self.store.get(spec.model, dtype=self.drafter_dtype)
        return target, DrafterChoice(lookup=spec.lookup, model=held)

    def _forget(self, model: LoadedModel) -> None:
        """Drop the pairs that use a model the store unloaded, so that its memory is freed."""
        for key, loaded in list(self.pairs.items()):
            if loaded.uses(model):
                self.pairs.pop(key, None)
                self._warm.discard(key)

    # --- a run ---------------------------------------------------------------------------------------------
    def open_auto(self, loaded: Loaded, drafter: str | None, *, progress: Progress | None = None) -> AutoInputs:
        """What an `auto` run of the pair opens from (uag.costs.pair.open_auto) with the evidence its runs here
        share, under the host's one cost policy: off the requests' path, a pair without costs runs without them
        and is measured when the worker is idle (`drafter`: as a request names it, for the keeper); otherwise a
        pair is measured on its first use (`progress` hears of it)."""
        schedule = None
        if self.off_path:
            schedule = lambda key, why: self.want(Wanted(key, drafter, why))  # noqa: E731
        return open_auto(
            loaded.target,
            loaded.choice,
            progress=progress,
            held=self.evidence,
            schedule=schedule,
            keep=self.auto is None,
            save=self.keep_evidence,
        )

    def keep_evidence(self, key: dict | None, evidence: Evidence) -> None:
        """Save a pair's evidence for the next process (uag.costs.pair.keep_evidence): at once where the worker runs
        nothing else, else once the requests running together have drained (the last of them to end writes every
        pair's). A file written and renamed on the worker thread stalls every member of a batch (docs/results.md,
        cz). Meanwhile the evidence is the host's, in memory (`evidence`): what the next request opens from; a
        server stopped before its batch drained leaves the newest lessons unsaved (the next process learns them
        again)."""
        if key is None:
            return
        self.unsaved[json.dumps(key, sort_keys=True)] = (key, evidence)
        if self.worker.alone:
            for pending, taught in self.unsaved.values():
                keep_evidence(pending, taught)
            self.unsaved.clear()

    def admit(self, target: LoadedModel, tokens: int) -> None:
        """NoRoom when a request of up to `tokens` tokens would not fit beside the requests running together now."""
        if self.batched:
            room_for(target, tokens, self.worker.batch)

    @contextmanager
    def running(
        self,
        job: Job,
        loaded: Loaded,
        ids: list[int],
        config: GenerationConfig,
        *,
        auto: AutoInputs | None = None,
        key: str | None = None,
        remember: bool = False,
        caches: Any = None,
        copy_forms: bool = False,
        translator: Translator | None = None,
    ) -> Iterator[Running]:
        """Run the pair on `ids` (the host's `stream`, cancelled with the job), batched with the requests running
        together now where it is; at the end, also when stopped early, the engine's `finally` leaves the caches
        exact and `auto` is finished (its evidence saved, costs found off measured again). `remember` (an API
        request, where the host keeps a lookup memory): prompt lookup also drafts from the earlier requests of the
        API key it presented (`key`; None: none, or the server's one) and of no other, and this run's prompt and
        reply join them when it ends without an error. `copy_forms` (a reply that may write JSON: a request with tools
        or a JSON grammar): lookup also drafts from the prompt as a JSON string holds it (uag.core.copy_forms).
        `translator`: the drafter's, started on `ids` when the drafter's room was checked
        (uag.runtime.pair.checked_prompt): the run takes it rather than translate the prompt again (a sharded
        target's ranks translate it for themselves)."""
        target, choice = loaded.target, loaded.choice
        extra: dict[str, Any] = {} if auto is None else auto.engine_kwargs()
        translator = translator if self.stream is engine_stream else None
        if self.auto is not None or translator is not None:
            extra["seams"] = Seams(auto=self.auto, translator=translator)
        if (sharing := sharing_now()) is not None:
            extra["sharing"] = sharing
        owner = (hashlib.sha256((key or "").encode()).hexdigest(), target.name)  # never the key itself
        drafting = choice
        memory = self.memory if remember and choice is not None and choice.lookup else None
        if memory is not None:
            drafting = replace(choice, shared_index=memory.get(owner))
        if copy_forms and choice is not None and choice.lookup:
            drafting = replace(drafting, copy_forms=True)
        events = self.stream(target, drafting, ids, config, cancel=job.cancelled, caches=caches, **extra)
        running, clean = Running(events, sharing), False
        try:
            yield running
            clean = True
        finally:
            events.close()  # the engine's finally leaves the caches exact, also when stopped early
            handed_back()  # plain KV caches again, where they were rows of the batch's: kept for the next turn
            if clean and remember and self.memory is not None and running.run is not None:
                self.memory.add(owner, [*running.run.prompt_ids, *running.run.token_ids])
            if auto is not None:  # the pair's next run opens from its evidence; costs found off are measured again
                generated = running.run.generated if running.run is not None else 0
                auto.finish(context=len(ids) + generated, generated=generated)

    def check(self, loaded: Loaded, ids: list[int], config: GenerationConfig, run: Run, *, cancel=None, baseline=None):
        """The run against the target alone on the same prompt (uag.runtime.pair.check_against_target), run the
        way the host runs the pair."""
        return check_against_target(loaded, ids, config, run, cancel=cancel, baseline=baseline, stream=self.stream)

    # --- costs: measured off the requests' path -----------------------------------------------------------
    def starting(self) -> str | None:
        """What the host still does at start-up (`start`), or None once that is done."""
        job = self._starting
        return None if job is None or job.done.is_set() else job.label

    def start(self, drafter: str | None, offered, *, progress: Progress | None = None, then=None) -> Job:
        """Load the target's pair with `drafter` in the background, so that the first request finds it loaded,
        then measure the costs auto decides by where none are saved, for every drafter `offered` whose models are
        loaded now. A request queued meanwhile stops the measuring, which the `CostKeeper` takes up again when the
        worker is idle; a drafter loaded later is measured then. `then(loaded)`: what else to do once it is loaded."""

        def job(job: Job) -> Iterator[str]:
            loaded = self.open_target(drafter, progress=progress or (lambda text: tell(job, text)))
            if then is not None:
                then(loaded)
            yield loaded.target.name
            job.label = "measuring auto's costs (stops for a request)"
            self.measure_missing(job, offered, progress)
            if self.batched and compiles_at_first_use():
                job.label = "compiling the batch's kernels (stops for a request)"
                self.warm_batch(job, loaded)

        def drain(queued: Job) -> None:
            try:
                for _ in queued:
                    pass
            except Exception:  # said again, to the client, on the first request
                log.warning("preloading the default pair failed", exc_info=True)

        queued = self._starting = self.worker.submit(job, label=f"loading {self.target_name}")
        threading.Thread(target=drain, args=(queued,), name="uag-serve-preload", daemon=True).start()
        self.costs.start()
        return queued

    def warm_batch(self, job: Job, loaded: Loaded) -> None:
        """Run the batched passes requests will run once, on made-up prompts, so that a backend that compiles its
        kernels at first use (MLX's CUDA backend) does so here rather than in the first requests that run together
        (uag.runtime.warmup); it stops for a request, which then pays for what is left."""
        drafter = loaded.choice.model if loaded.choice is not None else None
        try:
            seconds = warm_batch(
                loaded.target, drafter, cancel=lambda: job.cancelled.is_set() or self.worker.backlog > 0
            )
        except Exception:  # a failed warm-up costs the first requests their compile time, nothing else
            log.warning("warming up the batch's passes failed", exc_info=True)
            return
        log.info("ran the batch's passes once to compile their kernels, in %.1f s", seconds)

    def measure_missing(self, job: Job, offered, progress: Progress | None = None) -> None:
        """At start-up: measure every offered pair whose models are loaded and that has no costs saved, or a
        verify curve short of what its lookup copies (`why_short`; model drafters first: a pair's measurement also
        gives prompt lookup its target-only costs)."""
        stopped = False
        for drafter in sorted(offered, key=lambda text: DrafterSpec.parse(text).model is None):
            pair = self.loaded(drafter)
            if pair is None:
                continue  # measured once a request has loaded it
            key = evidence_key(*pair)
            saved = read_calibration(key)
            why = "no costs are saved for it yet" if saved is None else why_short(saved, pair[1])
            if why is None:
                continue
            wanted = Wanted(key, drafter, why)
            stopped = stopped or not self._measure(job, wanted, self.costs.cancel_for(job), progress)
            if stopped:  # a request came in: the rest wait for an idle moment
                self.want(wanted)
            else:
                self.costs.measured(key)

    def want(self, wanted: Wanted) -> None:
        """Measure `wanted` when the worker is idle (the keeper decides when), said once in the log."""
        state = self.costs.want(wanted)
        if state == "deferred":
            log.info(
                "auto's costs for %s: %s; measured %.0f min ago, so not again before %g min have passed (until "
                "then auto rescales them as it runs)",
                pair_name(wanted.key),
                wanted.reason,
                (self.costs.since(wanted.key) or 0) / 60,
                self.costs.interval_s / 60,
            )
        if state == "scheduled":
            first = wanted.reason.startswith("no costs")
            log.warning(
                "auto's costs for %s: %s; measuring them%s in the background when the server is idle (until "
                "then auto %s)",
                pair_name(wanted.key),
                wanted.reason,
                "" if first else " again",
                "learns them as it runs" if first else "rescales the saved ones as it runs",
            )

    def _measure(self, job: Job, wanted: Wanted, cancel: Callable[[], bool], progress=None) -> bool:
        """The keeper's `measure`: the pair `wanted` names, if its models are loaded now (False otherwise)."""
        pair = self.loaded(wanted.drafter)
        if pair is None:
            return False
        target, choice = pair
        if evidence_key(target, choice) != wanted.key:  # the models loaded now are not those it was asked for
            return True
        kw = {} if self.measure is None else {"measure": self.measure}
        return measure_wanted(
            target, choice, wanted, cancel=cancel, job=job, progress=progress, interval_s=self.costs.interval_s, **kw
        )


def pair_key(target: str, drafter: str | None, target_dtype=None, drafter_dtype=None) -> tuple:
    """How the host names a pair it opened: a pair in other dtypes is another pair (its r, its costs, its warm-up)."""
    if target_dtype or drafter_dtype:
        return (target, drafter, target_dtype, drafter_dtype)
    return (target, drafter)
