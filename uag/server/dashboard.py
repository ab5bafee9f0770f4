"""The app's **Server** tab: what `uag serve` served — the recent requests, the time speculation saved, and the
speedup-vs-α plane with the break-even curves, fed by real requests.

`server_view` is plain data (a caption, a table, a plotly figure), tested without a browser; `add_server_tab`
puts it into the app's page beside its own tabs (`uag.app.ui.build` is not edited).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from uag.app.history import group_of, plot_view
from uag.core.config import DrafterSpec, adaptive_k, short_name
from uag.server.protocol import ServerDefaults
from uag.server.service import Served, Service

COLUMNS = (
    "time", "model", "drafter", "tokens", "prompt (cached)", "tok/s", "α", "sources", "speedup", "saved s", "check",
)  # fmt: skip
NUMBERS = ("tok/s", "α", "speedup", "saved s")  # may be blank
# Percent of the table's width, so that it fits a 1280 px window (long names wrap in their cell).
WIDTHS = ("7%", "10%", "17%", "6%", "10%", "5%", "5%", "16%", "6.5%", "6%", "9.5%")
CHECKED = {"identical": "identical", "diverged_near_tie": "near-tie (rounding)", "diverged": "MISMATCH (bug)"}
API = "`/v1/chat/completions`"  # on this server's port, beside the app at /ui
R_FROM = "the latest request's drafter/target bytes, weighted by what drafted (prompt lookup: 0)"


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
        }  # fmt: skip
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
                    "what each one generated, its acceptance α and sources, and the estimated speedup. The "
                    "curves are S(α, k) with their break-even α* (amber: prompt lookup, r = 0); each request's r "
                    "counts the drafter's model only for the cycles it drafted."
                )
                refresh = gr.Button("Refresh", size="sm")
                caption = gr.Markdown()
                table = gr.Dataframe(interactive=False, wrap=True, column_widths=list(WIDTHS))
                plot = gr.Plot()
        outputs = [caption, table, plot]
        tab.select(lambda: server_view(service), outputs=outputs, queue=False)
        refresh.click(lambda: server_view(service), outputs=outputs, queue=False)
