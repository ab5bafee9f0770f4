"""The study's tables from raw runs: each checked against a direct computation on hand-made runs. No mlx."""

import doctest
import json
import math
import sqlite3

import numpy as np
import pandas as pd
import pytest
from scipy.stats import norm

from tests.support.synthetic_runs import add_prompt
from uag.core.speedup import break_even_leviathan, speedup
from uag.costs.fit import fit_c_from_speedups
from uag.study import analyze as analysis_module
from uag.study.analyze import analyze, drafter_r, main
from uag.study.plots import HYBRID_GROUP, LOOKUP_GROUP
from uag.study.report import R_IS, figures, planes
from uag.study.results import ResultsDB, load_runs
from uag.study.stats import break_even_ols

R, C = 0.07, 0.185  # synthetic_runs stores drafter/target bytes with r = 0.07


def test_docstring_examples():
    assert doctest.testmod(analysis_module).failed == 0


def test_analysis_json_gives_no_number_for_an_unreachable_break_even(tmp_path, capsys):
    runs = {("d", "context", 2): (2, 2, 12.0), ("d", "context", 8): (1, 8, 4.0)}
    path = db_with(tmp_path, [(f"w{i}", 10.0, runs, "wiki") for i in range(3)])
    assert main([str(path), "--out", str(tmp_path / "out"), "--json"]) == 0
    table7 = json.loads(capsys.readouterr().out)["tables"]["table7_model"]
    paper = next(row for row in table7 if row["source"] == "paper (M2 Pro)" and row["form"] == "study")
    assert paper["alpha_star_k8"] is None and 8 in paper["unreachable_k"] and paper["alpha_star_k2"] == 0.44
    assert all(v is None or v <= 1 for row in table7 for c, v in row.items() if c.startswith("alpha_star_k"))


def db_with(tmp_path, prompts) -> str:
    """A results file from [(prompt_id, tps_base, runs, dataset)] (see synthetic_runs.add_prompt)."""
    path = tmp_path / "results.db"
    with ResultsDB(path) as db:
        for prompt_id, tps_base, runs, dataset in prompts:
            add_prompt(db, prompt_id, tps_base=tps_base, runs=runs, dataset=dataset)
    return path


def test_tables_2_3_4_mean_and_pooled(tmp_path):
    path = db_with(
        tmp_path,
        [
            ("w1", 10.0, {("d", "context", 2): (2, 2, 12.0), ("d", "context", 4): (3, 4, 11.0)}, "wiki"),
            ("w2", 20.0, {("d", "context", 2): (2, 8, 10.0), ("d", "context", 4): (1, 4, 16.0)}, "wiki"),
        ],
    )
    result = analyze(load_runs(path))
    assert result.k == 2
    alpha = result.tables["table2_alpha"].iloc[0]
    assert (alpha["n"], alpha["alpha_mean"], alpha["alpha_pooled"]) == (2, pytest.approx(0.625), pytest.approx(0.4))
    speed = result.tables["table3_speed"].iloc[0]
    assert [speed["tps_base"], speed["tps"], speed["speedup"]] == pytest.approx([15.0, 11.0, (1.2 + 0.5) / 2])
    by_k = result.tables["table4_k"].set_index("k")
    assert by_k.loc[4, ["alpha_mean", "alpha_pooled", "tps", "speedup"]].tolist() == pytest.approx(
        [0.5, 0.5, 13.5, (1.1 + 0.8) / 2]
    )


def direct_break_even(alpha, tps, baselines, level=0.95):
    """α* = (mean baseline − a) / b and its delta-method interval, by hand."""
    X = np.column_stack([np.ones(len(alpha)), alpha])
    (a, b), *_ = np.linalg.lstsq(X, tps, rcond=None)
    residuals = tps - X @ [a, b]
    cov = residuals @ residuals / (len(alpha) - 2) * np.linalg.inv(X.T @ X)
    base = np.mean(baselines)
    base_var = np.var(baselines, ddof=1) / len(baselines)
    alpha_star = (base - a) / b
    grad = np.array([-1 / b, -(base - a) / b**2])
    se = math.sqrt(grad @ cov @ grad + base_var / b**2)
    z = norm.ppf(0.5 + level / 2)
    return alpha_star, alpha_star - z * se, alpha_star + z * se


def test_table5_break_even_matches_a_direct_computation(tmp_path):
    """TPS = 8 + 16·α + noise over 30 prompts and two strategies; runs at k = 4 must not enter the k = 2 fit."""
    rng = np.random.default_rng(7)
    prompts, alphas, tps, baselines = [], [], [], []
    for i in range(30):
        base = 14.7 + rng.normal(0, 0.3)
        runs = {}
        for strategy in ("naive", "context"):
            accepted = int(rng.integers(5, 95))
            runs[("d", strategy, 2)] = (accepted, 100, 8 + 16 * accepted / 100 + rng.normal(0, 0.5))
            alphas.append(accepted / 100)
            tps.append(runs[("d", strategy, 2)][2])
        runs[("d", "context", 4)] = (50, 100, 1.0)
        prompts.append((f"wiki-{i:03d}", base, runs, "wiki"))
        baselines.append(base)

    row = analyze(load_runs(db_with(tmp_path, prompts)), k=2).tables["table5_break_even"].iloc[0]
    alpha_star, low, high = direct_break_even(np.array(alphas), np.array(tps), np.array(baselines))
    assert row["n"] == 60
    assert [row["alpha_star"], row["ci_low"], row["ci_high"]] == pytest.approx([alpha_star, low, high], rel=1e-9)
    assert row["ci_low"] < (np.mean(baselines) - 8) / 16 < row["ci_high"]


def test_table6_buckets_per_drafter(tmp_path):
    path = db_with(
        tmp_path,
        [
            ("w1", 10.0, {("d1", "context", 2): (12, 100, 8.0), ("d2", "context", 2): (55, 100, 11.0)}, "wiki"),
            ("w2", 10.0, {("d1", "context", 2): (18, 100, 10.0)}, "wiki"),
        ],
    )
    buckets = analyze(load_runs(path)).tables["table6_buckets"]
    rows = {(r.drafter, r.bucket): (r.n, r.mean_speedup) for r in buckets.itertuples()}
    assert rows == {
        ("all model drafters", "10–20 %"): (2, pytest.approx(0.9)),
        ("all model drafters", "50–60 %"): (1, pytest.approx(1.1)),
        ("d1", "10–20 %"): (2, pytest.approx(0.9)),
        ("d2", "50–60 %"): (1, pytest.approx(1.1)),
    }


def test_table7_fits_c_back_from_speedups_the_model_generated(tmp_path):
    """Speedups exactly S(α, k) with r = 0.07, c = 0.185: the fit recovers c, and α* = r + c·k per k."""
    rng = np.random.default_rng(3)
    prompts = []
    for i in range(8):
        runs = {}
        for k in (1, 2, 4):
            accepted = int(rng.integers(10, 90))
            runs[("org/d", "context", k)] = (accepted, 100, 10.0 * float(speedup(accepted / 100, k, R, C)))
        prompts.append((f"w{i}", 10.0, runs, "wiki"))
    table7 = analyze(load_runs(db_with(tmp_path, prompts))).tables["table7_model"]
    free = table7[table7["r_is"] == R_IS["free"]].set_index(["source", "form"])
    table = table7[table7["r_is"] != R_IS["free"]].set_index(["source", "form"])

    study = table.loc[("org/d", "study")]
    assert (study["r"], study["c"], study["n"]) == (pytest.approx(R), pytest.approx(C, abs=1e-9), 24)
    assert study["rmse"] < 1e-9 and study["r2"] == pytest.approx(1.0)
    assert [study[f"alpha_star_k{k}"] for k in (1, 2, 4, 6)] == pytest.approx([R + C * k for k in (1, 2, 4, 6)])
    measured = table.loc[("org/d", "measured")]
    assert [measured[f"alpha_star_k{k}"] for k in (1, 2, 4)] == pytest.approx([R + C * k for k in (1, 2, 4)])
    assert math.isnan(measured["alpha_star_k8"])  # not measured
    assert table.loc[("org/d", "leviathan"), "rmse"] > study["rmse"]  # the other form fits these speedups worse
    paper = table.loc[("paper (M2 Pro)", "study")]
    assert [paper[f"alpha_star_k{k}"] for k in (2, 4, 6)] == pytest.approx([0.44, 0.81, 1.18])
    # The same c at r = 0, what a free drafter gives: α* = c·k, for the fitted c and the paper's.
    assert free.loc[("org/d", "study"), "c"] == pytest.approx(C, abs=1e-9)
    assert [free.loc[(s, "study"), "alpha_star_k4"] for s in ("org/d", "paper (M2 Pro)")] == pytest.approx([4 * C] * 2)


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("r, c", [(0.07, 0.185), (0.2, 0.05), (0.0, 0.01)])
def test_leviathan_alpha_star_uncapped_extends_the_capped_one_past_one(k, r, c):
    capped, uncapped = break_even_leviathan(k, r, c), break_even_leviathan(k, r, c, cap=False)
    cost = 1 + k * r + c * k * k
    assert sum(uncapped**j for j in range(k + 1)) == pytest.approx(cost, rel=1e-9)  # E(α*, k) = cycle cost
    if capped is None:
        assert uncapped > 1
    else:
        assert capped == pytest.approx(uncapped, abs=1e-12) and capped <= 1


def test_model_only_reproduces_table7_of_the_paper(capsys):
    assert main(["--model-only", "--r", "0.07", "--c", "0.185", "--k", "2,4,6", "--json"]) == 0
    rows = {(row["source"], row["form"]): row for row in json.loads(capsys.readouterr().out)["table7_model"]}
    study, leviathan = rows[("model", "study")], rows[("model", "leviathan")]
    free = rows[("free drafter (r = 0)", "study")]  # a drafter that costs nothing, e.g. prompt lookup: α* = c·k
    assert (free["r"], free["alpha_star_k2"], free["alpha_star_k4"]) == (0.0, pytest.approx(0.37), pytest.approx(0.74))
    assert [study["alpha_star_k2"], study["alpha_star_k4"]] == pytest.approx([0.44, 0.81])
    # 1.18 and Leviathan's 1.047 at k = 6 are above 100 %: no acceptance reaches them, so no number is given.
    assert study["alpha_star_k6"] is None and study["unreachable_k"] == [6]
    assert leviathan["alpha_star_k6"] is None and leviathan["unreachable_k"] == [6]
    assert leviathan["alpha_star_k4"] == pytest.approx(0.917, abs=1e-3)

    assert main(["--model-only", "--k", "2", "4", "6"]) == 0  # the paper's r and c by default
    study_row = next(line for line in capsys.readouterr().out.splitlines() if "| study |" in line)
    assert study_row.endswith("| 44 % | 81 % | ≥ 100 % |")


def test_outputs(tmp_path, capsys):
    runs = [
        {("org/d", "none", 2): (10 * i, 100, 9.0 + i), ("org/d", "context", 2): (10 * i + 5, 100, 10 + i)}
        for i in range(4)
    ]
    prompts = [(f"w{i}", 10.0, runs[i], "wiki") for i in range(4)]
    path = db_with(tmp_path, [*prompts, ("x1", None, {("org/d", "context", 2): (50, 100, 10.0)}, "wiki")])
    out = tmp_path / "report"
    assert main([str(path), "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["k"] == 2 and result["runs"] == 9
    assert set(result["tables"]) == {
        "table2_alpha",
        "table3_speed",
        "table4_k",
        "table5_break_even",
        "table6_buckets",
        "table7_model",
    }
    assert result["machine"][0]["device"] == "Device(cpu, 0)"
    assert any("1 speculative runs have no baseline" in note for note in result["notes"])
    names = {p.name for p in out.iterdir()}
    assert {f"{table}.csv" for table in result["tables"]} <= names
    assert {"report.html", "plotly.min.js", "speedup_vs_alpha_d_k2.html", "alpha_by_strategy.html"} <= names
    report = (out / "report.html").read_text()
    assert "Table 5. Break-even α*" in report and "Device(cpu, 0)" in report and "cdn.plot.ly" not in report


def test_default_out_is_next_to_the_results_file(tmp_path, capsys):
    path = db_with(tmp_path, [("w1", 10.0, {("d", "none", 1): (1, 2, 9.0)}, "wiki")])
    assert main([str(path)]) == 0
    assert "## Table 2. Acceptance α" in capsys.readouterr().out
    assert (tmp_path / "analysis" / "report.html").exists()


def empty(path):
    path.write_bytes(b"")


def foreign(path):
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER)")


def not_sqlite(path):
    path.write_text("id,alpha\n1,0.5\n")


def only_baselines(path):
    with ResultsDB(path) as db:
        add_prompt(db, "w1", tps_base=10.0, runs={})


@pytest.mark.parametrize(
    "make, message",
    [
        (None, "no results file at"),
        (empty, "is empty"),
        (foreign, "foreign database"),
        (not_sqlite, "not a SQLite database"),
        (only_baselines, "no speculative runs yet"),
    ],
)
def test_bad_results_file_is_one_error_line(tmp_path, capsys, make, message):
    path = tmp_path / "results.db"
    if make:
        make(path)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_k_that_was_not_measured(tmp_path, capsys):
    path = db_with(tmp_path, [("w1", 10.0, {("d", "none", 1): (1, 2, 9.0), ("d", "none", 4): (1, 2, 9.0)}, "wiki")])
    assert main([str(path), "--k", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: no runs with k = 2 (the results have k = 1, 4)"
    assert analyze(load_runs(path)).k == 1  # without --k: 2 if measured, else the smallest


# --- prompt lookup and the hybrid beside model drafters ------------------------------------------------------
C_LOOKUP, R_HYBRID = 0.2, 0.03


def mixed_runs(tmp_path):
    """12 prompts at 10 tok/s: a model drafter (α 10–60 %, S at r = 0.07 plus noise), prompt lookup (α 70–98 %,
    exactly S at r = 0 with c = 0.2) and the hybrid (α 40–80 %), all at k = 2."""
    rng = np.random.default_rng(11)
    prompts = []
    for i in range(12):
        model, lookup, hybrid = (int(rng.integers(lo, hi)) for lo, hi in ((10, 60), (70, 98), (40, 80)))
        runs = {
            ("org/d", "context", 2): (model, 100, 10 * float(speedup(model / 100, 2, R, C)) + rng.normal(0, 0.2)),
            ("lookup", "context", 2): (lookup, 100, 10 * float(speedup(lookup / 100, 2, 0.0, C_LOOKUP))),
            ("lookup+org/d", "context", 2): (hybrid, 100, 10 * float(speedup(hybrid / 100, 2, R_HYBRID, C))),
        }
        prompts.append((f"w{i}", 10.0, runs, "wiki"))
    return load_runs(db_with(tmp_path, prompts))


def test_lookup_and_hybrid_runs_share_the_model_drafters_plane_with_curves_at_r_0(tmp_path):
    runs = mixed_runs(tmp_path)
    figs = figures(analyze(runs))
    assert {name for name in figs if name.startswith("speedup_vs_alpha")} == {"speedup_vs_alpha_d_k2"}
    traces = figs["speedup_vs_alpha_d_k2"].data
    points = {t.legendgroup: t for t in traces if t.mode == "markers" and t.hovertext is not None}
    lookup_alpha = runs.loc[runs["drafter"] == "lookup", "alpha"]
    assert sorted(points[LOOKUP_GROUP].x) == pytest.approx(sorted(lookup_alpha))
    assert points[LOOKUP_GROUP].marker.symbol == "star" and points[LOOKUP_GROUP].legendgrouptitle.text == LOOKUP_GROUP
    assert len(points[HYBRID_GROUP].x) == 12 and len(points["d · context"].x) == 12
    curves = [t.name for t in traces if t.mode == "lines" and t.name.startswith("S(α")]
    assert curves[0].startswith(f"S(α, k=2), r={R:.2f}, c=")  # the model's, at its r
    assert curves[1] == f"S(α, k=2), r=0.00, c={C_LOOKUP:.3f} (c fitted to the lookup runs)"
    marks = [t for t in traces if t.name and t.name.startswith("α*(k=2, r=0)")]
    assert marks[0].x[0] == pytest.approx(2 * C_LOOKUP)  # α* = c·k at r = 0


def test_binned_tables_reach_the_high_alpha_buckets_lookup_fills(tmp_path):
    runs = mixed_runs(tmp_path)
    buckets = analyze(runs).tables["table6_buckets"]
    lookup = buckets[buckets["drafter"] == "lookup"]
    assert set(lookup["drafter_kind"]) == {"lookup"} and lookup["hi"].max() == 1.0
    assert {"70–80 %", "80–90 %", "90–100 %"} <= set(lookup["bucket"]) and (lookup["n"] > 0).all()
    assert lookup["n"].sum() == 12
    high = buckets[buckets["lo"] >= 0.7]  # nothing in the high buckets pools lookup with a model drafter
    assert set(high["drafter"]) <= {"lookup", "lookup+org/d"} and not buckets["drafter"].str.startswith("all").any()


def test_model_fits_leave_lookup_and_hybrid_runs_out(tmp_path):
    runs = mixed_runs(tmp_path)
    result = analyze(runs)
    model_runs = runs[runs["drafter"] == "org/d"]
    alone = break_even_ols(model_runs["alpha"], model_runs["tps"], 10.0)
    pooled = break_even_ols(runs["alpha"], runs["tps"], 10.0)
    table5 = result.tables["table5_break_even"].set_index("drafter")
    assert table5.loc["org/d", "alpha_star"] == pytest.approx(alone.alpha_star, rel=1e-9)
    assert table5.loc["org/d", "alpha_star"] != pytest.approx(pooled.alpha_star, rel=1e-3)
    assert table5.loc["lookup", "drafter_kind"] == "lookup"

    table7 = result.tables["table7_model"]
    fitted = table7[(table7["form"] == "study") & (table7["r_is"] != R_IS["free"])].set_index("source")
    c_alone = fit_c_from_speedups(model_runs["alpha"], model_runs["k"], model_runs["speedup"], R).c
    assert (fitted.loc["org/d", "r"], fitted.loc["org/d", "c"]) == (pytest.approx(R), pytest.approx(c_alone))
    assert (fitted.loc["lookup", "r"], fitted.loc["lookup", "c"]) == (0.0, pytest.approx(C_LOOKUP, abs=1e-9))
    assert fitted.loc["lookup+org/d", "r_is"] == R_IS["hybrid"]
    assert any("prompt lookup runs" in note and "r = 0" in note for note in result.notes)


def test_hybrid_r_is_the_models_r_times_the_share_it_drafted():
    runs = pd.DataFrame(
        {
            "drafter": ["lookup+org/d"] * 2,
            "drafter_bytes": [700] * 2,
            "target_bytes": [10_000] * 2,
            "drafter_passes": [5, 5],
            "k": [2, 2],
            "cycles": [10, 10],
        }
    )
    assert drafter_r(runs) == pytest.approx(0.07 * 5 / 20)
    assert drafter_r(runs.assign(drafter="lookup")) == 0.0 and drafter_r(runs.assign(drafter="org/d")) == 0.07


@pytest.mark.parametrize(
    "drafters, expected",
    [
        (
            ["org/d", "lookup", "lookup+org/d", "lookup+org/e"],
            {"org/d": ["org/d", "lookup", "lookup+org/d"], "lookup+org/e": ["lookup+org/e", "lookup"]},
        ),
        (["lookup"], {"lookup": ["lookup"]}),
        (["a", "b"], {"a": ["a"], "b": ["b"]}),
    ],
)
def test_planes(drafters, expected):
    assert planes(drafters) == expected


def test_the_app_history_names_a_hybrid_drafter_as_a_hybrid():
    from uag.app.history import group_of

    assert group_of("lookup+org/d-1B", "auto") == "lookup+d-1B · auto"
    assert group_of("mlx-community/Qwen2.5-1.5B-Instruct-4bit", "context") == "Qwen2.5-1.5B-Instruct-4bit · context"
