"""The app's **Server** tab: what `uag serve` served — the recent requests, the time speculation saved, the
speedup-vs-α plane with the break-even curves, fed by real requests, and the load: tokens/s of all requests
together and requests running, over time.

`server_view` and `load_view` are plain data (a caption, a table, plotly figures), tested without a browser;
`add_server_tab` puts them into the app's page beside its own tabs (`uag.app.ui.build` is not edited).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from uag.app.history import group_of, plot_view
from uag.core.config import DrafterSpec, adaptive_k, short_name
from uag.server.protocol import ServerDefaults
from uag.server.service import Served, Service

COLUMNS = (
    "time",
    "model",
    "drafter",
    "tokens",
    "prompt (cached)",
    "tok/s",
    "batch",
    "α",
    "sources",
    "speedup",
    "saved s",
    "check",
)
NUMBERS = ("tok/s", "batch", "α", "speedup", "saved s")  # may be blank
# Percent of the table's width, so that it fits a 1280 px window (long names wrap in their cell).
WIDTHS = ("7%", "9%", "15%", "6%", "10%", "5%", "5%", "5%", "15%", "6.5%", "6%", "9.5%")
CHECKED = {"identical": "identical", "diverged_near_tie": "near-tie (rounding)", "diverged": "MISMATCH (bug)"}
API = "`/v1/chat/completions`"  # on this server's port, beside the app at /ui
R_FROM = "the latest request's drafter/target bytes, weighted by what drafted (prompt lookup: 0)"
Span = tuple[float, float, int]  # one request: (started, finished) in epoch seconds, and the tokens it generated
BUCKETS = 60  # the most tokens/s bars the load figure draws
BUCKET_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)  # round widths for them


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def speculation_label(s: Served) -> str:
    """The drafter, strategy and draft length in one short cell (under auto, k is the most it may draft).

    Example: lookup+org/demo-drafter, auto, k 8 -> "lookup+demo-drafter auto k≤8"; no drafter -> "off"
    """
    if s.drafter is None:
        return "off"
    return f"{short_name(s.drafter)} {s.strategy} k{'≤' if adaptive_k(s.strategy) else '='}{s.k}"


def sources_label(s: Served) -> str:
    """Cycles per source; a speculative request that never drafted says so (it ran as the target alone).

    Example: {"lookup": 9, "model": 3, "plain": 30} -> "lookup 9, model 3, plain 30";
             auto with {"plain": 47} -> "none drafted (parked)"
    """
    if s.drafter is not None and not s.drafted:
        return "none drafted (parked)" if adaptive_k(s.strategy) else "none drafted"
    return ", ".join(f"{name} {n}" for name, n in sorted(s.sources.items(), key=lambda item: item[0] == "plain"))


def request_row(s: Served) -> dict[str, Any]:
    """One request as the table shows it: estimated speedup only where something drafted (else blank)."""
    return {
        "time": s.time,
        "model": s.model,
        "drafter": speculation_label(s),
        "tokens": s.completion_tokens,
        "prompt (cached)": f"{s.prompt_tokens} ({s.cached_tokens})",
        "tok/s": _rounded(s.tokens_per_second, 1),
        "batch": _rounded(s.batch, 1),  # blank on an unbatched server
        "α": _rounded(s.alpha, 2),
        "sources": sources_label(s),
        "speedup": _rounded(s.speedup, 2) if s.drafted else None,
        "saved s": round(s.saved_s, 1) if s.drafter is not None else None,
        "check": CHECKED.get(s.check, ""),
    }


def requests_frame(served: Sequence[Served]) -> pd.DataFrame:
    """The recent requests, newest first (speedup is estimated against the target alone)."""
    frame = pd.DataFrame([request_row(s) for s in reversed(served)], columns=list(COLUMNS))
    return frame.astype(dict.fromkeys(NUMBERS, float))  # blanks as NaN, which the table leaves empty


def plot_rows(served: Sequence[Served], target: str) -> list[dict[str, Any]]:
    """Requests that drafted, with α and an estimated speedup, as the history rows `uag.app.history.plot_view`
    reads; each carries the r of what drafted it (`Served.drafting_r`: prompt lookup's cycles cost 0)."""
    return [
        {
            "time": s.time,
            "prompt": f"{s.prompt_tokens} prompt tokens ({s.cached_tokens} cached)",
            "target": target,
            "drafter": s.drafter,
            "strategy": s.strategy,
            "k": s.k,
            "tokens": s.completion_tokens,
            "alpha": s.alpha,
            "speedup": s.speedup,
            "tps": s.tokens_per_second,
            "r": s.drafting_r,
            "group": group_of(s.drafter, s.strategy),
        }
        for s in served
        if s.drafted and s.alpha is not None and s.speedup is not None
    ]


def nothing_plotted(served: Sequence[Served], defaults: ServerDefaults) -> str:
    """What the Server tab says in place of the plot's caption while no request has a point on it, and what
    would give it one."""
    speculative = [s for s in served if s.drafter is not None]
    drafted = [s for s in speculative if s.drafted]
    if drafted and all(s.speedup is None for s in drafted):
        return (
            "No speedup to plot yet: the estimate needs the target's step time on this machine. Send one request "
            'with `"speculative": false` (the target alone), or run `uag calibrate` on this pair.'
        )
    if speculative and not drafted:
        with_model = [d for d in defaults.allowed if DrafterSpec.parse(d).model is not None]
        nudge = (
            f' To draft every cycle, name a drafter with a model and a fixed strategy: `"speculative": '
            f'{{"drafter": "{with_model[0]}", "strategy": "context"}}`.'
            if with_model
            else ""
        )
        return (
            f"No speculative request has drafted yet: the {len(speculative)} so far ran as the target alone (auto "
            "parks where drafting does not look worth it; prompt lookup drafts only where the reply repeats its "
            f"prompt), so there is no acceptance α to plot.{nudge}"
        )
    if speculative:
        return "No speculative request has had a draft verified yet, so there is no acceptance α to plot."
    if defaults.drafter is not None:
        return (
            f"No speculative request yet: send one to this server's {API}; it speculates with "
            f'`{defaults.drafter}` unless it says `"speculative": false`. Each adds a point here.'
        )
    if defaults.allowed:
        return (
            f"No speculative request yet, and speculation is off by default here: send "
            f'`"speculative": {{"drafter": "{defaults.allowed[0]}"}}` with a request to this server\'s {API} '
            f"(drafters allowed: {', '.join(defaults.allowed)}). Each adds a point here."
        )
    return "This server runs the target alone (no drafter allowed): restart `uag serve` with `--drafter` to plot."


# --- the load over time ----------------------------------------------------------------------------------------
def bucket_seconds(span_s: float) -> int:
    """A round bucket width that cuts `span_s` seconds into at most `BUCKETS` buckets.

    Example: 50 s -> 1; 90 s -> 2; 3 hours -> 300
    """
    hours = BUCKET_S[-1]
    return next((w for w in BUCKET_S if span_s <= w * BUCKETS), hours * math.ceil(span_s / (hours * BUCKETS)))


def throughput(spans: Sequence[Span], width: float) -> list[tuple[float, float]]:
    """Tokens/s of all requests together per bucket of `width` seconds (buckets start at multiples of it), each
    request's tokens spread evenly over its span (one of no length puts them in its bucket): (bucket start,
    tokens/s) from the first span's bucket to the last's, idle buckets at 0.

    Example: [(0, 4, 40), (2, 4, 20)], width 2 -> [(0, 10.0), (2, 20.0)]
    """
    if width <= 0:
        raise ValueError(f"a bucket must last longer than 0 s (got {width})")
    if not spans:
        return []
    first = math.floor(min(start for start, _, _ in spans) / width)
    last = max(math.ceil(end / width) - 1 if end > start else math.floor(start / width) for start, end, _ in spans)
    tokens = [0.0] * (last - first + 1)
    for start, end, n in spans:
        if end <= start:
            tokens[math.floor(start / width) - first] += n
            continue
        for i in range(math.floor(start / width), math.ceil(end / width)):
            tokens[i - first] += n * (min(end, (i + 1) * width) - max(start, i * width)) / (end - start)
    return [((first + i) * width, n / width) for i, n in enumerate(tokens)]


def running(spans: Sequence[Span]) -> list[tuple[float, int]]:
    """Requests running over time, from their spans: (time, running from then on) at each start and end.

    Example: [(0, 4, 40), (2, 3, 9)] -> [(0, 1), (2, 2), (3, 1), (4, 0)]
    """
    changes: dict[float, int] = {}
    for start, end, _ in spans:
        changes[start] = changes.get(start, 0) + 1
        changes[end] = changes.get(end, 0) - 1
    points: list[tuple[float, int]] = []
    for t in sorted(changes):
        if changes[t] or not points:
            points.append((t, (points[-1][1] if points else 0) + changes[t]))
    return points


def since(points: Sequence[tuple[float, int]], start: float) -> list[tuple[float, int]]:
    """A step line from `start` on: the value it held at `start`, then its later changes.

    Example: [(0, 1), (5, 2), (9, 0)] since 6 -> [(6, 2), (9, 0)]
    """
    held = [(start, n) for t, n in points if t <= start][-1:]
    return held + [(t, n) for t, n in points if t > start]


def load_figure(served: Sequence[Served], history: Sequence[tuple[float, int]], now: float) -> go.Figure:
    """Tokens/s of the requests together (bars) and requests running (a step line, right axis) since the oldest
    request listed: running as the worker's batch counted them (`history`: [(epoch seconds, members)]) where it
    batches, else from the requests' own spans; up to `now` while some still run."""
    spans = [(s.started, s.finished, s.completion_tokens) for s in served if None not in (s.started, s.finished)]
    fig = go.Figure()
    if spans:
        start = min(begun for begun, _, _ in spans)
        steps = since(history, start) if history else running(spans)
        end = now if steps and steps[-1][1] else max(finished for _, finished, _ in spans)
        if steps and steps[-1][1]:  # still running: the line goes on to now
            steps.append((now, steps[-1][1]))
        width = bucket_seconds(end - start)
        rates = throughput(spans, width)
        fig.add_bar(
            x=[datetime.fromtimestamp(t + width / 2) for t, _ in rates],
            y=[r for _, r in rates],
            width=width * 1000,
            name=f"tokens/s (all requests, per {width} s)",
            marker_color="#93c5fd",
            hovertemplate="%{x|%H:%M:%S}: %{y:.1f} tokens/s<extra></extra>",
        )
        fig.add_scatter(
            x=[datetime.fromtimestamp(t) for t, _ in steps],
            y=[n for _, n in steps],
            yaxis="y2",
            mode="lines",
            line=dict(shape="hv", color="#b45309", width=2),
            name="requests running",
            hovertemplate="%{x|%H:%M:%S}: %{y} running<extra></extra>",
        )
    else:
        fig.add_annotation(
            text="No request served yet: the load shows once one has finished.",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.5,
            font=dict(color="#475569"),
        )
    fig.update_layout(
        title="Load: tokens/s of all requests together, and requests running",
        yaxis=dict(title="tokens/s", rangemode="tozero"),
        yaxis2=dict(title="running", overlaying="y", side="right", rangemode="tozero", tickformat="d", showgrid=False),
        template="plotly_white",
        height=300,
        bargap=0,
        legend=dict(orientation="h", y=-0.25),
        margin=dict(l=60, r=60, t=50, b=40),
    )
    return fig


def load_view(service: Service) -> go.Figure:
    """The Server tab's load figure: the recent requests and the worker's batch sizes (none where it keeps none:
    an unbatched server's worker never batches)."""
    served, _ = service.snapshot()
    batch = getattr(service.runner.worker, "batch", None)  # None until the worker's loop has started
    return load_figure(served, [] if batch is None else list(batch.history), time.time())


def server_view(service: Service, ks: Sequence[int] = (2, 4, 8)) -> tuple[str, pd.DataFrame, Any]:
    """(caption, recent requests, speedup-vs-α figure) for the Server tab."""
    served, saved = service.snapshot()
    speculative = [s for s in served if s.drafter is not None]
    parked = [s for s in speculative if not s.drafted]
    tokens = sum(s.completion_tokens for s in served)
    cached = sum(s.cached_tokens for s in served)
    verb = "saved" if saved >= 0 else "lost"
    caption = (
        f"**{len(served)} request{'s' * (len(served) != 1)}** served ({len(speculative)} speculative), "
        f"{tokens} tokens generated, {cached} prompt tokens read from conversation caches. "
        f"Speculation **{verb} ≈ {abs(saved):.1f} s** against the target alone — an estimate from the target's "
        "step time on this machine (its calibration, or this server's requests with speculation off)."
    )
    if parked:
        caption += (
            f" {len(parked)} speculative request{'s' * (len(parked) != 1)} never drafted"
            f"{' (auto parked)' if all(adaptive_k(s.strategy) for s in parked) else ''}: run as the target alone, "
            "they count only what the drafter's rehearsals took."
        )
    checked = [s.check for s in served if s.check]
    if checked:
        counts = ", ".join(f"{checked.count(kind)} {label}" for kind, label in CHECKED.items() if kind in checked)
        caption += (
            f' {len(checked)} checked against the target alone (`"speculative": {{"check": true}}`): {counts}'
            + (" — report a mismatch with its request." if "diverged" in checked else ".")
        )
    rows = plot_rows(served, service.target_name)
    view = plot_view(rows, ks=ks, latest_r_from=R_FROM)
    plotted = view.caption if rows else nothing_plotted(served, service.defaults)
    return caption + "\n\n" + plotted, requests_frame(served), view.figure


def add_server_tab(demo: Any, service: Service) -> None:
    """A "Server" tab after the app's own tabs, refreshed when opened and on its button."""
    import gradio as gr

    tabs = next((block for block in demo.children if isinstance(block, gr.Tabs)), None)
    with demo:
        with tabs if tabs is not None else gr.Tabs():
            with gr.Tab("Server") as tab:
                gr.Markdown(
                    "Requests to this server's OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`): "
                    "what each one generated, the mean batch it ran in (`--max-batch`), its acceptance α and "
                    "sources, and the estimated speedup. The curves are S(α, k) with their break-even α* (amber: "
                    "prompt lookup, r = 0); each request's r counts the drafter's model only for the cycles it "
                    "drafted. Below: the tokens/s of all requests together and how many ran at once."
                )
                refresh = gr.Button("Refresh", size="sm")
                caption = gr.Markdown()
                table = gr.Dataframe(interactive=False, wrap=True, column_widths=list(WIDTHS))
                plot = gr.Plot()
                load = gr.Plot()
        outputs = [caption, table, plot, load]
        tab.select(lambda: (*server_view(service), load_view(service)), outputs=outputs, queue=False)
        refresh.click(lambda: (*server_view(service), load_view(service)), outputs=outputs, queue=False)
