"""Cold reads: the time to first token of a long prompt nothing has cached, `uag serve` against `mlx_lm.server`.

Both servers run side by side (as `serve.py` starts them: the same converted folder, OpenBLAS in both); each round
asks each server once, the order alternating from round to round, so that a machine whose speed drifts slows both
alike. The prompt is aider's first `--edit-format` request of an `edit` conversation (`edit_formats.Replay`), its
system prompt opening with a different word for every request, so that no server holds any of it; 2 tokens are
asked, streamed through the `openai` SDK (`serving.ask`), and the time to the first content token is taken at the
client. On a shared machine other work only ever adds time: the least of the rounds is printed beside the median.
`--session` reads the head of a recorded agent session's first request instead (`benchmarks/agent_sessions/`, as
chat completions with its tools, as `agent_sessions.py` sends mlx_lm.server). `--apart` runs one server at a time
(each round starts each anew, the order alternating): where memory holds one copy of the target but not two. The
machine's 1-minute load is printed with every time, and the CPU time the server process spent meanwhile (its own
work, which other processes' load inflates less than the wall clock).

Usage: python benchmarks/cold_read.py [--target coder-target] [--drafter lookup] [--conversation edit-008]
       [--edit-format whole] [--session benchmarks/agent_sessions/codex-rename.jsonl] [--rounds 3] [--apart]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import agent_sessions  # benchmarks/, beside this script
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


def cpu_s(server: serving.Server) -> float:
    """User and system CPU seconds the server's process has used (/proc; its threads included)."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_of(server: serving.Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=serving.REQUEST_S)


def warmed(server: serving.Server) -> serving.Server:
    """The server after one short request without the head's tools (mlx_lm.server loads its model on its first
    request)."""
    bare = replace(
        server.condition, extra_body={k: v for k, v in (server.condition.extra_body or {}).items() if k != "tools"}
    )
    serving.ask(client_of(server), bare, [{"role": "user", "content": "Hi"}], 2, first_only=True)
    return server


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
    parser.add_argument("--session", help="a recorded agent session: its first request's head instead of aider's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--apart", action="store_true", help="one server at a time, each started anew every round")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= len(OPENINGS) // 2:
        parser.error(f"--rounds: from 1 to {len(OPENINGS) // 2}")
    found = [c for c in load_conversations("edit") if c.id == args.conversation]
    if not found:
        parser.error(f"--conversation: no {args.conversation!r} in the edit set")
    messages, tools = edit_formats.Replay.of(found[0], args.edit_format).messages(), None
    if args.session:
        turn = agent_sessions.load(Path(args.session))[0]
        chat = agent_sessions.as_chat(turn["path"], turn["body"], args.target, 2)
        messages, tools = chat["messages"], chat.get("tools")

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
    conditions = [
        replace(c, extra_body={**(c.extra_body or {}), "tools": tools}) if tools else c
        for c in serving.conditions(settings)
    ]
    times: dict[str, list[float]] = {c.name: [] for c in conditions}
    loads: dict[str, list[float]] = {c.name: [] for c in conditions}
    cpus: dict[str, list[float]] = {c.name: [] for c in conditions}
    words = iter(OPENINGS)

    def timed(server: serving.Server, i: int) -> None:
        name, before = server.condition.name, cpu_s(server)
        times[name].append(first_token_s(server, client_of(server), opened_with(messages, next(words))))
        loads[name].append(os.getloadavg()[0])
        cpus[name].append(cpu_s(server) - before)
        print(
            f"round {i + 1}, {name}: {times[name][-1]:.2f} s, CPU {cpus[name][-1]:.1f} s, load {loads[name][-1]:.2f}",
            file=sys.stderr,
            flush=True,
        )

    with ExitStack() as stack:
        servers = []
        if not args.apart:
            servers = [
                warmed(stack.enter_context(serving.Server(c, logs / f"{c.name.replace(':', '-')}.log")))
                for c in conditions
            ]
        for i in range(args.rounds):
            for condition in conditions[:: 1 if i % 2 == 0 else -1]:
                if not args.apart:
                    timed(next(s for s in servers if s.condition is condition), i)
                    continue
                log = logs / f"{condition.name.replace(':', '-')}-{i + 1}.log"
                with serving.Server(condition, log) as server:
                    timed(warmed(server), i)
    ours, peer = times[f"uag:{args.drafter}"], times["mlx_lm"]
    print(
        f"cold read of {Path(args.session).stem if args.session else args.conversation} turn 1 "
        f"{'' if args.session else f'as aider asks ({args.edit_format})'}, {args.target}, "
        f"{args.rounds} rounds{', servers apart' if args.apart else ''}; time to first token, s"
    )
    for name, ts in times.items():
        listed = ", ".join(f"{t:.2f}" for t in ts)
        print(
            f"{name:24} median {statistics.median(ts):7.2f}  least {min(ts):7.2f}  [{listed}]  "
            f"CPU s {', '.join(f'{x:.1f}' for x in cpus[name])}  load {', '.join(f'{x:.2f}' for x in loads[name])}"
        )
    print(
        f"uag / mlx_lm: medians {statistics.median(ours) / statistics.median(peer):.3f}, "
        f"least {min(ours) / min(peer):.3f} (target <= {serve.COPY_GOALS['cold_ttft']}); CPU time, medians "
        f"{statistics.median(cpus[f'uag:{args.drafter}']) / statistics.median(cpus['mlx_lm']):.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
