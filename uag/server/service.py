"""What a request runs on the MLX worker: load the pair, render and check the prompt, run the engine's stream with
the conversation's caches and the pair's evidence, and hand back text deltas and one final report. Also what
the Server tab shows: the recent requests and the time speculation saved.

The HTTP layer (uag.server.routes) never touches a model: it queues `Service.job` through the `JobRunner` that the
app's Session shares, so API requests and the app's comparisons run on one worker, in turn. No request measures
costs: `CostKeeper` measures a pair's missing or stale costs while the worker is idle, and stops for a request.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from uag.core.config import DrafterSpec
from uag.costs.pair import open_auto
from uag.errors import InputError
from uag.models.store import ModelStore
from uag.runtime.batching import room_for, share
from uag.runtime.jobs import JobRunner
from uag.runtime.pair import (
    Loaded,
    check_against_target,
    check_prompt_chars,
    max_prompt_chars,
    open_pair,
    prompt_ids_for,
)
from uag.runtime.worker import Job
from uag.server.chat import render
from uag.server.costs import CostKeeper, Wanted, every
from uag.server.errors import APIError, bad
from uag.server.prompt_cache import ConversationCaches
from uag.server.protocol import Request, ServerDefaults
from uag.server.responses import Served, StepTime, report, saved_seconds
from uag.server.streaming import ReplyText

log = logging.getLogger(__name__)

RECENT = 200  # requests the Server tab keeps
FINISH = {"eos": "stop", "length": "length", "stopped": "stop"}
PROGRESS_EVERY_S = 3.0  # a start-up measurement's progress on the console, at most this often


@dataclass(frozen=True)
class Accepted:
    """The prompt passed its checks and generation starts (a stream may now send its first chunk)."""

    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """Content to send now."""

    text: str


@dataclass(frozen=True)
class Done:
    """The end of a request: the reply, why it ended, and the usage/speculative/timings report."""

    text: str  # the whole content (stop sequences cut; without the tool calls)
    finish: str  # OpenAI's finish_reason: stop, length, tool_calls
    report: dict
    tool_calls: list | None = None
    tail: str = ""  # content not yet sent as a Delta


class Service:
    """The server's state: one model store, the conversation caches, each pair's `auto` evidence, the log of
    requests, the `CostKeeper`. `stream` is the engine's (`uag.core.engine.stream`) and `measure` a pair's quick
    calibration (`uag.costs.pair.measure_costs`; a sharded server's over its ranks); tests may pass
    others with their signatures."""

    def __init__(
        self,
        store: ModelStore,
        runner: JobRunner,
        defaults: ServerDefaults,
        *,
        target: str,
        cache_bytes: float,
        stream: Callable[..., Iterator[Any]] | None = None,
        target_dtype: str | None = None,
        drafter_dtype: str | None = None,
        measure: Callable[..., Any] | None = None,
        auto: Any = None,
        lookup_memory: int = 0,
    ):
        from uag.core.engine import stream as engine_stream
        from uag.core.lookup import SharedIndexes

        self.store, self.runner, self.defaults, self.target_name = store, runner, defaults, target
        self.target_dtype, self.drafter_dtype = target_dtype, drafter_dtype  # None: as stored
        self.caches = ConversationCaches(cache_bytes)
        self.stream = stream or engine_stream
        self.measure = measure
        self.auto = auto  # AutoSettings with parts of auto switched off (`--auto-off`, an ablation); None: as shipped
        self.batched = runner.worker.max_batch > 1  # requests run together (`--max-batch`)
        self.costs = CostKeeper(runner.worker, self._measure, lambda wanted: self.holds(wanted.drafter))
        self.evidence: dict[str, Any] = {}  # per pair: the uag.core.evidence.Evidence its auto runs share
        # earlier requests' prompts and replies, per API key and target, that prompt lookup drafts from (None: off)
        self.memory = SharedIndexes(lookup_memory) if lookup_memory > 0 else None
        self.recent: deque[Served] = deque(maxlen=RECENT)
        self.saved_s = 0.0
        self._steps: dict[str, StepTime] = {}  # target -> its step time as served here (speculation off)
        self._lock = threading.Lock()
        self._starting: Job | None = None  # `preload`'s job: loading the default pair, then measuring its costs
        store.on_evict.append(lambda model: self.caches.forget(model.name))

    def starting(self) -> str | None:
        """What the server still does at start-up (loading the default pair, then measuring auto's costs where
        none are saved), or None once that is done: a request sent meanwhile is served, but waits for the models
        and stops the measurement, and auto then runs without measured costs until the server is next idle."""
        job = self._starting
        return None if job is None or job.done.is_set() else job.label

    def preload(self, progress: Callable[[str], None] | None = None) -> Job:
        """Load the default pair in the background, so that the first request finds it loaded, then measure the
        costs auto decides by where none are saved, for every drafter offered whose models are loaded now (the
        default's pair, and prompt lookup's target alone). A request queued meanwhile stops the measuring, which
        the `CostKeeper` takes up again when the worker is idle; a drafter loaded later is measured then."""

        def job(job: Job) -> Iterator[str]:
            target = self.load(job, self.defaults.drafter, progress=progress).target
            max_prompt_chars(target)  # worked out now, not in the first request
            yield target.name
            job.label = "measuring auto's costs (stops for a request)"
            self._measure_missing(job, progress)

        def drain(queued: Job) -> None:
            try:
                for _ in queued:
                    pass
            except Exception:  # said again, to the client, on the first request
                log.warning("preloading the default pair failed", exc_info=True)

        queued = self._starting = self.runner.worker.submit(job, label=f"loading {self.target_name}")
        threading.Thread(target=drain, args=(queued,), name="uag-serve-preload", daemon=True).start()
        self.costs.start()
        return queued

    # --- on the worker thread ------------------------------------------------------------------------------
    def load(self, job: Job, drafter: str | None, progress: Callable[[str], None] | None = None) -> Loaded:
        """The target and the drafter (None: the target alone) in the server's dtypes, loaded once and checked as a
        pair (uag.runtime.pair.open_pair), failures as user messages; a job cancelled meanwhile (its client left,
        its time budget ran out) stops between the two."""
        from uag.runtime.jobs import tell

        go_on = lambda: self._go_on(job, "loading the models")  # noqa: E731
        loaded = open_pair(
            self.store,
            self.target_name,
            drafter,
            target_dtype=self.target_dtype,
            drafter_dtype=self.drafter_dtype,
            progress=progress or (lambda text: tell(job, text)),
            between=go_on,
        )
        go_on()
        if self.batched:  # requests running together share the models' passes (uag.runtime.batching)
            share(loaded.target, "target")
            if loaded.choice is not None and loaded.choice.model is not None:
                share(loaded.choice.model, "drafter")
        return loaded

    def holds(self, drafter: str | None) -> bool:
        """Whether the server holds the models of the target's pair with `drafter` now (touches none of them)."""
        model = None if drafter is None else DrafterSpec.parse(drafter).model
        return self.store.has(self.target_name, self.target_dtype) and (
            model is None or self.store.has(model, self.drafter_dtype)
        )

    def loaded(self, drafter: str | None):
        """(target, `DrafterChoice` or None) when the server holds the pair's models now (`holds`); None
        otherwise. Loads nothing."""
        from uag.core.drafters import DrafterChoice

        if not self.holds(drafter):
            return None
        target = self.store.get(self.target_name, dtype=self.target_dtype)
        if drafter is None:
            return target, None
        spec = DrafterSpec.parse(drafter)
        held = None if spec.model is None else self.store.get(spec.model, dtype=self.drafter_dtype)
        return target, DrafterChoice(lookup=spec.lookup, model=held)

    def _go_on(self, job: Job, doing: str) -> None:
        """Stop a request whose client left or whose time budget ran out before it generates anything."""
        if not job.cancelled.is_set():
            return
        if job.out_of_time:
            raise APIError(
                503,
                f"this request's time budget of {self.runner.budget_s:g} s (--time-budget) ran out "
                f"while {doing}; what was loaded stays loaded: retry",
                code="timeout",
            )
        raise APIError(499, "the request was cancelled", code="cancelled")  # nobody is left to read it

    def prompt(self, loaded: Loaded, request: Request) -> list[int]:
        """The request's prompt as target ids (a conversation through the target's chat template, with its tools),
        checked as every front end checks it (uag.runtime.pair.prompt_ids_for); a prompt with more characters
        than the target's context can hold is refused before it is tokenised."""
        target = loaded.target
        chars = sum(len(m["content"]) for m in request.messages) if request.kind == "chat" else len(request.prompt)
        try:
            check_prompt_chars(target, chars)
            if request.kind == "chat":
                ids = render(target.tokenizer, request.messages, request.tools)
            else:
                ids = list(target.tokenizer.encode(request.prompt))
            if not ids:
                raise bad("messages", "the messages hold no text")
            return prompt_ids_for(loaded, ids, request.config)
        except InputError as err:
            raise APIError(400, str(err), param="messages", code="context_length_exceeded") from None

    def job(self, job: Job, request: Request, key: str | None = None) -> Iterator[Accepted | Delta | Done]:
        """The job function (`JobRunner.run(service.job, request, …)`): `Accepted`, `Delta`s, then one `Done`.
        `key`: the API key it presented (None: the server's one key, or none); prompt lookup drafts from the
        earlier requests of that key alone, and this one's prompt and reply join them when it ends."""
        from dataclasses import replace

        from uag.core.engine import PromptCaches

        job.limit(self.runner.budget_s)  # loading and reading the prompt count too
        loaded = self.load(job, request.drafter)
        target, choice = loaded.target, loaded.choice
        ids = self.prompt(loaded, request)
        self._go_on(job, "reading the prompt")
        if self.batched:
            room_for(target, len(ids) + request.config.max_tokens, self.runner.worker.batch)
        config = request.config
        auto = None
        if config.k_policy == "adaptive":  # costs missing or off are measured later, while the worker is idle
            schedule = lambda key, why: self._want(Wanted(key, request.drafter, why))  # noqa: E731
            auto = open_auto(target, choice, held=self.evidence, schedule=schedule, keep=self.auto is None)
        # Keyed by the target: the caches name the models that filled them, and the engine reuses a drafter's
        # cache only for that drafter, so a conversation keeps its target cache when speculation changes.
        pair = target.name
        caches = self.caches.take(pair, ids) or PromptCaches.empty()
        yield Accepted(len(ids))
        text = ReplyText(request.stop, request.tools)
        run, stopped, clean = None, False, False
        extra = {} if auto is None else auto.engine_kwargs()
        if self.auto is not None:
            from uag.core.engine import Seams

            extra["seams"] = Seams(auto=self.auto)
        owner = (hashlib.sha256((key or "").encode()).hexdigest(), target.name)  # never the key itself
        drafting = choice
        if self.memory is not None and choice is not None and choice.lookup:
            drafting = replace(choice, shared_index=self.memory.get(owner))
        events = self.stream(target, drafting, ids, config, cancel=job.cancelled, caches=caches, **extra)
        fed = 0  # characters of the run's text given to `text` so far
        try:
            for event in events:
                run, fed = event.run, fed + len(event.text)
                out, stopped = text.feed(event.text)
                if out:
                    yield Delta(out)
                if stopped:
                    break
            clean = True
        finally:
            events.close()  # the engine's finally leaves the caches exact, also when stopped early
            if clean:
                self.caches.put(pair, caches)
                if self.memory is not None and run is not None:
                    self.memory.add(owner, [*run.prompt_ids, *run.token_ids])
            if auto is not None:
                auto.finish()  # the pair's next process opens from its evidence; costs found off are measured again
        if run is None or run.finish_reason is None:
            raise RuntimeError("the engine's stream ended without a final record")
        if not stopped and (rest := run.text[fed:]):  # what the detokenizer held back to the end (a trailing space)
            out, stopped = text.feed(rest)
            if out:
                yield Delta(out)
        tail, calls = text.finish()
        if calls and not request.parallel_tool_calls:
            calls = calls[:1]  # tool_choice "auto" with parallel_tool_calls false (a forcing one's grammar writes one)
        finish = "stop" if stopped else FINISH[run.finish_reason]
        if job.out_of_time:
            finish = "length"
        if calls and finish != "length":  # cut short, a reply says so whatever calls came before the cut
            finish = "tool_calls"
        step = self.step_time(target, choice, run, None if auto is None else auto.evidence)
        done_report = report(
            run,
            completion_tokens=run.generated,
            cached_tokens=run.cached_tokens,
            drafter=request.drafter,
            step=step,
        )
        from uag.core.records import sharing

        if (shared := sharing()) is not None:
            done_report["speculative"]["batch"] = {"mean": round(shared.mean_size, 2), "largest": shared.largest}
        if job.out_of_time:
            done_report["speculative"]["note"] = f"stopped by the server's time budget of {self.runner.budget_s:g} s"
        elif request.check and request.drafter is not None:
            done_report["speculative"]["check"] = self.check(job, loaded, ids, config, run)
        self._record(request, run, done_report, step, choice, target)
        yield Done(text.hold.content, finish, done_report, calls, tail)  # content: the text outside the calls

    def check(self, job: Job, loaded: Loaded, ids: list[int], config, run) -> dict:
        """The request's `"check": true` (uag.runtime.pair.check_against_target, as `uag generate --compare`): the
        target alone on the same prompt for as many tokens as the reply, and the verdict on the two greedy
        outputs; a reply cut by a stop string is compared on the tokens it generated, as a length cut."""
        from dataclasses import replace

        if run.finish_reason == "stopped":
            run = replace(run, finish_reason="length")
        return check_against_target(loaded, ids, config, run, cancel=job.cancelled, stream=self.stream).to_dict()

    def step_time(self, target, choice, run, evidence=None) -> StepTime | None:
        """The target's plain step time on this machine: its calibration, else this server's own runs of it
        alone (which also keep that figure current), else what auto's runs of the pair timed of one-token target
        passes (`evidence`: before the pair's costs are measured)."""
        from uag.costs.pair import read_calibration, saved_profile
        from uag.costs.profiles import target_key

        if run.strategy == "baseline" and run.tokens_per_second:
            with self._lock:
                self._steps[target.name] = StepTime(1000 / run.tokens_per_second, "served with speculation off")
        calibration = read_calibration(target_key(target))
        profile = None if calibration is None else calibration.profile
        if profile is None and choice is not None and choice.model is not None:
            profile = saved_profile(target, choice)
        if profile is not None and 1 in profile.target_ms:
            return StepTime(profile.target_ms[1], "calibration")
        if target.name in self._steps:
            return self._steps[target.name]
        timed = None if evidence is None else evidence.verify_ms.get(1)
        return None if not timed else StepTime(timed, "auto's own target passes")

    # --- what auto decides by: measured off the requests' path ---------------------------------------------
    def _want(self, wanted: Wanted) -> None:
        from uag.costs.profiles import pair_name

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

    def _measure_missing(self, job: Job, progress: Callable[[str], None] | None) -> None:
        """At start-up: measure every offered pair whose models are loaded and that has no costs saved, or a
        verify curve short of what its lookup copies (`why_short`; model drafters first: a pair's measurement also
        gives prompt lookup its target-only costs)."""
        from uag.costs.pair import evidence_key, read_calibration, why_short

        offered = sorted(self.defaults.allowed, key=lambda text: DrafterSpec.parse(text).model is None)
        stopped = False
        for drafter in offered:
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
                self._want(wanted)
            else:
                self.costs.measured(key)

    def _measure(self, job: Job, wanted: Wanted, cancel: Callable[[], bool], progress=None) -> bool:
        """Measure the pair `wanted` names (`CostKeeper`'s `measure`): True once done with it (measured and saved,
        or kept because the saved costs were measured quieter, or not measured because the machine is busy now
        and they were), False when its models are not loaded or a request stopped the measurement."""
        from uag.costs.calibrate import MeasurementStopped
        from uag.costs.pair import evidence_key, keep_measured, measure_costs, read_calibration
        from uag.costs.profiles import machine_load, pair_name, replaces

        pair = self.loaded(wanted.drafter)
        if pair is None:
            return False
        target, choice = pair
        if evidence_key(target, choice) != wanted.key:  # the models loaded now are not those it was asked for
            return True
        name, saved, now = pair_name(wanted.key), read_calibration(wanted.key), machine_load()
        if saved is not None and not replaces(now, saved):
            log.info(
                "not measuring auto's costs for %s now: the machine is busy (%s) and the saved ones were "
                "measured at %s; tried again after %g min",
                name,
                now,
                saved.load,
                self.costs.interval_s / 60,
            )
        else:
            log.info(
                "measuring auto's costs for %s (%s)%s",
                name,
                wanted.reason,
                "; a request stops it" if progress is None else "",
            )

            def said(text: str) -> None:
                job.progress = text
                if tell is not None:
                    tell(f"{name}: {text}")

            tell = None if progress is None else every(progress, PROGRESS_EVERY_S)
            tic = time.monotonic()
            try:
                calibration = (self.measure or measure_costs)(target, choice, progress=said, cancel=cancel)
            except MeasurementStopped:
                log.info(
                    "stopped measuring auto's costs for %s: a request came in (measured when the server is idle again)",
                    name,
                )
                return False
            kept, line = keep_measured(calibration, target)
            (log.info if kept else log.warning)("%s (in %.0f s)", line, time.monotonic() - tic)
        return True

    def _record(self, request: Request, run, done_report: dict, step: StepTime | None, choice, target) -> None:
        speedup = done_report["speculative"]["estimated_speedup"]
        saved = 0.0 if request.drafter is None else saved_seconds(run, step)
        r = None
        if choice is not None:
            r = 0.0 if choice.model is None else choice.model.weight_bytes / target.weight_bytes
        epoch = time.time() - time.perf_counter()  # the run's timestamps are perf_counter's
        finished = (run.last_token_s or time.perf_counter()) + epoch
        started = finished if run.first_token_s is None else run.first_token_s - run.prompt_ms / 1000 + epoch
        served = Served(
            time=datetime.now().strftime("%H:%M:%S"),
            model=request.model,
            drafter=request.drafter,
            strategy=done_report["speculative"]["strategy"],
            k=request.config.k if request.drafter else 0,
            prompt_tokens=len(run.prompt_ids),
            cached_tokens=done_report["usage"]["prompt_tokens_details"]["cached_tokens"],
            completion_tokens=run.generated,
            tokens_per_second=run.tokens_per_second,
            alpha=run.acceptance_rate,
            sources=run.sources() if request.drafter else {},
            speedup=speedup,
            saved_s=saved,
            r=r,
            check=(done_report["speculative"].get("check") or {}).get("kind"),
            batch=(done_report["speculative"].get("batch") or {}).get("mean"),
            started=started,
            finished=finished,
        )
        with self._lock:
            self.recent.append(served)
            self.saved_s += saved

    def snapshot(self) -> tuple[list[Served], float]:
        """The recent requests (oldest first) and the seconds saved so far (estimated)."""
        with self._lock:
            return list(self.recent), self.saved_s
