"""`GET /metrics`: what the server has done, in Prometheus' text format (prometheus_client), named as vLLM names
its metrics with a `uag:` prefix (docs/server.md#metrics maps them to vLLM's and llama.cpp's). Every count comes
from one place, a finished request's run and report (`Metrics.finished`), so a scrape adds up exactly to the
responses' `usage` and `speculative` blocks; queue, running requests, batch and auto's costs are read at scrape.

    metrics = Metrics("demo-target")
    metrics.finished("demo-target", run, report, "stop", queued_at=t0)  # on the worker, once per reply
    metrics.exposition()  # -> b"# HELP uag:prompt_tokens_total …"
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no `*_created` series: they double a scrape and no dashboard reads them (as vLLM's)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes (prometheus_client serves it so too)
# Seconds, from a GPU's milliseconds to a busy CPU's minutes (vLLM's buckets, with more below 10 ms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960)
BATCH_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32)
SHARED_INDEX = "shared_index"  # the source label of a lookup draft from earlier requests' text
# Paths the request counter names itself; the generating routes are named by their dialect (`name_routes`).
FIXED_ROUTES = {"/health": "health", "/metrics": "metrics", "/v1/models": "models", "/": "ui"}
PREFIXES = {"/v1/models/": "models", "/ui": "ui"}


def per_position(cycles: Iterable[Any]) -> tuple[list[int], list[int]]:
    """(drafted, accepted) per draft position: a cycle that proposed n tokens counts positions 0..n-1 drafted, one
    that kept m of them positions 0..m-1 accepted; so each list sums to the run's drafted (accepted) tokens.

    Example: proposals of 3, 2 and 1 keeping 2, 0 and 1 -> ([3, 2, 1], [2, 1, 0])
    """
    drafted: list[int] = []
    accepted: list[int] = []
    for cycle in cycles:
        n, kept = len(cycle.proposed_ids), cycle.accepted
        drafted += [0] * (n - len(drafted))
        accepted += [0] * (n - len(accepted))
        for i in range(n):
            drafted[i] += 1
            accepted[i] += i < kept
    return drafted, accepted


def source_of(cycle: Any) -> str:
    """What drafted a cycle, as the `source` label says it: model, lookup, shared_index (lookup from earlier
    requests' text, uag.core.lookup.SharedIndex) or grammar (tokens a constraint forces).

    Example: a lookup cycle with shared_index -> "shared_index";  a plain step -> "plain"
    """
    if cycle.source == "lookup" and cycle.shared_index:
        return SHARED_INDEX
    return cycle.source or "plain"


def per_source(cycles: Iterable[Any]) -> dict[str, tuple[int, int, int]]:
    """(drafts, drafted tokens, accepted tokens) per source, over the cycles that drafted (k > 0): the drafts sum to
    the report's `speculative.cycles`, and lookup with shared_index to its `sources["lookup"]`.

    Example: a model draft of 4 keeping 3 and a lookup draft of 8 keeping 8 -> {"model": (1, 4, 3), "lookup": (1, 8, 8)}
    """
    out: dict[str, tuple[int, int, int]] = {}
    for cycle in cycles:
        if cycle.k > 0:
            drafts, drafted, accepted = out.get(source_of(cycle), (0, 0, 0))
            out[source_of(cycle)] = (drafts + 1, drafted + len(cycle.proposed_ids), accepted + cycle.accepted)
    return out


class Metrics:
    """The server's metrics in their own `CollectorRegistry` (two servers in one process keep theirs apart). Counts
    are fed by `finished` (each reply) and `answered` (each HTTP response); `began`/`ended` bracket a request's time
    on the worker; `watch` names what the gauges read at scrape time. `model_names`: the served models (`uag serve
    --serve`), each a `model_name` label; the first labels what the server does as a whole (requests running,
    waiting, the batch)."""

    def __init__(self, *model_names: str):
        self.model_name, self.model_names = model_names[0], model_names
        self.registry = r = CollectorRegistry()
        model, position, source = ["model_name"], ["model_name", "position"], ["model_name", "source"]
        self.requests = Counter(
            "uag:http_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.success = Counter(
            "uag:request_success", "Replies finished, by finish reason", ["model_name", "finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("uag:prompt_tokens", "Prompt tokens (usage.prompt_tokens)", model, registry=r)
        self.cached_tokens = Counter(
            "uag:prompt_tokens_cached", "Prompt tokens read from a cache (usage's cached_tokens)", model, registry=r
        )
        self.generation_tokens = Counter(
            "uag:generation_tokens", "Generated tokens (usage.completion_tokens)", model, registry=r
        )
        self.drafts = Counter("uag:spec_decode_num_drafts", "Drafts verified (speculative.cycles)", model, registry=r)
        self.draft_tokens = Counter(
            "uag:spec_decode_num_draft_tokens", "Draft tokens verified (speculative.drafted_tokens)", model, registry=r
        )
        self.accepted_tokens = Counter(
            "uag:spec_decode_num_accepted_tokens",
            "Draft tokens accepted (speculative.accepted_tokens)",
            model,
            registry=r,
        )
        self.accepted_per_pos = Counter(
            "uag:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each position",
            position,
            registry=r,
        )
        self.drafted_per_pos = Counter(
            "uag:spec_decode_num_draft_tokens_per_pos", "Draft tokens verified at each position", position, registry=r
        )
        self.source_drafts = Counter(
            "uag:spec_decode_num_drafts_by_source", "Drafts verified, by what drafted them", source, registry=r
        )
        self.source_draft_tokens = Counter(
            "uag:spec_decode_num_draft_tokens_by_source", "Draft tokens verified, by source", source, registry=r
        )
        self.source_accepted_tokens = Counter(
            "uag:spec_decode_num_accepted_tokens_by_source", "Draft tokens accepted, by source", source, registry=r
        )
        self.ttft = Histogram(
            "uag:time_to_first_token_seconds",
            "From the request's queueing on the worker to its first token",
            model,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "uag:time_per_output_token_seconds",
            "A reply's generation time per token after the prompt pass's",
            model,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "uag:e2e_request_latency_seconds",
            "From the request's queueing on the worker to its finished reply",
            model,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.batch = Histogram(
            "uag:request_batch_size",
            "The mean batch a reply's target passes ran in (speculative.batch.mean; a batching server)",
            model,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        # Per API key, by its name (never the key; only with keys): a label as bounded as the key file.
        self.key_requests = Counter(
            "uag:key_request_success",
            "Replies finished, per API key and finish reason",
            ["key", "finished_reason"],
            registry=r,
        )
        self.key_prompt_tokens = Counter("uag:key_prompt_tokens", "Prompt tokens per API key", ["key"], registry=r)
        self.key_cached_tokens = Counter(
            "uag:key_prompt_tokens_cached", "Prompt tokens read from a cache, per API key", ["key"], registry=r
        )
        self.key_generation_tokens = Counter(
            "uag:key_generation_tokens", "Generated tokens per API key", ["key"], registry=r
        )
        for model_name in model_names:  # present, at 0, from the start: a rate() has a first sample
            for metric in (self.prompt_tokens, self.cached_tokens, self.generation_tokens, self.drafts):
                metric.labels(model_name)
            for metric in (self.draft_tokens, self.accepted_tokens, self.ttft, self.tpot, self.e2e):
                metric.labels(model_name)
        self._routes: dict[str, str] = {}
        self._running = 0
        self._lock = threading.Lock()
        self._now = Now(self)
        r.register(self._now)

    # --- fed by the server ---------------------------------------------------------------------------------------
    def finished(
        self, model: str, run: Any, report: dict, finish: str, *, queued_at: float | None = None, key: str | None = None
    ) -> None:
        """One finished reply: its `report` (uag.server.responses.report) as the client got it and the `run` it came
        from (per position and source), `finish` its finish_reason; `queued_at` (perf_counter) when its job was
        queued, where the time to first token and the latency count from; `key` the name of its API key (None: a
        server without keys)."""
        usage, spec = report["usage"], report["speculative"]
        if key is not None:
            self.key_requests.labels(key, finish).inc()
            self.key_prompt_tokens.labels(key).inc(usage["prompt_tokens"])
            self.key_cached_tokens.labels(key).inc(usage["prompt_tokens_details"]["cached_tokens"])
            self.key_generation_tokens.labels(key).inc(usage["completion_tokens"])
        self.success.labels(model, finish).inc()
        self.prompt_tokens.labels(model).inc(usage["prompt_tokens"])
        self.cached_tokens.labels(model).inc(usage["prompt_tokens_details"]["cached_tokens"])
        self.generation_tokens.labels(model).inc(usage["completion_tokens"])
        self.drafts.labels(model).inc(spec["cycles"])
        self.draft_tokens.labels(model).inc(spec["drafted_tokens"])
        self.accepted_tokens.labels(model).inc(spec["accepted_tokens"])
        drafted, accepted = per_position(run.cycles)
        for i, (n, kept) in enumerate(zip(drafted, accepted)):
            self.drafted_per_pos.labels(model, str(i)).inc(n)
            self.accepted_per_pos.labels(model, str(i)).inc(kept)
        for source, (drafts, n, kept) in per_source(run.cycles).items():
            self.source_drafts.labels(model, source).inc(drafts)
            self.source_draft_tokens.labels(model, source).inc(n)
            self.source_accepted_tokens.labels(model, source).inc(kept)
        if queued_at is not None:
            if run.first_token_s is not None:
                self.ttft.labels(model).observe(max(run.first_token_s - queued_at, 0.0))
            self.e2e.labels(model).observe(max(time.perf_counter() - queued_at, 0.0))
        if run.generation_s and run.generated > run.opening:
            self.tpot.labels(model).observe(run.generation_s / (run.generated - run.opening))
        if (batch := spec.get("batch")) is not None:
            self.batch.labels(model).observe(batch["mean"])

    def name_routes(self, routes: dict[str, str]) -> None:
        """The generating routes' endpoint labels: path -> its dialect's name ("/v1/chat/completions" -> "chat")."""
        self._routes = dict(routes)

    def endpoint(self, path: str) -> str:
        """The endpoint label of a request path: a dialect's name, models, health, metrics, ui, or "other" for any
        path this server does not serve (so a scan of random paths adds no series).

        Example: endpoint("/v1/models/demo-target") -> "models";  endpoint("/wp-login.php") -> "other"
        """
        path = path.rstrip("/") or "/"  # every API route answers with a trailing slash too
        if (name := self._routes.get(path) or FIXED_ROUTES.get(path)) is not None:
            return name
        return next((name for prefix, name in PREFIXES.items() if path.startswith(prefix)), "other")

    def answered(self, path: str, status: int | None) -> None:
        """One HTTP response (uag.server.logs.RequestLog): its endpoint and status ("none": it never started)."""
        self.requests.labels(self.endpoint(path), "none" if status is None else str(status)).inc()

    def began(self) -> None:
        """A request's job started on the worker (it runs until `ended`)."""
        with self._lock:
            self._running += 1

    def ended(self) -> None:
        with self._lock:
            self._running -= 1

    @property
    def running(self) -> int:
        """API requests on the worker now (loading, reading the prompt or generating)."""
        with self._lock:
            return self._running

    def watch(self, *, admitted: Callable[[], int], worker: Any = None, costs: Any = None) -> None:
        """What the gauges read at scrape time: `admitted` the requests the server has taken in and not yet
        answered (uag.server.routes.Gate), the `worker` (its batch) and auto's `CostKeeper`, or each served model's
        by its name."""
        self._now.admitted, self._now.worker, self._now.costs = admitted, worker, costs

    def exposition(self) -> bytes:
        """The scrape: every metric in Prometheus' text format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class Now:
    """The gauges read at scrape time: requests waiting and running, the batch running now, and what auto's cost
    keeper holds (pairs measured by this server, scheduled, deferred, and whether it measures now)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.admitted: Callable[[], int] | None = None
        self.worker: Any = None
        self.costs: Any = None

    def describe(self) -> Sequence[Any]:
        return []  # read at scrape time only

    def collect(self) -> Iterable[GaugeMetricFamily]:
        model = [self.metrics.model_name]
        running = self.metrics.running
        admitted = self.admitted() if self.admitted is not None else running
        yield gauge("uag:num_requests_running", "Requests on the model worker now", model, running)
        yield gauge("uag:num_requests_waiting", "Requests admitted, waiting for the worker", model, admitted - running)
        worker = self.worker
        batched = worker is not None and worker.max_batch > 1 and worker.batch is not None
        size = len(worker.batch) if batched else min(running, 1)
        yield gauge("uag:batch_size", "Requests whose passes run together now", model, size)
        times = worker.round_times if batched else None  # uag.runtime.batching.RoundTimes
        if times is not None:
            rounds = CounterMetricFamily(
                "uag:batch_rounds", "Rounds the batch ran (one pass per model each)", labels=["model_name"]
            )
            rounds.add_metric(model, times.rounds)
            yield rounds
            family = CounterMetricFamily(
                "uag:batch_round_seconds",
                "Where the batch's rounds spent the model worker's time: passes (building their graphs, waiting for "
                "the device), members (each request's own work between passes), rest (the rest of each round and the "
                "time between rounds); clock: wall, or the worker thread's CPU (wall above cpu: it waited)",
                labels=["model_name", "part", "clock"],
            )
            for part in times.PARTS:
                family.add_metric([*model, part, "wall"], times.wall[part])
                family.add_metric([*model, part, "cpu"], times.cpu[part])
            yield family
        if self.costs is not None:
            family = GaugeMetricFamily(
                "uag:auto_cost_pairs", "Pairs by the state of auto's measured costs", labels=["model_name", "state"]
            )
            keepers = self.costs if isinstance(self.costs, Mapping) else {self.metrics.model_name: self.costs}
            for name, keeper in keepers.items():
                for state, n in keeper.counts().items():
                    family.add_metric([name, state], n)
            yield family


def gauge(name: str, documentation: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["model_name"])
    family.add_metric(labels, max(value, 0))
    return family
