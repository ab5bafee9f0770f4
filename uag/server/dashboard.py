"""The app's **Server** tab: what `uag serve` served — the recent requests, the time speculation saved, and the
speedup-vs-α plane with the break-even curves, fed by real requests.

`server_view` is plain data (a caption, a table, a plotly figure), tested without a browser; `add_server_tab`
puts it into the app's page beside its own tabs (`uag.app.ui.build` is not edited).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import pandas as pd

from uag.app.history import group_of, plot_view
from uag.server.service import Served, Service

COLUMNS = (
    "time", "model", "drafter", "strategy", "k", "prompt_tokens", "cached_tokens", "completion_tokens",
    "tokens_per_second", "alpha", "sources", "speedup", "saved_s", "check",
)  # fmt: skip
CHECKED = {"identical": "identical", "diverged_near_tie": "near-tie (rounding)", "diverged": "MISMATCH (bug)"}


def requests_frame(served: Sequence[Served]) -> pd.DataFrame:
    """The recent requests, newest first (speedup is estimated against the target alone)."""
    rows = [asdict(s) for s in reversed(served)]
    for row in rows:
        row["sources"] = ", ".join(f"{name} {n}" for name, n in row["sources"].items())
        row["drafter"] = row["drafter"] or "(off)"
        row["check"] = CHECKED.get(row["check"], "")
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    return frame.round({"tokens_per_second": 2, "alpha": 2, "speedup": 2, "saved_s": 1, "r": 3})


def plot_rows(served: Sequence[Served], target: str) -> list[dict[str, Any]]:
    """Speculative requests with an estimated speedup, as the history rows `uag.app.history.plot_view` reads."""
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
            "r": s.r,
            "group": group_of(s.drafter, s.strategy),
        }  # fmt: skip
        for s in served
        if s.drafter is not None and s.alpha is not None and s.speedup is not None
    ]


def server_view(service: Service, ks: Sequence[int] = (2, 4, 8)) -> tuple[str, pd.DataFrame, Any]:
    """(caption, recent requests, speedup-vs-α figure) for the Server tab."""
    served, saved = service.snapshot()
    speculative = [s for s in served if s.drafter is not None]
    tokens = sum(s.completion_tokens for s in served)
    cached = sum(s.cached_tokens for s in served)
    verb = "saved" if saved >= 0 else "lost"
    caption = (
        f"**{len(served)} request{'s' * (len(served) != 1)}** served ({len(speculative)} speculative), "
        f"{tokens} tokens generated, {cached} prompt tokens read from conversation caches. "
        f"Speculation **{verb} ≈ {abs(saved):.1f} s** against the target alone — an estimate from the target's "
        "step time on this machine (its calibration, or this server's requests with speculation off)."
    )
    checked = [s.check for s in served if s.check]
    if checked:
        counts = ", ".join(f"{checked.count(kind)} {label}" for kind, label in CHECKED.items() if kind in checked)
        caption += (
            f' {len(checked)} checked against the target alone (`"speculative": {{"check": true}}`): {counts}'
            + (" — report a mismatch with its request." if "diverged" in checked else ".")
        )
    if not served:
        caption += " Point a client at this server's /v1 to fill this tab."
    view = plot_view(plot_rows(served, service.target_name), ks=ks)
    return caption + "\n\n" + view.caption, requests_frame(served), view.figure


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
                    "curves are S(α, k) with their break-even α* (amber: prompt lookup, r = 0)."
                )
                refresh = gr.Button("Refresh", size="sm")
                caption = gr.Markdown()
                table = gr.Dataframe(interactive=False, wrap=True)
                plot = gr.Plot()
        outputs = [caption, table, plot]
        tab.select(lambda: server_view(service), outputs=outputs, queue=False)
        refresh.click(lambda: server_view(service), outputs=outputs, queue=False)
