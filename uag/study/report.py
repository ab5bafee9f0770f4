"""The analysis as people read it: formatted tables, markdown, JSON, figures and report.html. No mlx.

`uag.study.analyze` computes the tables (numbers in DataFrames); this module only presents them.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from uag.core.config import DrafterSpec, short_name
from uag.study.plots import alpha_by_strategy, speedup_vs_alpha


@dataclass
class Analysis:
    """Every table of one results file, the runs they came from and what the reader should know."""

    source: str
    k: int  # the draft length of Tables 2, 3, 5 and 6/8–10
    runs: pd.DataFrame
    tables: dict[str, pd.DataFrame]
    machine: pd.DataFrame  # distinct software/device/BLAS combinations, with their run counts
    models: pd.DataFrame  # each model's bytes and dtype as loaded
    notes: list[str] = field(default_factory=list)


BREAK_EVEN_PREFIX = "alpha_star_k"  # Table 7's α* columns: alpha_star_k2, alpha_star_k4, …
R_IS = {  # Table 7's r_is: where each row's r comes from, by drafter kind
    "model": "drafter/target bytes",
    "lookup": "0: no drafter model",
    "hybrid": "model's r × share of positions it drafted",
    "free": "0: a free drafter at this c",
}


DEFINITIONS = (
    "α = accepted ÷ proposed draft tokens (in target tokens); tokens/s from the prompt pass's tokens to the last "
    "token (prompt processing excluded); speedup = a run's tokens/s ÷ the baseline's on the same prompt, averaged over "
    "prompts; α* = the acceptance at which speculation breaks even (speedup 1): above 100 % it cannot pay."
)
TITLES = {
    "table2_alpha": "Table 2. Acceptance α per drafter × strategy × dataset (k = {k})",
    "table3_speed": "Table 3. Tokens/s and speedup per drafter × strategy × dataset (k = {k})",
    "table4_k": "Table 4. Effect of the draft length k (all datasets)",
    "table5_break_even": "Table 5. Break-even α* from TPS = a + b·α per drafter × dataset (k = {k})",
    "table6_buckets": "Tables 6, 8–10. Mean speedup per α bucket, per drafter kind and drafter (k = {k})",
    "table7_model": "Table 7. Parametric model: r, fitted c and α* per k (each c also at r = 0: α* = c·k)",
}


def planes(drafters: Sequence[str]) -> dict[str, list[str]]:
    """Which drafters share a speedup-vs-α plane, keyed by the drafter it is named after: each model drafter
    with prompt lookup and its own hybrid; a hybrid whose model did not run alone, with lookup; lookup alone
    only where no other drafter ran.

    Example: ["org/d", "lookup", "lookup+org/d", "lookup+org/e"] ->
             {"org/d": ["org/d", "lookup", "lookup+org/d"], "lookup+org/e": ["lookup+org/e", "lookup"]};
             ["lookup"] -> {"lookup": ["lookup"]}
    """
    specs = {d: DrafterSpec.parse(d) for d in drafters}
    lookup = [d for d, spec in specs.items() if spec.kind == "lookup"]
    models = {spec.model for spec in specs.values() if spec.kind == "model"}
    out = {}
    for d, spec in specs.items():
        if spec.kind == "model":
            out[d] = [d, *lookup, *(h for h, other in specs.items() if other.kind == "hybrid" and other.model == d)]
        elif spec.kind == "hybrid" and spec.model not in models:
            out[d] = [d, *lookup]
    return out or {d: [d] for d in lookup}


def _fitted(study: pd.DataFrame, drafter: str) -> tuple[float | None, float, str]:
    """(r, c, where r comes from) of a drafter's fitted study-form row of Table 7; (None, NaN, "") if none."""
    row = study[(study["source"] == drafter) & (study["r_is"] != R_IS["free"])]
    return (float(row["r"].iloc[0]), float(row["c"].iloc[0]), row["r_is"].iloc[0]) if len(row) else (None, math.nan, "")


def figures(analysis: Analysis) -> dict[str, object]:
    """Plotly figures by file stem: speedup vs α per model drafter and k, with prompt lookup and the hybrid on
    the same plane (see `planes`): points, OLS line and α* with its interval per drafter · strategy, the
    fitted S(α, k) at the drafter's r and at r = 0 (c fitted to the lookup runs, else the drafter's); and α by
    strategy at the tables' k."""
    runs, model = analysis.runs, analysis.tables["table7_model"]
    out = {}
    for target, of_target in runs.groupby("target", sort=False):
        study = model[(model["target"] == target) & (model["form"] == "study")]
        _, lookup_c, _ = _fitted(study, "lookup")
        for anchor, members in planes(list(pd.unique(of_target["drafter"]))).items():
            name = short_name(anchor)
            r, c, r_is = _fitted(study, anchor)
            curve = f"S(α, k) with r = {r:.3f} ({r_is}), fitted c = {c:.3f}" if r is not None else "no c fitted"
            free = dict(lookup_c=lookup_c, lookup_c_from="c fitted to the lookup runs")
            if anchor == "lookup":  # its own curves are the r = 0 ones
                r, free = None, dict(lookup_c=c, lookup_c_from=free["lookup_c_from"])
            elif not math.isfinite(lookup_c):
                free = dict(lookup_c=c, lookup_c_from=f"c of {name}'s fit")
            plane = of_target[of_target["drafter"].isin(members)]
            free = free if "lookup" in members else {}  # r = 0 curves only beside lookup runs
            for k, at_k in plane.groupby("k", sort=True):
                title = f"{name} → {short_name(target)}, k = {k}: {curve}"
                out[f"speedup_vs_alpha_{_slug(name)}_k{k}"] = speedup_vs_alpha(
                    at_k, ks=(int(k),), r=r, c=c, title=title, **free
                )
    at_k = runs[runs["k"] == analysis.k]
    out["alpha_by_strategy"] = alpha_by_strategy(at_k, title=f"Acceptance by strategy, k = {analysis.k}")
    return out


def _slug(text: str) -> str:
    """Example: "Qwen2.5-1.5B Instruct" -> "Qwen2.5-1.5B_Instruct" """
    return re.sub(r"[^\w.-]+", "_", text)


# --- output ---------------------------------------------------------------------------------------------------
def _cell(column: str, value) -> str:
    """How a table cell reads: α in %, α* of Table 7 capped as the paper prints it, speedups with ×.

    Example: ("alpha_mean", 0.4462) -> "44.6 %";  ("alpha_star_k6", 1.18) -> "≥ 100 %";  ("speedup", 1.06) -> "1.06×"
    """
    if value is None or pd.isna(value):
        return "–"
    if isinstance(value, str):
        return value
    if column.startswith("alpha_star_k"):
        return "≥ 100 %" if value > 1 else f"{value * 100:.0f} %"
    if column.startswith("alpha") or column in ("ci_low", "ci_high", "se", "lo", "hi"):
        return f"{value * 100:.1f} %"
    if "speedup" in column:
        return f"{value:.2f}×"
    if column in ("n", "k", "runs", "bytes"):
        return f"{int(value)}"
    if column in ("r", "c", "r2", "rmse", "sem"):
        return f"{value:.3f}"
    if column == "p_b":
        return f"{value:.2g}"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def formatted(table: pd.DataFrame) -> pd.DataFrame:
    """The table with every cell as text, as `_cell` writes it."""
    return pd.DataFrame({c: [_cell(c, v) for v in table[c].tolist()] for c in table.columns}, index=table.index)


def markdown(table: pd.DataFrame) -> str:
    """A GitHub markdown table of the formatted cells."""
    text = formatted(table)
    lines = ["| " + " | ".join(map(str, text.columns)) + " |", "|" + "---|" * len(text.columns)]
    lines += ["| " + " | ".join(row) + " |" for row in text.itertuples(index=False)]
    return "\n".join(lines)


def _records(table: pd.DataFrame) -> list[dict]:
    return json.loads(table.to_json(orient="records", force_ascii=False))  # NaN -> null, numpy -> plain


def break_even_records(table: pd.DataFrame) -> list[dict]:
    """Table 7's rows for JSON: an α* above 1 cannot be reached by any acceptance, so it is null, and
    `unreachable_k` lists those k (a number there would read as an acceptance to aim for).

    Example: {"alpha_star_k4": 0.81, "alpha_star_k6": 1.18} -> {"alpha_star_k4": 0.81, "alpha_star_k6": None,
             "unreachable_k": [6]}
    """
    records = []
    for record in _records(table):
        over = {c for c, v in record.items() if c.startswith(BREAK_EVEN_PREFIX) and v is not None and v > 1}
        record = {c: None if c in over else v for c, v in record.items()}
        record["unreachable_k"] = sorted(int(c.removeprefix(BREAK_EVEN_PREFIX)) for c in over)
        records.append(record)
    return records


def to_json(analysis: Analysis) -> dict:
    """Everything as one JSON-ready object: raw numbers (α as fractions), notes and where the runs ran."""
    return {
        "source": analysis.source,
        "k": analysis.k,
        "runs": len(analysis.runs),
        "tables": {
            name: break_even_records(table) if name == "table7_model" else _records(table)
            for name, table in analysis.tables.items()
        },
        "machine": _records(analysis.machine),
        "models": _records(analysis.models),
        "notes": analysis.notes,
    }


def to_markdown(analysis: Analysis) -> str:
    parts = [f"# Analysis of {analysis.source} ({len(analysis.runs)} speculative runs)", DEFINITIONS]
    parts += [f"note: {note}" for note in analysis.notes]
    for name, table in analysis.tables.items():
        parts += [f"## {TITLES[name].format(k=analysis.k)}", markdown(table)]
    parts += ["## Machine", markdown(analysis.machine), markdown(analysis.models)]
    return "\n\n".join(parts) + "\n"


def write(analysis: Analysis, out: Path) -> list[Path]:
    """CSV per table, one HTML file per figure, and report.html with all of them; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, table in {**analysis.tables, "machine": analysis.machine, "models": analysis.models}.items():
        table.to_csv(out / f"{name}.csv", index=False)
        written.append(out / f"{name}.csv")
    figs = figures(analysis)
    for name, fig in figs.items():
        fig.write_html(out / f"{name}.html", include_plotlyjs="directory")  # one plotly.min.js, works offline
        written.append(out / f"{name}.html")
    (out / "report.html").write_text(_report(analysis, figs), encoding="utf-8")
    return [*written, out / "report.html"]


def _report(analysis: Analysis, figs: dict) -> str:
    def table_html(table: pd.DataFrame) -> str:
        return formatted(table).to_html(index=False, border=0, classes="table")

    body = [f"<h1>Speculative decoding study: {html.escape(analysis.source)}</h1>"]
    body.append(f"<p>{len(analysis.runs)} speculative runs; per-k tables at k = {analysis.k}.</p>")
    body.append(f"<p>{html.escape(DEFINITIONS)}</p>")
    body += [f"<p class='note'>{html.escape(note)}</p>" for note in analysis.notes]
    body += ["<h2>Machine</h2>", table_html(analysis.machine), table_html(analysis.models)]
    for name, table in analysis.tables.items():
        body += [f"<h2>{html.escape(TITLES[name].format(k=analysis.k))}</h2>", table_html(table)]
    body.append("<h2>Figures</h2>")
    for i, fig in enumerate(figs.values()):
        body.append(fig.to_html(full_html=False, include_plotlyjs="directory" if i == 0 else False))
    style = (
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}"
        ".table{border-collapse:collapse;margin:1em 0;font-size:14px}"
        ".table td,.table th{padding:3px 10px;border-bottom:1px solid #e2e8f0;text-align:right}"
        ".note{color:#b45309}"
    )
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>uag analysis</title><style>{style}</style>"
        f"</head><body>\n{chr(10).join(body)}\n</body></html>\n"
    )
