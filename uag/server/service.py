"""What a request runs on the MLX worker: load the pair, render and check the prompt, run the engine's stream with
the conversation's caches and the pair's evidence, and hand back text deltas and one final report. Also what
the Server tab shows: the recent requests and the time speculation saved.

The HTTP layer (uag.server.app) never touches a model: it queues `Service.job` through the `JobRunner` that the
app's Session shares, so API requests and the app's comparisons run on one worker, in turn.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from uag.core.config import DrafterSpec
from uag.core.prompt_input import check_context
from uag.errors import InputError
from uag.models.store import ModelStore
from uag.runtime.jobs import JobRunner
from uag.runtime.prompt_cache import ConversationCaches
from uag.runtime.worker import Job
from uag.server.chat import render
from uag.server.protocol import APIError, Request, ServerDefaults, bad
from uag.server.responses import StepTime, report
from uag.server.streaming import ReplyText

log = logging.getLogger(__name__)

RECENT = 200  # requests the Server tab keeps
FINISH = {"eos": "stop", "length": "length", "stopped": "stop"}


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


@dataclass(frozen=True)
class Served:
    """One finished request, as the Server tab lists it."""

    time: str
    model: str
    drafter: str | None
    strategy: str
    k: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    tokens_per_second: float | None
    alpha: float | None
    sources: dict
    speedup: float | None  # estimated, against the target alone
    saved_s: float  # estimated seconds saved (negative: lost)
    r: float | None  # the drafter's drafter/target bytes (0 for prompt lookup; a hybrid's: its model's)
    check: str | None = None  # with "check": identical, diverged_near_tie, diverged (uag.study.divergence)

    @property
    def drafted(self) -> bool:
        """Whether any cycle drafted; one that never did (auto parked throughout) ran as the target alone."""
        return any(n for source, n in self.sources.items() if source != "plain")

    @property
    def drafting_r(self) -> float | None:
        """r for what actually drafted: the drafter's r weighted by the share of drafting cycles its model
        drafted, since prompt lookup drafts for free (None when nothing drafted).

        Example: a hybrid with r = 0.5, sources {"lookup": 9, "model": 3, "plain": 30} -> 0.5 · 3/12 = 0.125;
                 the same hybrid with sources {"lookup": 12, "plain": 30} -> 0.0
        """
        drafting = sum(n for source, n in self.sources.items() if source != "plain")
        if self.r is None or not drafting:
            return None
        return self.r * self.sources.get("model", 0) / drafting


def saved_seconds(run: Any, step: StepTime | None) -> float:
    """The seconds speculation saved on a run against the target alone (negative: lost), estimated: the
    target's step time × the tokens after the prompt pass − the run's generation time. A run that never drafted
    (auto parked throughout) ran as the target alone, so that estimate would be only the step time's error:
    what it paid for speculation is its drafter's rehearsals, measured.

    Example: 41 tokens after the prompt pass in 2.0 s, step 100 ms -> 4.1 − 2.0 = 2.1;
             never drafted, one 30 ms rehearsal -> −0.03
    """
    if not any(c.source for c in run.cycles):
        return -sum(c.draft_ms for c in run.cycles) / 1000
    after = run.generated - run.opening
    if step is None or not run.generation_s or after <= 0:  # as `estimated_speedup`: nothing to estimate
        return 0.0
    return after * step.ms / 1000 - run.generation_s


class Service:
    """The server's state: one model store, the conversation caches, each pair's `auto` evidence, the log of
    requests. `stream` is the engine's (`uag.api.stream`); tests may pass another with its signature."""

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
    ):
        import uag.api

        self.store, self.runner, self.defaults, self.target_name = store, runner, defaults, target
        self.target_dtype, self.drafter_dtype = target_dtype, drafter_dtype  # None: as stored
        self.caches = ConversationCaches(cache_bytes)
        self.stream = stream or uag.api.stream
        self.evidence: dict[str, Any] = {}  # per pair: the uag.core.evidence.Evidence its auto runs share
        self.recent: deque[Served] = deque(maxlen=RECENT)
        self.saved_s = 0.0
        self._steps: dict[str, StepTime] = {}  # target -> its step time as served here (speculation off)
        self._lock = threading.Lock()
        store.on_evict.append(lambda model: self.caches.forget(model.name))

    def preload(self) -> Job:
        """Load the default pair in the background, so that the first request finds it loaded."""

        def job(job: Job) -> Iterator[str]:
            target, _ = self.load(job, self.defaults.drafter)
            yield target.name

        def drain(queued: Job) -> None:
            try:
                for _ in queued:
                    pass
            except Exception:  # said again, to the client, on the first request
                log.warning("preloading the default pair failed", exc_info=True)

        queued = self.runner.worker.submit(job, label=f"loading {self.target_name}")
        threading.Thread(target=drain, args=(queued,), name="uag-serve-preload", daemon=True).start()
        return queued

    # --- on the worker thread ------------------------------------------------------------------------------
    def load(self, job: Job, drafter: str | None):
        """The target and the drafter (a `DrafterChoice`, or None) in the server's dtypes, loaded once (memory
        checked first), failures as user messages."""
        from uag.core.loading import check_memory, load_drafter_choice, load_model

        spec = None if drafter is None else DrafterSpec.parse(drafter)
        check_memory(self.store, [("target", self.target_name, self.target_dtype),
                                  ("drafter", spec and spec.model, self.drafter_dtype)])  # fmt: skip
        target = load_model(self.store, self.target_name, role="target", dtype=self.target_dtype)
        choice = None
        if spec is not None:
            choice = load_drafter_choice(self.store, spec, dtype=self.drafter_dtype)
            target = load_model(self.store, self.target_name, role="target", dtype=self.target_dtype,
                                keep=[spec.model or self.target_name])  # fmt: skip
        return target, choice

    def prompt(self, target, choice, request: Request) -> list[int]:
        """The request's prompt as target ids, checked against the target's and the drafter's context."""
        from uag.core.loading import check_drafter_fits

        if request.kind == "chat":
            ids = render(target.tokenizer, request.messages, request.tools)
        else:
            ids = list(target.tokenizer.encode(request.prompt))
        if not ids:
            raise bad("messages", "the messages hold no text")
        try:
            check_context(len(ids), target.context_length, "target", target.name)
            check_drafter_fits(target, choice, ids, request.config)
        except InputError as err:
            raise APIError(400, str(err), param="messages", code="context_length_exceeded") from None
        return ids

    def job(self, job: Job, request: Request) -> Iterator[Accepted | Delta | Done]:
        """The job function (`JobRunner.run(service.job, request, …)`): `Accepted`, `Delta`s, then one `Done`."""
        from uag.core.engine import PromptCaches
        from uag.study.pair_costs import open_auto

        target, choice = self.load(job, request.drafter)
        ids = self.prompt(target, choice, request)
        config = request.config
        extra: dict[str, Any] = {}
        close = None
        if config.strategy == "auto":  # a first-use calibration happens here, outside the time budget
            close = open_auto(target, choice, extra, held=self.evidence)
        job.limit(self.runner.budget_s)
        # Keyed by the target: the caches name the models that filled them, and the engine reuses a drafter's
        # cache only for that drafter, so a conversation keeps its target cache when speculation changes.
        pair = target.name
        caches = self.caches.take(pair, ids) or PromptCaches.empty()
        yield Accepted(len(ids))
        text = ReplyText(request.stop, request.tools)
        run, stopped, clean = None, False, False
        events = self.stream(target, choice, ids, config, cancel=job.cancelled, caches=caches, **extra)
        try:
            for event in events:
                run = event.run
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
            if close is not None:
                close()  # the pair's next process opens from its evidence; a stale profile is measured again
        if run is None or run.finish_reason is None:
            raise RuntimeError("the engine's stream ended without a final record")
        tail, calls = text.finish()
        finish = "tool_calls" if calls else "stop" if stopped else FINISH[run.finish_reason]
        if job.out_of_time:
            finish = "length"
        step = self.step_time(target, choice, run)
        done_report = report(
            run,
            completion_tokens=run.generated,
            cached_tokens=run.cached_tokens,
            drafter=request.drafter,
            step=step,
        )
        if job.out_of_time:
            done_report["speculative"]["note"] = f"stopped by the server's time budget of {self.runner.budget_s:g} s"
        elif request.check and request.drafter is not None:
            done_report["speculative"]["check"] = self.check(job, target, ids, config, run)
        self._record(request, run, done_report, step, choice, target)
        content = text.text if calls is None else (text.text[: text.text.find("<tool_call>")].strip() or None)
        yield Done(content or ("" if calls is None else None), finish, done_report, calls, tail)

    def check(self, job: Job, target, ids: list[int], config, run) -> dict:
        """The request's `"check": true`: the target alone on the same prompt, as many tokens as the reply
        (read cold, as `uag generate --strategy baseline` would), and the verdict on the two greedy outputs:
        identical, a near-tie where the dtype's rounding may pick either token, or a mismatch (a bug)."""
        from dataclasses import replace

        from uag.core.engine import PromptCaches
        from uag.study.margins import compare_runs

        if run.generated == 0:
            return {"kind": None, "message": "not compared: the reply has no tokens"}
        plain = replace(config, strategy="baseline", max_tokens=run.generated)
        baseline = None
        for event in self.stream(target, None, ids, plain, cancel=job.cancelled, caches=PromptCaches.empty()):
            baseline = event.run
        if baseline is None or baseline.finish_reason == "stopped":
            return {"kind": None, "message": "not compared: the target alone's run was stopped"}
        if run.finish_reason == "stopped":  # cut by a stop string: compare the tokens it generated, as a length cut
            run = replace(run, finish_reason="length")
        verdict = compare_runs(target, baseline, run)
        if verdict is None:
            return {"kind": None, "message": "not compared: the runs cannot be compared token for token"}
        tps = baseline.tokens_per_second
        measured = run.tokens_per_second / tps if tps and run.tokens_per_second else None
        return {**verdict.to_dict(), "baseline_tokens_per_second": tps, "measured_speedup": measured}

    def step_time(self, target, choice, run) -> StepTime | None:
        """The target's plain step time on this machine: its calibration, else this server's own runs of it
        alone (which also keep that figure current)."""
        from uag.study.profiles import find_profile, target_key

        if run.strategy == "baseline" and run.tokens_per_second:
            with self._lock:
                self._steps[target.name] = StepTime(1000 / run.tokens_per_second, "served with speculation off")
        profile = find_profile(target_key(target))
        if profile is None and choice is not None and choice.model is not None:
            from uag.api import saved_profile

            profile = saved_profile(target, choice)
        if profile is not None:
            return StepTime(profile.target_ms[1], "calibration")
        return self._steps.get(target.name)

    def _record(self, request: Request, run, done_report: dict, step: StepTime | None, choice, target) -> None:
        speedup = done_report["speculative"]["estimated_speedup"]
        saved = 0.0 if request.drafter is None else saved_seconds(run, step)
        r = None
        if choice is not None:
            r = 0.0 if choice.model is None else choice.model.weight_bytes / target.weight_bytes
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
        )
        with self._lock:
            self.recent.append(served)
            self.saved_s += saved

    def snapshot(self) -> tuple[list[Served], float]:
        """The recent requests (oldest first) and the seconds saved so far (estimated)."""
        with self._lock:
            return list(self.recent), self.saved_s
