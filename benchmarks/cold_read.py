"""Cold reads: the time to first token of a long prompt nothing has cached, `uag serve` against `mlx_lm.server`.

Both servers run side by side (as `serve.py` starts them: the same converted folder, OpenBLAS in both); each round
asks each server once, the order alternating from round to round, so that a machine whose speed drifts slows both
alike. The prompt is aider's first `--edit-format` request of an `edit` conversation (`edit_formats.Replay`), its
system prompt opening with a different word for every request, so that no server holds any of it; 2 tokens are
asked, streamed through the `openai` SDK (`serving.ask`), and the time to the first content token is taken at the
client. On a shared machine other work only ever adds time: the least of the rounds is printed beside the median.

Usage: python benchmarks/cold_read.py [--target coder-target] [--drafter lookup] [--conversation edit-008]
       [--edit-format whole] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import edit_formats  # benchmarks/, beside this script
import openai
import serve  # COPY_GOALS: the target this checks
import serving

from uag.study.datasets import load_conversations

OPENINGS = ("Act", "Be", "Work", "Serve", "Help", "Code", "Edit", "Write", "Reply", "Answer", "Think", "Read")


def first_token_s(server: serving.Server, client: openai.OpenAI, messages: list[dict]) -> float:
    """Seconds to the first content token of a streamed 2-token reply (`serving.ask`, the stream closed there)."""
    reply = serving.ask(client, server.condition, messages, 2, first_only=True)
    if reply.ttft_s is None:
        raise RuntimeError(f"{server.condition.name}'s reply held no content")
    return reply.ttft_s


def opened_with(messages: list[dict], word: str) -> list[dict]:
    """The messages with `word` before the system prompt: a prefix no earlier request shares."""
    head, *rest = messages
    return [{**head, "content": f"{word}: {head['content']}"}, *rest]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="coder-target")
    parser.add_argument("--drafter", default="lookup", help="uag's drafter, under auto")
    parser.add_argument("--conversation", default="edit-008", help="an `edit` conversation")
    parser.add_argument("--edit-format", default="whole", choices=("whole", "diff"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= len(OPENINGS) // 2:
        parser.error(f"--rounds: from 1 to {len(OPENINGS) // 2}")
    found = [c for c in load_conversations("edit") if c.id == args.conversation]
    if not found:
        parser.error(f"--conversation: no {args.conversation!r} in the edit set")
    messages = edit_formats.Replay.of(found[0], args.edit_format).messages()

    settings = argparse.Namespace(
        target=args.target,
        drafters=[args.drafter],
        max_tokens=2,
        ablate=None,
        without_shared_index=False,
        peer_draft=None,
        num_draft_tokens=[],
        only=[f"uag:{args.drafter}", "mlx_lm"],
    )
    logs = Path(f"cold-read-{time.strftime('%Y%m%d-%H%M%S')}.logs")
    with ExitStack() as stack:
        servers = [
            stack.enter_context(serving.Server(c, logs / f"{c.name.replace(':', '-')}.log"))
            for c in serving.conditions(settings)
        ]
        clients = {
            s.condition.name: openai.OpenAI(
                base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=serving.REQUEST_S
            )
            for s in servers
        }
        for server in servers:  # mlx_lm.server loads its model on its first request
            first_token_s(server, clients[server.condition.name], [{"role": "user", "content": "Hi"}])
        times: dict[str, list[float]] = {s.condition.name: [] for s in servers}
        words = iter(OPENINGS)
        for i in range(args.rounds):
            for server in servers[:: 1 if i % 2 == 0 else -1]:
                name = server.condition.name
                times[name].append(first_token_s(server, clients[name], opened_with(messages, next(words))))
                print(f"round {i + 1}, {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    ours, peer = times[f"uag:{args.drafter}"], times["mlx_lm"]
    print(
        f"cold read of {args.conversation} turn 1 as aider asks ({args.edit_format}), {args.target}, "
        f"{args.rounds} rounds; time to first token, s"
    )
    for name, ts in times.items():
        listed = ", ".join(f"{t:.2f}" for t in ts)
        print(f"{name:24} median {statistics.median(ts):7.2f}  least {min(ts):7.2f}  [{listed}]")
    print(
        f"uag / mlx_lm: medians {statistics.median(ours) / statistics.median(peer):.3f}, "
        f"least {min(ours) / min(peer):.3f} (target <= {serve.COPY_GOALS['cold_ttft']})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
