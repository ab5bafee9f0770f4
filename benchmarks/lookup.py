"""Drafters that cost nothing: baseline vs model drafts vs prompt lookup vs the hybrid vs auto.

Per bundled dataset, per prompt, side by side and interleaved (medians of --repeats): the target alone;
the model drafter with context translation at k = 1 and 2; prompt lookup at fixed k; the hybrid
(lookup + model) at fixed k; auto over lookup alone and over the hybrid (k ≤ --k-max). Prints per
dataset the mean speedup (tokens/s ÷ the baseline's on the same prompt), the pooled speedup, α and the
share of the output that came from drafts. Every greedy run must reproduce the baseline's tokens.

Targets (issue 12): `structured`, auto over lookup ≥ 1.5× on the mean; the other sets, auto over the
hybrid ≥ 0.97× pooled and ≥ the best fixed configuration on the mean.

Usage: python benchmarks/lookup.py [--target demo-target] [--drafter demo-drafter]
       [--datasets structured wiki alpaca synthetic] [--n 4] [--max-tokens 48] [--repeats 2]
       [--lookup-k 4] [--k-max 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

from side_by_side import (
    Condition,
    differing,
    mean_alpha,
    pooled,
    run_prompt,
    speedups,
)  # (this folder; loads uag first)

# isort: split
import mlx.core as mx

from uag.api import load, load_drafter, saved_profile
from uag.core.config import GenerationConfig
from uag.machine import backend, blas, device_name
from uag.study.datasets import load_bundled


def conditions(model, hybrid, lookup, args) -> list[Condition]:
    g = lambda **kw: GenerationConfig.parse(max_tokens=args.max_tokens, **kw)  # noqa: E731
    return [
        Condition("baseline", None, g(strategy="baseline")),
        Condition("ctx k=1", model, g(strategy="context", k=1)),
        Condition("ctx k=2", model, g(strategy="context", k=2)),
        Condition(f"lookup k={args.lookup_k}", lookup, g(strategy="context", k=args.lookup_k)),
        Condition("hybrid k=2", hybrid, g(strategy="context", k=2)),
        Condition("auto lookup", lookup, g(strategy="auto", k=args.k_max)),
        Condition("auto hybrid", hybrid, g(strategy="auto", k=args.k_max)),
    ]


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--drafter", default="demo-drafter")
    parser.add_argument("--datasets", nargs="+", default=["structured", "wiki", "alpaca", "synthetic"])
    parser.add_argument("--n", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lookup-k", type=int, default=4)
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--json", help="also write every row to this JSON file")
    args = parser.parse_args()

    target = load(args.target)
    model, hybrid, lookup = (load_drafter(s) for s in (args.drafter, f"lookup+{args.drafter}", "lookup"))
    profile = saved_profile(target, model)  # auto over the hybrid uses the pair's calibration when saved
    conds = conditions(model, hybrid, lookup, args)
    run_prompt(target, conds, "Hello", 1)  # warm-up: every path compiled once
    header = (
        f"lookup benchmark — {date.today()}, {target.name} ({target.dtype}) ← {args.drafter}, {device_name()} "
        f"({backend()}), MLX {mx.__version__}, BLAS {blas()}, {args.max_tokens} tokens, median of {args.repeats}, "
        f"profile {'saved' if profile else 'none'}"
    )
    print(header, flush=True)
    names = [c.name for c in conds[1:]]
    results = {}
    for dataset in args.datasets:
        rows = []
        for prompt in load_bundled(dataset, args.n):
            row = {"id": prompt.id, **run_prompt(target, conds, prompt.text, args.repeats, profile=profile)}
            rows.append(row)
            print(
                f"  {prompt.id:<16} base {row['baseline']:6.2f} tok/s  "
                + "  ".join(f"{n} {row[n] / row['baseline']:.2f}" for n in names),
                flush=True,
            )
        mean = speedups(rows, names)
        results[dataset] = {"rows": rows, "mean": mean, "pooled": {n: pooled(rows, n) for n in names}}
        print(f"{dataset}: mean speedup " + "  ".join(f"{n} {mean[n]:.2f}×" for n in names))
        print(f"{dataset}: pooled       " + "  ".join(f"{n} {results[dataset]['pooled'][n]:.2f}×" for n in names))
        alphas = {n: mean_alpha(rows, n) for n in names}
        print(f"{dataset}: α            " + "  ".join(f"{n} {_pct(alphas[n])}" for n in names), flush=True)
    everything = [r for d in results.values() for r in d["rows"]]
    wrong = differing(everything, names)
    total = len(everything) * len(names)
    print(
        f"lossless: {total - len(wrong)}/{total} runs equal the baseline" + (f"; differing: {wrong}" if wrong else "")
    )
    others = [d for d in args.datasets if d != "structured"]
    if "structured" in results:
        print(f"target: structured auto lookup {results['structured']['mean']['auto lookup']:.2f}× (>= 1.5)")
    if others:
        rows = [r for d in others for r in results[d]["rows"]]
        fixed = [n for n in names if not n.startswith("auto")]
        mean = speedups(rows, names)
        best = max(fixed, key=mean.get)
        print(
            f"target: other sets, auto hybrid pooled {pooled(rows, 'auto hybrid'):.2f}× (>= 0.97); mean "
            f"{mean['auto hybrid']:.2f}× vs best fixed {best} {mean[best]:.2f}× (>=)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
