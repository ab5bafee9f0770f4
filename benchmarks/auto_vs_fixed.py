"""Does `--strategy auto` pay? Baseline vs fixed k vs auto, per prompt, over the bundled datasets.

For each prompt: the target alone, context translation at each fixed k, and auto (context translation,
k re-decided each cycle, k ≤ --k-max), run back to back. auto decides by the pair's saved profile, as users
get after `python -m uag calibrate` (measured and saved first where there is none, or with --recalibrate),
and opens from what its earlier runs of the pair accepted, saved between runs as the API does. With
--hybrid, auto over lookup + the drafter too. Speedups per prompt, their mean, and pooled (total tokens ÷
total time, each prompt's median run). With --ablate, also "auto −NAME" for each mechanism NAME of auto
switched off on its own (uag.core.policy.MECHANISMS, or "all"; docs/how-it-works.md#what-each-part-earns).
Targets (issue 25): auto ≥ 0.97 × the best fixed k pooled, ≥ 0.97 × baseline pooled where nothing pays.

Usage: python benchmarks/auto_vs_fixed.py [--target demo-target] [--drafter demo-drafter] [--n 4]
       [--datasets wiki alpaca synthetic] [--ids code-001 …] [--max-tokens 64] [--ks 1 2 4] [--k-max 8]
       [--hybrid] [--ablate all | stop_rule …] [--recalibrate] [--repeats 1] [--dtype D] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from dataclasses import replace
from datetime import date

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx

from uag.api import generate  # auto: with the saved profile, as users get it
from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice
from uag.core.engine import Seams
from uag.core.policy import MECHANISMS, AutoSettings, Evidence
from uag.costs.calibrate import calibrate
from uag.costs.pair import evidence_key
from uag.costs.profiles import find_calibration, find_evidence, save
from uag.machine import backend, blas, device_name
from uag.models.store import ModelStore, check_pair
from uag.study.datasets import load_bundled

# Per ablated auto ("auto −NAME"): what it learned on the prompts before this one, as the API keeps a pair's.
ablated: dict[str, Evidence] = {}


def opening_evidence(target, drafter) -> Evidence:
    """A copy of what the pair's earlier runs saved (empty where none): an ablated auto opens from it as auto
    does, and learns into its own (the pair's saved evidence stays auto's)."""
    saved = find_evidence(evidence_key(target, drafter))
    return Evidence() if saved is None else Evidence.from_dict(saved.to_dict())


def run_prompt(pair, text: str, ks, k_max: int, max_tokens: int, repeats: int, hybrid: bool = False, ablate=()) -> dict:
    """Each condition `repeats` times, in an order that rotates every repetition so drift on a shared
    machine hits all alike; the median tokens/s per condition. Every run must match the baseline's tokens.
    `ablate`: mechanisms of auto to switch off, one at a time ("auto −NAME"; with --hybrid, over the hybrid)."""
    conditions = [("baseline", "baseline", 0)] + [(f"k={k}", "context", k) for k in ks] + [("auto", "auto", k_max)]
    conditions += [("auto hybrid", "auto", k_max)] if hybrid else []
    conditions += [(f"auto −{name}", "auto", k_max) for name in ablate]
    hybrid_choice = DrafterChoice(lookup=True, model=pair.drafter)
    rates = {name: [] for name, _, _ in conditions}
    runs = {}
    for rep in range(repeats):
        shift = rep % len(conditions)
        for name, strategy, k in conditions[shift:] + conditions[:shift]:
            drafter = None if strategy == "baseline" else pair.drafter
            if name == "auto hybrid" or (hybrid and name.startswith("auto −")):
                drafter = hybrid_choice
            config = GenerationConfig.parse(strategy=strategy, k=max(k, 1), max_tokens=max_tokens)
            kw = {}
            if name.startswith("auto −"):  # its own evidence, opened from what the pair's earlier runs saved
                off = name.removeprefix("auto −")
                kw = {"seams": Seams(auto=replace(AutoSettings(), **{off: False}))}
                kw["evidence"] = ablated.setdefault(name, opening_evidence(pair.target, drafter))
            runs[name] = generate(pair.target, drafter, text, config, **kw)
            rates[name].append(runs[name].tokens_per_second)
    base = runs["baseline"].token_ids
    for name, run in runs.items():
        assert run.token_ids == base, f"{name} changed the output"
    row = {name: statistics.median(r) for name, r in rates.items()}
    row |= {f"alpha {name}": runs[name].acceptance_rate for name in rates if name != "baseline"}
    row["auto ks"] = [c.k for c in runs["auto"].cycles]
    row["tokens"] = runs["baseline"].generated
    row["first drafted"] = next((i for i, t in enumerate(runs["auto"].from_draft) if t), None)
    return row


def conditions_of(rows: list[dict], ks) -> list[str]:
    autos = [c for c in rows[0] if c.startswith("auto ") and c != "auto ks"] if rows else []
    return [f"k={k}" for k in ks] + ["auto"] + autos


def pooled(rows: list[dict], condition: str) -> float:
    """Total tokens ÷ total time over the prompts, against the baseline's: tokens/s = tokens ÷ time per prompt."""
    seconds = lambda c: sum(r["tokens"] / r[c] for r in rows)  # noqa: E731
    return seconds("baseline") / seconds(condition)


def summarise(rows: list[dict], ks) -> dict:
    conditions = conditions_of(rows, ks)
    mean = {c: statistics.fmean(r[c] / r["baseline"] for r in rows) for c in conditions}
    pool = {c: pooled(rows, c) for c in conditions}
    fixed = [c for c in conditions if c.startswith("k=")]
    best_fixed = max(fixed, key=pool.get, default=None)
    autos = [c for c in conditions if c.startswith("auto")]
    return {
        "mean_speedup": mean,
        "pooled_speedup": pool,
        "best_fixed": best_fixed,
        "auto_min_vs_baseline": min(r["auto"] / r["baseline"] for r in rows),
        "auto_vs_best_fixed_pooled": {c: pool[c] / pool[best_fixed] for c in autos} if best_fixed else None,
        "auto_vs_best_fixed_mean": mean["auto"] / mean[best_fixed] if best_fixed else None,
        "parked_share": statistics.fmean(r["auto ks"].count(0) / max(1, len(r["auto ks"])) for r in rows),
    }


def report(header: str, rows: list[dict], summary: dict, ks) -> str:
    conditions = conditions_of(rows, ks)
    lines = [
        header,
        "",
        f"{'prompt':<14} {'base tok/s':>10} " + " ".join(f"{c:>7}" for c in conditions) + "  (speedup × baseline)",
    ]
    for r in rows:
        lines.append(
            f"{r['id']:<14} {r['baseline']:>10.2f} " + " ".join(f"{r[c] / r['baseline']:>7.2f}" for c in conditions)
        )
    m, pool = summary["mean_speedup"], summary["pooled_speedup"]
    lines += [
        f"{'mean':<14} {'':>10} " + " ".join(f"{m[c]:>7.2f}" for c in conditions),
        f"{'pooled':<14} {'':>10} " + " ".join(f"{pool[c]:>7.2f}" for c in conditions),
        "",
        f"auto vs baseline, worst prompt: {summary['auto_min_vs_baseline']:.3f}; "
        f"auto parked {summary['parked_share']:.0%} of its cycles; first drafted token per prompt: "
        + ", ".join(str(r["first drafted"]) for r in rows),
    ]
    if summary["best_fixed"]:
        versus = summary["auto_vs_best_fixed_pooled"]
        lines.append(
            f"pooled, against the best fixed k ({summary['best_fixed']}): "
            + ", ".join(f"{c} {v:.3f}" for c, v in versus.items())
            + " (target >= 0.97)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--drafter", default="demo-drafter")
    parser.add_argument("--datasets", nargs="+", default=["wiki", "alpaca", "synthetic"])
    parser.add_argument("--n", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--ids", nargs="+", help="only these prompt ids of the datasets (e.g. code-001 code-025)")
    parser.add_argument("--hybrid", action="store_true", help="also auto over lookup + the drafter")
    parser.add_argument(
        "--ablate",
        nargs="*",
        default=[],
        choices=[*MECHANISMS, "all"],
        help="also auto with each of these switched off (with --hybrid: over the hybrid)",
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure the pair's costs again (default: "
        "the saved profile, as auto uses it; calibrated and saved where there is none)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 2, 4], help="fixed k to compare (none: auto only)")
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="runs per condition, median taken (GPU: use 5)")
    parser.add_argument("--dtype", help="dtype of the demo models (default: the backend's, see docs/benchmarks.md)")
    parser.add_argument("--json", help="also write everything to this JSON file")
    args = parser.parse_args()

    store = ModelStore(dtype=args.dtype)
    pair = check_pair(store.get(args.target), store.get(args.drafter))
    calibration = None if args.recalibrate else find_calibration(pair)
    if calibration is None:
        calibration = calibrate(pair)
        save(calibration)
    generate(pair.target, pair.drafter, "Hello", GenerationConfig(max_tokens=8))  # warm-up
    rows = []
    for dataset in args.datasets:
        for prompt in load_bundled(dataset, args.n, args.ids):
            ablate = MECHANISMS if "all" in args.ablate else args.ablate
            row = run_prompt(pair, prompt.text, args.ks, args.k_max, args.max_tokens, args.repeats, args.hybrid, ablate)
            rows.append({"id": prompt.id, **row})
            print(
                f"[auto_vs_fixed] {prompt.id}: "
                + ", ".join(f"{c} {row[c] / row['baseline']:.2f}" for c in conditions_of(rows, args.ks)),
                flush=True,
            )
    summary = summarise(rows, args.ks)
    header = (
        f"auto vs fixed k — {date.today()}, {pair.target.name} ({pair.target.dtype}) ← {pair.drafter.name}, "
        f"{device_name()} ({backend()}), MLX {mx.__version__}, BLAS {blas()}, "
        f"{args.max_tokens} tokens per run, median of {args.repeats}, context translation, W = 10"
    )
    print(report(header, rows, summary, args.ks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "platform": platform.platform(),
                    "profile": calibration.to_dict(),
                    "rows": rows,
                    "summary": summary,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
