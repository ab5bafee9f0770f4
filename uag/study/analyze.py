"""`python -m uag analyze results.db`: the study's tables and figures, regenerated from raw per-prompt runs.

Every number comes from the rows of a results file that `python -m uag bench` wrote (uag.study.results);
nothing is typed in. Tables are numbered as in the paper:

- Table 2: acceptance α per drafter × strategy × dataset: the mean of per-prompt α and the pooled
  Σ accepted / Σ proposed.
- Table 3: tokens/s and speedup per drafter × strategy × dataset, next to the baseline's tokens/s.
- Table 4: the effect of the draft length k on α, tokens/s and speedup, per drafter × strategy.
- Table 5: per drafter × dataset, the OLS fit TPS = a + b·α over prompts and the break-even
  α* = (TPS_base − a) / b with its delta-method interval (uag.study.stats).
- Tables 6, 8–10: mean speedup per 10-point α bucket (up to 90–100 %), per drafter kind and per drafter.
- Table 7: the parametric model, r = drafter bytes / target bytes and c fitted to the speedups, in the study's
  form S = (1 + kα)/(1 + kr + ck²) and Leviathan's E = (1 − α^(k+1))/(1 − α): α* per k, next to the
  measured α* and to the paper's r = 0.07, c = 0.185; each c also at r = 0 (a free drafter: α* = c·k).

Drafters come in kinds (uag.core.config.DrafterSpec): a model, prompt `lookup` (no model, so r = 0) and the hybrid
`lookup+<model>` (r = the model's times the share of draft positions its model drafted). Every fit is per
drafter, so lookup and hybrid runs never enter a model drafter's fit; the plane shows them side by side.

Tables 2, 3, 5 and 6/8–10 are at one draft length (``--k``, default 2), as in the paper.

    python -m uag analyze results.db                  # tables on stdout; CSV, HTML, report.html in analysis/
    python -m uag analyze results.db --json           # everything as one JSON object
    python -m uag analyze --model-only --r 0.07 --c 0.185 --k 2,4,6,8   # the model's α* per k, no data
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from uag.command import CommandParser, number, run
from uag.core.costmodel import FORMS
from uag.core.speedup import break_even_leviathan
from uag.costs.fit import fit_c_from_speedups
from uag.errors import InputError
from uag.study.plots import STUDY_C, STUDY_R, drafter_kind, kinds
from uag.study.report import (
    BREAK_EVEN_PREFIX,
    R_IS,
    Analysis,
    break_even_records,
    markdown,
    to_json,
    to_markdown,
    write,
)
from uag.study.results import load_runs
from uag.study.stats import break_even_ols, bucket_means

TABLE_K = 2  # the paper's tables are at k = 2
MODEL_KS = (1, 2, 4, 6, 8)
PAPER = "paper (M2 Pro)"
MACHINE_COLUMNS = ["platform", "python", "uag_version", "mlx_version", "device", "backend", "blas"]
SETTINGS = ["max_tokens", "temperature", "seed", "chat", "window"]


# --- tables (pure: runs in, DataFrame out) ----------------------------------------------------------------------
def summarize(runs: pd.DataFrame, by: Sequence[str]) -> pd.DataFrame:
    """Per group of runs: n, mean per-prompt α, pooled α = Σ accepted / Σ proposed, mean baseline tokens/s,
    mean tokens/s and mean per-prompt speedup. Groups come in the order the sweep ran them.

    Example: α = 2/2 and 2/8 on two prompts -> alpha_mean 0.625, alpha_pooled 4/10 = 0.4
    """
    by = list(by)
    table = (
        runs.groupby(by, sort=False, dropna=False)
        .agg(
            n=("alpha", "size"),
            alpha_mean=("alpha", "mean"),
            accepted=("accepted", "sum"),
            proposed=("proposed", "sum"),
            tps_base=("tps_base", "mean"),
            tps=("tps", "mean"),
            speedup=("speedup", "mean"),
        )
        .reset_index()
    )
    table["alpha_pooled"] = table["accepted"] / table["proposed"].where(table["proposed"] > 0)
    table = _in_run_order(table, runs, by)
    return table[[*by, "n", "alpha_mean", "alpha_pooled", "tps_base", "tps", "speedup"]]


def _in_run_order(table: pd.DataFrame, runs: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Sort rows by each key's first appearance in the runs (none, naive, context; wiki, alpaca, …)."""
    rank = {c: {v: i for i, v in enumerate(pd.unique(runs[c]))} for c in by}
    return table.sort_values(by, key=lambda col: col.map(rank[col.name]), kind="stable").reset_index(drop=True)


def alpha_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 2: α per target × drafter × strategy × dataset."""
    keys = ["target", "drafter", "strategy", "dataset"]
    return summarize(runs, keys)[[*keys, "n", "alpha_mean", "alpha_pooled"]]


def speed_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 3: baseline tokens/s, speculative tokens/s and speedup per target × drafter × strategy × dataset."""
    keys = ["target", "drafter", "strategy", "dataset"]
    return summarize(runs, keys)[[*keys, "n", "tps_base", "tps", "speedup"]]


def k_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 4: α, tokens/s and speedup per target × drafter × strategy × k, over all datasets."""
    keys = ["target", "drafter", "strategy", "k"]
    return summarize(runs, keys)[[*keys, "n", "alpha_mean", "alpha_pooled", "tps_base", "tps", "speedup"]]


def break_even_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Table 5: per target × drafter × dataset, TPS = a + b·α over prompts (all strategies) and
    α* = (TPS_base − a) / b. TPS_base is the mean over the prompts' baselines; its variance is that of the mean.
    Each drafter is fitted alone: prompt lookup (r = 0) and hybrid runs never enter a model drafter's line.
    """
    rows = []
    for (target, drafter, dataset), frame in runs.groupby(["target", "drafter", "dataset"], sort=False):
        base = frame.drop_duplicates("baseline_id")["tps_base"].dropna()
        mean = base.mean() if len(base) else math.nan
        variance = base.var(ddof=1) / len(base) if len(base) > 1 else math.nan
        fit = break_even_ols(frame["alpha"], frame["tps"], mean, tps_base_var=variance)
        rows.append(
            {
                "target": target,
                "drafter": drafter,
                "drafter_kind": drafter_kind(drafter),
                "dataset": dataset,
                "n": fit.n,
                "tps_base": mean,
                **{
                    name: getattr(fit, name)
                    for name in ("a", "b", "r2", "p_b", "alpha_star", "ci_low", "ci_high", "se")
                },
                "note": fit.note,
            }
        )
    return pd.DataFrame(rows).astype({"n": int})


def bucket_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Tables 6 and 8–10: mean speedup per 10-point α bucket, 0–10 % up to 90–100 % (α = 100 % included),
    over each drafter kind that has several drafters ("all model drafters"), then per drafter. Kinds are
    never pooled: the high-α buckets that prompt lookup fills stay attributable to it.

    Example: model runs at α 12 %, 18 % and lookup at 95 % -> rows (model, d, "10–20 %", n 2) and
    (lookup, lookup, "90–100 %", n 1); no row pools the two
    """
    kind_of = kinds(runs)
    parts = [
        bucket_means(frame["alpha"], frame["speedup"]).assign(drafter_kind=kind, drafter=f"all {kind} drafters")
        for kind, frame in runs.groupby(kind_of, sort=False)
        if frame["drafter"].nunique() > 1
    ]
    parts += [
        bucket_means(frame["alpha"], frame["speedup"]).assign(drafter_kind=drafter_kind(drafter), drafter=drafter)
        for drafter, frame in runs.groupby("drafter", sort=False)
    ]
    columns = ["drafter_kind", "drafter", "bucket", "lo", "hi", "n", "mean_speedup", "sem"]
    return pd.concat(parts, ignore_index=True)[columns]


def parametric(r: float, c: float, ks: Sequence[int], *, source: str) -> pd.DataFrame:
    """α* per k for given r and c in both forms: the study's r + c·k and Leviathan's (uncapped; > 1 = never).

    Example: parametric(0.07, 0.185, [2, 4, 6], source="paper") ->
        form       alpha_star_k2  alpha_star_k4  alpha_star_k6
        study      0.44           0.81           1.18     (the paper prints 44 %, 81 %, 100 %)
        leviathan  0.563          0.917          1.047
    """
    rows = []
    for form in FORMS:
        star = (lambda k: r + c * k) if form == "study" else (lambda k: break_even_leviathan(k, r, c, cap=False))
        rows.append({"source": source, "form": form, "r": r, "c": c, **{_k_column(k): star(k) for k in ks}})
    return pd.DataFrame(rows)


def _k_column(k: int) -> str:
    return f"alpha_star_k{k}"


def drafter_r(runs: pd.DataFrame) -> float:
    """r of one drafter's runs: drafter/target bytes for a model; 0 for prompt lookup (no model: its cost is
    microseconds); for the hybrid, the model's r times the share of draft positions its model drafted,
    drafter passes ÷ (k · cycles), since a lookup cycle costs no drafter pass. The median over runs.

    Example: hybrid, bytes ratio 0.07, 10 cycles at k = 2 with 5 model passes -> 0.07 · 5 / 20 = 0.0175
    """
    kind = drafter_kind(runs["drafter"].iloc[0])
    if kind == "lookup":
        return 0.0
    r = runs["drafter_bytes"] / runs["target_bytes"]
    if kind == "hybrid":
        r = r * runs["drafter_passes"] / (runs["k"] * runs["cycles"]).where(runs["cycles"] > 0)
    return float(r.median())


def model_table(runs: pd.DataFrame, ks: Sequence[int] = MODEL_KS) -> pd.DataFrame:
    """Table 7: per target × drafter, r (drafter_r) and c fitted to every run's speedup (all k, strategies and
    datasets) in both forms, with goodness of fit; the measured α* per k (OLS of speedup on α at that k,
    where it reaches 1); each model drafter's c again at r = 0 (what a free drafter gives: α* = c·k); and the
    paper's r = 0.07, c = 0.185, also at r = 0. `r_is` says where each row's r comes from."""
    ks = sorted({*ks, *runs["k"].astype(int)})
    parts = []
    for (target, drafter), frame in runs.groupby(["target", "drafter"], sort=False):
        kind, r = drafter_kind(drafter), drafter_r(frame)
        pair = dict(target=target, drafter_kind=kind)
        for form in FORMS:
            try:
                fit = fit_c_from_speedups(frame["alpha"], frame["k"], frame["speedup"], r, form=form)
            except ValueError:  # no run with a speedup yet
                continue
            quality = dict(rmse=fit.rmse, r2=fit.r2, n=fit.n)
            parts.append(_form(parametric(r, fit.c, ks, source=drafter), form, **pair, r_is=R_IS[kind], **quality))
            if kind == "model":
                parts.append(_form(parametric(0.0, fit.c, ks, source=drafter), form, **pair, r_is=R_IS["free"]))
        measured = {
            int(k): break_even_ols(at_k["alpha"], at_k["speedup"], 1.0).alpha_star
            for k, at_k in frame.groupby("k", sort=True)
        }
        row = {**pair, "source": drafter, "form": "measured", "r": r, "r_is": R_IS[kind], "n": len(frame)}
        parts.append(pd.DataFrame([{**row, **{_k_column(k): measured.get(k) for k in ks}}]))
    parts.append(parametric(STUDY_R, STUDY_C, ks, source=PAPER).assign(target="", r_is="the paper's"))
    parts.append(parametric(0.0, STUDY_C, ks, source=PAPER).assign(target="", r_is=R_IS["free"]))
    table = pd.concat(parts, ignore_index=True)
    columns = ["target", "source", "drafter_kind", "form", "r", "r_is", "c", "rmse", "r2", "n", *map(_k_column, ks)]
    numbers = {c: float for c in columns if c in ("r", "c", "rmse", "r2") or c.startswith(BREAK_EVEN_PREFIX)}
    return table.reindex(columns=columns).astype({"n": "Int64", **numbers})


def _form(rows: pd.DataFrame, form: str, **columns) -> pd.DataFrame:
    """The row of `parametric`'s output in `form`, with `columns` added."""
    return rows[rows["form"] == form].assign(**columns)


# --- the whole analysis -----------------------------------------------------------------------------------------
def choose_k(runs: pd.DataFrame, k: int | None) -> int:
    """The draft length for the per-k tables: `k` if measured, else 2 if measured, else the smallest.

    Example: runs at k = 1, 4 and k None -> 1;  k = 3 -> ValueError naming the k that were measured
    """
    measured = sorted(int(x) for x in runs["k"].unique())
    if k is None:
        return TABLE_K if TABLE_K in measured else measured[0]
    if k not in measured:
        raise InputError(f"no runs with k = {k} (the results have k = {', '.join(map(str, measured))})")
    return k


def kind_notes(runs: pd.DataFrame) -> list[str]:
    """What the analysis did with prompt lookup and hybrid runs, where there are any.

    Example: runs of a model and of lookup -> one note: lookup is fitted alone with r = 0, …
    """
    present = set(runs["drafter_kind"])
    notes = []
    if "lookup" in present:
        notes.append(
            "prompt lookup runs (no drafter model, r = 0) are fitted on their own: they never enter a model "
            "drafter's OLS line (Table 5) or its c (Table 7); Table 7 fits their c at r = 0, and the figures put "
            "them on each model drafter's plane with S(α, k) at r = 0 drawn with that c"
        )
    if "hybrid" in present:
        notes.append(
            "hybrid runs (lookup+<model>) are fitted on their own, with r = the model's × the share of draft "
            "positions its model drafted (drafter passes ÷ k·cycles); on their model's plane they are points without a "
            "curve; a hybrid whose model did not run alone gets a plane of its own, with S(α, k) at that r"
        )
    return notes


def analyze(runs: pd.DataFrame, *, k: int | None = None, source: str = "") -> Analysis:
    """All tables from `load_runs` output; Tables 2, 3, 5 and 6/8–10 at draft length `k` (see choose_k)."""
    k = choose_k(runs, k)
    runs = runs.assign(drafter_kind=kinds(runs))
    at_k = runs[runs["k"] == k]
    tables = {
        "table2_alpha": alpha_table(at_k),
        "table3_speed": speed_table(at_k),
        "table4_k": k_table(runs),
        "table5_break_even": break_even_table(at_k),
        "table6_buckets": bucket_table(at_k),
        "table7_model": model_table(runs),
    }
    notes = kind_notes(runs)
    missing = int(runs["tps_base"].isna().sum())
    if missing:
        notes.append(f"{missing} speculative runs have no baseline on their prompt yet: their speedup is missing")
    settings = runs[SETTINGS].astype(str).drop_duplicates()
    if len(settings) > 1:
        notes.append(f"runs with {len(settings)} different decoding settings ({', '.join(SETTINGS)}) are pooled")
    machine = runs.groupby(MACHINE_COLUMNS, dropna=False, sort=False).size().reset_index(name="runs")
    if len(machine) > 1:
        notes.append(f"the runs come from {len(machine)} different machines or software versions")
    models = pd.concat(
        [
            runs[["target", "target_bytes", "target_dtype"]].set_axis(["model", "bytes", "dtype"], axis=1),
            runs[["drafter", "drafter_bytes", "drafter_dtype"]].set_axis(["model", "bytes", "dtype"], axis=1),
        ]
    ).drop_duplicates(ignore_index=True)
    return Analysis(source, k, runs, tables, machine, models, notes)


# --- command line -----------------------------------------------------------------------------------------------
def k_list(text: str) -> list[int]:
    """Draft lengths from "2,4,6" (an argparse type; with nargs="+", "--k 2 4 6" works too). The range is
    checked by the command, so that a bad k is reported like any other bad setting.

    Example: "2,4, 6" -> [2, 4, 6];  "2.5" -> argparse error
    """
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"draft lengths must be whole numbers (got {text!r})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="python -m uag analyze",
        description="The study's tables and figures, regenerated from a results file of python -m uag bench.",
    )
    parser.add_argument("db", nargs="?", type=Path, help="results file written by python -m uag bench")
    parser.add_argument("--out", type=Path, help="folder for CSV, HTML and report.html (default: analysis/ next to db)")
    parser.add_argument("--json", action="store_true", help="print everything as one JSON object")
    parser.add_argument(
        "--k",
        type=k_list,
        nargs="+",
        help=f"draft length of Tables 2, 3, 5, 6 (default {TABLE_K}); with --model-only, the k list "
        f"(default {','.join(map(str, MODEL_KS))})",
    )
    parser.add_argument("--model-only", action="store_true", help="α* per k from the parametric model, no data")
    parser.add_argument("--r", type=number, help=f"with --model-only: drafter/target bytes (default {STUDY_R})")
    parser.add_argument("--c", type=number, help=f"with --model-only: verification cost (default {STUDY_C})")
    return parser


def _model_only(args: argparse.Namespace, ks: list[int]) -> int:
    if args.db is not None:
        raise InputError("--model-only reads no results file; drop the file name or --model-only")
    r = STUDY_R if args.r is None else args.r
    c = STUDY_C if args.c is None else args.c
    if ks and min(ks) < 1:
        raise InputError(f"draft lengths k must be at least 1 (got {min(ks)})")
    table = parametric(r, c, ks or MODEL_KS, source="model")
    if r != 0:  # what a free drafter (r = 0, e.g. prompt lookup) gives at the same c: α* = c·k
        table = pd.concat([table, parametric(0.0, c, ks or MODEL_KS, source="free drafter (r = 0)")], ignore_index=True)
    if args.json:
        print(json.dumps({"r": r, "c": c, "table7_model": break_even_records(table)}, ensure_ascii=False))
    else:
        print(markdown(table))
    return 0


def _analyze_file(args: argparse.Namespace, ks: list[int]) -> int:
    if args.db is None:
        raise InputError("no results file given (python -m uag analyze results.db, or --model-only)")
    if args.r is not None or args.c is not None:
        raise InputError("--r and --c go with --model-only; with a results file both come from the data")
    if len(ks) > 1:
        raise InputError(f"--k takes one draft length with a results file (got {', '.join(map(str, ks))})")
    analysis = analyze(load_runs(args.db), k=ks[0] if ks else None, source=str(args.db))
    out = args.out or args.db.parent / "analysis"
    try:
        write(analysis, out)
    except OSError as err:
        raise InputError(f"cannot write the analysis to {out}: {err.strerror or err}; choose another --out") from None
    print(f"wrote {out}/report.html, CSV tables and figures", file=sys.stderr)
    if args.json:
        print(json.dumps({**to_json(analysis), "out": str(out)}, ensure_ascii=False))
    else:
        print(to_markdown(analysis))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ks = [k for group in args.k or [] for k in group]
    return run("python -m uag analyze", lambda: _model_only(args, ks) if args.model_only else _analyze_file(args, ks))
