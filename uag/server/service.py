"""The OpenAI-side adapter over the `Host` (uag.runtime.host): what a request runs on the MLX worker — render and
check the prompt, run the pair on the host with the conversation's caches, cut stop strings, take tool calls, and
hand back text deltas and one final report (finish reason, usage, speculative, timings). Also what the Server tab
shows: the recent requests and the time speculation saved.

The HTTP layer (uag.server.routes) never touches a model: it queues `Service.job` through the host's `JobRunner`,
which the app at /ui shares, so API requests and the app's comparisons run on one worker, in turn. The host holds
the pairs, auto's evidence, the shared lookup index and the cost keeper: no request measures costs.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from uag.core.engine import PromptCaches
from uag.costs.pair import read_calibration, saved_profile
from uag.costs.profiles import target_key
from uag.errors import InputError
from uag.runtime.host import Host
from uag.runtime.jobs import JobRunner, tell, watched
from uag.runtime.keeper import CostKeeper
from uag.runtime.pair import Loaded, PromptIds, check_prompt_chars, checked_prompt, max_prompt_chars
from uag.runtime.worker import Job
from uag.server import fim
from uag.server.chat import render
from uag.server.dialects import Accepted, Delta, Done
from uag.server.errors import APIError, bad
from uag.server.prompt_cache import ConversationCaches
from uag.server.protocol import ModelRouter, Request, ServerDefaults
from uag.server.responses import Served, StepTime, report, saved_seconds
from uag.server.streaming import ReplyText

log = logging.getLogger(__name__)

RECENT = 200  # requests the Server tab keeps
FINISH = {"eos": "stop", "length": "length", "stopped": "stop"}


class Service:
    """The OpenAI-side adapter over a `Host` (the pairs, auto's evidence, the shared lookup index, the cost keeper:
    uag.runtime.host): the server's defaults, the conversation caches, the log of requests the Server tab shows,
    and the step times served here. `others`: the models served beside `host`'s (`uag serve --serve`), each its
    defaults and its own host on the same store and runner; a request's `model` picks (`router`), and each pair
    keeps its evidence, costs and caches."""

    def __init__(
        self,
        host: Host,
        defaults: ServerDefaults,
        *,
        cache_bytes: float,
        metrics: Any = None,
        disk: Any = None,
        others: Sequence[tuple[ServerDefaults, Host]] = (),
    ):
        self.host, self.defaults = host, defaults  # the default model's (the app at /ui, preloading)
        self.router = ModelRouter((defaults, *(served for served, _ in others)))
        self.hosts = {defaults.model: host, **{served.model: other for served, other in others}}
        assert all(other.store is host.store and other.runner is host.runner for other in self.hosts.values())
        self.caches = ConversationCaches(cache_bytes)
        self.disk = disk  # uag.server.disk_cache.DiskCaches (--cache-dir): caches that survive a restart; None: off
        self.metrics = metrics  # uag.server.metrics.Metrics that GET /metrics reads (None: no metrics)
        self.recent: deque[Served] = deque(maxlen=RECENT)
        self.saved_s = 0.0
        self._steps: dict[str, StepTime] = {}  # target -> its step time as served here (speculation off)
        self._lock = threading.Lock()
        host.store.on_evict.append(lambda model: self.caches.forget(model.name))

    @property
    def runner(self) -> JobRunner:
        return self.host.runner

    @property
    def batched(self) -> bool:
        """Whether requests run together (`--max-batch`): the routes submit them as shared jobs."""
        return self.host.batched

    @property
    def costs(self) -> CostKeeper:
        return self.host.costs

    @property
    def keepers(self) -> dict[str, CostKeeper]:
        """Each served model's cost keeper, by its name (what GET /metrics reports per model)."""
        return {name: host.costs for name, host in self.hosts.items()}

    @property
    def store(self):
        return self.host.store

    def host_for(self, model: str) -> Host:
        """The host of the served model a request's `model` names (the default one for an id none answers to)."""
        found = self.router.find(model)
        return self.host if found is None else self.hosts[found.model]

    @property
    def target_name(self) -> str:
        return self.host.target_name

    def starting(self) -> str | None:
        """What the server still does at start-up (loading the default pair, then measuring auto's costs where
        none are saved), or None once that is done: a request sent meanwhile is served, but waits for the models
        and stops the measurement, and auto then runs without measured costs until the server is next idle."""
        return self.host.starting()

    def preload(self, progress: Callable[[str], None] | None = None) -> Job:
        """Load the default pair in the background, so that the first request finds it loaded, then measure the
        costs auto decides by where none are saved, for every drafter offered whose models are loaded now (the
        default's pair, and prompt lookup's target alone): `Host.start`."""
        then = lambda loaded: max_prompt_chars(loaded.target)  # noqa: E731  worked out now, not in the first request
        return self.host.start(self.defaults.drafter, self.defaults.allowed, progress=progress, then=then)

    # --- on the worker thread ------------------------------------------------------------------------------
    def load(
        self,
        job: Job,
        drafter: str | None,
        progress: Callable[[str], None] | None = None,
        *,
        host: Host | None = None,
    ) -> Loaded:
        """The target and the drafter (None: the target alone) in the server's dtypes, opened on the host (loaded
        once, checked as a pair, shared for batching), failures as user messages; a job cancelled meanwhile (its
        client left, its time budget ran out) stops between the two. `host`: the served model's (default: the
        default model's)."""
        go_on = lambda: self._go_on(job, "loading the models")  # noqa: E731
        host = host or self.host
        loaded = host.open_target(drafter, progress=progress or (lambda text: tell(job, text)), between=go_on)
        go_on()
        return loaded

    def _go_on(self, job: Job, doing: str) -> None:
        """Stop a request whose client left or whose time budget ran out before it generates anything."""
        if not job.cancelled.is_set():
            return
        if job.out_of_time:
            raise APIError(
                503,
                f"this request was {self.runner.reason(job)} while {doing}; what was loaded stays loaded: retry",
                code="timeout",
            )
        raise APIError(499, "the request was cancelled", code="cancelled")  # nobody is left to read it

    def prompt(self, loaded: Loaded, request: Request) -> PromptIds:
        """The request's prompt as target ids (a conversation through the target's chat template, with its tools),
        checked as every front end checks it (uag.runtime.pair.checked_prompt: with the translator the drafter's
        check started on them); a prompt with more characters than the target's context can hold is refused before
        it is tokenised."""
        target = loaded.target
        chars = sum(len(m["content"]) for m in request.messages) if request.kind == "chat" else len(request.prompt)
        try:
            check_prompt_chars(target, request.fill.chars if request.fill else chars)
            if request.kind == "chat":
                ids = render(target.tokenizer, request.messages, request.tools)
            elif request.fill is not None:  # the target's FIM tokens around the user's text, read as text
                ids = fim.prompt_ids(target.tokenizer, request.fill)
            else:
                ids = list(target.tokenizer.encode(request.prompt))
            if not ids:
                raise bad("messages", "the messages hold no text")
            return checked_prompt(loaded, ids, request.config)
        except InputError as err:
            raise APIError(400, str(err), param="messages", code="context_length_exceeded") from None

    def job(self, job: Job, request: Request, key: str | None = None) -> Iterator[Accepted | Delta | Done]:
        """The job function (`JobRunner.run(service.job, request, …)`): `Accepted`, `Delta`s, then one `Done`.
        `key`: the API key it presented (None: the server's one key, or none); prompt lookup drafts from the
        earlier requests of that key alone, and this one's prompt and reply join them when it ends."""
        self.runner.limit(job)  # its time budget (--time-budget; none by default) and stall guard: loading counts too
        host = self.host_for(request.model)
        loaded = self.load(job, request.drafter, host=host)
        # A running request's models stay loaded whatever the store's budget: a request for another model batched
        # beside it, loading its own, unloads the least recently used of the others.
        with self.store.pinned(loaded.target, None if loaded.choice is None else loaded.choice.model):
            yield from self._reply(job, host, loaded, request, key)

    def _reply(
        self, job: Job, host: Host, loaded: Loaded, request: Request, key: str | None
    ) -> Iterator[Accepted | Delta | Done]:
        """`job` once the served model's pair is loaded (and pinned)."""
        target, choice = loaded.target, loaded.choice
        ids, translator = self.prompt(loaded, request)
        self._go_on(job, "reading the prompt")
        host.admit(target, len(ids) + request.config.max_tokens)
        config = request.config
        auto = None
        if config.k_policy == "adaptive":  # under `uag serve`, costs missing or off are measured while idle
            auto = host.open_auto(loaded, request.drafter)
        # Keyed by the API key's digest and the target: the caches name the models that filled them, and the engine
        # reuses a drafter's cache only for that drafter, so a conversation keeps its target cache when speculation
        # changes; another key's conversation is never reused, however alike.
        owner = hashlib.sha256((key or "").encode()).hexdigest()
        pair = (owner, target.name)
        drafter_model = None if choice is None else choice.model
        caches = self.caches.take(pair, ids)
        if caches is None and self.disk is not None:
            caches = self.disk.take(owner, target, drafter_model, ids)
        caches = caches or PromptCaches.empty()
        yield Accepted(len(ids))
        text = ReplyText(request.stop, request.tools)
        run, stopped = None, False
        fed = 0  # characters of the run's text given to `text` so far
        writes_json = bool(request.tools) or config.constraint is not None  # lookup also copies the prompt as JSON
        with host.running(
            job,
            loaded,
            ids,
            config,
            auto=auto,
            key=key,
            remember=True,
            caches=caches,
            copy_forms=writes_json,
            translator=translator,
        ) as running:
            events = watched(job, iter(running))
            try:
                for event in events:
                    run, fed = event.run, fed + len(event.text)
                    out, stopped = text.feed(event.text)
                    if out:
                        yield Delta(out)
                    if stopped:
                        break
            finally:
                events.close()
        held = None if self.disk is None else self.disk.hold(owner, target, drafter_model, caches)
        self.caches.put(pair, caches)  # the run ended without an error: its caches are exact for the next turn
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
        if (shared := running.sharing) is not None:
            done_report["speculative"]["batch"] = {"mean": round(shared.mean_size, 2), "largest": shared.largest}
            if auto is not None and shared.largest > 1 and auto.evidence.realised:  # what batched cycles realised
                realised = {kind or "plain": float(f"{r:.2g}") for kind, r in auto.evidence.realised.items()}
                done_report["speculative"]["batch"]["realised"] = realised
        if job.out_of_time:  # finish_reason "length", and why, where a client reads it
            note = self.runner.reason(job)
            done_report["speculative"]["note"] = note
            done_report["uag"] = {"stopped_by": job.cut, "message": f"the reply was {note}"}
            log.warning("a request was %s after %d tokens", note, run.generated)
        elif request.check and request.drafter is not None:
            done_report["speculative"]["check"] = self.check(job, loaded, ids, config, run, host=host)
        self._record(request, run, done_report, step, choice, target)
        if self.metrics is not None:  # every count GET /metrics serves, from the report the client gets
            self.metrics.finished(
                self.host_model(host), run, done_report, finish, queued_at=job.queued_at, key=getattr(key, "name", None)
            )
        # content: the text outside the calls
        yield Done(text.hold.content, finish, done_report, calls, tail, stop_sequence=text.stop.matched)
        if held is not None:  # the reply has gone out: its caches are written when no other request waits
            self.disk.later(held)
        if self.disk is not None and self.disk.pending and self.runner.worker.alone:
            self.disk.flush()

    def host_model(self, host: Host) -> str:
        """The served name of `host`'s model."""
        return next(name for name, held in self.hosts.items() if held is host)

    def check(self, job: Job, loaded: Loaded, ids: list[int], config, run, *, host: Host | None = None) -> dict:
        """The request's `"check": true` (uag.runtime.pair.check_against_target, as `uag generate --compare`): the
        target alone on the same prompt for as many tokens as the reply, and the verdict on the two greedy
        outputs; a reply cut by a stop string is compared on the tokens it generated, as a length cut."""
        if run.finish_reason == "stopped":
            run = replace(run, finish_reason="length")
        return (host or self.host).check(loaded, ids, config, run, cancel=job.cancelled).to_dict()

    def step_time(self, target, choice, run, evidence=None) -> StepTime | None:
        """The target's plain step time on this machine: its calibration, else this server's own runs of it
        alone (which also keep that figure current), else what auto's runs of the pair timed of one-token target
        passes (`evidence`: before the pair's costs are measured)."""
        if run.translation == "baseline" and run.tokens_per_second:
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
