"""One rank of a sharded test run (tests/distributed/test_sharded.py starts one process per rank).

Runs `uag.distributed.sharded.generate_sharded` once per --run and writes what the test checks to OUT/rank<r>.json:
per run the token ids, target passes, and every cache offset that was not exact after a cycle. Errors
go through uag.command.run, as on the command line: one line, exit 2.

    MLX_RANK=0 MLX_HOSTFILE=h.json python -m tests.support.sharded_rank --target DIR --shard tensor --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--shard", required=True)
    parser.add_argument(
        "--run",
        action="append",
        required=True,
        metavar="STRATEGY:DRAFTER",
        help="a generation, e.g. context:lookup, auto:lookup+DIR, baseline: (repeatable)",
    )
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--prompt", default="Ala ma kota, a kot ma Alę. Ala ma kota, a kot")
    parser.add_argument("--out", required=True)
    parser.add_argument("--check-every", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--connect-timeout", type=float, default=30.0)
    parser.add_argument("--slow-ms", type=float, default=0.0, help="sleep after every step (fault tests)")
    parser.add_argument("--tamper-at", type=int, default=0, help="rank 1 commits a wrong token at this cycle")
    args = parser.parse_args()

    from uag.command import run

    return run("sharded_rank", lambda: _rank(args))


def _rank(args) -> int:
    from uag.core.config import DrafterSpec, GenerationConfig
    from uag.distributed.sharded import connect, load_rank0_drafter, load_sharded
    from uag.models.store import ModelStore

    ranks = connect(connect_timeout_s=args.connect_timeout, timeout_s=args.timeout)
    out = Path(args.out) / f"rank{ranks.rank}.json"
    progress = Path(args.out) / f"progress{ranks.rank}"
    target = load_sharded(args.target, args.shard, ranks)
    if args.tamper_at and ranks.rank == 1:
        _tamper(args.tamper_at)
    ids = target.tokenizer.encode(args.prompt)
    store = ModelStore(dtype="float32")
    results = []
    for spec in args.run:
        strategy, _, name = spec.partition(":")
        config = GenerationConfig.parse(strategy=strategy, k=args.k, max_tokens=args.max_tokens)
        drafter = load_rank0_drafter(store, DrafterSpec.parse(name), ranks) if config.speculative else None
        results.append(_generate(args, ranks, target, drafter, ids, config, progress))
    ranks.close()
    out.write_text(json.dumps(results))
    return 0


def _generate(args, ranks, target, drafter, ids, config, progress: Path) -> dict:
    from uag.distributed.sharded import generate_sharded

    cache = target.make_cache()
    bad_offsets = []

    def on_event(event) -> None:
        committed = len(ids) + event.run.generated
        if event.cycle is not None and event.cycle.k > 0 and cache[0].offset != committed - 1:
            bad_offsets.append([event.run.generated, cache[0].offset, committed - 1])
        progress.write_text(str(event.run.generated))
        if args.slow_ms:
            time.sleep(args.slow_ms / 1000)

    run = generate_sharded(
        target, drafter, ids, config, ranks, cache=cache, on_event=on_event, check_every=args.check_every
    )
    return {
        "rank": ranks.rank,
        "token_ids": run.token_ids,
        "passes": len(run.cycles) + 1,
        "cycles_k": [c.k for c in run.cycles],
        "bad_offsets": bad_offsets,
        "final_offset": cache[0].offset,
        "committed": len(ids) + run.generated,
        "finish_reason": run.finish_reason,
        "k_policy": run.k_policy,
    }


def _tamper(at: int) -> None:
    """Make this rank's verification pick a different token once (the debug check must notice)."""
    import uag.core.engine
    from uag.core.verify import Verdict

    real, calls = uag.core.engine.accept_greedy, [0]

    def wrong(proposed, choices):
        calls[0] += 1
        verdict = real(proposed, choices)
        return Verdict(verdict.accepted, verdict.token + 1) if calls[0] == at else verdict

    uag.core.engine.accept_greedy = wrong


if __name__ == "__main__":
    sys.exit(main())
