"""`uag serve` against `mlx_lm.server`, through the `openai` SDK: code-edit conversations and open chat.

Conditions, each a server process this script starts on a free port and stops again:
- `uag:<drafter>`: `uag serve --target T --drafter <drafter> --strategy auto`, one per `--drafters`;
- `uag:off`: `uag serve --target T --drafter off`, requests with `"speculative": false` (the target alone);
- `mlx_lm`: `mlx_lm.server --model <T's converted folder>`, prompt cache on (its default);
- `mlx_lm:draft<N>`: the same with `--draft-model <--peer-draft's folder> --num-draft-tokens N`, per N.
Fair to the peer: the same converted float32 folders (`uag.models.demo.ensure`) and the OpenBLAS that uag loads,
preloaded into mlx_lm.server with LD_PRELOAD (without it MLX on Linux runs its reference BLAS, dozens of times
slower); each server's /proc/<pid>/maps is checked for it and a short warm-up reply's speed is printed.

One server runs at a time (the coder target in float32 takes ~7 GB), so conditions are interleaved by session:
every repeat runs each condition once, in an order that rotates from repeat to repeat, and the summary takes
medians over repeats. With `--together` the conditions' servers run side by side (uag:off then shares the uag
server, its requests saying `"speculative": false`; refused when the weights would not fit in the memory available)
and each request goes to every condition in turn, the order rotating from request to request: a machine whose
speed drifts during a run then slows every condition alike. A shared server reads each prompt once for both of
its conditions, so uag:off's time to first token there is not a cold read (and only the first of them, in the
rotation, makes the turn-2 cold read).

A session: warm-up, the `edit` workload (bundled three-turn conversations, each turn sent after the server's
own reply to the one before, `uag.study.datasets.load_conversations`), the turn-2 cold read (below), then open chat
(the first `--chat-prompts` Polish `alpaca` and English `code` instructions).

`--edit-formats` chooses how the edit conversations are asked: `edit` as bundled (a system prompt asking for the
whole file back, the file in turn 1), `whole` and `diff` as aider sends them with its edit format of that name
(workloads `aider-whole` and `aider-diff`: aider's system prompt, examples and rules, the file re-sent every turn
as it stands after the edits so far; `edit_formats.py`, from aider's own requests). An aider turn's row says
whether its edits applied to the file (`applied`: a `diff` reply's every SEARCH found in the file).

Per turn, one JSON row in `--out`: time to first token (streaming), generation tokens/s (client side, from the
first content chunk to the last: (completion tokens - 1) / that time), end-to-end time, cached prompt tokens
(`usage.prompt_tokens_details.cached_tokens`), uag's `speculative` object (acceptance, sources) and the text.
At the end of each session every uag server's `GET /metrics` is scraped and its counters compared with the sums of
the `usage` and `speculative` blocks of the replies it gave (a "metrics" row; the summary's last lines).

Turn-2 cold read: the second turn of `--ttft-conversation` (~1,700 tokens on the coder target) is read warm,
after turn 1 (the server keeps the conversation's KV cache), and cold: the same messages once more with the
system prompt's first letter's case swapped, so that no held cache shares more than the chat template's first
tokens. Both requests are the same but for that letter (the same max_tokens and speculation); the cold stream
is closed after its first token (mlx_lm.server logs a BrokenPipeError for it).

Targets (issue 24), printed with the measured values: `edit` turns 2-3 generation tokens/s (pooled) uag >= 3x
mlx_lm alone and >= 2x mlx_lm with its best N; end to end per turn (median over turns 2-3) >= 2.5x mlx_lm
alone; open chat uag >= 0.97x mlx_lm alone (pooled); speculation off >= 0.97x mlx_lm alone (all turns,
pooled); turn-2 time to first token <= 0.25x the cold read; lossless: every uag speculative text equals
uag:off's text for the same turn (and whether mlx_lm's text agrees, for information: on a target without a
chat template, such as the demo target, mlx_lm.server joins the messages its own way, so its text differs).
Where a text differs, after the servers stop the target is loaded here and the margin where the two part says
near-tie or bug (benchmarks/near_ties.py; a "parted" row each); met where every difference is a near-tie.

Usage (a smoke run on the demo pair, which has no same-vocabulary drafter for mlx_lm):
    python benchmarks/serve.py --conversations 1 --chat-prompts 1 --max-tokens 8 --repeats 1
The issue's run (on a quiet machine; hours: every edit turn writes a whole file back):
    python benchmarks/serve.py --target coder-target --conversations 22 --chat-prompts 5 --max-tokens 1024 \\
        --repeats 3 --out serve-coder.jsonl     # drafters lookup+demo-drafter and lookup+coder-drafter; the
                                                # peer drafts with coder-drafter, N = 2, 3, 4
    python benchmarks/serve.py --summarize serve-coder.jsonl      # the summary again, from the rows
    python benchmarks/serve.py --summarize serve-coder.jsonl --classify   # with verdicts the rows lack
Chosen conversations instead of the first N (e.g. ones no tuning looked at): --ids edit-010 edit-015 edit-020
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import edit_formats  # benchmarks/edit_formats.py, beside this script
import httpx
import near_ties  # benchmarks/near_ties.py: where a reply differs from uag:off's, near-tie or bug
import openai
import serve_many  # benchmarks/serve_many.py: --concurrency, and its rows' summary
from serving import (  # benchmarks/serving.py: what this script shares with serve_many.py
    REQUEST_S,
    WARM_UP,
    WARM_UP_TOKENS,
    Condition,
    Reply,
    Server,
    ask,
    chat_prompts,
    conditions,
    fmt,
    folder,
    joined,
    row,
    rows_file,
    say,
    version,
)

from uag.core.policy import MECHANISMS
from uag.study.datasets import Conversation, load_conversations

# The longest file (105 lines): 893 tokens at turn 1 on the coder target, some 1,700 at turn 2 with the file back.
DEFAULT_TTFT_CONVERSATION = "edit-020"
SPECULATIVE_GOALS = {"tps_alone": 3.0, "tps_draft": 2.0, "e2e_alone": 2.5, "chat": 0.97, "off": 0.97, "ttft": 0.25}
# issue 39 (copying): every whole-file edit turn vs mlx_lm alone, tokens kept per lookup cycle over them, and the
# cold read's time to first token vs mlx_lm's; diff-format edits (short replies around the changes) for information
COPY_GOALS = {"edit_alone": 4.5, "kept_per_cycle": 10.0, "cold_ttft": 1.05}
EDIT_WORKLOADS = {"edit": "edit", "whole": "aider-whole", "diff": "aider-diff"}  # --edit-formats -> workload
WHOLE_FILE = ("edit", "aider-whole")  # the workloads whose replies write the whole file back


# --- what a session checks -----------------------------------------------------------------------------------
# A scrape's counter -> the field of the replies' blocks it adds up to (uag.server.metrics).
METRIC_SUMS = {
    "uag:prompt_tokens_total": ("usage", "prompt_tokens"),
    "uag:prompt_tokens_cached_total": ("usage", "prompt_tokens_details", "cached_tokens"),
    "uag:generation_tokens_total": ("usage", "completion_tokens"),
    "uag:spec_decode_num_drafts_total": ("speculative", "cycles"),
    "uag:spec_decode_num_draft_tokens_total": ("speculative", "drafted_tokens"),
    "uag:spec_decode_num_accepted_tokens_total": ("speculative", "accepted_tokens"),
}


def metrics_check(url: str, replies: list[Reply]) -> dict:
    """uag serve's `GET /metrics` against the replies it gave: {"sums": {counter: [scraped, summed over the
    replies]}, "verdict"}. Exact where every reply was read to its end; a stream closed at its first token (the
    cold read) has no usage, while the scrape counts what its run did, so there the scrape may only exceed."""
    from prometheus_client.parser import text_string_to_metric_families

    scraped: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            scraped[sample.name] += sample.value

    def field_of(reply: Reply, path: tuple[str, ...]) -> float:
        value = {"usage": reply.usage, "speculative": reply.speculative or {}}
        for key in path:
            value = (value or {}).get(key)
        return value or 0

    sums = {name: [scraped[name], sum(field_of(r, path) for r in replies)] for name, path in METRIC_SUMS.items()}
    unread = sum(not r.usage for r in replies)
    off = {name: pair for name, pair in sums.items() if (pair[0] < pair[1] if unread else pair[0] != pair[1])}
    if off:
        verdict = "does NOT add up to the replies: " + ", ".join(f"{n} {a:g} vs {b:g}" for n, (a, b) in off.items())
    elif unread:
        verdict = f"covers the {len(replies)} replies ({unread} closed early: at least their sums)"
    else:
        verdict = f"adds up to the {len(replies)} replies' usage and speculative blocks exactly"
    return {"sums": sums, "replies": len(replies), "unread": unread, "verdict": verdict}


# --- a session: one server, every workload ------------------------------------------------------------------------


def cold(messages: list[dict]) -> list[dict]:
    """The same messages with the system prompt's first letter's case swapped: nothing held shares its prefix.

    Example: [{"role": "system", "content": "You are …"}, …] -> [{"role": "system", "content": "you are …"}, …]
    """
    head, *rest = messages
    assert head["role"] == "system" and head["content"], "the cold read needs a system prompt to change"
    text = head["content"]
    return [{**head, "content": text[0].swapcase() + text[1:]}, *rest]


def session(
    group: list[Condition],
    repeat: int,
    args: argparse.Namespace,
    edit: list[Conversation],
    ttft: Conversation | None,
    chat: list[tuple[str, str]],
    logs: Path,
    write: Callable[[dict], None],
) -> None:
    """Every workload on the `group`'s servers, up side by side (conditions with one command line share one
    server): each request goes to every condition in turn, in an order that rotates from request to request, so
    that a machine that drifts slows every condition alike. A group of one is the one-server-at-a-time session."""
    names = ", ".join(c.name for c in group)
    say(f"{names}, repeat {repeat + 1}: starting")
    with ExitStack() as stack:
        servers: dict[tuple[str, ...], Server] = {}
        clients: dict[str, openai.OpenAI] = {}
        for c in group:
            if c.argv not in servers:
                log = logs / f"{c.name.replace(':', '-')}-r{repeat + 1}.log"
                servers[c.argv] = stack.enter_context(Server(c, log))
            url = servers[c.argv].url + "/v1"
            clients[c.name] = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=REQUEST_S)
        answered: dict[tuple[str, ...], list[Reply]] = defaultdict(list)  # per server, for its /metrics at the end

        def send(c: Condition, messages: list[dict], max_tokens: int, **kw) -> Reply:
            reply = ask(clients[c.name], c, messages, max_tokens, **kw)
            answered[c.argv].append(reply)
            return reply

        for c in group:
            server = servers[c.argv]
            warm = send(c, WARM_UP, WARM_UP_TOKENS)  # loads (uag), calibrates a first `auto` use
            again = send(c, WARM_UP, WARM_UP_TOKENS)
            write(
                {
                    "kind": "warmup",
                    "condition": c.name,
                    "repeat": repeat,
                    "startup_s": server.startup_s,
                    "openblas_mapped": server.openblas,
                    "first_e2e_s": warm.e2e_s,
                    "tokens": again.completion_tokens,
                    "generation_tps": again.generation_tps,
                    "e2e_s": again.e2e_s,
                }
            )
            rate = "-" if again.generation_tps is None else f"{again.generation_tps:.1f}"
            say(
                f"{c.name}: up in {server.startup_s:.0f} s, OpenBLAS mapped: {server.openblas}, warm-up "
                f"{again.completion_tokens} tokens at {rate} tokens/s"
            )
        sent = 0
        retried: dict[str, dict[str, list[str]]] = {c.name: {} for c in group}

        def each() -> list[Condition]:
            """The group in this request's order (rotating by one per request)."""
            nonlocal sent
            shift, sent = sent % len(group), sent + 1
            return group[shift:] + group[:shift]

        def converse(conversation: Conversation, workload: str, turns: int) -> dict[str, list[dict]]:
            """The conversation's turns, each sent to every condition (each condition after its own replies);
            returns each condition's messages up to turn 2."""
            replies: dict[str, list[str]] = {c.name: [] for c in group}
            for c in group:
                retried[c.name][conversation.id] = replies[c.name]  # its turn 1 reply, for a retry of turn 2
            for turn in range(turns):
                for c in each():
                    reply = send(c, conversation.messages(replies[c.name]), args.max_tokens)
                    replies[c.name].append(reply.text)
                    write(row(c, repeat, workload, conversation.id, turn + 1, reply))
                    say(f"  {c.name} {workload} {conversation.id} turn {turn + 1}: {describe(reply)}")
            return {name: conversation.messages(texts[:1]) for name, texts in replies.items()}

        second = None
        for conversation in edit if "edit" in args.edit_formats else ():
            messages = converse(conversation, "edit", len(conversation.turns))
            if ttft is not None and conversation.id == ttft.id:
                second = messages
        for edit_format in (f for f in args.edit_formats if f != "edit"):
            workload = EDIT_WORKLOADS[edit_format]
            for conversation in edit:  # as aider asks: each condition's file moves on with its own replies
                replays = {c.name: edit_formats.Replay.of(conversation, edit_format) for c in group}
                for turn in range(replays[group[0].name].turns):
                    for c in each():
                        reply = send(c, replays[c.name].messages(), args.max_tokens)
                        outcome = replays[c.name].answer(reply.text)
                        write(row(c, repeat, workload, conversation.id, turn + 1, reply, outcome))
                        applied = "applied" if outcome.applied else f"not applied: {outcome.why}"
                        say(f"  {c.name} {workload} {conversation.id} turn {turn + 1}: {describe(reply)}, {applied}")
        for conversation in edit if args.retry and "edit" in args.edit_formats else ():  # turn 2 asked again
            for c in each():
                messages = conversation.messages(retried[c.name][conversation.id][:1])
                reply = send(c, messages, args.max_tokens)
                write(row(c, repeat, "retry", conversation.id, 2, reply))
                say(f"  {c.name} retry {conversation.id} turn 2: {describe(reply)}")
        if ttft is not None:
            if second is None:  # not among the edit conversations of this run: turns 1 and 2 for it alone
                second = converse(ttft, "ttft", 2)
            read: set[tuple[str, ...]] = set()
            for c in each():
                if c.argv in read:  # a shared server holds the cold messages now: no second cold read there
                    continue
                read.add(c.argv)
                reply = send(c, cold(second[c.name]), args.max_tokens, first_only=True)
                write(row(c, repeat, "ttft-cold", ttft.id, 2, reply))
                say(f"  {c.name} cold read of {ttft.id} turn 2: {describe(reply)}")
        for item, text in chat:
            for c in each():
                reply = send(c, [{"role": "user", "content": text}], args.max_tokens)
                write(row(c, repeat, "chat", item, 1, reply))
                say(f"  {c.name} chat {item}: {describe(reply)}")
        for argv, server in servers.items():
            if server.condition.server == "uag":
                check = metrics_check(server.url, answered[argv])
                write({"kind": "metrics", "server": server.condition.name, "repeat": repeat, **check})
                say(f"{server.condition.name}: GET /metrics {check['verdict']}")


def together(conds: list[Condition]) -> list[Condition]:
    """The conditions for `--together`: uag:off is served by the first uag drafter condition's server (its
    requests say `"speculative": false`), so the target is loaded once for both."""
    host = next((c for c in conds if c.server == "uag" and c.name != "uag:off"), None)
    if host is None:
        return conds
    return [replace(c, argv=host.argv) if c.name == "uag:off" else c for c in conds]


def weight_bytes(argv: tuple[str, ...]) -> int:
    """The weights a server's command line loads: its --target/--model and --drafter/--draft-model folders."""
    total = 0
    for flag, value in zip(argv, argv[1:]):
        if flag in ("--target", "--model", "--draft-model") or (flag == "--drafter" and value not in ("off", "lookup")):
            name = value.removeprefix("lookup+")
            path = Path(folder(name))
            total += sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0
    return total


def check_memory(conds: list[Condition]) -> None:
    """Refuse a `--together` group whose servers' weights would not fit in the memory available now."""
    need = sum(weight_bytes(argv) for argv in {c.argv for c in conds})
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    if need > 0.85 * available:
        raise SystemExit(
            f"--together: the servers' weights take {need / 2**30:.1f} GiB, {available / 2**30:.1f} GiB is available: "
            "choose fewer conditions with --only"
        )


def describe(reply: Reply) -> str:
    out = f"TTFT {fmt(reply.ttft_s, '.2f')} s"
    if reply.usage:  # a stream closed at its first token has none
        out += f", {reply.completion_tokens} tokens"
        if reply.generation_tps:
            out += f" at {reply.generation_tps:.1f}/s"
        cached = (reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out += f", {cached} of {reply.usage.get('prompt_tokens')} prompt tokens cached"
    out += f", {reply.e2e_s:.1f} s end to end"
    if reply.speculative and reply.speculative.get("acceptance_rate") is not None:
        out += f", α {reply.speculative['acceptance_rate']:.2f}"
    return out


# --- the summary (from rows alone) ------------------------------------------------------------------------------
Key = tuple[str, str, int]  # (workload, item, turn)


def medians(rows: Iterable[dict]) -> dict[str, dict[Key, dict]]:
    """Per condition and (workload, item, turn): medians over repeats of the timings; the text of every repeat."""
    groups: dict[str, dict[Key, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("kind") == "turn":
            groups[r["condition"]][(r["workload"], r["item"], r["turn"])].append(r)
    out: dict[str, dict[Key, dict]] = {}
    for condition, keys in groups.items():
        out[condition] = {}
        for key, reps in keys.items():
            m = {
                name: _median([r[name] for r in reps])
                for name in ("ttft_s", "generation_s", "e2e_s", "completion_tokens", "cached_tokens", "prompt_tokens")
            }
            m["drafted"] = sum(r["drafted"] or 0 for r in reps)
            m["accepted"] = sum(r["accepted"] or 0 for r in reps)
            lookups = [r.get("lookup") or {} for r in reps]
            for field_name in ("cycles", "proposed_tokens", "accepted_tokens"):
                m[f"lookup_{field_name}"] = sum(x.get(field_name) or 0 for x in lookups)
            m["texts"] = {r["repeat"]: r["text"] for r in reps}
            m["applied"] = [r["applied"] for r in reps if r.get("applied") is not None]  # aider-format turns
            out[condition][key] = m
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def select(table: dict[Key, dict], workload: str, turns: Iterable[int] | None = None) -> dict[Key, dict]:
    turns = None if turns is None else set(turns)
    return {k: v for k, v in table.items() if k[0] == workload and (turns is None or k[2] in turns)}


def pooled_tps(table: dict[Key, dict], keys: Iterable[Key]) -> float | None:
    """Σ (tokens - 1) ÷ Σ generation time over `keys`: turns that wrote one token or none count nowhere."""
    tokens = seconds = 0.0
    for k in keys:
        m = table.get(k)
        if m and m["completion_tokens"] and m["completion_tokens"] > 1 and m["generation_s"]:
            tokens += m["completion_tokens"] - 1
            seconds += m["generation_s"]
    return tokens / seconds if seconds else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdict(what: str, value: float | None, bound: float, *, at_most: bool = False, unit: str = "x") -> tuple:
    """(what, measured, goal, met) for one target: met where `value` is at least (`at_most`: at most) `bound`; None
    where nothing was measured. Example: verdict("x", 5.0, 4.5) -> ("x", 5.0, ">= 4.5x", True)"""
    met = None if value is None else (value <= bound if at_most else value >= bound)
    return what, value, f"{'<=' if at_most else '>='} {bound:g}{unit}", met


def targets(tables: dict[str, dict[Key, dict]]) -> list[tuple[str, float | None, str, bool | None]]:
    """(what, measured, goal, met) for the issue's targets, per uag speculative condition."""
    out = []
    alone = tables.get("mlx_lm", {})
    drafts = {name: t for name, t in tables.items() if name.startswith("mlx_lm:draft")}
    ups = [name for name in tables if name.startswith("uag:") and name != "uag:off"]
    off = tables.get("uag:off")

    def goal(what: str, value: float | None, bound: float, at_most: bool = False) -> None:
        out.append(verdict(what, value, bound, at_most=at_most))

    for name in ups:
        table = tables[name]
        later = select(table, "edit", (2, 3))
        if alone:
            keys = later.keys() & select(alone, "edit", (2, 3)).keys()
            goal(
                f"edit turns 2-3 tokens/s, {name} / mlx_lm",
                ratio(pooled_tps(table, keys), pooled_tps(alone, keys)),
                SPECULATIVE_GOALS["tps_alone"],
            )
        if drafts:
            rates = {d: pooled_tps(t, later.keys() & select(t, "edit", (2, 3)).keys()) for d, t in drafts.items()}
            best = max(rates, key=lambda d: rates[d] or 0)
            keys = later.keys() & select(drafts[best], "edit", (2, 3)).keys()
            goal(
                f"edit turns 2-3 tokens/s, {name} / {best} (its best N)",
                ratio(pooled_tps(table, keys), pooled_tps(drafts[best], keys)),
                SPECULATIVE_GOALS["tps_draft"],
            )
        if alone:
            per_turn = [ratio(alone[k]["e2e_s"], later[k]["e2e_s"]) for k in later.keys() & alone.keys()]
            goal(
                f"edit turns 2-3 end to end per turn (median), mlx_lm / {name}",
                _median(per_turn),
                SPECULATIVE_GOALS["e2e_alone"],
            )
            chat = select(table, "chat").keys() & select(alone, "chat").keys()
            goal(
                f"chat tokens/s pooled, {name} / mlx_lm",
                ratio(pooled_tps(table, chat), pooled_tps(alone, chat)),
                SPECULATIVE_GOALS["chat"],
            )
    out += copy_targets(tables)
    if off is not None and alone:
        keys = {k for k in off.keys() & alone.keys() if k[0] in ("edit", "chat")}
        goal(
            "speculation off tokens/s pooled (edit and chat), uag:off / mlx_lm",
            ratio(pooled_tps(off, keys), pooled_tps(alone, keys)),
            SPECULATIVE_GOALS["off"],
        )
    for name, table in tables.items():
        for (workload, item, turn), warm in table.items():
            cold_read = table.get(("ttft-cold", item, 2))
            if workload not in ("edit", "ttft") or turn != 2 or cold_read is None:
                continue
            what = f"turn-2 TTFT warm / cold ({item}, {fmt(warm['prompt_tokens'], '.0f')} tokens), {name}"
            value = ratio(warm["ttft_s"], cold_read["ttft_s"])
            if name.startswith("uag"):
                goal(what, value, SPECULATIVE_GOALS["ttft"], at_most=True)
            else:
                out.append((what, value, "(peer)", None))
    return out


def copy_targets(tables: dict[str, dict[Key, dict]]) -> list[tuple[str, float | None, str, bool | None]]:
    """Issue 39's targets per uag speculative condition and edit workload: every turn's tokens/s vs mlx_lm alone,
    tokens kept per lookup cycle (goals for the whole-file workloads; the diff format's for information), the cold
    read's time to first token vs mlx_lm's; and, where both ran, the retries with the shared index vs without it."""
    out = []
    alone = tables.get("mlx_lm", {})
    for name, table in tables.items():
        if not name.startswith("uag:") or name == "uag:off":
            continue
        for workload in EDIT_WORKLOADS.values():
            edits = select(table, workload)
            if not edits:
                continue
            whole = workload in WHOLE_FILE
            if alone:
                keys = edits.keys() & select(alone, workload).keys()
                value = ratio(pooled_tps(table, keys), pooled_tps(alone, keys))
                what = f"{workload} all turns tokens/s, {name} / mlx_lm"
                out.append(verdict(what, value, COPY_GOALS["edit_alone"]) if whole else (what, value, "(diff)", None))
            cycles = sum(m["lookup_cycles"] for m in edits.values())
            proposed = sum(m["lookup_proposed_tokens"] for m in edits.values())
            kept = ratio(sum(m["lookup_accepted_tokens"] for m in edits.values()), cycles)
            what = f"{workload} tokens kept per lookup cycle ({fmt(ratio(proposed, cycles), '.1f')} proposed), {name}"
            out.append(
                verdict(what, kept, COPY_GOALS["kept_per_cycle"], unit="") if whole else (what, kept, "(diff)", None)
            )
        value = ratio(cold_read(table), cold_read(alone))
        out.append(verdict(f"cold read TTFT, {name} / mlx_lm", value, COPY_GOALS["cold_ttft"], at_most=True))
        plain = tables.get(f"{name}:noshare") if not name.endswith(":noshare") else None
        if plain is not None:
            keys = select(table, "retry").keys() & select(plain, "retry").keys()
            out.append(
                (
                    f"retries tokens/s, {name} / {name}:noshare",
                    ratio(pooled_tps(table, keys), pooled_tps(plain, keys)),
                    "(shared index)",
                    None,
                )
            )
    return out


def cold_read(table: dict[Key, dict]) -> float | None:
    """The time to first token of a condition's cold read (the turn-2 one), if it made one."""
    return next((m["ttft_s"] for k, m in table.items() if k[0] == "ttft-cold"), None)


def ablation(tables: dict[str, dict[Key, dict]]) -> list[tuple[str, float | None, float | None]]:
    """(condition, edit turns 2-3 tokens/s pooled, end to end summed over them), each × auto as shipped over the
    same drafter (`--ablate`: condition uag:<drafter>-no-<mechanism>), on the turns both served."""
    out = []
    for name, table in tables.items():
        full = tables.get(name.split("-no-")[0]) if "-no-" in name else None
        if full is None:
            continue
        keys = select(table, "edit", (2, 3)).keys() & select(full, "edit", (2, 3)).keys()
        e2e = [(table[k]["e2e_s"], full[k]["e2e_s"]) for k in keys if table[k]["e2e_s"] and full[k]["e2e_s"]]
        out.append(
            (
                name,
                ratio(pooled_tps(table, keys), pooled_tps(full, keys)),
                ratio(sum(f for _, f in e2e), sum(t for t, _ in e2e)) if e2e else None,
            )
        )
    return out


def lossless(rows: Iterable[dict]) -> list[near_ties.Comparison]:
    """Each condition's texts against uag:off's, turn by turn and repeat by repeat (mlx_lm's for information); where
    uag:off did not run, uag's against mlx_lm, for information. A comparison's `parted` are the turns that differ."""
    said = near_ties.replies(rows)
    reference = "uag:off" if "uag:off" in said else "mlx_lm" if "mlx_lm" in said else None
    if reference is None:
        return []
    out = []
    for name, runs in said.items():
        if name == reference or (reference == "mlx_lm" and not name.startswith("uag:")):
            continue
        total = near_ties.Comparison(name, reference)
        for run, texts in runs.items():
            if run in said[reference]:
                where = {"repeat": run[0]}
                total.add(near_ties.compare(name, reference, texts, said[reference][run], where, where))
        out.append(total)
    return out


def classified(rows: list[dict], target: str, write: Callable[[dict], None]) -> None:
    """Where a uag condition's text differs from uag:off's, the verdict (near-tie or bug: benchmarks/near_ties.py),
    each written as a "parted" row; the target is loaded in this process only where a text differs."""
    known = near_ties.verdicts(rows)
    parted = [
        p
        for c in lossless(rows)
        if c.reference == "uag:off" and c.condition.startswith("uag:")
        for p in c.parted
        if p.key not in known
    ]
    if parted:
        say(f"{len(parted)} replies differ from uag:off's: classifying them with {target} loaded here")
        for r in near_ties.classify(parted, target, say=lambda line: say(f"  {line}")):
            write(r)


def summary(rows: list[dict]) -> str:
    tables = medians(rows)
    meta = next((r for r in rows if r.get("kind") == "meta"), {})
    lines = [
        f"uag serve vs mlx_lm.server — {meta.get('date', '?')}, {meta.get('machine', '?')}, target "
        f"{meta.get('target', '?')}, {meta.get('max_tokens', '?')} max tokens, "
        f"repeats: {meta.get('repeats', '?')} (medians)"
    ]
    columns = (
        ("condition", max([26, *(len(name) + 2 for name in tables)])),
        ("workload", 18),
        ("turns", 6),
        ("TTFT s", 9),
        ("tokens/s", 10),
        ("e2e s", 9),
        ("α", 7),
        ("cached", 9),
    )
    header = "".join(name.ljust(width) if i < 2 else name.rjust(width) for i, (name, width) in enumerate(columns))
    lines += ["", header, "-" * len(header)]
    for name, table in tables.items():
        for label, part in (
            *(
                (f"{w} t{turns}", select(table, w, {"1": (1,), "2-3": (2, 3)}[turns]))
                for w in EDIT_WORKLOADS.values()
                for turns in ("1", "2-3")
            ),
            ("chat", select(table, "chat")),
            ("retry t2", select(table, "retry")),
        ):
            if not part:
                continue
            drafted = sum(m["drafted"] for m in part.values())
            alpha = sum(m["accepted"] for m in part.values()) / drafted if drafted else None
            cells = (
                name,
                label,
                str(len(part)),
                fmt(_median([m["ttft_s"] for m in part.values()]), ".2f"),
                fmt(pooled_tps(table, part), ".2f"),
                fmt(_median([m["e2e_s"] for m in part.values()]), ".1f"),
                fmt(alpha, ".2f"),
                fmt(_median([m["cached_tokens"] for m in part.values()]), ".0f"),
            )
            lines.append(
                "".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, (_, w)) in enumerate(zip(cells, columns)))
            )
    lines += [
        "",
        "TTFT, e2e: medians over turns; tokens/s: pooled, Σ(tokens - 1) / Σ(first to last token); "
        "cached: median cached prompt tokens",
        "",
    ]
    for what, value, goal, met in targets(tables):
        verdict = "" if goal.startswith("(") else "not measured" if met is None else "met" if met else "NOT met"
        measured = "-" if value is None else f"{value:.2f}" + ("x" if " / " in what else "")  # a ratio, or tokens
        lines.append(f"{what:<86}{measured:>9}  {goal:<9} {verdict}")
    for name, tps, e2e in ablation(tables):
        what = f"ablation: {name}, edit turns 2-3 × auto as shipped: tokens/s; speed end to end"
        lines.append(f"{what:<86}{fmt(tps, '.3f'):>9}  {fmt(e2e, '.3f')}")
    found = near_ties.verdicts(rows)
    for c in lossless(rows):
        if c.condition.startswith("uag:") and c.reference == "uag:off":
            what = f"lossless: {c.condition} text == uag:off text"
            why, verdict = near_ties.note(c, found)
        else:
            what, why, verdict = f"for information: {c.condition} text == {c.reference} text", "", ""
        lines.append(f"{what:<86}{f'{c.same}/{c.total}':>9}  {'all' if verdict else '':<9} {verdict} {why}".rstrip())
    for name, workload, applied, total in edits_applied(tables):
        lines.append(f"{f'edits applied to the file, {workload}, {name}':<86}{f'{applied}/{total}':>9}")
    for r in (r for r in rows if r.get("kind") == "metrics"):  # issue 50: a scrape adds up to the replies
        lines.append(f"GET /metrics, {r['server']}, repeat {r['repeat'] + 1}: {r['verdict']}")
    return "\n".join(lines)


def edits_applied(tables: dict[str, dict[Key, dict]]) -> list[tuple[str, str, int, int]]:
    """(condition, workload, turns whose edits applied, aider-format turns), over every repeat."""
    out = []
    for name, table in tables.items():
        for workload in (w for w in EDIT_WORKLOADS.values() if w != "edit"):
            applied = [a for m in select(table, workload).values() for a in m["applied"]]
            if applied:
                out.append((name, workload, sum(applied), len(applied)))
    return out


# --- main --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target", help="an offline name, a folder or a hub id")
    parser.add_argument(
        "--drafters",
        nargs="+",
        help="uag's drafters, each a condition under auto (default: "
        "lookup+demo-drafter, and lookup+coder-drafter for coder-target)",
    )
    parser.add_argument(
        "--peer-draft",
        help="mlx_lm.server's --draft-model: a same-vocabulary model (default: "
        "coder-drafter for coder-target, none otherwise; 'none' to leave it out)",
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, nargs="+", default=[2, 3, 4], help="mlx_lm.server's N, each a condition"
    )
    parser.add_argument("--conversations", type=int, default=2, help="edit conversations (three turns each)")
    parser.add_argument("--ids", nargs="+", help="these edit conversations instead of the first --conversations")
    parser.add_argument(
        "--edit-formats",
        nargs="+",
        default=["edit"],
        choices=list(EDIT_WORKLOADS),
        help="how the edit conversations are asked, each a workload: edit (as bundled: the whole file back), whole "
        "and diff (as aider asks with that --edit-format; workloads aider-whole, aider-diff)",
    )
    parser.add_argument("--chat-prompts", type=int, default=2, help="open chat prompts per language (Polish, English)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ttft-conversation", default=DEFAULT_TTFT_CONVERSATION, help="'' to skip the cold read")
    parser.add_argument("--only", nargs="+", help="run only these conditions, in this order, e.g. uag:off mlx_lm")
    parser.add_argument(
        "--ablate",
        nargs="+",
        default=[],
        choices=[*MECHANISMS, "all"],
        help="also auto over the first drafter "
        "with each of these switched off (`uag serve --auto-off`), as condition uag:<drafter>-no-<name>; every "
        "uag server then opens from a copy of the saved profiles and evidence as they were at the start",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="run the conditions' servers side by side and send each request to every one in turn (interleaved "
        "request by request; uag:off shares the uag server; the weights must fit in memory together)",
    )
    parser.add_argument("--out", help="the rows, one JSON object per line (default serve-<date-time>.jsonl)")
    parser.add_argument(
        "--summarize",
        metavar="ROWS",
        nargs="+",
        help="print the summary of a rows file and exit; several files: their runs summarised together (each "
        "file's repeats numbered after the ones before it)",
    )
    parser.add_argument(
        "--classify",
        action="store_true",
        help="with --summarize: classify the replies that differ from uag:off's (near-tie or bug; loads the target "
        "here, in the rows' dtype as stored) where the rows lack a verdict, and append the verdicts to the file",
    )
    parser.add_argument(
        "--retry",
        action="store_true",
        help="after the edit conversations, each one's turn 2 asked "
        "again (workload `retry`: what an index shared across requests copies)",
    )
    parser.add_argument(
        "--without-shared-index",
        action="store_true",
        help="each uag drafter also as uag:<drafter>:noshare, with `--lookup-memory 0`",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        metavar="C",
        help="the concurrency benchmark (benchmarks/serve_many.py): C requests at once, each C a level, e.g. 1 2 4 8",
    )
    parser.add_argument("--plot", metavar="PATH", help="with --concurrency: aggregate tokens/s against it, as PNG")
    parser.add_argument(
        "--py-spy",
        action="store_true",
        help="with --concurrency: py-spy on each uag server through its waves; where its MLX worker's time went "
        "(benchmarks/worker_profile.py; needs py-spy and the right to attach)",
    )
    args = parser.parse_args(argv)
    if args.summarize:
        paths = [Path(p) for p in args.summarize]
        if args.classify and len(paths) > 1:
            parser.error("--classify appends to its rows file: give it one")
        path = paths[0]
        rows = joined([[json.loads(line) for line in p.read_text().splitlines() if line.strip()] for p in paths])
        many = any(r.get("kind") == "request" for r in rows)  # rows of --concurrency
        if args.classify:  # the verdicts the rows lack, appended to them
            meta = next((r for r in rows if r.get("kind") == "meta"), {})
            with path.open("a") as f:

                def write(r: dict) -> None:
                    rows.append(r)
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")

                (serve_many.classified if many else classified)(rows, meta.get("target") or args.target, write)
        if many:
            return serve_many.summarize(rows, args.plot)
        print(summary(rows))
        return 0
    coder = args.target == "coder-target"
    if args.drafters is None:
        args.drafters = ["lookup+demo-drafter", "lookup+coder-drafter"] if coder else ["lookup+demo-drafter"]
    if args.peer_draft is None:
        args.peer_draft = "coder-drafter" if coder else None
    elif args.peer_draft.lower() == "none":
        args.peer_draft = None
    bad = [
        f"--{n.replace('_', '-')} must be at least {lo}"
        for n, lo in (("conversations", 0), ("chat_prompts", 0), ("max_tokens", 2), ("repeats", 1))
        if getattr(args, n) < lo
    ]
    bad += [f"--num-draft-tokens {n}: mlx_lm.server drafts 1 or more" for n in args.num_draft_tokens if n < 1]
    if bad:
        parser.error("; ".join(bad))
    if args.concurrency:
        return serve_many.main(args)
    if args.ids:
        known = {c.id: c for c in load_conversations("edit")}
        unknown = [i for i in args.ids if i not in known]
        if unknown:
            parser.error(f"--ids: no conversation {', '.join(map(repr, unknown))} in the edit set")
        edit = [known[i] for i in args.ids]
    else:
        edit = load_conversations("edit", args.conversations) if args.conversations else []
    ttft = None
    if args.ttft_conversation:
        found = [c for c in load_conversations("edit") if c.id == args.ttft_conversation]
        if not found:
            parser.error(f"--ttft-conversation: no conversation {args.ttft_conversation!r} in the edit set")
        ttft = found[0]
    chat = chat_prompts(args.chat_prompts)
    conds = conditions(args)
    if args.together:
        conds = together(conds)
        check_memory(conds)
    out = Path(args.out or f"serve-{datetime.now():%Y%m%d-%H%M%S}.jsonl")
    logs = out.with_suffix(".logs")

    from uag.machine import backend, blas, device_name

    meta = {
        "kind": "meta",
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": device_name(),
        "backend": backend(),
        "blas": blas(),
        "cpus": os.cpu_count(),
        "target": args.target,
        "target_folder": folder(args.target),
        "peer_draft": args.peer_draft,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "together": args.together,
        "conversations": [c.id for c in edit],
        "edit_formats": args.edit_formats,
        "aider_layout": edit_formats.aider_version() if set(args.edit_formats) - {"edit"} else None,
        "chat": [i for i, _ in chat],
        "ttft_conversation": ttft.id if ttft else None,
        "conditions": [{"name": c.name, "argv": list(c.argv), "extra_body": c.extra_body} for c in conds],
        "versions": {p: version(p) for p in ("mlx", "mlx-lm", "openai", "uag")},
    }
    with rows_file(out, meta) as (rows, write):
        for repeat in range(args.repeats):
            shift = repeat % len(conds)
            order = conds[shift:] + conds[:shift]
            for group in [order] if args.together else [[c] for c in order]:
                session(group, repeat, args, edit, ttft, chat, logs, write)
        classified(rows, args.target, write)  # every server has stopped: the target fits here now
    say(f"rows in {out}, server logs in {logs}/")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
