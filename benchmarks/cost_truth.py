"""Does the cost model predict what runs measure? Predicted vs measured cycle time and speedup, per pair and k.

For each prompt of the bundled sets: the target alone, then `context` at each fixed k for each drafter (and
prompt lookup), run side by side, the order rotating every repeat. Each speculative run's own cycles are
priced with the pair's profile, the one `auto` decides by (uag.costs.profiles: the saved profile, or a quick
calibration as users get): `CostProfile.price` charges a cycle the target's verification at the width it
verified, the drafter's steps and what its first pass read, translation; a lookup's proposal the lookup
and the pass. The acceptance is the run's own, so where prediction and measurement part the costs are
wrong, not α. Timing as the records define it: from the prompt pass's tokens to the last token, so the
cycle the prompt pass verified is left out of both sides. Printed per drafter, dataset and k (pooled over
prompts; each prompt's median run of --repeats):

  cycle ms    measured (wall time ÷ cycles) · the cycles' own phases (draft + translate + verify + re-sync)
              · predicted (Σ priced ÷ cycles), and the prediction's error against the wall time;
  speedup     measured (tokens/s over the target alone's) vs predicted (a priced target step × tokens ÷
              Σ priced); the target alone's step, measured vs the profile's;
  phases      mean verification ms vs the profile's at the widths verified; drafting ms vs priced.

Runs on the demo pair by default. The coder pair, once converted (`python -m uag models coder-target
coder-drafter`, ~1.6 GB): --target coder-target --drafters demo-drafter demo-target coder-drafter lookup.
Run it on a quiet machine (the header prints the load); every greedy run must reproduce the target alone.

Usage: python benchmarks/cost_truth.py [--target demo-target] [--drafters demo-drafter lookup]
       [--datasets code wiki alpaca synthetic structured] [--n 3] [--max-tokens 48] [--ks 1 2 3 4]
       [--repeats 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx

from uag.api import generate, load, load_drafter, profile_for
from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.engine import prompt_ids
from uag.core.records import Run
from uag.machine import backend, blas, device_name
from uag.study.datasets import BUNDLED, chat_for, load_bundled


@dataclass(frozen=True)
class Priced:
    """One speculative run beside its prediction: the cycles after the prompt pass, measured and priced."""

    tokens: int  # tokens after the prompt pass's
    cycles: int
    wall_ms: float  # first token to last
    phases_ms: float  # Σ the cycles' own phase timings
    predicted_ms: float  # Σ CostProfile.price
    verify_ms: float  # Σ measured verification
    verify_predicted_ms: float
    draft_ms: float  # Σ measured drafting (drafter passes or lookups)
    draft_predicted_ms: float


def priced(run: Run, profile: CostProfile) -> Priced:
    """The run's cycles after its prompt pass (whose time the records leave out), measured and priced."""
    cycles = run.cycles
    if cycles and sum(c.emitted for c in cycles) == run.generated:  # the prompt pass verified the first cycle
        cycles = cycles[1:]
    verify_predicted = [profile.target_at(c.proposed + 1) for c in cycles]
    return Priced(
        tokens=run.generated - run.opening,
        cycles=len(cycles),
        wall_ms=(run.generation_s or 0.0) * 1000,
        phases_ms=sum(c.ms for c in cycles),
        predicted_ms=sum(profile.price(c) for c in cycles),
        verify_ms=sum(c.verify_ms for c in cycles),
        verify_predicted_ms=sum(verify_predicted),
        draft_ms=sum(c.draft_ms for c in cycles),
        draft_predicted_ms=sum(
            profile.price(c) - v - (profile.translate_ms if c.k and c.source == "model" else 0.0)
            for c, v in zip(cycles, verify_predicted)
        ),
    )


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.tokens_per_second or 0.0)[len(runs) // 2]


def measure_prompt(target, drafters: dict, ids: list[int], args, repeats: int) -> dict:
    """Every condition on one prompt, `repeats` times in rotating order; the median run of each."""
    g = lambda **kw: GenerationConfig.parse(max_tokens=args.max_tokens, **kw)  # noqa: E731
    conditions = [("baseline", None, g(strategy="baseline"))]
    for name, choice in drafters.items():
        conditions += [(f"{name} k={k}", choice, g(strategy="context", k=k)) for k in args.ks]
    runs: dict[str, list[Run]] = {name: [] for name, _, _ in conditions}
    for rep in range(repeats):
        shift = rep % len(conditions)
        for name, drafter, config in [*conditions[shift:], *conditions[:shift]]:
            runs[name].append(generate(target, drafter, ids, config))
    return {name: median_run(r) for name, r in runs.items()}


def summarise(rows: list[dict], profiles: dict[str, CostProfile]) -> list[dict]:
    """Per drafter, dataset and k, pooled over prompts: measured and predicted cycle time and speedup."""
    out = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        subset = [r for r in rows if r["dataset"] == dataset]
        base_ms = sum(r["runs"]["baseline"].generation_s * 1000 for r in subset)
        base_tokens = sum(r["runs"]["baseline"].generated - r["runs"]["baseline"].opening for r in subset)
        for name in [n for n in subset[0]["runs"] if n != "baseline"]:
            drafter = name.rsplit(" k=", 1)[0]
            parts = [priced(r["runs"][name], profiles[drafter]) for r in subset]
            tokens, cycles = sum(p.tokens for p in parts), sum(p.cycles for p in parts)
            step_predicted = profiles[drafter].target_at(1)
            runs = [r["runs"][name] for r in subset]
            out.append(
                {
                    "dataset": dataset,
                    "condition": name,
                    "prompts": len(subset),
                    "cycles": cycles,
                    "alpha": sum(r.accepted for r in runs) / max(1, sum(r.proposed for r in runs)),
                    "same": all(r["runs"][name].token_ids == r["runs"]["baseline"].token_ids for r in subset),
                    "cycle_ms": sum(p.wall_ms for p in parts) / cycles,
                    "cycle_phases_ms": sum(p.phases_ms for p in parts) / cycles,
                    "cycle_predicted_ms": sum(p.predicted_ms for p in parts) / cycles,
                    "speedup": (tokens / sum(p.wall_ms for p in parts)) / (base_tokens / base_ms),
                    "speedup_predicted": (tokens / sum(p.predicted_ms for p in parts)) * step_predicted,
                    "step_ms": base_ms / base_tokens,
                    "step_predicted_ms": step_predicted,
                    "verify_ms": sum(p.verify_ms for p in parts) / cycles,
                    "verify_predicted_ms": sum(p.verify_predicted_ms for p in parts) / cycles,
                    "draft_ms": sum(p.draft_ms for p in parts) / cycles,
                    "draft_predicted_ms": sum(p.draft_predicted_ms for p in parts) / cycles,
                }
            )
    return out


def _error(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.0%}" if measured else "–"


def report(summary: list[dict]) -> str:
    """The summary as a table, one line per drafter, dataset and k."""
    lines = [
        f"{'dataset':<11} {'condition':<22} {'α':>4} {'cycle ms: wall':>15} {'phases':>7} {'predicted':>9} {'err':>6}  "
        f"{'speedup':>7} {'predicted':>9} {'err':>6}  {'step ms':>7} {'profile':>7}  {'verify':>6} {'pred':>6}  "
        f"{'draft':>6} {'pred':>6}"
    ]
    for s in summary:
        lines.append(
            f"{s['dataset']:<11} {s['condition']:<22} {s['alpha']:4.0%} {s['cycle_ms']:15.1f} "
            f"{s['cycle_phases_ms']:7.1f} {s['cycle_predicted_ms']:9.1f} "
            f"{_error(s['cycle_predicted_ms'], s['cycle_ms']):>6}  {s['speedup']:6.2f}× {s['speedup_predicted']:8.2f}× "
            f"{_error(s['speedup_predicted'], s['speedup']):>6}  {s['step_ms']:7.1f} {s['step_predicted_ms']:7.1f}  "
            f"{s['verify_ms']:6.1f} {s['verify_predicted_ms']:6.1f}  "
            f"{s['draft_ms']:6.1f} {s['draft_predicted_ms']:6.1f}" + ("" if s["same"] else "  OUTPUT DIFFERS")
        )
    within = [s for s in summary if abs(s["speedup_predicted"] / s["speedup"] - 1) <= 0.10]
    lines.append(f"predicted speedup within ±10 % of measured: {len(within)} of {len(summary)} (drafter, dataset, k)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--drafters", nargs="+", default=["demo-drafter", "lookup"])
    parser.add_argument("--datasets", nargs="+", default=list(BUNDLED), choices=BUNDLED)
    parser.add_argument("--n", type=int, default=3, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--repeats", type=int, default=1, help="runs per condition and prompt (the median is kept)")
    parser.add_argument("--json", help="also write the summary to this JSON file")
    args = parser.parse_args()

    target = load(args.target)
    drafters = {name: load_drafter(name) for name in args.drafters}
    say = lambda message: print(f"[calibrate] {message}", flush=True)  # noqa: E731
    profiles = {name: profile_for(target, choice, progress=say) for name, choice in drafters.items()}
    load1, load5, _ = os.getloadavg()
    print(
        f"cost truth — {date.today()}, {target.name} ({target.dtype}) with {', '.join(args.drafters)}, "
        f"{device_name()} ({backend()}, {os.cpu_count()} cores, load {load1:.1f} / {load5:.1f}), MLX {mx.__version__}, "
        f"BLAS {blas()}, {args.max_tokens} tokens, {args.n} prompts per set, median of {args.repeats}",
        flush=True,
    )
    measure_prompt(target, drafters, prompt_ids(target, "def f(x):"), args, 1)  # warm-up: every path once
    rows = []
    for dataset in args.datasets:
        for prompt in load_bundled(dataset, args.n):
            ids = prompt_ids(target, prompt.text, chat=chat_for(prompt, False))
            runs = measure_prompt(target, drafters, ids, args, args.repeats)
            rows.append({"dataset": dataset, "id": prompt.id, "runs": runs})
            print(f"  {dataset}/{prompt.id} done", flush=True)
    summary = summarise(rows, profiles)
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
