"""A pair where a cross-family model drafter pays: Qwen2.5-Coder-1.5B drafted for by SmolLM2-135M,
Gemma-3-270M (both through translation) and Qwen2.5-Coder-0.5B (same tokenizer), plus lookup and auto.

Per dataset and prompt, side by side and interleaved (medians of --repeats): the target alone; `context`
at k = --ks for each cross-family drafter; the same-tokenizer drafter at k = --identity-ks; auto over
SmolLM2 (k ≤ --k-max, with the pair's measured costs: the saved profile, or a quick calibration on first
use, as users get); lookup alone and lookup + SmolLM2 under auto. Prints per dataset and condition the
mean speedup (tokens/s ÷ the baseline's on the same prompt), pooled speedup and α; every greedy run must
reproduce the baseline's tokens. Prompts of the `code` set that ask for a chat template get it.

Targets (issue 16): `code`, SmolLM2 `context` at its best fixed k ≥ 1.25×; auto (SmolLM2) ≥ that best
fixed k on the `code` mean and ≥ 0.97× on every dataset; Qwen2.5-Coder-0.5B at its best k ≥ 1.4×.

Usage: python benchmarks/coder_pair.py [--datasets code wiki alpaca synthetic structured] [--n 3]
       [--max-tokens 48] [--repeats 2] [--ks 1 2 3 4] [--identity-ks 2 4 8] [--k-max 8]
       [--drafters demo-drafter demo-target] [--only 'SmolLM2 k=2' 'auto SmolLM2' …] [--json FILE]
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

from uag.api import load, load_drafter, profile_for
from uag.core.config import GenerationConfig
from uag.core.engine import prompt_ids
from uag.machine import backend, blas, device_name
from uag.study.datasets import chat_for, load_bundled

SHORT = {"demo-drafter": "SmolLM2", "demo-target": "Gemma", "coder-drafter": "Qwen0.5B"}


def conditions(args, chat: bool) -> list[Condition]:
    g = lambda **kw: GenerationConfig.parse(max_tokens=args.max_tokens, chat=chat, **kw)  # noqa: E731
    out = [Condition("baseline", None, g(strategy="baseline"))]
    for name in args.drafters:
        out += [
            Condition(f"{SHORT.get(name, name)} k={k}", load_drafter(name), g(strategy="context", k=k)) for k in args.ks
        ]
    if args.same_tokenizer:
        same = load_drafter(args.same_tokenizer)
        out += [Condition(f"Qwen0.5B k={k}", same, g(strategy="context", k=k)) for k in args.identity_ks]
    first, auto = args.drafters[0], g(strategy="auto", k=args.k_max)
    label = SHORT.get(first, first)
    out += [
        Condition(f"auto {label}", load_drafter(first), auto),
        Condition("auto lookup", load_drafter("lookup"), auto),
        Condition(f"auto lookup+{label}", load_drafter(f"lookup+{first}"), auto),
    ]
    return [c for c in out if not args.only or c.name == "baseline" or c.name in args.only]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="coder-target")
    parser.add_argument("--drafters", nargs="+", default=["demo-drafter", "demo-target"])
    parser.add_argument("--same-tokenizer", default="coder-drafter", help="'' to leave it out")
    parser.add_argument("--datasets", nargs="+", default=["code", "wiki", "alpaca", "synthetic", "structured"])
    parser.add_argument("--n", type=int, default=3, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--identity-ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--only", nargs="+", help="run only these conditions beside the baseline, e.g. 'auto SmolLM2'")
    parser.add_argument("--json", help="also write every row to this JSON file")
    args = parser.parse_args()

    target = load(args.target)
    profile = profile_for(target, load_drafter(args.drafters[0]), progress=lambda m: print(f"[calibrate] {m}"))
    header = (
        f"coder pair — {date.today()}, {target.name} ({target.dtype}), {device_name()} ({backend()}), "
        f"MLX {mx.__version__}, BLAS {blas()}, {args.max_tokens} tokens, median of {args.repeats}"
    )
    print(header, flush=True)
    run_prompt(target, conditions(args, False), "def f(x):", 1)  # warm-up: every path compiled once
    results = {}
    for dataset in args.datasets:
        rows = []
        for prompt in load_bundled(dataset, args.n):
            chat = chat_for(prompt, False)
            conds = conditions(args, chat)
            text = prompt_ids(target, prompt.text, chat=chat)
            row = {"id": prompt.id, **run_prompt(target, conds, text, args.repeats, profile=profile)}
            rows.append(row)
            names = [c.name for c in conds[1:]]
            print(
                f"  {prompt.id:<16} base {row['baseline']:5.2f} tok/s  "
                + "  ".join(f"{n} {row[n] / row['baseline']:.2f}" for n in names),
                flush=True,
            )
        mean = speedups(rows, names)
        results[dataset] = {"rows": rows, "mean": mean, "pooled": {n: pooled(rows, n) for n in names}}
        for n in names:
            a = mean_alpha(rows, n)
            print(
                f"{dataset:<11} {n:<22} mean {mean[n]:.2f}×  pooled {results[dataset]['pooled'][n]:.2f}×  "
                f"α {'–' if a is None else f'{a:.0%}'}",
                flush=True,
            )
    everything = [r for d in results.values() for r in d["rows"]]
    wrong = differing(everything, names)
    total = len(everything) * len(names)
    print(
        f"lossless: {total - len(wrong)}/{total} runs equal the baseline" + (f"; differing: {wrong}" if wrong else "")
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
