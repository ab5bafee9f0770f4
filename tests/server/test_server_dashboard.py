"""The Server tab's data (`uag.server.dashboard`) and the `Served` records behind it, without a model or a server:
each request's r is what drafted it, a request that never drafted is shown as the target alone, the empty plot
says how to fill it, the table is narrow enough for a 1280 px window and shows the batch each request ran in, and
the load figure's tokens/s and requests running come from the requests' spans and the worker's batch."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pandas as pd
import pytest

from uag.core.config import GenerationConfig
from uag.core.records import Cycle, Run, Token
from uag.server.dashboard import (
    COLUMNS,
    WIDTHS,
    bucket_seconds,
    load_figure,
    load_view,
    nothing_plotted,
    plot_rows,
    request_row,
    requests_frame,
    running,
    server_view,
    since,
    throughput,
)
from uag.server.protocol import Request, ServerDefaults
from uag.server.responses import StepTime, report, saved_seconds
from uag.server.service import Served, Service

HYBRID = "lookup+demo-drafter"
R_HYBRID = 0.5  # the demo drafter's bytes / the target's, about
C_TRUE = 0.05
DEFAULTS = ServerDefaults(model="demo-target", drafter=HYBRID, drafters=("lookup", "demo-drafter"))


def served(sources: dict, *, alpha=0.8, speedup=2.0, r=R_HYBRID, drafter=HYBRID, strategy="auto", k=8, **kw) -> Served:
    fields = dict(
        time="10:21:23",
        model="demo-target",
        prompt_tokens=875,
        cached_tokens=874,
        completion_tokens=48,
        tokens_per_second=11.623920158817,
        saved_s=1.234,
        check=None,
    )
    fields.update(kw)
    return Served(drafter=drafter, strategy=strategy, k=k, alpha=alpha, sources=sources, speedup=speedup, r=r, **fields)


def on_the_curve(sources: dict, alpha: float, k: int = 8) -> Served:
    """A hybrid's request whose speedup is exactly the study's S(α, k) for what drafted it, c = C_TRUE."""
    model = sources.get("model", 0) / sum(n for s, n in sources.items() if s != "plain")
    speedup = (1 + k * alpha) / (1 + k * R_HYBRID * model + C_TRUE * k * k)
    return served(sources, alpha=alpha, speedup=speedup, k=k)


@dataclass
class FakeService:
    """What `server_view` reads of a `Service`."""

    recent: list[Served] = field(default_factory=list)
    saved_s: float = 0.0
    target_name: str = "demo-target"
    defaults: ServerDefaults = DEFAULTS
    runner: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(worker=SimpleNamespace(batch=None)))

    def snapshot(self) -> tuple[list[Served], float]:
        return list(self.recent), self.saved_s


# --- r of what drafted ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sources, r, expected",
    [
        ({"lookup": 9, "model": 3, "plain": 30}, 0.5, 0.125),  # mixed: weighted by drafting cycles
        ({"lookup": 12, "plain": 30}, 0.5, 0.0),  # a hybrid that drafted only by lookup drafted for free
        ({"model": 7, "plain": 2}, 0.5, 0.5),  # its model alone
        ({"lookup": 4}, 0.0, 0.0),  # prompt lookup
        ({"plain": 47}, 0.5, None),  # never drafted
        ({}, 0.5, None),
    ],
)
def test_drafting_r_weights_the_drafters_r_by_what_drafted(sources, r, expected):
    request = served(sources, r=r)
    assert request.drafting_r == expected
    assert request.drafted == (expected is not None)


def test_each_plotted_request_carries_the_r_of_what_drafted_it():
    rows = plot_rows([served({"lookup": 12, "plain": 30}), served({"lookup": 9, "model": 3})], "demo-target")
    assert [row["r"] for row in rows] == [0.0, 0.125]
    assert {row["group"] for row in rows} == {"lookup+demo-drafter · auto"}


def test_lookup_only_requests_of_a_hybrid_fit_a_positive_c():
    """Drafted only by lookup (r = 0), the hybrid's requests fit the c they were made with; taken at the hybrid's
    r = 0.5 they would fit c = 0.05 − 0.5/8 < 0."""
    requests = [on_the_curve({"lookup": 10, "plain": 20}, alpha) for alpha in (0.5, 0.6, 0.7, 0.8)]
    caption, _, _ = server_view(FakeService(requests))
    assert "r = 0.000" in caption and "fitted to 4 runs" in caption
    assert f"c = {C_TRUE:.3f}" in caption


def test_a_fit_over_mixed_requests_takes_each_requests_r():
    """Lookup-only and mixed requests of one hybrid, the latest mixed: the fit still finds c exactly, and the
    curves are drawn at the latest request's r."""
    requests = [on_the_curve({"lookup": 10, "plain": 20}, alpha) for alpha in (0.5, 0.6, 0.7)]
    requests += [on_the_curve({"lookup": 6, "model": 6, "plain": 3}, 0.55, k=4)]  # r = 0.25
    requests += [on_the_curve({"lookup": 6, "model": 2, "plain": 9}, 0.75)]  # r = 0.125
    caption, _, figure = server_view(FakeService(requests))
    assert "r = 0.125: the latest request's drafter/target bytes, weighted by what drafted" in caption
    assert f"c = {C_TRUE:.3f}: fitted to 5 runs of this pair (RMSE 0.00×)" in caption
    assert figure is not None


# --- a request that never drafted ----------------------------------------------------------------------------
def test_a_request_that_never_drafted_is_shown_as_the_target_alone():
    parked = served({"plain": 47}, alpha=None, speedup=1.01, saved_s=-0.03)
    row = request_row(parked)
    assert row["sources"] == "none drafted (parked)" and row["speedup"] is None and row["α"] is None
    assert row["saved s"] == -0.0 and row["drafter"] == "lookup+demo-drafter auto k≤8"
    assert plot_rows([parked], "demo-target") == []
    caption, frame, _ = server_view(FakeService([parked], saved_s=-0.03))
    assert "1 speculative request never drafted (auto parked)" in caption and "lost ≈ 0.0 s" in caption
    assert pd.isna(frame["speedup"].iloc[0]) and pd.isna(frame["α"].iloc[0]) and frame["saved s"].iloc[0] == 0


def _run(cycles: list[Cycle], seconds: float) -> Run:
    run = Run(translation="context", target="demo-target", drafter="lookup+demo-drafter", k=8, k_policy="adaptive")
    run.tokens = [None] * (1 + sum(c.emitted for c in cycles))  # the prompt pass's token, then the cycles'
    run.cycles, run.first_token_s, run.last_token_s = cycles, 100.0, 100.0 + seconds
    return run


def _drafting(source: str, accepted: int) -> Cycle:
    return Cycle(
        index=0, k=4, draft_ids=[1] * 4, proposed_ids=[1] * 4, accepted=accepted, emitted=accepted + 1, source=source
    )


def test_time_saved_counts_only_rehearsals_for_a_request_that_never_drafted():
    step = StepTime(100.0, "calibration")
    parked = [Cycle.plain(i, 100.0) for i in range(40)]
    parked[15].draft_ms = 30.0  # one rehearsal
    # 40 tokens in 4.4 s against 100 ms a step: the estimate would say 0.4 s lost, the step time's error
    assert saved_seconds(_run(parked, 4.4), step) == pytest.approx(-0.03)
    drafted = [_drafting("lookup", 4), _drafting("model", 1), Cycle.plain(2, 100.0)]  # 5 + 2 + 1 = 8 tokens
    assert saved_seconds(_run(drafted, 0.5), step) == pytest.approx(0.8 - 0.5)
    assert saved_seconds(_run(drafted, 0.5), None) == 0.0


# --- the empty plot ------------------------------------------------------------------------------------------
def test_with_no_request_the_plot_says_how_to_add_one():
    caption, frame, figure = server_view(FakeService())
    assert "run a comparison" not in caption and "results file" not in caption  # the Plot tab's words
    assert "No speculative request yet: send one to this server's `/v1/chat/completions`" in caption
    assert "`lookup+demo-drafter`" in caption
    assert list(frame.columns) == list(COLUMNS) and len(frame) == 0 and figure is not None


def test_with_speculation_off_by_default_the_plot_names_a_drafter_to_send():
    off = ServerDefaults(model="demo-target", drafter=None, drafters=("lookup",))
    baseline = served({}, drafter=None, strategy="baseline", k=0, alpha=None, speedup=None, r=None, saved_s=0.0)
    caption = nothing_plotted([baseline], off)
    assert '`"speculative": {"drafter": "lookup"}`' in caption and "/v1/chat/completions" in caption
    assert "restart" in nothing_plotted([], ServerDefaults(model="demo-target", drafter=None))


def test_when_every_request_parked_the_plot_says_so_and_how_to_draft():
    caption = nothing_plotted([served({"plain": 47}, alpha=None)] * 2, DEFAULTS)
    assert caption.startswith("No speculative request has drafted yet: the 2 so far ran as the target alone")
    assert '"drafter": "lookup+demo-drafter", "strategy": "context"' in caption


def test_without_the_targets_step_time_the_plot_says_where_to_get_it():
    caption = nothing_plotted([served({"lookup": 3}, speedup=None)], DEFAULTS)
    assert "step time" in caption and '`"speculative": false`' in caption and "uag calibrate" in caption


# --- the table -----------------------------------------------------------------------------------------------
def test_the_table_keeps_what_a_request_did_in_compact_columns():
    rows = [
        served(
            {"lookup": 9, "model": 3, "plain": 30}, alpha=0.7551020408, speedup=2.345678, check="identical", batch=2.4
        ),
        served({}, drafter=None, strategy="baseline", k=0, alpha=None, speedup=None, r=None, saved_s=0.0),
        served(
            {"model": 5},
            drafter="mlx-community/Qwen2.5-0.5B-Instruct-4bit",
            strategy="context",
            k=4,
            check="diverged_near_tie",
        ),
    ]
    frame = requests_frame(rows)
    newest, baseline, oldest = (frame.iloc[i].to_dict() for i in range(3))
    assert newest["drafter"] == "Qwen2.5-0.5B-Instruct-4bit context k=4" and newest["check"] == "near-tie (rounding)"
    assert baseline["drafter"] == "off" and baseline["sources"] == "" and pd.isna(baseline["speedup"])
    assert pd.isna(baseline["saved s"]) and pd.isna(baseline["α"]) and pd.isna(baseline["batch"])  # unbatched
    assert oldest == {
        "time": "10:21:23",
        "model": "demo-target",
        "drafter": "lookup+demo-drafter auto k≤8",
        "tokens": 48,
        "prompt (cached)": "875 (874)",
        "tok/s": 11.6,
        "batch": 2.4,
        "α": 0.76,
        "sources": "lookup 9, model 3, plain 30",
        "speedup": 2.35,
        "saved s": 1.2,
        "check": "identical",
    }


def test_the_column_widths_fill_the_table_without_overflowing_it():
    assert len(WIDTHS) == len(COLUMNS)
    percents = [float(w.rstrip("%")) for w in WIDTHS]
    assert all(w.endswith("%") for w in WIDTHS) and 95 <= sum(percents) <= 100


# --- the load over time --------------------------------------------------------------------------------------
@pytest.mark.parametrize("span_s, width", [(0, 1), (60, 1), (61, 2), (90, 2), (3 * 3600, 300), (100 * 3600, 7200)])
def test_buckets_are_round_and_at_most_sixty(span_s, width):
    assert bucket_seconds(span_s) == width


@pytest.mark.parametrize(
    "spans, width, expected",
    [
        ([(0, 4, 40), (2, 4, 20)], 2, [(0, 10.0), (2, 20.0)]),  # overlapping requests add up
        ([(0, 1, 10), (5, 6, 10)], 2, [(0, 5.0), (2, 0.0), (4, 5.0)]),  # an idle bucket between them is 0
        ([(3, 3, 6)], 2, [(2, 3.0)]),  # a span of no length: all its tokens in its bucket
        ([(1, 4, 30)], 2, [(0, 5.0), (2, 10.0)]),  # spread by the share of its span in each bucket
        ([], 5, []),
    ],
)
def test_throughput_spreads_each_requests_tokens_over_its_span(spans, width, expected):
    rates = throughput(spans, width)
    assert [t for t, _ in rates] == [t for t, _ in expected]
    assert [rate for _, rate in rates] == pytest.approx([rate for _, rate in expected])


def test_throughput_keeps_every_token():
    rng = random.Random(7)
    now = 1.7e9
    spans = []
    for _ in range(50):
        start = now + rng.uniform(0, 600)
        spans.append((start, start + rng.choice([0.0, rng.uniform(0, 90)]), rng.randint(1, 500)))
    width = bucket_seconds(max(e for _, e, _ in spans) - min(s for s, _, _ in spans))
    rates = throughput(spans, width)
    assert sum(rate * width for _, rate in rates) == pytest.approx(sum(n for _, _, n in spans))
    assert all(rate >= 0 for _, rate in rates) and [t for t, _ in rates] == sorted(t for t, _ in rates)
    with pytest.raises(ValueError, match="longer than 0 s"):
        throughput(spans, 0)


def test_requests_running_step_at_each_start_and_end():
    assert running([(0, 4, 40), (2, 3, 9)]) == [(0, 1), (2, 2), (3, 1), (4, 0)]
    assert running([(0, 2, 1), (2, 4, 1)]) == [(0, 1), (4, 0)]  # one ends as the next starts: still 1
    assert since([(0, 1), (5, 2), (9, 0)], 6) == [(6, 2), (9, 0)]
    assert since([(5, 2), (9, 0)], 1) == [(5, 2), (9, 0)] and since([(5, 2)], 9) == [(9, 2)]


def _timed(started: float, finished: float, tokens: int) -> Served:
    return served({"lookup": 3}, started=started, finished=finished, completion_tokens=tokens)


def test_the_load_figure_counts_running_from_the_batch_where_the_worker_batches():
    t0 = 1.7e9
    requests = [_timed(t0, t0 + 20, 200), _timed(t0 + 5, t0 + 10, 100)]
    history = [(t0 - 50, 1), (t0 - 40, 0), (t0 + 1, 1), (t0 + 5, 2), (t0 + 10, 1), (t0 + 20, 0)]
    bars, line = load_figure(requests, history, now=t0 + 3600).data
    assert list(line.y) == [0, 1, 2, 1, 0] and line.yaxis == "y2"  # from the first request's start on
    assert sum(bars.y) * bars.width / 1000 == pytest.approx(300) and max(bars.y) == pytest.approx(30)
    # without a batch's history, running is the requests' own spans
    _, line = load_figure(requests, [], now=t0 + 3600).data
    assert list(line.y) == [1, 2, 1, 0]


def test_the_load_figure_runs_on_to_now_while_requests_run():
    t0 = 1.7e9
    _, line = load_figure([_timed(t0, t0 + 20, 200)], [(t0, 1), (t0 + 15, 2), (t0 + 20, 1)], now=t0 + 30).data
    assert list(line.y) == [1, 2, 1, 1] and line.x[-1].timestamp() == pytest.approx(t0 + 30)


def test_the_load_figure_says_why_it_is_empty():
    figure = load_view(FakeService([served({}, drafter=None, strategy="baseline", k=0)]))  # no times: not served
    assert not figure.data and "No request served yet" in figure.layout.annotations[0].text
    batch = SimpleNamespace(history=[(1.7e9, 1), (1.7e9 + 4, 0)])
    service = FakeService([_timed(1.7e9, 1.7e9 + 4, 40)], runner=SimpleNamespace(worker=SimpleNamespace(batch=batch)))
    assert list(load_view(service).data[1].y) == [1, 0]


def test_a_served_request_records_its_batch_and_its_span():
    from uag.models.store import ModelStore
    from uag.runtime.host import Host
    from uag.runtime.jobs import JobRunner
    from uag.runtime.worker import MLXWorker

    runner = JobRunner(MLXWorker())
    service = Service(Host(ModelStore(), runner, target="demo-target"), DEFAULTS, cache_bytes=0)
    run = Run(translation="baseline", target="demo-target", prompt_ids=[1, 2, 3], prompt_ms=500.0)
    run.tokens = [Token(7, "a", False)] * 5
    run.first_token_s, run.last_token_s = time.perf_counter() - 2.0, time.perf_counter() - 0.5
    request = Request(kind="completion", model="demo-target", config=GenerationConfig("baseline"), drafter=None)
    done = report(run, completion_tokens=5, cached_tokens=0, drafter=None, step=None)
    try:
        service._record(request, run, done, None, None, SimpleNamespace(weight_bytes=1))
        done["speculative"]["batch"] = {"mean": 2.5, "largest": 3}
        service._record(request, run, done, None, None, SimpleNamespace(weight_bytes=1))
    finally:
        runner.worker.close()
    alone, batched = service.snapshot()[0]
    assert alone.batch is None and batched.batch == 2.5
    assert batched.finished - batched.started == pytest.approx(2.0, abs=0.05)  # the prompt's 0.5 s counts
    assert batched.finished == pytest.approx(time.time() - 0.5, abs=1.0)
