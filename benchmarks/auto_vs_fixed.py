"""Does `--strategy auto` pay? Baseline vs fixed k vs auto, per prompt, over the bundled datasets.

For each prompt: the target alone, context translation at each fixed k, and auto (context translation,
k re-decided each cycle, k ≤ --k-max), run back to back. The pair is calibrated first (the profile is
saved and auto uses it, as users get after `python -m uag calibrate`). Targets: auto ≥ 0.97 × baseline
on every prompt, and auto ≥ the best fixed k on the mean.

Usage: python benchmarks/auto_vs_fixed.py [--target demo-target] [--drafter demo-drafter] [--n 4]
       [--datasets wiki alpaca synthetic] [--max-tokens 64] [--ks 1 2 4] [--k-max 8] [--repeats 1]
       [--dtype D] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from datetime import date

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx

from uag.api import generate  # auto: with the saved profile, as users get it
from uag.core.config import GenerationConfig
from uag.machine import backend, blas, device_name
from uag.models.store import ModelStore, check_pair
from uag.study.calibrate import calibrate
from uag.study.datasets import load_bundled
from uag.study.profiles import save


def run_prompt(pair, text: str, ks, k_max: int, max_tokens: int, repeats: int) -> dict:
    """Each condition `repeats` times, in an order that rotates every repetition so drift on a shared
    machine hits all alike; the median tokens/s per condition. Every run must match the baseline's tokens."""
    conditions = [("baseline", "baseline", 0)] + [(f"k={k}", "context", k) for k in ks] + [("auto", "auto", k_max)]
    rates = {name: [] for name, _, _ in conditions}
    runs = {}
    for rep in range(repeats):
        shift = rep % len(conditions)
        for name, strategy, k in conditions[shift:] + conditions[:shift]:
            drafter = None if strategy == "baseline" else pair.drafter
            config = GenerationConfig(strategy=strategy, k=max(k, 1), max_tokens=max_tokens)
            runs[name] = generate(pair.target, drafter, text, config)
            rates[name].append(runs[name].tokens_per_second)
    base = runs["baseline"].token_ids
    for name, run in runs.items():
        assert run.token_ids == base, f"{name} changed the output"
    row = {name: statistics.median(r) for name, r in rates.items()}
    row |= {f"alpha {name}": runs[name].acceptance_rate for name in rates if name != "baseline"}
    row["auto ks"] = [c.k for c in runs["auto"].cycles]
    return row


def summarise(rows: list[dict], ks) -> dict:
    conditions = [f"k={k}" for k in ks] + ["auto"]
    mean = {c: statistics.fmean(r[c] / r["baseline"] for r in rows) for c in conditions}
    best_fixed = max((c for c in conditions if c != "auto"), key=mean.get, default=None)
    return {
        "mean_speedup": mean,
        "best_fixed": best_fixed,
        "auto_min_vs_baseline": min(r["auto"] / r["baseline"] for r in rows),
        "auto_vs_best_fixed_mean": mean["auto"] / mean[best_fixed] if best_fixed else None,
        "parked_share": statistics.fmean(r["auto ks"].count(0) / max(1, len(r["auto ks"])) for r in rows),
    }


def report(header: str, rows: list[dict], summary: dict, ks) -> str:
    conditions = [f"k={k}" for k in ks] + ["auto"]
    lines = [
        header,
        "",
        f"{'prompt':<14} {'base tok/s':>10} " + " ".join(f"{c:>7}" for c in conditions) + "  (speedup × baseline)",
    ]
    for r in rows:
        lines.append(
            f"{r['id']:<14} {r['baseline']:>10.2f} " + " ".join(f"{r[c] / r['baseline']:>7.2f}" for c in conditions)
        )
    m = summary["mean_speedup"]
    lines += [
        f"{'mean':<14} {'':>10} " + " ".join(f"{m[c]:>7.2f}" for c in conditions),
        "",
        f"auto vs baseline, worst prompt: {summary['auto_min_vs_baseline']:.3f} (target >= 0.97)",
        f"auto parked {summary['parked_share']:.0%} of its cycles",
    ]
    if summary["best_fixed"]:
        lines[-1] = (
            f"auto vs best fixed ({summary['best_fixed']}) on the mean: {summary['auto_vs_best_fixed_mean']:.3f} "
            f"(target >= 1.0); " + lines[-1]
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--drafter", default="demo-drafter")
    parser.add_argument("--datasets", nargs="+", default=["wiki", "alpaca", "synthetic"])
    parser.add_argument("--n", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 2, 4], help="fixed k to compare (none: auto only)")
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="runs per condition, median taken (GPU: use 5)")
    parser.add_argument("--dtype", help="dtype of the demo models (default: the backend's, see docs/benchmarks.md)")
    parser.add_argument("--json", help="also write everything to this JSON file")
    args = parser.parse_args()

    store = ModelStore(dtype=args.dtype)
    pair = check_pair(store.get(args.target), store.get(args.drafter))
    calibration = calibrate(pair)
    save(calibration)
    generate(pair.target, pair.drafter, "Hello", GenerationConfig(max_tokens=8))  # warm-up
    rows = []
    for dataset in args.datasets:
        for prompt in load_bundled(dataset, args.n):
            row = run_prompt(pair, prompt.text, args.ks, args.k_max, args.max_tokens, args.repeats)
            rows.append({"id": prompt.id, **row})
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
