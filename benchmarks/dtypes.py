"""The dtypes users run: a pair in float32, bfloat16, q8 and q4 — what speculation gains, and how often and at
what margins greedy output parts from the target alone (issue 26).

Per dtype (target and drafter both in it, converted once into the user cache), per prompt, side by side and
interleaved (medians of --repeats): the target alone, then `auto` over prompt lookup, over the hybrid
(lookup + model) and over the model drafter. Every greedy run is compared with the baseline's tokens; where
they part, the target's margin there (top-two logit gap, in the plain step and in the speculative pass) is
computed and the divergence classified (uag.runtime.divergence): a near-tie, or a bug.

First, per dtype, what the near-tie thresholds rest on: how far a k-token verification pass moves the gap
between the target's top two logits from what one-token steps compute (`--rounding`; median / p99 / max over
--rounding-tokens positions of each prompt). A divergence whose margin is below that is rounding.

Runs unchanged on the CPU and on MLX's CUDA backend (a GPU, where bfloat16 and quantized kernels amortise
verification; on a CPU only float32 does, so expect speedups < 1 there for the other dtypes).

Usage: python benchmarks/dtypes.py [--target demo-target] [--drafter demo-drafter]
       [--dtypes float32 bfloat16 q8 q4] [--datasets structured wiki] [--n 3] [--max-tokens 48] [--k 8]
       [--repeats 1] [--rounding-tokens 24] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

from side_by_side import Condition  # (this folder; loads uag first)

# isort: split
import mlx.core as mx

from uag.core.config import GenerationConfig
from uag.core.drafters import load_drafter_choice
from uag.core.engine import generate
from uag.core.passes import prefill
from uag.costs.pair import profile_for
from uag.machine import backend, blas, device_name
from uag.models.dtypes import DTYPES
from uag.models.loading import check_memory, load_model
from uag.models.store import ModelStore
from uag.runtime.divergence import DIVERGED, IDENTICAL, NEAR_TIE, near_tie_margin
from uag.runtime.margins import compare_runs
from uag.study.datasets import load_bundled


def rounding(target, prompts, *, k: int, tokens: int) -> list[float]:
    """|change of the top-two logit gap| between one-token steps and k-token passes over the same greedy text,
    at every position (the plain steps' top two tokens; both computations read the same prefix)."""
    deltas = []
    for prompt in prompts:
        ids = target.tokenizer.encode(prompt.text)
        cache = target.make_cache()
        prefill(target.model, cache, ids[:-1])
        text, steps = list(ids), []
        for _ in range(tokens):  # the plain steps: one token at a time, greedy
            logits = target.model(mx.array(text[-1:])[None], cache=cache)[0, -1].astype(mx.float32)
            steps.append(logits)
            text.append(int(mx.argmax(logits)))
        cache = target.make_cache()
        prefill(target.model, cache, ids[:-1])
        passes = []
        for start in range(len(ids) - 1, len(ids) - 1 + tokens, k):  # the same text read k tokens per pass
            chunk = text[start : min(start + k, len(ids) - 1 + tokens)]
            passes += list(target.model(mx.array(chunk)[None], cache=cache)[0].astype(mx.float32))
        for a, b in zip(steps, passes):
            first, second = (int(i) for i in mx.argsort(a)[-2:][::-1])
            deltas.append(abs(float((a[first] - a[second]) - (b[first] - b[second]))))
    return deltas


def measure_dtype(args, dtype: str, prompts) -> dict:
    store = ModelStore()
    check_memory(store, [("target", args.target, dtype), ("drafter", args.drafter, dtype)])
    say = lambda message: print(f"[dtypes] {dtype}: {message}", flush=True)  # noqa: E731
    target = load_model(store, args.target, role="target", dtype=dtype, progress=say)
    choices = {
        name: load_drafter_choice(store, spec, dtype=dtype, progress=say)
        for name, spec in (("lookup", "lookup"), ("hybrid", f"lookup+{args.drafter}"), ("model", args.drafter))
    }
    auto = GenerationConfig(k=args.k, k_policy="adaptive", max_tokens=args.max_tokens)
    conditions = [Condition("baseline", None, auto.replace(strategy="baseline"))]
    conditions += [Condition(name, choice, auto) for name, choice in choices.items()]
    profiles = {c.name: profile_for(target, c.drafter, progress=say) for c in conditions[1:]}
    generate(target, choices["hybrid"], prompts[0].text, auto.replace(max_tokens=8))  # warm-up, not recorded

    deltas = rounding(target, prompts, k=args.k, tokens=args.rounding_tokens) if args.rounding_tokens else []
    rows = []
    for prompt in prompts:
        rates = {c.name: [] for c in conditions}
        runs = {}
        for rep in range(args.repeats):  # interleaved, rotating, as benchmarks/side_by_side.py does
            shift = rep % len(conditions)
            for c in [*conditions[shift:], *conditions[:shift]]:
                kw = {"profile": profiles[c.name]} if c.name in profiles else {}
                runs[c.name] = generate(target, c.drafter, prompt.text, c.config, **kw)
                rates[c.name].append(runs[c.name].tokens_per_second or 0.0)
        row = {"dtype": dtype, "prompt": f"{prompt.dataset}/{prompt.id}", "tokens": runs["baseline"].generated}
        row["baseline tps"] = statistics.median(rates["baseline"])
        for c in conditions[1:]:
            verdict = compare_runs(target, runs["baseline"], runs[c.name])
            row[c.name] = {
                "speedup": statistics.median(rates[c.name]) / row["baseline tps"] if row["baseline tps"] else None,
                "alpha": runs[c.name].acceptance_rate,
                "divergence": None if verdict is None else verdict.to_dict(),
            }
        rows.append(row)
        print(f"[dtypes] {dtype} {row['prompt']}: " + ", ".join(_cell(row[c.name]) for c in conditions[1:]), flush=True)
    return {
        "dtype": dtype,
        "target_dtype": target.dtype,
        "drafter_dtype": choices["model"].model.dtype,
        "target_bytes": target.weight_bytes,
        "drafter_bytes": choices["model"].model.weight_bytes,
        "threshold": near_tie_margin(target.dtype),
        "rounding": _spread(deltas),
        "rows": rows,
    }


def _cell(result: dict) -> str:
    kind = (result["divergence"] or {}).get("kind")
    mark = {IDENTICAL: "", NEAR_TIE: " (near-tie)", DIVERGED: " (BUG)"}.get(kind, " (not compared)")
    speedup = result["speedup"]
    return f"{'–' if speedup is None else f'{speedup:.2f}x'}{mark}"


def _spread(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
    }


def report(results: list[dict], names=("lookup", "hybrid", "model")) -> str:
    """Markdown: per dtype the mean speedup of each drafter under auto, and how greedy outputs compared."""
    lines = [
        "| dtype | target / drafter MB | " + " | ".join(f"auto {n}" for n in names) + " | parted (near-tie / bug) "
        "| margins where parted | pass vs step, max gap change | near-tie below |",
        "|---" * (len(names) + 6) + "|",
    ]
    for result in results:
        rows = result["rows"]
        cells = []
        kinds, margins = [], []
        for name in names:
            speedups = [r[name]["speedup"] for r in rows if r[name]["speedup"] is not None]
            cells.append(f"{statistics.fmean(speedups):.2f}x" if speedups else "–")
            for r in rows:
                d = r[name]["divergence"]
                if d is not None and d["kind"] != IDENTICAL:
                    kinds.append(d["kind"])
                    margins.append(d["margin"])
        near, bugs = kinds.count(NEAR_TIE), kinds.count(DIVERGED)
        compared = sum(1 for r in rows for n in names if r[n]["divergence"] is not None)
        shown = ", ".join("?" if m is None else f"{m:.3g}" for m in sorted(margins, key=lambda m: m or 0)) or "–"
        moved = "–" if result["rounding"] is None else f"{result['rounding']['max']:.3g}"
        lines.append(
            f"| {result['dtype']} | {result['target_bytes'] / 1e6:.0f} / {result['drafter_bytes'] / 1e6:.0f} | "
            + " | ".join(cells)
            + f" | {near + bugs} of {compared} ({near} / {bugs}) | {shown} | "
            f"{moved} | {result['threshold']:g} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--drafter", default="demo-drafter")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "q8", "q4"], choices=DTYPES)
    parser.add_argument("--datasets", nargs="+", default=["structured", "wiki"])
    parser.add_argument("--n", type=int, default=3, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=8, help="auto's largest draft length (and the rounding pass's k)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounding-tokens", type=int, default=24, help="positions per prompt; 0 skips it")
    parser.add_argument("--json", type=Path, help="write every row and the summary here")
    args = parser.parse_args()
    prompts = [p for name in args.datasets for p in load_bundled(name, args.n)]
    started = time.perf_counter()
    results = [measure_dtype(args, dtype, prompts) for dtype in args.dtypes]
    machine = f"{device_name()} ({backend()}, MLX {mx.__version__}, {blas()}), {date.today()}"
    print(
        f"\n{args.target} with {args.drafter}, k <= {args.k}, {args.max_tokens} tokens, {len(prompts)} prompts "
        f"({', '.join(args.datasets)}); {machine}; {time.perf_counter() - started:.0f} s\n"
    )
    print(report(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"machine": machine, "args": vars(args) | {"json": str(args.json)}, "results": results},
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
