"""uag side by side with the study's own implementation (the mlx-lm fork), on the same pair and prompts.

The fork (krzysiekfonal/mlx-lm, branch feature/slem-with-context-aware, commit be2f622) is a peer to
measure against: it is never copied into this repository. Give a checkout of it; it is installed into a
scratch venv (MLX's CPU wheel of the version uag runs, and the fork's own requirements from PyPI) and run
there by benchmarks/peer_fork_runner.py, a persistent subprocess. Both sides load the same converted demo
folders in float32 with the same OpenBLAS, get the same prompt ids, and run greedy, 48 tokens, one
condition at a time, interleaved fork / uag, in an order that rotates every repeat; medians are taken.

Per prompt: lossless (ids equal to the side's own baseline, every repeat), share of output tokens from
the drafter, α (the fork's proposals are counted from its translation calls), end-to-end tokens/s
(tokens / time from the call to the last token: the fork yields its first token only after its first
cycle, so uag's first-to-last metric would flatter it), speedup against each side's own baseline.

Usage: python benchmarks/peer_fork.py FORK_CHECKOUT [--venv DIR] [--datasets wiki alpaca synthetic]
       [--n 4] [--skip 0] [--english 4] [--ks 2 4] [--window 10] [--strategies context] [--max-tokens 48]
       [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import venv
from datetime import date
from importlib import metadata
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx

from uag.machine import backend, blas, device_name
from uag.models import demo
from uag.study.datasets import Prompt, load_bundled

RUNNER = Path(__file__).with_name("peer_fork_runner.py")
DEFAULT_VENV = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "uag" / "peer-fork-venv"
# Held-out English prompts: neither side was tuned on them (the bundled sets are Polish).
ENGLISH = (
    "The history of the bicycle begins in the early nineteenth century, when",
    "Explain in simple words why the sky is blue during the day and red at sunset.",
    "Write a short list of five tips for someone who wants to learn to cook.",
    "What is the capital of Australia, and why is it not Sydney?",
)
SIDES = ("fork", "uag")


# --- the fork's venv and runner ------------------------------------------------------------------


def ensure_venv(fork: Path, where: Path) -> Path:
    """A venv with the fork installed next to the MLX, transformers and tokenizers versions uag uses;
    reused while the fork's commit and those versions are unchanged. Returns its python."""
    python = where / "bin" / "python"
    pins = [f"mlx[cpu]=={mx.__version__}"] + [
        f"{name}=={metadata.version(name)}" for name in ("transformers", "tokenizers", "numpy")
    ]
    commit = subprocess.run(["git", "-C", str(fork), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    stamp = json.dumps({"commit": commit.strip(), "pins": pins})
    if python.exists() and (where / "uag-peer.json").exists() and (where / "uag-peer.json").read_text() == stamp:
        return python
    print(f"installing the fork into {where} ...", file=sys.stderr)
    venv.create(where, with_pip=True, clear=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pins, str(fork)], check=True)
    (where / "uag-peer.json").write_text(stamp)
    return python


class Fork:
    """The fork running in its own venv: one request, one answer, over pipes."""

    def __init__(self, python: Path, target: Path, drafter: Path):
        self.proc = subprocess.Popen(
            [str(python), str(RUNNER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        library = blas().removeprefix("openblas:") if blas().startswith("openblas:") else None
        self.info = self.ask({"cmd": "load", "target": str(target), "drafter": str(drafter), "openblas": library})
        if self.info["blas"] != blas():
            raise RuntimeError(f"BLAS differs: fork {self.info['blas']}, uag {blas()}")

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        answer = json.loads(self.proc.stdout.readline() or '{"error": "the fork runner exited"}')
        if "error" in answer:
            raise RuntimeError(f"fork runner: {answer['error']}")
        return answer

    def run(self, mode: str, ids: list[int], k: int, args) -> dict:
        keys = ("window", "max_tokens", "temperature", "seed")
        out = self.ask(
            {"cmd": "run", "mode": mode, "prompt_ids": ids, "k": k, **{key: getattr(args, key) for key in keys}}
        )
        n = len(out["ids"])
        return {
            "ids": out["ids"],
            "drafted": sum(out["from_draft"]),
            "proposed": out["proposed"] if mode != "baseline" else None,
            "tps": n / (out["times"][-1] - out["t_call"]),
        }

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_uag(target, drafter, mode: str, ids: list[int], k: int, args) -> dict:
    config = uag.GenerationConfig.parse(
        strategy=mode, k=k, window=args.window, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    t_call = time.perf_counter()
    run = uag.generate(target, None if mode == "baseline" else drafter, ids, config)
    stats = run.stats()
    return {
        "ids": run.token_ids,
        "drafted": stats["accepted"],
        "proposed": stats["proposed"] if mode != "baseline" else None,
        "tps": run.generated / (run.last_token_s - t_call),
    }


# --- measuring -----------------------------------------------------------------------------------


def conditions(ks, strategies) -> list[tuple[str, int]]:
    return [("baseline", 0)] + [(s, k) for k in ks for s in strategies]


def measure_prompt(fork: Fork, pair, ids: list[int], args) -> dict:
    """Every (side, condition) `repeats` times; fork and uag alternate condition by condition, and the
    order of conditions rotates every repeat, so drift on a shared machine hits both sides alike."""
    conds = conditions(args.ks, args.strategies)
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for rep in range(args.repeats):
        shift = rep % len(conds)
        for mode, k in conds[shift:] + conds[:shift]:
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                if side == "fork":
                    r = fork.run(mode, ids, k or 1, args)
                else:
                    r = run_uag(*pair, mode, ids, k or 1, args)
                runs.setdefault((side, mode, k), []).append(r)
    return summarise_prompt(runs, conds, sampled=args.temperature > 0)


def summarise_prompt(runs: dict, conds, *, sampled: bool = False) -> dict:
    """Per side and condition: lossless, drafter share, α, median tokens/s, speedup vs own baseline.
    Sampled runs (temperature > 0) have no lossless check: each run draws its own tokens."""
    row: dict = {"baseline_agree": runs[("fork", "baseline", 0)][0]["ids"] == runs[("uag", "baseline", 0)][0]["ids"]}
    for side in SIDES:
        base = runs[(side, "baseline", 0)]
        base_tps = statistics.median(r["tps"] for r in base)
        row[f"{side} baseline tps"] = base_tps
        for mode, k in conds[1:]:
            rs = runs[(side, mode, k)]
            first = rs[0]
            key = f"{side} {mode} k={k}"
            row[key] = {
                "lossless": None if sampled else all(r["ids"] == base[0]["ids"] for r in rs + base),
                "generated": len(first["ids"]),
                "share": first["drafted"] / len(first["ids"]),
                "alpha": first["drafted"] / first["proposed"] if first["proposed"] else None,
                "proposed": first["proposed"],
                "tps": statistics.median(r["tps"] for r in rs),
                "speedup": statistics.median(r["tps"] for r in rs) / base_tps,
            }
    return row


def summarise(rows: list[dict], ks, strategies, datasets) -> dict:
    """The issue's target figures, per strategy and k."""
    out = {}
    for mode in strategies:
        for k in ks:
            f, u = (f"fork {mode} k={k}", f"uag {mode} k={k}")
            scored = [r for r in rows if r["dataset"] in datasets]
            ratios = [r[u]["tps"] / r[f]["tps"] for r in scored]
            per_set = {
                d: {
                    side: statistics.fmean(r[key]["share"] for r in scored if r["dataset"] == d)
                    for side, key in (("fork", f), ("uag", u))
                }
                for d in datasets
            }
            out[f"{mode} k={k}"] = {
                "share_fork": statistics.fmean(s["fork"] for s in per_set.values()),
                "share_uag": statistics.fmean(s["uag"] for s in per_set.values()),
                "per_dataset": per_set,
                "uag_ge_fork_prompts": sum(r[u]["share"] >= r[f]["share"] for r in scored) / len(scored),
                "tps_ratio_mean": statistics.fmean(ratios),
                "tps_ratio_range": (min(ratios), max(ratios)),
                "speedup_fork": statistics.fmean(r[f]["speedup"] for r in scored),
                "speedup_uag": statistics.fmean(r[u]["speedup"] for r in scored),
                "alpha_fork": _ratio(scored, f),
                "alpha_uag": _ratio(scored, u),
                "lossless": {
                    side: sum(bool(r[key]["lossless"]) for r in rows) for side, key in (("fork", f), ("uag", u))
                },
                "prompts": len(rows),
            }
    return out


def _ratio(rows, key) -> float | None:
    proposed = sum(r[key]["proposed"] or 0 for r in rows)
    return sum(r[key]["share"] * r[key]["generated"] for r in rows) / proposed if proposed else None


# --- printing ------------------------------------------------------------------------------------


def report(header: str, rows: list[dict], summary: dict, ks, strategies) -> str:
    lines = [header, ""]
    for mode in strategies:
        for k in ks:
            f, u = f"fork {mode} k={k}", f"uag {mode} k={k}"
            lines += [
                f"{mode}, k = {k}: share of output from the drafter, α, end-to-end tok/s, speedup vs own baseline",
                f"{'prompt':<14} {'share fork':>10} {'uag':>6} {'α fork':>7} {'uag':>6} "
                f"{'tps fork':>8} {'uag':>6} {'uag/fork':>8} {'× fork':>7} {'× uag':>6}  lossless",
            ]
            for r in rows:
                a, b = r[f], r[u]
                lines.append(
                    f"{r['id']:<14} {a['share']:>10.1%} {b['share']:>6.1%} {_pct(a['alpha']):>7} {_pct(b['alpha']):>6} "
                    f"{a['tps']:>8.2f} {b['tps']:>6.2f} {b['tps'] / a['tps']:>8.2f} {a['speedup']:>7.2f} "
                    f"{b['speedup']:>6.2f}  {_yes(a['lossless'])}/{_yes(b['lossless'])}"
                )
            s = summary[f"{mode} k={k}"]
            diff = (s["share_uag"] - s["share_fork"]) * 100
            lines += [
                "",
                f"  drafter share, mean over {', '.join(s['per_dataset'])}: fork {s['share_fork']:.1%}, "
                f"uag {s['share_uag']:.1%} ({diff:+.1f} pp; target >= +3)",
                "  per dataset: "
                + "; ".join(f"{d} {v['fork']:.1%} / {v['uag']:.1%}" for d, v in s["per_dataset"].items()),
                f"  uag >= fork on {s['uag_ge_fork_prompts']:.0%} of those prompts (target >= 80 %)",
                f"  α: fork {_pct(s['alpha_fork'])}, uag {_pct(s['alpha_uag'])}",
                f"  end-to-end tok/s uag / fork: {s['tps_ratio_mean']:.2f}x mean "
                f"({s['tps_ratio_range'][0]:.2f}-{s['tps_ratio_range'][1]:.2f})"
                + (" (target >= 1.25 at k = 2)" if k == 2 else ""),
                f"  speedup vs own baseline, mean: fork {s['speedup_fork']:.2f}x, uag {s['speedup_uag']:.2f}x",
                f"  lossless: fork {s['lossless']['fork']}/{s['prompts']}, uag {s['lossless']['uag']}/{s['prompts']}",
                "",
            ]
    agree = sum(r["baseline_agree"] for r in rows)
    lines.append(f"the two baselines wrote the same tokens on {agree}/{len(rows)} prompts")
    return "\n".join(lines)


def _yes(lossless: bool | None) -> str:
    return "n/a" if lossless is None else "yes" if lossless else "NO"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def load_average() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fork", type=Path, help="a checkout of the fork (commit be2f622)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="scratch venv for the fork")
    parser.add_argument("--datasets", nargs="+", default=["wiki", "alpaca", "synthetic"])
    parser.add_argument("--n", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--skip", type=int, default=0, help="skip the first prompts of each dataset (held-out runs)")
    parser.add_argument("--english", type=int, default=4, help="held-out English prompts, reported apart (0-4)")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--strategies", nargs="+", default=["context"], choices=["context", "naive"])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="runs per side and condition, median taken")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, exact-match verification")
    parser.add_argument("--seed", type=int, default=None, help="random seed of every run (temperature > 0)")
    parser.add_argument("--json", help="also write everything to this JSON file")
    args = parser.parse_args()

    python = ensure_venv(args.fork.resolve(), args.venv)
    pair = (uag.load("demo-target"), uag.load("demo-drafter"))
    fork = Fork(python, demo.ensure("demo-target"), demo.ensure("demo-drafter"))
    prompts: list[Prompt] = []
    for name in args.datasets:
        prompts += load_bundled(name, args.skip + args.n)[args.skip :]
    prompts += [Prompt(f"english-{i + 1}", "english", text) for i, text in enumerate(ENGLISH[: args.english])]
    loads = [load_average()]
    warm = pair[0].tokenizer.encode("Hello")  # the prompt ids uag makes of a text (no chat template)
    fork.run("context", warm, 2, args), run_uag(*pair, "context", warm, 2, args)  # warm-up
    rows = []
    for p in prompts:
        ids = list(pair[0].tokenizer.encode(p.text))
        rows.append({"id": p.id, "dataset": p.dataset, **measure_prompt(fork, pair, ids, args)})
        loads.append(load_average())
        print(f"{p.id} done (load {loads[-1]:.2f})", file=sys.stderr)
    fork.close()
    summary = summarise(rows, args.ks, args.strategies, args.datasets)
    english = [r for r in rows if r["dataset"] == "english"]
    held_out = summarise(english, args.ks, args.strategies, ["english"]) if english else None
    header = (
        f"uag vs the study's fork (mlx-lm {fork.info['mlx_lm']}, {args.fork}) — {date.today()}, "
        f"{device_name()} ({backend()}, {os.cpu_count()} cores), MLX {mx.__version__}, "
        f"BLAS {blas()} on both sides; "
        f"demo-target (float32) ← demo-drafter, W = {args.window}, {args.max_tokens} tokens, "
        f"{'sampled' if args.temperature else 'greedy'}, "
        f"median of {args.repeats} interleaved; 1-min load average {min(loads):.2f}-{max(loads):.2f}"
        + (f"; temperature {args.temperature}, seed {args.seed} (exact-match verification)" if args.temperature else "")
    )
    text = report(header, rows, summary, args.ks, args.strategies)
    if held_out:
        text += "\n\nheld-out English prompts:\n" + "\n".join(
            f"  {cond}: share fork {s['share_fork']:.1%}, uag {s['share_uag']:.1%}; "
            f"tok/s uag/fork {s['tps_ratio_mean']:.2f}x"
            for cond, s in held_out.items()
        )
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "header": header,
                    "platform": platform.platform(),
                    "argv": sys.argv,
                    "rows": rows,
                    "summary": summary,
                    "held_out": held_out,
                    "loads": loads,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
