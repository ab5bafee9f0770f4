"""Which draft-length policy wins on a pair? Exact acceptance, the machine's measured costs, no timing noise.

Greedy speculation is lossless, so once the target's baseline continuation of a prompt is known, its
verdict on any proposal is too: it keeps the longest prefix that matches and writes the next baseline
token. This script records each prompt's baseline once with the real target (cached in the user cache),
then runs the real engine (uag.core.engine.stream: the real drafter, translator and policy) against
`ReplayModel`, a stand-in target that answers every forward pass with its baseline's next tokens at no
cost. Each run's cycles are then priced with the pair's calibration profile (uag.costs.profiles;
`CostProfile.price`: the target's pass over the width verified, the drafter's steps, the drafter's one pass
over what its first pass read — its pending token plus any backlog: the prompt, the target's corrections,
tokens committed while parked — and translation; a parked step that ended with a rehearsal, one drafter pass
over its stretch), and

    predicted speedup = generated tokens × target pass over 1 token ÷ Σ priced cycles

(the first token included on both sides; the prompt's own reading is the same for both and left out).
For the widest fixed k it also prints how often the target kept a draft per band of the drafter's confidence
in it (its probability of the token it drafted), which auto's stop rule reads (uag.core.policy.AdaptiveK.enough).
benchmarks/cost_truth.py checks that pricing against real runs. Policies: fixed k; auto (AdaptiveK,
deciding by the profile alone: learn_costs=False), one `Evidence` carried from prompt to prompt in order, as a
server keeps it per pair; "auto −NAME" for each mechanism NAME of `--ablate` (uag.core.policy.MECHANISMS, or
"all"), the same with that one switched off (each with its own carried evidence). A policy change is tried
here on dozens of prompts in minutes; the winner is then checked end to end with benchmarks/auto_vs_fixed.py.

Usage: python benchmarks/policy_replay.py [--target coder-target] [--drafter demo-drafter]
       [--datasets code wiki alpaca synthetic structured] [--n 10] [--ids code-003 …] [--max-tokens 48] [--ks 1 2 3 4]
       [--k-max 8] [--ablate all | stop_rule carried …] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
from dataclasses import replace
from datetime import date
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx

from uag.api import load_drafter, profile_for
from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.engine import Seams, generate, prompt_ids
from uag.core.evidence import CONFIDENCE_BANDS, MODEL, confidence_band
from uag.core.policy import MECHANISMS, AdaptiveK, AutoSettings, Evidence, FixedK
from uag.core.records import Run
from uag.machine import cache_dir, device_name
from uag.models.store import LoadedModel, ModelStore
from uag.study.datasets import chat_for, load_bundled


class ReplayCache:
    """A KV cache that only counts: the replayed target needs the offset and trimming, nothing else."""

    def __init__(self):
        self.offset = 0
        self.state = mx.zeros(1)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n


class ReplayModel:
    """A target that answers each position with the next token of its recorded sequence (prompt +
    baseline), as one-hot logits: greedy verification then decides exactly as the real target would."""

    def __init__(self, sequence: list[int], vocab_size: int, eos: int):
        self.sequence, self.vocab_size, self.eos = sequence, vocab_size, eos
        self.layers = [None]

    def parameters(self) -> dict:
        return {"none": mx.zeros(1)}  # nothing to weigh: the pair's r is never used here (policies are given)

    def make_cache(self) -> list:
        return [ReplayCache()]

    def __call__(self, x: mx.array, cache: list) -> mx.array:
        start, n = cache[0].offset, x.shape[1]
        cache[0].offset += n
        nxt = [self.sequence[p + 1] if p + 1 < len(self.sequence) else self.eos for p in range(start, start + n)]
        return (mx.arange(self.vocab_size)[None] == mx.array(nxt)[:, None])[None] * 30.0


def baseline(target: LoadedModel, ids: list[int], max_tokens: int) -> list[int]:
    """The target's greedy continuation, recorded once per (target, prompt, length) in the user cache."""
    key = hashlib.sha256(json.dumps([target.name, target.dtype, ids, max_tokens]).encode()).hexdigest()[:20]
    path = cache_dir() / "replay" / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    run = generate(target, None, ids, GenerationConfig(translation="baseline", max_tokens=max_tokens))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run.token_ids))
    return run.token_ids


def priced_ms(run: Run, profile: CostProfile) -> float:
    """What the run's cycles cost on the profile's machine (see the module docstring)."""
    opening = profile.target_at(1) * (run.generated - sum(c.emitted for c in run.cycles))  # it verified no draft
    return opening + sum(profile.price(c) for c in run.cycles)


def trace(c) -> str:
    """One cycle in a trace: "4/2" drafted 4, kept 2; "0" a plain step; "0r19" one that ended with a rehearsal."""
    if c.k:
        return f"{c.k}/{c.accepted}"
    return f"0r{c.drafter_read}" if c.drafter_read else "0"


def position_counts(run: Run) -> dict[str, list[int]]:
    """Per proposal position i: cycles that reached it (proposed > i, positions before accepted) and
    those that kept it; and the first position again, split by whether the cycle before was fully accepted."""
    longest = max((c.proposed for c in run.cycles), default=0)
    reached = [sum(c.proposed > i and c.accepted >= i for c in run.cycles) for i in range(longest)]
    kept = [sum(c.proposed > i and c.accepted > i for c in run.cycles) for i in range(longest)]
    after = {True: [0, 0], False: [0, 0]}
    drafted = [c for c in run.cycles if c.proposed]
    for before, c in zip(drafted, drafted[1:]):
        after[before.accepted == before.proposed][0] += 1
        after[before.accepted == before.proposed][1] += c.accepted > 0
    return {"reached": reached, "kept": kept, "after full": after[True], "after miss": after[False]}


class FixedKHeard(FixedK):
    """Fixed k whose model drafter says how sure it was of each draft (a stop rule that never stops): the same
    drafts, verdicts and price as FixedK, and the record of each cycle carries the drafts' confidence."""

    def stop_rule(self, source: str, k: int):
        return (lambda confidences: None) if source == MODEL else None


def confidence_table(runs: list[Run]) -> list[tuple[str, int, float]]:
    """How often the target kept a model draft, per band of the drafter's confidence in it (uag.core.evidence.
    CONFIDENCE_BANDS): (band, drafts judged, share kept). Only cycles whose drafts translated one for one
    into target tokens count, so that a draft's position is its target position."""
    edges = (0.0, *CONFIDENCE_BANDS, 1.0)
    judged, kept = [0] * (len(edges) - 1), [0] * (len(edges) - 1)
    for run in runs:
        for c in run.cycles:
            if not c.confidence or len(c.proposed_ids) != len(c.draft_ids):
                continue
            for j, q in enumerate(c.confidence[: len(c.draft_ids)]):
                if j > c.accepted:
                    break
                judged[confidence_band(q)] += 1
                kept[confidence_band(q)] += j < c.accepted
    bands = [b for b in range(len(judged)) if judged[b]]
    return [(f"{edges[b]:.2f}–{edges[b + 1]:.2f}", judged[b], kept[b] / judged[b]) for b in bands]


def auto_settings(args) -> dict[str, AutoSettings]:
    """auto's variants by name: "auto" (the defaults), "auto −NAME" per mechanism ablated, "auto[FIELD=V,…]" per
    --auto variant; all deciding by the profile's costs alone (learn_costs=False: no timing noise)."""
    pinned = AutoSettings(learn_costs=False)
    out = {"auto": pinned}
    for name in MECHANISMS if "all" in args.ablate else args.ablate:
        out[f"auto −{name}"] = replace(pinned, **{name: False})
    for variant in args.auto:  # "rehearse_every=8,prior=0.4": AutoSettings' fields changed
        fields = {k: float(v) if "." in v else int(v) for k, v in (kv.split("=") for kv in variant.split(","))}
        out[f"auto[{variant}]"] = replace(pinned, **fields)
    return out


def policies(args, profile: CostProfile, carried: dict[str, Evidence]) -> dict[str, object]:
    """Each policy's maker by name; each auto variant learns into its own `carried` evidence."""
    out = {f"k={k}": (lambda k=k: FixedKHeard(k)) for k in args.ks}
    for name, settings in auto_settings(args).items():
        evidence = carried.setdefault(name, Evidence())
        out[name] = lambda s=settings, e=evidence: AdaptiveK(k_max=args.k_max, profile=profile, evidence=e, settings=s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="coder-target")
    parser.add_argument("--drafter", default="demo-drafter")
    parser.add_argument("--datasets", nargs="+", default=["code", "wiki", "alpaca", "synthetic", "structured"])
    parser.add_argument("--n", type=int, default=10, help="prompts per dataset")
    parser.add_argument("--ids", nargs="+", help="only these prompt ids of the datasets (e.g. code-003 code-005)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--auto", nargs="*", default=[], help="auto variants: AutoSettings fields, rehearse_every=8")
    parser.add_argument(
        "--ablate", nargs="*", default=[], choices=[*MECHANISMS, "all"], help="auto with each of these switched off"
    )
    parser.add_argument("--trace", nargs="*", default=[], help="print these policies' k per cycle, e.g. auto")
    parser.add_argument("--json", help="also write every row to this JSON file")
    args = parser.parse_args()

    targets = ModelStore()  # the target's own store: its weights are dropped once its baselines are recorded
    target = targets.get(args.target)
    drafter = load_drafter(args.drafter)
    profile = profile_for(target, drafter, progress=lambda m: print(f"[calibrate] {m}"))
    work = []  # (dataset, prompt id, prompt ids, baseline ids)
    for dataset in args.datasets:
        for prompt in load_bundled(dataset, args.n, args.ids):
            ids = prompt_ids(target, prompt.text, chat=chat_for(prompt, False))
            work.append((dataset, prompt.id, ids, baseline(target, ids, args.max_tokens)))
    vocab_size, eos = target.model.args.vocab_size, min(target.eos_ids)
    template = replace(target, model=None)  # its tokenizer and config, without the weights
    del targets, target
    gc.collect()
    mx.clear_cache()

    carried: dict[str, Evidence] = {}  # per auto variant, what it learned on the prompts before this one
    names = list(policies(args, profile, carried))
    reads = ", ".join(f"{n}: {profile.drafter_pass(n):.0f}" for n in (1, 2, 4, 8, 16, 32, 64, 128))
    print(
        f"policy replay — {date.today()}, {args.target} ← {args.drafter}, {device_name()}, profile: target "
        f"{profile.target_at(1):.0f} ms per token, drafter step {profile.drafter_ms:.1f} ms, {args.max_tokens} tokens"
        f"\ndrafter pass over n tokens (ms): {reads}"
    )
    rows, heard = [], {}  # heard: per dataset, the widest fixed k's runs (their drafts' confidence)
    for dataset, pid, ids, base in work:
        replay = replace(template, model=ReplayModel([*ids, *base], vocab_size, eos))
        row = {"dataset": dataset, "id": pid, "target ms": len(base) * profile.target_at(1)}  # the target alone
        for name, make in policies(args, profile, carried).items():
            strategy = "auto" if name.startswith("auto") else "context"
            config = GenerationConfig.parse(strategy=strategy, k=args.k_max, max_tokens=args.max_tokens)
            run = generate(replay, drafter, ids, config, seams=Seams(policy=make()))
            assert run.token_ids == base, (pid, name)  # the replay is only as good as this
            row[f"ms {name}"] = priced_ms(run, profile)
            row[name] = row["target ms"] / row[f"ms {name}"]
            row[f"alpha {name}"] = run.acceptance_rate
            row[f"ks {name}"] = [c.k for c in run.cycles]
            row[f"trace {name}"] = " ".join(trace(c) for c in run.cycles)
            row[f"positions {name}"] = position_counts(run)
            if name == f"k={max(args.ks)}":
                heard.setdefault(dataset, []).append(run)
        rows.append(row)
        print(f"  {pid:<16} " + "  ".join(f"{n} {row[n]:.2f}" for n in names), flush=True)
        for name in args.trace:
            print(f"    {name}: k/accepted per cycle (r: a rehearsal that read n tokens) {row[f'trace {name}']}")
    for dataset in args.datasets:
        subset = [r for r in rows if r["dataset"] == dataset]
        print(f"{dataset:<11} mean " + "  ".join(f"{n} {statistics.fmean(r[n] for r in subset):.3f}×" for n in names))
        pooled = {n: sum(r["target ms"] for r in subset) / sum(r[f"ms {n}"] for r in subset) for n in names}
        print(f"{'':<11} pooled " + "  ".join(f"{n} {s:.3f}×" for n, s in pooled.items()))
        alphas = {n: [r[f"alpha {n}"] for r in subset if r[f"alpha {n}"] is not None] for n in names}
        print(f"{'':<11} α " + "  ".join(f"{n} {statistics.fmean(a) if a else 0:.0%}" for n, a in alphas.items()))
        widest = f"k={max(args.ks)}"
        counts = [r[f"positions {widest}"] for r in subset]
        depth = max(len(c["reached"]) for c in counts)
        shares = []
        for i in range(depth):
            reached = sum(c["reached"][i] for c in counts if i < len(c["reached"]))
            kept = sum(c["kept"][i] for c in counts if i < len(c["kept"]))
            shares.append(f"{kept / reached:.0%} of {reached}" if reached else "–")
        full = [sum(c[key][j] for c in counts) for key in ("after full", "after miss") for j in (0, 1)]
        print(
            f"{'':<11} {widest}: P(position i kept | the ones before kept) "
            + ", ".join(shares)
            + f"; first kept after a fully accepted cycle {full[1] / max(full[0], 1):.0%} of {full[0]}, "
            f"after a miss {full[3] / max(full[2], 1):.0%} of {full[2]}"
        )
        table = confidence_table(heard.get(dataset, []))
        print(
            f"{'':<11} {widest}: drafts kept by the drafter's confidence in them "
            + ", ".join(f"{band} {share:.0%} of {n}" for band, n, share in table)
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
