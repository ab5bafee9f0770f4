"""Plotly figures shared by the app and the analysis report. Built from plain data; no mlx, no gradio.

Runs come as a DataFrame with one row per speculative run and (at least) the columns
``alpha`` (0–1), ``speedup`` (speculative tokens/s ÷ baseline tokens/s on the same prompt), ``k`` and
``group`` (the series a run belongs to, e.g. "demo-drafter · context"); ``prompt`` is shown on hover.
A ``drafter_kind`` or ``drafter`` column, where present, says which runs come from prompt lookup or the
hybrid (else the group's drafter part does: "lookup · context").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from uag.core.config import DrafterSpec
from uag.core.costmodel import CostProfile
from uag.core.records import Cycle
from uag.core.speedup import break_even, speedup
from uag.study.stats import BreakEven, break_even_ols

STUDY_R = 0.07  # drafter/target bytes in the study (Qwen2.5-1.5B 4-bit vs Bielik-11B 8-bit)
STUDY_C = 0.185  # verification-cost coefficient fitted on the study's M2 Pro
PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d")
CURVE_COLOURS = ("#64748b", "#94a3b8", "#334155", "#cbd5e1")
LOOKUP_COLOURS = ("#d97706", "#f59e0b", "#b45309", "#fbbf24")  # prompt lookup: amber points and r = 0 curves
HYBRID_COLOURS = ("#0d9488", "#14b8a6", "#0f766e", "#5eead4")
LOOKUP_GROUP = "prompt lookup (r = 0)"
HYBRID_GROUP = "lookup + model (0 < r < the model's)"
KIND_STYLE = {  # legend group, marker, colours; model runs keep one legend entry per series
    "lookup": (LOOKUP_GROUP, "star", LOOKUP_COLOURS),
    "hybrid": (HYBRID_GROUP, "square", HYBRID_COLOURS),
}


def _hover(frame: pd.DataFrame) -> list[str]:
    prompts = frame.get("prompt", pd.Series([""] * len(frame), index=frame.index)).fillna("").astype(str)
    return [
        f"{p[:80] + ('…' if len(p) > 80 else '')}<br>α {a:.0%} · speedup {s:.2f}× · k {k}"
        for p, a, s, k in zip(prompts, frame["alpha"], frame["speedup"], frame["k"])
    ]


def drafter_kind(drafter: str) -> str:
    """ "model", "lookup" or "hybrid", as uag.core.config.DrafterSpec reads the drafter's name.

    Example: "org/d-1B" -> "model";  "lookup" -> "lookup";  "lookup+org/d-1B" -> "hybrid"
    """
    return DrafterSpec.parse(drafter).kind


def kinds(runs: pd.DataFrame) -> pd.Series:
    """Each run's drafter kind: its ``drafter_kind`` column, else parsed from ``drafter``, else from the
    group's drafter part (the app's series are "lookup · context", "demo-drafter · naive", …)."""
    if "drafter_kind" in runs:
        return runs["drafter_kind"].astype(str)
    names = runs["drafter"] if "drafter" in runs else runs["group"].astype(str).str.split(" · ").str[0]
    return names.map(drafter_kind).rename("drafter_kind")


def fit_groups(runs: pd.DataFrame) -> dict[str, BreakEven]:
    """Per group: OLS of speedup on α and the break-even α* where the fitted speedup reaches 1."""
    fits = {}
    for group, frame in runs.dropna(subset=["alpha", "speedup"]).groupby("group", sort=False):
        fits[str(group)] = break_even_ols(frame["alpha"], frame["speedup"], 1.0)
    return fits


def speedup_vs_alpha(
    runs: pd.DataFrame,
    *,
    ks: Sequence[int] = (2, 4),
    r: float | None = STUDY_R,
    c: float = STUDY_C,
    title: str = "Speedup vs acceptance",
    lookup_c: float | None = None,
    lookup_c_from: str = "",
) -> go.Figure:
    """Runs as points; per group the OLS line and break-even α* with its confidence band; the parametric
    S(α, k) = (1 + kα)/(1 + kr + ck²) for each k with its break-even α* = r + ck marked.

    Prompt lookup runs are stars in the legend group "prompt lookup (r = 0)", hybrid runs squares in a group
    of their own (no curve: their r lies between 0 and the model's). Where lookup runs are on the plane, or
    `lookup_c` is given, S(α, k) is drawn at r = 0 too (α* = c·k), with `lookup_c` (`lookup_c_from` says where
    it comes from) or else the model curves' c.
    """
    fig = go.Figure()
    fig.add_hline(y=1.0, line=dict(color="#475569", width=1, dash="dot"), annotation_text="break-even")
    runs = runs.dropna(subset=["alpha", "speedup"]) if len(runs) else runs
    fits = fit_groups(runs) if len(runs) else {}
    run_kinds = kinds(runs) if len(runs) else pd.Series(dtype=str)
    seen: dict[str, int] = {}
    for group, frame in runs.groupby("group", sort=False) if len(runs) else []:
        kind = run_kinds[frame.index[0]]
        legend, symbol, colours = KIND_STYLE.get(kind, (str(group), "circle", PALETTE))
        seen[kind] = seen.get(kind, -1) + 1
        colour = colours[seen[kind] % len(colours)]
        _add_series(fig, frame, str(group), fits[str(group)], colour=colour, symbol=symbol, legend=legend)
    if r is not None:
        _add_curves(fig, ks, r, c, source="", colours=CURVE_COLOURS)
    free_c = lookup_c if lookup_c is not None else c if (run_kinds == "lookup").any() else None
    if free_c is not None and np.isfinite(free_c):
        source = lookup_c_from or ("c of the model curves" if r is not None else "c given")
        _add_curves(fig, ks, 0.0, free_c, source=source, colours=LOOKUP_COLOURS, legend=LOOKUP_GROUP)
    fig.update_layout(
        title=title,
        xaxis=dict(title="acceptance rate α", tickformat=".0%", range=[0, 1]),
        yaxis=dict(title="speedup (× baseline tokens/s)", rangemode="tozero"),
        template="plotly_white",
        legend=dict(orientation="h", y=-0.2),
        margin=dict(l=60, r=20, t=60, b=40),
    )
    return fig


def _add_series(
    fig: go.Figure, frame: pd.DataFrame, group: str, fit: BreakEven, *, colour: str, symbol: str, legend: str
) -> None:
    """One series' points, its OLS line and its α* with the interval band, in legend group `legend`."""
    title = dict(text=legend) if legend != group else None
    fig.add_trace(
        go.Scatter(
            x=frame["alpha"],
            y=frame["speedup"],
            mode="markers",
            name=group,
            legendgroup=legend,
            legendgrouptitle=title,
            marker=dict(color=colour, size=11 if symbol != "circle" else 9, opacity=0.8, symbol=symbol),
            hovertext=_hover(frame),
            hoverinfo="text",
        )
    )
    if fit.a is None or fit.b is None:
        return
    grid = np.linspace(0.0, 1.0, 101)
    fig.add_trace(
        go.Scatter(
            x=grid,
            y=fit.a + fit.b * grid,
            mode="lines",
            name=f"{group}: OLS",
            legendgroup=legend,
            showlegend=False,
            line=dict(color=colour, width=2),
            hoverinfo="skip",
        )
    )
    if fit.alpha_star is not None and 0 <= fit.alpha_star <= 1:
        if fit.has_interval:
            lo, hi = max(fit.ci_low, 0.0), min(fit.ci_high, 1.0)
            fig.add_vrect(x0=lo, x1=hi, fillcolor=colour, opacity=0.12, line_width=0)
        fig.add_vline(
            x=fit.alpha_star,
            line=dict(color=colour, width=1.5, dash="dash"),
            annotation_text=f"α* {fit.alpha_star:.0%}",
            annotation_font_color=colour,
        )


def _add_curves(
    fig: go.Figure, ks: Sequence[int], r: float, c: float, *, source: str, colours: Sequence[str], legend: str = ""
) -> None:
    """S(α, k) at r and c for each k, with α* = r + c·k marked where it is reachable; `source` says where c
    came from (in the legend)."""
    grid = np.linspace(0.0, 1.0, 101)
    label = f"r={r:.2f}, c={c:.3f}" + (f" ({source})" if source else "")
    for j, k in enumerate(ks):
        colour = colours[j % len(colours)]
        fig.add_trace(
            go.Scatter(
                x=grid,
                y=speedup(grid, k, r, c),
                mode="lines",
                name=f"S(α, k={k}), {label}",
                legendgroup=legend or None,
                line=dict(color=colour, width=1.5, dash="dot" if r else "dashdot"),
                hovertemplate=f"k={k}, r={r:.2f}: α %{{x:.0%}} → %{{y:.2f}}×<extra></extra>",
            )
        )
        alpha_star = float(break_even(k, r, c))
        if alpha_star <= 1:
            fig.add_trace(
                go.Scatter(
                    x=[alpha_star],
                    y=[1.0],
                    mode="markers",
                    name=f"α*(k={k}{', r=0' if not r else ''}) = {alpha_star:.0%}",
                    legendgroup=legend or None,
                    marker=dict(symbol="diamond", size=11, color=colour, line=dict(color="#0f172a", width=1)),
                )
            )


SOURCE_PATTERNS = {"lookup": "/", "model": ""}  # accepted drafts from prompt lookup are hatched


def cycle_ribbon(cycles: Sequence[Cycle], *, title: str = "Per cycle: proposed vs accepted") -> go.Figure:
    """Bars per verification cycle: target tokens proposed, accepted, and the target's own token.

    Where the engine records which drafter kind proposed a cycle (`Cycle.source`: "model", "lookup", or ""
    for a plain target step), the accepted bars of lookup cycles are hatched and the hover names the source.
    """
    index = [c.index + 1 for c in cycles]
    accepted = [c.accepted for c in cycles]
    rejected = [c.proposed - c.accepted for c in cycles]
    own = [c.emitted - c.accepted for c in cycles]
    sources = [getattr(c, "source", None) or ("plain step" if not c.proposed else "") for c in cycles]
    by_source = any(getattr(c, "source", None) for c in cycles)
    hover = [f"cycle {i}{f' · {s}' if s else ''}" for i, s in zip(index, sources)]
    accepted_bar = go.Bar(
        x=index,
        y=accepted,
        name="accepted draft",
        marker_color="#16a34a",
        hovertext=hover,
        hovertemplate="%{hovertext}: %{y} accepted<extra></extra>",
    )
    if by_source:
        accepted_bar.marker.pattern = dict(shape=[SOURCE_PATTERNS.get(s, "") for s in sources], fgcolor="#052e16")
    fig = go.Figure(
        [
            accepted_bar,
            go.Bar(x=index, y=rejected, name="rejected draft", marker_color="#fca5a5"),
            go.Bar(x=index, y=own, name="target's own token", marker_color="#94a3b8"),
        ]
    )
    if by_source:
        kinds = sorted({s for s in sources if s in SOURCE_PATTERNS})
        fig.add_annotation(
            text="hatched: drafted by prompt lookup" if "lookup" in kinds else f"drafted by: {', '.join(kinds)}",
            xref="paper",
            yref="paper",
            x=1,
            y=1.12,
            showarrow=False,
            font=dict(size=11, color="#475569"),
        )
    fig.update_layout(
        barmode="stack",
        title=title,
        xaxis_title="cycle",
        yaxis_title="tokens",
        template="plotly_white",
        height=260,
        bargap=0.05,
        legend=dict(orientation="h", y=-0.3),
        margin=dict(l=50, r=10, t=40, b=30),
    )
    return fig


def position_acceptance(values: Sequence[float | None], *, title: str = "Acceptance by draft position") -> go.Figure:
    """P(draft position i accepted | the earlier positions were), one bar per position; positions never
    tried are marked "untried" instead of a bar.

    Example: [0.8, 0.5, None] -> bars 80 %, 50 % at positions 1, 2; position 3 untried
    """
    positions = list(range(1, len(values) + 1))
    tried = [v if v is not None else 0.0 for v in values]
    labels = [f"{v:.0%}" if v is not None else "untried" for v in values]
    fig = go.Figure(
        go.Bar(
            x=positions,
            y=tried,
            text=labels,
            textposition="outside",
            marker_color=["#16a34a" if v is not None else "#e2e8f0" for v in values],
            hovertemplate="position %{x}: %{text}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis=dict(title="draft position", dtick=1),
        yaxis=dict(title="P(accepted | earlier accepted)", tickformat=".0%", range=[0, 1.15]),
        template="plotly_white",
        height=260,
        margin=dict(l=50, r=10, t=40, b=30),
        showlegend=False,
    )
    return fig


def verify_cost(profile: CostProfile, *, title: str = "What a target pass costs on this machine") -> go.Figure:
    """The target's forward time over w new tokens (verifying k drafts is w = k + 1) with one drafter step as
    a dashed line, and a whole cycle at w = k + 1: k drafter steps + translation + the target's pass.
    Producing the same w tokens with plain target steps (w × one step) is in the legend, off by default,
    because it quickly dwarfs the rest.

    Example: {1: 10, 2: 11, 3: 12} ms, drafter 1 ms, translation 0.5 ms -> cycle points (2, 12.5), (3, 14.5)
    """
    widths = list(profile.target_ms)
    ks = [w - 1 for w in widths if w > 1]
    step = profile.target_ms[1]
    fig = go.Figure(
        [
            go.Scatter(
                x=widths,
                y=list(profile.target_ms.values()),
                mode="lines+markers",
                name="target pass over w tokens",
                line=dict(color=PALETTE[0], width=2),
                marker=dict(size=7),
                hovertemplate="target, w = %{x}: %{y:.2f} ms<extra></extra>",
            ),
            go.Scatter(
                x=[widths[0], widths[-1]],
                y=[profile.drafter_ms] * 2,
                mode="lines",
                name=f"one drafter step ({profile.drafter_ms:.2f} ms)",
                line=dict(color=PALETTE[2], width=1.5, dash="dash"),
                hovertemplate="one drafter step: %{y:.2f} ms<extra></extra>",
            ),
            go.Scatter(
                x=[k + 1 for k in ks],
                y=[profile.cycle_ms(k) for k in ks],
                customdata=ks,
                mode="lines+markers",
                name="whole cycle with k = w − 1 drafts",
                line=dict(color=PALETTE[4], width=1.5, dash="dot"),
                marker=dict(size=6, symbol="square"),
                hovertemplate="cycle, k = %{customdata}: %{y:.2f} ms<extra></extra>",
            ),
            go.Scatter(
                x=widths,
                y=[w * step for w in widths],
                mode="lines",
                name="w plain target steps",
                line=dict(color=CURVE_COLOURS[0], width=1, dash="dot"),
                visible="legendonly",
                hovertemplate="%{x} plain target steps: %{y:.1f} ms<extra></extra>",
            ),
        ]
    )
    fig.update_layout(
        title=title,
        xaxis=dict(
            title="tokens in the target's pass, w (verifying k drafts: w = k + 1)",
            dtick=1 if widths[-1] <= 16 else None,
        ),
        yaxis=dict(title="milliseconds", rangemode="tozero"),
        template="plotly_white",
        height=360,
        legend=dict(orientation="h", y=-0.25),
        margin=dict(l=60, r=20, t=50, b=40),
    )
    return fig


def alpha_by_strategy(runs: pd.DataFrame, *, title: str = "Acceptance by strategy") -> go.Figure:
    """Box plot of α per strategy, one colour per drafter (columns: alpha, strategy, drafter)."""
    fig = go.Figure()
    for i, (drafter, frame) in enumerate(runs.groupby("drafter", sort=False)):
        fig.add_trace(
            go.Box(
                x=frame["strategy"],
                y=frame["alpha"],
                name=str(drafter),
                marker_color=PALETTE[i % len(PALETTE)],
                boxmean=True,
            )
        )
    fig.update_layout(
        title=title,
        boxmode="group",
        yaxis=dict(title="acceptance rate α", tickformat=".0%", range=[0, 1]),
        template="plotly_white",
    )
    return fig
