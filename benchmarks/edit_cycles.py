"""Every cycle of aider's whole-file edits, as `uag serve` runs them: where a copy's tokens go and what each pass cost.

One process, the engine itself (the API's `generate`, auto with the pair's saved profile and evidence, as a server
request runs it alone): aider's requests for an `edit` conversation (`edit_formats.Replay`), each turn's reply
applied to the file before the next. For every cycle it prints the source (lookup or a plain target step), the
tokens proposed and kept, how far lookup's match ran back, how many continuations its pass verified and the pass's
milliseconds; per turn, the time spent in each source and the tokens they wrote. Earlier turns can be taken from
a `serve.py` run's rows (`--replies`) to trace a late turn without generating the ones before it. Use it to see
why lookup proposes what it does (docs/how-it-works.md, auto); `serve.py` measures the speed.

Usage: python benchmarks/edit_cycles.py [--target coder-target] [--drafter lookup] [--conversation edit-008]
       [--turns 1 3] [--replies rows.jsonl] [--max-tokens 1024] [--k 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import edit_formats  # benchmarks/, beside this script

from uag.core.config import GenerationConfig
from uag.core.records import Cycle, Run
from uag.server.chat import render
from uag.study.datasets import load_conversations


def saved_replies(path: Path, conversation: str) -> list[str]:
    """The uag replies of a `serve.py` run's `aider-whole` turns for `conversation`, in turn order."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    turns = [
        r
        for r in rows
        if r.get("kind") == "turn"
        and r.get("server") == "uag"
        and r.get("workload") == "aider-whole"
        and r.get("item") == conversation
    ]
    return [r["text"] for r in sorted(turns, key=lambda r: r["turn"])]


def cycle_line(c: Cycle) -> str:
    source = c.source or "plain"
    return (
        f"{c.index:4d} {source:6s} proposed {len(c.proposed_ids):2d} kept {c.accepted:2d} match {c.match:3d}"
        f" branches {c.branches} rows {(c.nodes or len(c.proposed_ids)) + 1:3d} {c.verify_ms + c.draft_ms:7.0f} ms"
    )


def by_source(cycles: Sequence[Cycle]) -> dict[str, tuple[int, int, float]]:
    """Per source: (cycles, tokens written, seconds spent drafting and verifying)."""
    out: dict[str, tuple[int, int, float]] = {}
    for c in cycles:
        n, tokens, s = out.get(c.source or "plain", (0, 0, 0.0))
        out[c.source or "plain"] = (n + 1, tokens + c.emitted, s + (c.verify_ms + c.draft_ms) / 1000)
    return out


def summary(turn: int, run: Run, wall_s: float) -> str:
    generation = (run.last_token_s or 0.0) - (run.first_token_s or 0.0)
    rate = (len(run.tokens) - 1) / generation if generation > 0 else float("nan")
    parts = ", ".join(f"{s}: {n} cycles, {t} tokens, {sec:.1f} s" for s, (n, t, sec) in by_source(run.cycles).items())
    return (
        f"turn {turn}: prompt {len(run.prompt_ids)} tokens read in {run.prompt_ms / 1000:.1f} s; {len(run.tokens)}"
        f" tokens, generation {generation:.1f} s ({rate:.2f} tokens/s); {parts}; {wall_s:.1f} s in all"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="coder-target")
    p.add_argument("--drafter", default="lookup")
    p.add_argument("--conversation", default="edit-008", help="an `edit` conversation's id")
    p.add_argument("--turns", type=int, nargs="*", default=None, help="turns to trace, from 1 (default: every turn)")
    p.add_argument("--replies", type=Path, help="a serve.py rows file whose uag replies stand for untraced turns")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--k", type=int, default=16, help="auto's k (uag serve's default: 16)")
    args = p.parse_args(argv)

    found = {c.id: c for c in load_conversations("edit")}
    if args.conversation not in found:
        p.error(f"no edit conversation {args.conversation!r}")
    replay = edit_formats.Replay.of(found[args.conversation], "whole")
    turns = args.turns or list(range(1, replay.turns + 1))
    if not all(1 <= t <= replay.turns for t in turns):
        p.error(f"turns run from 1 to {replay.turns}")
    replies = saved_replies(args.replies, args.conversation) if args.replies else []
    if args.replies and len(replies) < max(turns) - 1:
        p.error(f"{args.replies} holds {len(replies)} uag replies for {args.conversation}, fewer than the turns before")

    target, drafter = uag.load(args.target), uag.load_drafter(args.drafter)
    config = GenerationConfig(translation="context", k=args.k, k_policy="adaptive", max_tokens=args.max_tokens)
    for turn in range(1, max(turns) + 1):
        if turn not in turns and replies:
            replay.answer(replies[turn - 1])
            continue
        prompt = render(target.tokenizer, replay.messages())  # as uag serve reads the request
        tic = time.perf_counter()
        run = uag.generate(target, drafter, prompt, config)
        wall = time.perf_counter() - tic
        if turn in turns:
            for c in run.cycles:
                print(cycle_line(c))
            print(summary(turn, run, wall), flush=True)
        outcome = replay.answer(run.text)
        print(f"turn {turn}: edit {'applied' if outcome.applied else 'not applied'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
