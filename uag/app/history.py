"""A user's completed comparisons, as rows, as a table, and as the speedup-vs-α plot with S(α, k).

Plain data in and out; no mlx, no gradio. Column names are those of benchmark results files, so that a
results file's runs and the session's runs share one plot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
import pandas as pd

from uag.app.settings import Settings
from uag.core.config import short_name
from uag.core.records import Run
from uag.costs.fit import fit_c_from_speedups
from uag.study.plots import STUDY_C, STUDY_R, speedup_vs_alpha

HISTORY_COLUMNS = (
    "time",
    "prompt",
    "target",
    "drafter",
    "target_dtype",
    "drafter_dtype",
    "strategy",
    "k",
    "window",
    "max_tokens",
    "temperature",
    "seed",
    "chat",
    "tokens",
    "alpha",
    "mean_accepted",
    "cycles",
    "tps",
    "tps_base",
    "speedup",
    "identical",
    "r",
    "group",
)
K_CHOICES = (1, 2, 3, 4, 6, 8)  # draft lengths the plot can draw S(α, k) for
C_FITTED = "fitted from this session's runs"
C_STUDY = f"the study's c = {STUDY_C}"
LATEST_R_FROM = "drafter/target bytes of the latest run's pair"
MIN_RUNS_TO_FIT = 3


def speedup_of(baseline: Run | None, speculative: Run | None) -> float | None:
    """Speculative tokens/s ÷ target-alone tokens/s (None when either is untimed)."""
    if baseline is None or speculative is None:
        return None
    tps, tps_base = speculative.tokens_per_second, baseline.tokens_per_second
    return tps / tps_base if tps and tps_base else None


def group_of(drafter: str, strategy: str) -> str:
    """A plot series: the drafter's short name and the translation strategy (as results files name it).

    Example: group_of("mlx-community/Qwen2.5-1.5B-Instruct-4bit", "context") -> "Qwen2.5-1.5B-Instruct-4bit · context";
             group_of("lookup+org/d", "auto") -> "lookup+d · auto" (a hybrid stays a hybrid on the plot)
    """
    return f"{short_name(drafter)} · {strategy}"


def history_row(prompt: str, settings: Settings, baseline: Run, speculative: Run, *, r: float | None) -> dict:
    """One completed comparison, as a row of the user's history (column names as in results files)."""
    return {
        "time": datetime.now().strftime("%H:%M:%S"),
        "prompt": prompt,
        **settings.flat(),
        "tokens": speculative.generated,
        "alpha": speculative.acceptance_rate,
        "mean_accepted": speculative.mean_accepted,
        "cycles": len(speculative.cycles),
        "tps": speculative.tokens_per_second,
        "tps_base": baseline.tokens_per_second,
        "speedup": speedup_of(baseline, speculative),
        "identical": baseline.token_ids == speculative.token_ids,
        "r": r,
        "group": group_of(settings.drafter, settings.strategy),
    }


def history_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The history as a table, in a fixed column order (empty with those columns when there are no rows)."""
    return pd.DataFrame(list(rows), columns=list(HISTORY_COLUMNS))


@dataclass(frozen=True)
class PlotView:
    figure: Any  # plotly Figure
    caption: str
    r: float
    c: float


def _file_r(results: pd.DataFrame | None) -> float | None:
    if results is None or not {"drafter_bytes", "target_bytes"} <= set(results.columns):
        return None
    ratios = (results["drafter_bytes"] / results["target_bytes"]).dropna()
    return float(ratios.median()) if len(ratios) else None


def plot_view(
    rows: Sequence[Mapping[str, Any]],
    results: pd.DataFrame | None = None,
    *,
    ks: Sequence[int] = (2, 4),
    c_choice: str = C_FITTED,
    pair: tuple[str, str] | None = None,
    pair_r: float | None = None,
    latest_r_from: str = LATEST_R_FROM,
) -> PlotView:
    """Speedup vs α for this session's runs (and a loaded results file) with S(α, k) for each k.

    r is the latest run's (`latest_r_from` says what it is: by default the drafter/target bytes of its pair),
    else `pair_r`, the chosen pair's once it has run here, else the results file's runs, else the study's; c
    is fitted to this session's runs of that pair when asked and there are enough of them, else the study's.
    The fit takes each run's own r where it carries one (a served hybrid's runs differ in what drafted).
    """
    history = history_frame(rows)
    file_r = _file_r(results)
    latest_r = history["r"].dropna().iloc[-1] if len(history) and history["r"].notna().any() else None
    if latest_r is not None:
        latest = history.dropna(subset=["r"]).iloc[-1]
        r, pair = float(latest_r), (latest["target"], latest["drafter"])
        r_from = latest_r_from
    elif pair is not None and pair_r is not None:
        r, r_from = pair_r, "drafter/target bytes of the chosen pair"
    elif file_r is not None:
        r, pair, r_from = file_r, None, "the results file's drafter/target bytes (median)"
    else:
        r, pair, r_from = STUDY_R, None, "the study's (no run here yet)"
    c, c_from = STUDY_C, "the study's (M2 Pro)"
    if c_choice == C_FITTED:
        same = history[(history["target"] == pair[0]) & (history["drafter"] == pair[1])] if pair else history
        observed = same[["alpha", "k", "speedup"]].astype(float)
        usable = same[np.isfinite(observed).all(axis=1)]
        if len(usable) >= MIN_RUNS_TO_FIT:
            try:
                # Each run's own r, elementwise (rows all finite: the fit keeps every one, in order).
                rs = usable["r"].astype(float).fillna(r).to_numpy()
                fit = fit_c_from_speedups(usable["alpha"], usable["k"], usable["speedup"], rs)
                c, c_from = fit.c, f"fitted to {fit.n} runs of this pair (RMSE {fit.rmse:.2f}×)"
            except ValueError as err:  # the fit's own message: too few distinct k, a degenerate spread
                c_from = f"the study's; fitting failed ({err})"
        else:
            c_from = f"the study's; fitting needs {MIN_RUNS_TO_FIT} runs of one pair ({len(usable)} so far)"
    points = history[["alpha", "speedup", "k", "group", "prompt"]]
    if results is not None and len(results):
        from_file = results.reindex(columns=["alpha", "speedup", "k", "group", "prompt"]).copy()
        from_file["group"] = from_file["group"].astype(str) + " (file)"
        points = pd.concat([points, from_file], ignore_index=True) if len(points) else from_file
    figure = speedup_vs_alpha(
        points.astype({"alpha": float, "speedup": float}), ks=sorted(ks), r=r, c=c, title="Speedup vs acceptance α"
    )
    counts = f"{len(history)} run{'s' * (len(history) != 1)} this session"
    if results is not None:
        counts += f", {len(results)} from the results file"
    if not len(points):
        counts += " — run a comparison or load a results file to add points"
    caption = f"{counts}. r = {r:.3f}: {r_from}. c = {c:.3f}: {c_from}. Break-even α* = r + c·k."
    return PlotView(figure, caption, r, c)
