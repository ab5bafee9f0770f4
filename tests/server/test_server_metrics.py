"""`GET /metrics` (uag.server.metrics): the accounting per draft position and source on hand-made runs, the
gauges read at scrape time, and on the demo pair a scrape read with Prometheus' own parser that adds up exactly to
the `usage` and `speculative` blocks of the replies the server gave (one server for the module, max_tokens ≤ 8).
"""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.synthetic_runs import make_run, spec
from uag.core.records import Cycle, Passed, Run, Token
from uag.server.metrics import Metrics, per_position, per_source
from uag.server.responses import report

KEY = "metrics-key"
MODEL = "demo-target"


def scraped(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a scrape as (name, labels, value), through prometheus_client's parser."""
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 when there are none)."""
    return sum(v for n, have, v in samples if n == name and labels.items() <= have.items())


def by_label(samples, name: str, label: str) -> dict[str, float]:
    return {have[label]: v for n, have, v in samples if n == name and label in have}


def cycle(index: int, source: str, proposed: int, accepted: int, *, shared: bool = False) -> Cycle:
    emitted = accepted + 1
    return Cycle(index, proposed, [], [7] * proposed, accepted, emitted, source=source, shared_index=shared)


def mixed_run() -> Run:
    """A run whose cycles came from every source: a model draft, lookup (own context and earlier requests'), the
    grammar's forced tokens, and plain target steps."""
    cycles = [
        cycle(0, "model", 4, 3),
        cycle(1, "lookup", 8, 8),
        cycle(2, "lookup", 6, 1, shared=True),
        cycle(3, "grammar", 2, 2),
        Cycle.plain(4, verify_ms=1.0),
        cycle(5, "model", 4, 0),
        Cycle.plain(6, verify_ms=1.0),
    ]
    generated = sum(c.emitted for c in cycles) + 1
    return Run(
        "context",
        MODEL,
        "lookup+demo-drafter",
        k=8,
        prompt_ids=list(range(30)),
        cached_tokens=12,
        tokens=[Token(i, "x", False) for i in range(generated)],
        cycles=cycles,
        first_token_s=10.0,
        last_token_s=12.0,
        finish_reason="length",
    )


def test_per_position_counts_each_drafted_and_accepted_position():
    cycles = [cycle(0, "model", 3, 2), cycle(1, "model", 2, 0), cycle(2, "lookup", 1, 1), Cycle.plain(3, 1.0)]
    assert per_position(cycles) == ([3, 2, 1], [2, 1, 0])
    assert per_position([]) == ([], [])


def test_per_source_splits_lookup_by_where_it_copied_from():
    run = mixed_run()
    assert per_source(run.cycles) == {
        "model": (2, 8, 3),
        "lookup": (1, 8, 8),
        "shared_index": (1, 6, 1),
        "grammar": (1, 2, 2),
    }
    sources = run.sources()
    split = per_source(run.cycles)
    assert split["lookup"][0] + split["shared_index"][0] == sources["lookup"]
    assert split["model"][0] == sources["model"] and split["grammar"][0] == sources["grammar"]


@pytest.mark.parametrize(
    "runs",
    [
        [mixed_run()],
        [make_run(spec("p1", "d", "context", 4), tps=8.0, accepted=5, proposed=9), mixed_run()],
        [make_run(spec("p2"), tps=10.0)],  # the target alone: nothing drafted
    ],
)
def test_a_scrape_adds_up_to_the_reports(runs):
    """Counters fed report by report equal the reports' sums; per position and per source they sum to the totals."""
    metrics = Metrics(MODEL)
    reports = []
    for run in runs:
        done = report(run, completion_tokens=run.generated, cached_tokens=run.cached_tokens, drafter="d", step=None)
        reports.append(done)
        metrics.finished(MODEL, run, done, "length", queued_at=run.first_token_s - 0.5)
    samples = scraped(metrics.exposition().decode())
    total = lambda block, key: sum(r[block][key] for r in reports)  # noqa: E731
    assert value(samples, "uag:prompt_tokens_total", model_name=MODEL) == total("usage", "prompt_tokens")
    assert value(samples, "uag:generation_tokens_total") == total("usage", "completion_tokens")
    assert value(samples, "uag:prompt_tokens_cached_total") == sum(
        r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in reports
    )
    drafted, accepted = total("speculative", "drafted_tokens"), total("speculative", "accepted_tokens")
    assert value(samples, "uag:spec_decode_num_drafts_total") == total("speculative", "cycles")
    assert value(samples, "uag:spec_decode_num_draft_tokens_total") == drafted
    assert value(samples, "uag:spec_decode_num_accepted_tokens_total") == accepted
    assert value(samples, "uag:spec_decode_num_draft_tokens_per_pos_total") == drafted
    assert value(samples, "uag:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert value(samples, "uag:spec_decode_num_drafts_by_source_total") == total("speculative", "cycles")
    assert value(samples, "uag:spec_decode_num_accepted_tokens_by_source_total") == accepted
    assert value(samples, "uag:request_success_total", finished_reason="length") == len(runs)
    assert value(samples, "uag:time_to_first_token_seconds_count") == len(runs)
    assert value(samples, "uag:time_to_first_token_seconds_sum") == pytest.approx(0.5 * len(runs))


def test_positions_and_sources_as_labels():
    metrics = Metrics(MODEL)
    run = mixed_run()
    metrics.finished(
        MODEL, run, report(run, completion_tokens=run.generated, cached_tokens=12, drafter="d", step=None), "stop"
    )
    samples = scraped(metrics.exposition().decode())
    assert by_label(samples, "uag:spec_decode_num_accepted_tokens_per_pos_total", "position") == {
        str(i): n for i, n in enumerate(per_position(run.cycles)[1])
    }
    assert by_label(samples, "uag:spec_decode_num_drafts_by_source_total", "source") == {
        "model": 2,
        "lookup": 1,
        "shared_index": 1,
        "grammar": 1,
    }
    assert value(samples, "uag:time_per_output_token_seconds_count") == 1  # 2 s over the tokens after the first
    assert value(samples, "uag:time_per_output_token_seconds_sum") == pytest.approx(2.0 / (run.generated - 1))
    assert value(samples, "uag:time_to_first_token_seconds_count") == 0  # no queueing time given: not observed


def test_requests_by_endpoint_and_status_with_bounded_labels():
    metrics = Metrics(MODEL)
    metrics.name_routes({"/v1/chat/completions": "chat", "/v1/messages": "messages"})
    for path, status in [
        ("/v1/chat/completions", 200),
        ("/v1/chat/completions/", 200),
        ("/v1/chat/completions", 400),
        ("/v1/messages", 200),
        ("/v1/models/demo-target", 200),
        ("/metrics", 401),
        ("/ui/assets/x.js", 200),
        ("/wp-login.php", 404),
        ("/.env", 404),
        ("/v1/chat/completions", None),
    ]:
        metrics.answered(path, status)
    samples = scraped(metrics.exposition().decode())
    counts = {(have["endpoint"], have["status"]): v for n, have, v in samples if n == "uag:http_requests_total"}
    assert counts == {
        ("chat", "200"): 2,
        ("chat", "400"): 1,
        ("chat", "none"): 1,
        ("messages", "200"): 1,
        ("models", "200"): 1,
        ("metrics", "401"): 1,
        ("ui", "200"): 1,
        ("other", "404"): 2,
    }


def test_gauges_read_at_scrape_time_and_two_servers_apart():
    from uag.runtime.keeper import CostKeeper
    from uag.runtime.worker import MLXWorker

    worker = MLXWorker()
    try:
        keeper = CostKeeper(worker, lambda *_: True, lambda _: False)
        keeper.measured({"target": "t", "drafter": "d"})
        admitted = [3]
        metrics, other = Metrics(MODEL), Metrics("another")  # two registries: no duplicated series
        metrics.watch(admitted=lambda: admitted[0], worker=worker, costs=keeper)
        metrics.began()
        metrics.began()
        samples = scraped(metrics.exposition().decode())
        assert value(samples, "uag:num_requests_running", model_name=MODEL) == 2
        assert value(samples, "uag:num_requests_waiting") == 1
        assert value(samples, "uag:batch_size") == 1  # an unbatched worker runs one at a time
        assert by_label(samples, "uag:auto_cost_pairs", "state") == {
            "measured": 1,
            "scheduled": 0,
            "deferred": 0,
            "measuring": 0,
        }
        metrics.ended()
        metrics.ended()
        admitted[0] = 0
        samples = scraped(metrics.exposition().decode())
        assert value(samples, "uag:num_requests_running") == 0 and value(samples, "uag:num_requests_waiting") == 0
        assert value(scraped(other.exposition().decode()), "uag:num_requests_running", model_name="another") == 0
    finally:
        keeper.close()
        worker.close(5)


def test_a_batching_worker_says_where_its_rounds_spend_their_time():
    from uag.runtime.worker import MLXWorker

    worker = MLXWorker(max_batch=4)
    try:
        worker.round_times.rounds, worker.round_times.wall["passes"], worker.round_times.cpu["passes"] = 7, 0.5, 0.1
        metrics = Metrics(MODEL)
        metrics.watch(admitted=lambda: 0, worker=worker)
        samples = scraped(metrics.exposition().decode())
        assert value(samples, "uag:batch_rounds_total", model_name=MODEL) == 7
        seconds = {(h["part"], h["clock"]): v for n, h, v in samples if n == "uag:batch_round_seconds_total"}
        assert {h["model_name"] for n, h, _ in samples if n.startswith("uag:batch_round")} == {MODEL}
        assert seconds[("passes", "wall")] == 0.5 and seconds[("passes", "cpu")] == 0.1
        assert set(seconds) == {(part, clock) for part in ("passes", "members", "rest") for clock in ("wall", "cpu")}
        unbatched = MLXWorker()
        metrics.watch(admitted=lambda: 0, worker=unbatched)
        assert not [n for n, _, _ in scraped(metrics.exposition().decode()) if n.startswith("uag:batch_round")]
        unbatched.close(5)
    finally:
        worker.close(5)


# --- on the demo pair ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(store):
    """The base URL of `uag serve --api-key … --max-tokens 8` on the demo pair, with lookup and a model drafter."""
    from tests.support.server import serve_args, serving
    from uag.server.main import build

    settings = serve_args(
        "--api-key", KEY, "--max-tokens", "8", "--drafters", "lookup,demo-drafter,lookup+demo-drafter", "--no-ui"
    )
    app, service = build(settings, store=store)
    try:
        with serving(app) as url:
            yield url
    finally:
        service.costs.close()


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    response = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return scraped(response.text)


def scrape_once_answered(url: str, **answered: int) -> list[tuple[str, dict[str, str], float]]:
    """A scrape once the request counter holds `answered` ({endpoint: requests answered 200}): a response is counted
    as its log line is written, which may come a moment after its client has read it."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(url)
        counts = {name: value(samples, "uag:http_requests_total", endpoint=name, status="200") for name in answered}
        if counts == answered or time.monotonic() > deadline:
            assert counts == answered
            return samples
        time.sleep(0.05)


def check_sums(samples, reports: list[dict]) -> None:
    """The scrape's counters against the replies' own blocks, exactly."""
    usage = [r["usage"] for r in reports]
    spec = [r["speculative"] for r in reports]
    assert value(samples, "uag:prompt_tokens_total", model_name=MODEL) == sum(u["prompt_tokens"] for u in usage)
    assert value(samples, "uag:generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert value(samples, "uag:prompt_tokens_cached_total") == cached
    drafted, accepted = sum(s["drafted_tokens"] for s in spec), sum(s["accepted_tokens"] for s in spec)
    assert value(samples, "uag:spec_decode_num_drafts_total") == sum(s["cycles"] for s in spec)
    assert value(samples, "uag:spec_decode_num_draft_tokens_total") == drafted
    assert value(samples, "uag:spec_decode_num_accepted_tokens_total") == accepted
    assert value(samples, "uag:spec_decode_num_draft_tokens_per_pos_total") == drafted
    assert value(samples, "uag:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    sources: dict[str, int] = {}
    for s in spec:
        for source, n in s["sources"].items():
            if source != "plain":
                sources[source] = sources.get(source, 0) + n
    by_source = by_label(samples, "uag:spec_decode_num_drafts_by_source_total", "source")
    by_source["lookup"] = by_source.get("lookup", 0) + by_source.pop("shared_index", 0)
    assert {s: n for s, n in by_source.items() if n} == sources
    assert value(samples, "uag:spec_decode_num_drafts_by_source_total", source="shared_index") == sum(
        s["shared_lookup_cycles"] for s in spec
    )
    assert value(samples, "uag:e2e_request_latency_seconds_count") == len(reports)
    assert value(samples, "uag:time_to_first_token_seconds_count") == len(reports)


@pytest.mark.slow
def test_a_scrape_adds_up_to_the_replies(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0)
    prompt = "1. Warszawa\n2. Kraków\n3. Łódź\n4. Warszawa\n5. Kraków\n6."
    messages = [{"role": "user", "content": prompt}]
    reports: list[dict] = []

    def keep(reply) -> None:
        extra = reply.model_extra
        reports.append({"usage": reply.usage.model_dump(), "speculative": extra["speculative"]})

    keep(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8))  # lookup+demo-drafter, auto
    keep(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8))  # its conversation cached
    assert reports[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    check_sums(scrape_once_answered(served, chat=2), reports)  # during the run: what was answered so far, exactly

    model = {"speculative": {"drafter": "demo-drafter", "strategy": "context", "k": 3}}
    keep(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, extra_body=model))
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative": {"drafter": "lookup", "strategy": "context", "k": 4}},
        )
    )
    last = chunks[-1]
    reports.append({"usage": last.usage.model_dump(), "speculative": last.model_extra["speculative"]})
    keep(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body={"speculative": False})
    )
    assert {r["speculative"]["drafter"] for r in reports} == {"lookup+demo-drafter", "demo-drafter", "lookup", None}
    assert sum(r["speculative"]["accepted_tokens"] for r in reports) > 0  # the sums below are not all zeros

    samples = scrape_once_answered(served, chat=4, completion=1)
    check_sums(samples, reports)
    assert value(samples, "uag:http_requests_total", endpoint="metrics", status="200") >= 1  # the scrapes before
    assert value(samples, "uag:request_success_total", model_name=MODEL) == len(reports)
    assert value(samples, "uag:num_requests_running") == 0 and value(samples, "uag:num_requests_waiting") == 0
    assert by_label(samples, "uag:auto_cost_pairs", "state").keys() == {
        "measured",
        "scheduled",
        "deferred",
        "measuring",
    }


@pytest.mark.slow
def test_metrics_need_the_key(served):
    response = httpx.get(served + "/metrics")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert "uag:" not in response.text


def test_the_report_counts_the_drafter_s_passes_wherever_they_went():
    """A draft that proposed nothing is a plain step in `sources`, and a rehearsal proposes nothing: the report's
    `drafter_passes` and `rehearsals` say what the drafter model spent beside them."""
    run = make_run(spec("p", "d", "auto", 4), tps=10.0, accepted=2, proposed=4)
    run.cycles += [
        Cycle(1, 0, [5], [], 0, 1, verify_ms=1.0, drafter_passes=1),  # drafted one, proposed none
        Cycle(2, 0, [], [], 0, 1, verify_ms=1.0, drafter_passes=1, drafter_read=9),  # a rehearsal
        Cycle(3, 0, [], [], 0, 1, verify_ms=1.0),  # a plain step
    ]
    done = report(run, completion_tokens=run.generated, cached_tokens=0, drafter="d", step=None)["speculative"]
    assert (done["drafter_passes"], done["rehearsals"], done["cycles"]) == (6, 1, 1)


def test_the_report_says_the_lookup_proposals_auto_passed_over():
    """`passed_lookup`: how many decisions passed a lookup proposal over, and the last as it was priced."""
    run = make_run(spec("p", "d", "auto", 4), tps=10.0, accepted=2, proposed=4)
    quiet = report(run, completion_tokens=run.generated, cached_tokens=0, drafter="d", step=None)["speculative"]
    assert quiet["passed_lookup"] == {"decisions": 0, "last": None}
    run.cycles += [Cycle(1, 0, [], [], 0, 1, verify_ms=1.0, passed=Passed(5, 8, 2.5, 0.9, 8)) for _ in range(2)]
    run.cycles[-1].passed = Passed(12, 16, 6.25, 0.8125, 4, cycle_ms=31.0, plain_ms=12.0, others=3.0, alike=True)
    done = report(run, completion_tokens=run.generated, cached_tokens=0, drafter="d", step=None)["speculative"]
    last = {"match": 12, "k": 16, "expected_tokens": 6.25, "gain": 0.812, "batch": 4}
    last |= {"cycle_ms": 31.0, "plain_ms": 12.0, "others": 3.0, "alike": True}
    assert done["passed_lookup"] == {"decisions": 2, "last": last}
