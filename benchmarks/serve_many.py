"""Concurrent requests to `uag serve` and `mlx_lm.server` (issue 37): `benchmarks/serve.py --concurrency 1 2 4 8`.

At each concurrency C, each condition's server is started afresh, warmed up (one request, then C at once: a
backend that compiles kernels at first use does so there) and one client's threads send C requests at once:
`edit` (C conversations: their turn 1s together, then, once all are answered, their turns 2-3 together, each
conversation's turn 3 after its own turn 2) and open chat (C prompts), in waves over the first `--conversations` and
`--chat-prompts` (items left over from the last full wave are not sent at that C). Conditions, servers and requests
come from serving.py. The summary: per condition, workload and C, aggregate tokens/s (a wave's completion tokens ÷
the time from its first request sent to its last reply done; edit: turns 2-3), p50/p95 time to first token and end
to end; then the issue's targets and losslessness: each uag condition's texts against uag:off's, and uag:off's at each
C against its own at the lowest (batched passes against one request's), every difference classified near-tie or
bug after the servers stop (benchmarks/near_ties.py); last, per uag condition, workload and C, milliseconds a batch
round spent in its passes, its members' own work and the rest (wall / the worker's CPU), from the server's
`GET /metrics` scraped before and after every wave. Smoke run on the demo pair:
    python benchmarks/serve.py --concurrency 1 2 --conversations 2 --chat-prompts 1 --max-tokens 8 --plot c.png
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import httpx
import near_ties  # benchmarks/near_ties.py, beside this module: where a reply differs, near-tie or bug
import openai
import worker_profile  # benchmarks/worker_profile.py, beside this module: --py-spy
from serving import (  # benchmarks/serving.py, beside this module (serve.py runs this one; its folder is on sys.path)
    REQUEST_S,
    WARM_UP,
    WARM_UP_TOKENS,
    Condition,
    Reply,
    Server,
    ask,
    cache_snapshot,
    chat_prompts,
    fmt,
    row,
    rows_file,
    say,
    version,
)
from serving import conditions as serve_conditions

from uag.runtime.batching import RoundTimes
from uag.runtime.warmup import copy_prompt
from uag.study.datasets import Conversation, load_conversations

T = TypeVar("T")
AT = 4  # the concurrency where batched is set against one request after another
WARM_UP_BATCH_TOKENS = 32  # each of the C warm-up requests sent at once (`batch_warm_up`)
# Issue 52's targets, on medians over runs, at every C above 1: on a GPU, and on a CPU (its coder target)
GOALS = {
    "gpu": {"edit_peer": 2.5, "chat_peer": 1.0, "off_peer": 1.0, "serial": 1.5, "alone": 0.97},
    "cpu": {"edit_peer": 2.0, "chat_peer": 1.0, "off_peer": 0.97, "serial": None, "alone": 0.97},
}
SPREAD = 0.15  # each run within this fraction of its level's median
RUNS = 3  # runs a median needs before its verdict counts (#52: one-run figures do not count)
EDIT, CHAT = "edit t2-3", "chat"  # the summary's workloads: edit's turns 2-3, open chat


# --- conditions ----------------------------------------------------------------------------------------------------
def conditions(args: argparse.Namespace) -> list[Condition]:
    """serving.py's conditions with uag batched up to the largest concurrency, each uag drafter also as
    `uag:<drafter>:serial` (`--max-batch 1`: one request after another); `--only` picks and orders them."""
    most = max(args.concurrency)
    out = []
    for c in serve_conditions(argparse.Namespace(**{**vars(args), "only": None, "ablate": []})):
        if c.server != "uag":
            out.append(c)
            continue
        queue = ("--per-client", str(most), "--max-queue", str(max(8, most)))  # all C admitted, none refused
        out.append(replace(c, argv=(*c.argv, "--max-batch", str(most), *queue)))
        if c.name != "uag:off":
            out.append(replace(c, name=f"{c.name}:serial", argv=(*c.argv, "--max-batch", "1", *queue)))
    if args.only:
        unknown = sorted(set(args.only) - {c.name for c in out})
        if unknown:
            raise SystemExit(f"--only: no condition {', '.join(unknown)} (there are {', '.join(c.name for c in out)})")
        out = sorted((c for c in out if c.name in args.only), key=lambda c: args.only.index(c.name))
    return out


# --- requests at once ----------------------------------------------------------------------------------------------
def waves(items: Sequence[T], size: int) -> list[list[T]]:
    """`items` in full waves of `size`; what is left over is not sent.

    Example: waves("abcde", 2) -> [["a", "b"], ["c", "d"]]
    """
    return [list(items[i : i + size]) for i in range(0, len(items) - size + 1, size)]


def kernel_cache() -> Path:
    """Where MLX's CUDA backend keeps the kernels it compiled at first use (one file each; the next process on the
    machine loads them from there): `MLX_PTX_CACHE_DIR`, else <temp dir>/mlx/<version>/ptx. Empty or absent on a
    backend that compiles nothing at run time (the CPU's)."""
    if folder := os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(folder)
    import mlx.core as mx

    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def kernels() -> set[str]:
    """The names of the kernels in `kernel_cache()` now (what a wave compiled is the difference of two of these)."""
    folder = kernel_cache()
    return {f.name for f in folder.iterdir()} if folder.is_dir() else set()


def batch_warm_up(i: int) -> list[dict]:
    """The messages of the i-th of the C warm-up requests sent at once: a prompt of a few hundred tokens (read in
    chunks, several together) asking for a copy (drafted and verified in batched passes), unlike the others'."""
    return [{"role": "user", "content": copy_prompt(i, repeats=5)}]


def at_once(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each call on its own thread, all released together; their results in order (a call's error is raised)."""
    gate = threading.Barrier(len(calls))

    def run(call: Callable[[], T]) -> T:
        gate.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(run, call) for call in calls]
        return [f.result() for f in futures]


@dataclass
class Sent:
    """One request of a wave: its reply and when it was sent, in seconds from the wave's start."""

    workload: str
    item: str
    turn: int
    reply: Reply
    at_s: float


def request_row(condition: Condition, repeat: int, concurrency: int, wave: int, sent: Sent) -> dict:
    """serving.py's row of one reply, with the wave it ran in and its times from the wave's start."""
    reply = sent.reply
    return {
        **row(condition, repeat, sent.workload, sent.item, sent.turn, reply),
        "kind": "request",
        "concurrency": concurrency,
        "wave": wave,
        "started_s": sent.at_s,
        "first_token_s": None if reply.ttft_s is None else sent.at_s + reply.ttft_s,
        "done_s": sent.at_s + reply.e2e_s,
        "speculative": reply.speculative,
    }


class Client:
    """One OpenAI client for a server, shared by the threads of every wave."""

    def __init__(self, condition: Condition, url: str, max_tokens: int):
        self.condition, self.max_tokens = condition, max_tokens
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_S)

    def send(self, start: float, workload: str, item: str, turn: int, messages: list[dict]) -> Sent:
        at = time.perf_counter() - start
        return Sent(workload, item, turn, ask(self.openai, self.condition, messages, self.max_tokens), at)

    def edit(self, conversations: list[Conversation], between: Callable[[], None] = lambda: None) -> list[Sent]:
        """Turn 1 of every conversation at once; then, all answered (and `between()` called), the later turns of
        each in order."""
        start = time.perf_counter()
        first = at_once([lambda c=c: self.send(start, "edit", c.id, 1, c.messages([])) for c in conversations])
        replies = {s.item: [s.reply.text] for s in first}
        between()

        def later(c: Conversation, start: float) -> list[Sent]:
            out = []
            for turn in range(2, len(c.turns) + 1):
                out.append(self.send(start, "edit", c.id, turn, c.messages(replies[c.id])))
                replies[c.id].append(out[-1].reply.text)
            return out

        start = time.perf_counter()  # turns 2-3 are a wave of their own
        return first + [s for sents in at_once([lambda c=c: later(c, start) for c in conversations]) for s in sents]

    def chat(self, prompts: list[tuple[str, str]], between: Callable[[], None] = lambda: None) -> list[Sent]:
        """Every prompt at once (one part: `between` is never called)."""
        start = time.perf_counter()
        return at_once(
            [lambda i=i, t=t: self.send(start, "chat", i, 1, [{"role": "user", "content": t}]) for i, t in prompts]
        )


def level(
    condition: Condition,
    concurrency: int,
    repeat: int,
    work: tuple[list[Conversation], list[tuple[str, str]]],
    args: argparse.Namespace,
    logs: Path,
    write: Callable[[dict], None],
) -> None:
    """One concurrency on a freshly started server: a warm-up (one request, then C at once), then every wave of edit
    and of chat."""
    log = logs / f"{condition.name.replace(':', '-')}-c{concurrency}-r{repeat + 1}.log"
    edit, chat = work
    known = kernels()
    with Server(condition, log) as server:
        started = kernels()
        client = Client(condition, server.url, args.max_tokens)
        ask(client.openai, condition, WARM_UP, WARM_UP_TOKENS)  # loads (uag), calibrates a first `auto` use
        warm = ask(client.openai, condition, WARM_UP, WARM_UP_TOKENS)
        if concurrency > 1:  # C at once: a backend that compiles its kernels at first use (MLX's CUDA backend, on
            # a fresh machine) compiles the batched passes' here, not in the first wave (docs/results.md, bs)
            warm_ups = [
                lambda i=i: ask(client.openai, condition, batch_warm_up(i), WARM_UP_BATCH_TOKENS)
                for i in range(concurrency)
            ]
            at_once(warm_ups)
        write(
            {
                "kind": "warmup",
                "condition": condition.name,
                "repeat": repeat,
                "concurrency": concurrency,
                "startup_s": server.startup_s,
                "openblas_mapped": server.openblas,
                "tokens": warm.completion_tokens,
                "generation_tps": warm.generation_tps,
                "kernels_started": sorted(started - known),  # compiled at the server's start (its own warm-up)
                "kernels_warmed": sorted(kernels() - started),  # and by the warm-up requests above
            }
        )
        say(f"{condition.name} C={concurrency}: up in {server.startup_s:.0f} s, OpenBLAS mapped: {server.openblas}")
        jobs = [(client.edit, wave, group) for wave, group in enumerate(waves(edit, concurrency))]
        jobs += [(client.chat, wave, group) for wave, group in enumerate(waves(chat, concurrency))]
        spy = log.with_suffix(".spy.txt") if getattr(args, "py_spy", False) and condition.server == "uag" else None
        recorder = worker_profile.record(server.proc.pid, spy) if spy is not None else None
        try:
            waves_of(condition, concurrency, repeat, server, client, jobs, write)
        finally:
            if recorder is not None:  # where the worker's time went through the waves (py-spy)
                failed = worker_profile.stop(recorder)
                summary = worker_profile.summarize(spy)
                at = {"kind": "worker_profile", "condition": condition.name, "repeat": repeat}
                write({**at, "concurrency": concurrency, "error": failed, **summary})
                for line in worker_profile.say(summary):
                    say(f"  {line}")
                if failed:
                    say(f"  py-spy: {failed}")


def waves_of(
    condition: Condition,
    concurrency: int,
    repeat: int,
    server: Server,
    client: Client,
    jobs: list,
    write: Callable[[dict], None],
) -> None:
    """Every wave of a level on its server: its rows, and where a uag server's batch rounds went in each of its parts
    (an edit wave's turn 1s, then its turns 2-3; a chat wave whole), with the kernels each part compiled."""
    for run, wave, group in jobs:
        marks = []  # (round times, kernels) where each part of the wave starts, and where it ends

        def mark(marks: list = marks) -> None:
            marks.append((round_times(server.url) if condition.server == "uag" else None, kernels()))

        mark()
        try:
            sents = run(group, between=mark)
        except openai.APIError as err:
            raise SystemExit(f"{condition.name} C={concurrency}: {err}\n{server.tail()}") from err
        mark()
        rows = [request_row(condition, repeat, concurrency, wave, s) for s in sents]
        for r in rows:
            write(r)
        parts = ["1", "2-3"] if len(marks) == 3 else [None]
        for turns, (before, known), (after, now) in zip(parts, marks, marks[1:]):
            built, rounds = sorted(now - known), ""
            if before is not None:  # where the server's batch rounds spent this part's time (GET /metrics)
                part = rounds_row(condition, repeat, concurrency, wave, rows[0]["workload"], before, after)
                write({**part, "turns": turns, "kernels": built})  # the kernels it compiled at first use (CPU: none)
                if part["rounds"]:
                    per = {p: 1000 * part["wall"].get(p, 0) / part["rounds"] for p in RoundTimes.PARTS}
                    ms = ", ".join(f"{p} {v:.1f}" for p, v in per.items())
                    rounds = f"; {part['rounds']:.0f} rounds, ms each: {ms}"
            compiled = f"; {len(built)} kernels compiled" if built else ""
            label = f"{rows[0]['workload']} wave {wave + 1}" + (f" turns {turns}" if turns else "")
            if turns == "1":  # not measured (workload_of): the prompts read
                say(f"  {label}{rounds}{compiled}")
            else:
                s = Stats.of(r for r in rows if workload_of(r))
                tps = fmt(s.tps, ".2f")
                say(f"  {label}: {s.tokens} tokens in {s.wall_s:.1f} s, {tps} tokens/s{rounds}{compiled}")


# --- the summary (from rows alone) ---------------------------------------------------------------------------------
def round_times(url: str) -> dict:
    """uag serve's batch rounds so far, from `GET /metrics`: {"rounds": n, "wall": {part: s}, "cpu": {part: s}}
    (uag:batch_rounds_total, uag:batch_round_seconds_total; all zero where the server does not batch)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"rounds": 0.0, "wall": defaultdict(float), "cpu": defaultdict(float)}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "uag:batch_rounds_total":
                out["rounds"] += sample.value
            elif sample.name == "uag:batch_round_seconds_total":
                out[sample.labels["clock"]][sample.labels["part"]] += sample.value
    return out


def rounds_row(
    condition: Condition, repeat: int, concurrency: int, wave: int, workload: str | None, before: dict, after: dict
) -> dict:
    """The rounds a wave ran (an edit wave: its conversations' every turn) and where their time went: the difference
    of two `round_times` scrapes."""
    return {
        "kind": "rounds",
        "condition": condition.name,
        "repeat": repeat,
        "concurrency": concurrency,
        "wave": wave,
        "workload": workload,
        "rounds": after["rounds"] - before["rounds"],
        **{clock: {p: after[clock][p] - before[clock][p] for p in after[clock]} for clock in ("wall", "cpu")},
    }


def rounds_lines(rows: Iterable[dict]) -> list[str]:
    """Per uag condition, workload and concurrency, pooled over waves and repeats: milliseconds per batch round in its
    passes, its members' own work and the rest, wall clock / the worker thread's CPU (wall above CPU: it waited)."""
    pooled: dict[tuple, dict] = {}
    for r in rows:
        if r.get("kind") == "rounds" and r["rounds"]:
            key = (r["condition"], r["workload"] + (" turn 1" if r.get("turns") == "1" else ""), r["concurrency"])
            into = pooled.setdefault(key, {"rounds": 0.0, "wall": defaultdict(float), "cpu": defaultdict(float)})
            into["rounds"] += r["rounds"]
            for clock in ("wall", "cpu"):
                for part, seconds in r[clock].items():
                    into[clock][part] += seconds
    if not pooled:
        return []
    lines = ["", "where uag's batch rounds went: ms per round, wall / worker CPU (GET /metrics, pooled over waves)"]
    for (name, workload, c), t in pooled.items():
        per = {clock: {p: 1000 * v / t["rounds"] for p, v in t[clock].items()} for clock in ("wall", "cpu")}
        parts = "  ".join(f"{p} {per['wall'].get(p, 0):.2f} / {per['cpu'].get(p, 0):.2f}" for p in RoundTimes.PARTS)
        total = sum(per["wall"].values())
        lines.append(f"{name:<30}{workload or '-':<12}C={c:<3}{t['rounds']:>7.0f} rounds  {total:7.2f} ms: {parts}")
    return lines


def percentile(values: Iterable[float | None], q: float) -> float | None:
    """The q-th percentile, linear between the closest ranks (numpy's default); None for no values.

    Example: percentile([1, 2, 3, 4], 50) -> 2.5;  percentile([1, 2, 3, 4], 95) -> 3.85
    """
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def workload_of(r: dict) -> str | None:
    """A request row's workload in the summary: EDIT (edit's turns 2-3) or CHAT; None for edit's turn 1."""
    return CHAT if r["workload"] == "chat" else EDIT if r["workload"] == "edit" and r["turn"] >= 2 else None


@dataclass
class Stats:
    """One condition × workload × concurrency, pooled over its waves (and repeats)."""

    tokens: int = 0
    wall_s: float = 0.0  # Σ over waves of (last reply done - first request sent)
    ttft_s: list[float | None] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    batch: list[float] = field(default_factory=list)  # uag's mean batch size per request

    @classmethod
    def of(cls, rows: Iterable[dict]) -> Stats:
        """Example: two requests of one wave sent at 0 and 0.1 s, done at 2 and 4 s, 10 tokens each -> 20 / 4 s"""
        out, spans = cls(), defaultdict(list)
        for r in rows:
            spans[(r["repeat"], r["wave"])].append(r)
            out.tokens += r["completion_tokens"] or 0
            out.ttft_s.append(r["ttft_s"])
            out.e2e_s.append(r["e2e_s"])
            out.drafted += r["drafted"] or 0
            out.accepted += r["accepted"] or 0
            if (r.get("speculative") or {}).get("batch"):
                out.batch.append(r["speculative"]["batch"]["mean"])
        out.wall_s = sum(max(r["done_s"] for r in w) - min(r["started_s"] for r in w) for w in spans.values())
        return out

    @property
    def tps(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s > 0 else None

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


Level = tuple[str, str, int]  # (condition, workload, concurrency)


def levels(rows: Iterable[dict]) -> dict[Level, Stats]:
    """Every condition × workload × concurrency of the request rows, in the rows' order."""
    groups: dict[Level, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("kind") == "request" and workload_of(r):
            groups[(r["condition"], workload_of(r), r["concurrency"])].append(r)
    return {key: Stats.of(part) for key, part in groups.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def runs(rows: Iterable[dict]) -> dict[Level, list[float]]:
    """Every level's aggregate tokens/s in each run (repeat) that measured it, in the order of the runs.

    Example: a level measured at 80 tokens/s in repeat 0 and 100 in repeat 1 -> {level: [80.0, 100.0]}
    """
    groups: dict[Level, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("kind") == "request" and workload_of(r):
            groups[(r["condition"], workload_of(r), r["concurrency"])][r["repeat"]].append(r)
    out = {}
    for key, by_run in groups.items():
        out[key] = [tps for _, part in sorted(by_run.items()) if (tps := Stats.of(part).tps) is not None]
    return out


def spread(values: Sequence[float]) -> float | None:
    """The largest distance of a run from the median, as a fraction of the median.

    Example: spread([90, 100, 120]) -> 0.2;  spread([]) -> None
    """
    if not values:
        return None
    mid = statistics.median(values)
    return max(abs(v - mid) for v in values) / mid if mid else None


def targets(per_run: dict[Level, list[float]], gpu: bool) -> list[tuple[str, float | None, str, bool | None]]:
    """(what, measured, goal, met) for issue 52's targets, on medians over runs: per uag drafter condition (batched)
    at every C above 1, uag:off there, and each level's runs within ±SPREAD of their median (`measured`: the
    worst level's distance). `met` is None where a side was not measured."""
    goals, out = GOALS["gpu" if gpu else "cpu"], []
    med = {key: statistics.median(v) for key, v in per_run.items() if v}

    def compare(part: str, c: int, name: str, peer: str, key: str) -> None:
        bound = goals[key]
        if bound is None:
            return
        value = ratio(med.get((name, part, c)), med.get((peer, part, c)))
        met = None if value is None else value >= bound
        out.append((f"C={c} {part} tokens/s, {name} / {peer}", value, f">= {bound:g}x", met))

    names = list(dict.fromkeys(name for name, _, _ in per_run))
    batched = sorted({c for _, _, c in per_run if c > 1})
    for name in [n for n in names if n.startswith("uag:") and n != "uag:off" and not n.endswith(":serial")]:
        for c in batched:
            compare(EDIT, c, name, "mlx_lm", "edit_peer")
            compare(CHAT, c, name, "mlx_lm", "chat_peer")
        for part in (EDIT, CHAT):
            compare(part, AT, name, f"{name}:serial", "serial")
            compare(part, 1, name, f"{name}:serial", "alone")
    for c in batched:
        for part in (EDIT, CHAT):
            compare(part, c, "uag:off", "mlx_lm", "off_peer")
    spreads = [(spread(v), key) for key, v in per_run.items() if len(v) > 1]
    far = max(((d, key) for d, key in spreads if d is not None), default=None)
    if far is not None:
        (value, (name, part, c)) = far
        what = f"runs within ±{SPREAD:.0%} of their median (worst: {name} {part} C={c})"
        out.append((what, value, f"<= {SPREAD:g}", value <= SPREAD))
    return out


def medians_lines(per_run: dict[Level, list[float]]) -> list[str]:
    """Per level: the median tokens/s over runs, each run's, and their spread."""
    if not per_run:
        return []
    lines = ["", "tokens/s over runs: median (each run), spread = the largest distance from the median"]
    order = list(per_run)
    for (name, part, c), values in sorted(per_run.items(), key=lambda kv: (kv[0][1] != EDIT, order.index(kv[0]))):
        each = ", ".join(f"{v:.1f}" for v in values)
        far = spread(values)
        lines.append(
            f"{name:<30}{part:<12}C={c:<3}{statistics.median(values):>10.1f}  ({each})"
            + (f"  ±{far:.0%}" if far is not None and len(values) > 1 else "")
        )
    return lines


def lossless(rows: Iterable[dict]) -> list[tuple[str, int, int]]:
    """(condition, requests whose text equals uag:off's, requests compared) per uag speculative condition: the same
    request is the same repeat, concurrency, workload, item and turn."""
    return [(c.condition, c.same, c.total) for c in comparisons(rows) if c.condition != "uag:off"]


def comparisons(rows: Iterable[dict]) -> list[near_ties.Comparison]:
    """Each uag speculative condition's texts against uag:off's for the same request (repeat, concurrency, workload,
    item, turn); then uag:off batched against itself at the lowest concurrency (a batch's passes against one
    request's: `condition` "uag:off", one comparison per higher concurrency). Their `parted`: the requests that
    differ, for benchmarks/near_ties.py."""
    said = near_ties.replies(rows, by=("repeat", "concurrency"))
    off = said.get("uag:off")
    if off is None:
        return []
    out = []
    for name, runs in said.items():
        if name.startswith("uag:") and name != "uag:off":
            total = near_ties.Comparison(name, "uag:off")
            for run in sorted(runs.keys() & off.keys()):
                where = {"repeat": run[0], "concurrency": run[1]}
                total.add(near_ties.compare(name, "uag:off", runs[run], off[run], where, where))
            out.append(total)
    lowest = min((c for _, c in off), default=None)
    for level in sorted({c for _, c in off} - {lowest}):
        total = near_ties.Comparison("uag:off", "uag:off", label=f"C={level} vs C={lowest}")
        for repeat in sorted({r for r, c in off if c == level and (r, lowest) in off}):
            where, alone = {"repeat": repeat, "concurrency": level}, {"repeat": repeat, "concurrency": lowest}
            total.add(near_ties.compare("uag:off", "uag:off", off[repeat, level], off[repeat, lowest], where, alone))
        out.append(total)
    return out


def classified(rows: list[dict], target: str, write: Callable[[dict], None]) -> None:
    """Where a request's text differs from its reference's, the verdict (near-tie or bug: benchmarks/near_ties.py),
    each written as a "parted" row; the target is loaded in this process only where a text differs."""
    known = near_ties.verdicts(rows)
    parted = [p for c in comparisons(rows) for p in c.parted if p.key not in known]
    if parted:
        say(f"{len(parted)} replies differ from their reference's: classifying them with {target} loaded here")
        for r in near_ties.classify(parted, target, say=lambda line: say(f"  {line}")):
            write(r)


def lossless_lines(rows: list[dict]) -> list[str]:
    """The summary's lossless lines: per comparison, requests equal / compared, and the partings' verdicts."""
    found, lines = near_ties.verdicts(rows), []
    for c in comparisons(rows):
        if not c.total:  # no request of it ran beside uag:off's (another file's runs)
            continue
        why, verdict = near_ties.note(c, found)
        if c.condition == "uag:off":
            what = f"lossless: uag:off text, {c.label}"
        else:
            what = f"lossless: {c.condition} text == uag:off text"
        lines.append(f"{what:<72}{f'{c.same}/{c.total}':>9}  {'all':<9} {verdict} {why}".rstrip())
    return lines


COLUMNS = (
    ("condition", 30),
    ("workload", 11),
    ("C", 4),
    ("requests", 9),
    ("tokens", 8),
    ("wall s", 9),
    ("tokens/s", 10),
    ("TTFT p50", 10),
    ("TTFT p95", 10),
    ("e2e p50", 9),
    ("e2e p95", 9),
    ("α", 6),
    ("batch", 7),
)


def summary(rows: list[dict]) -> str:
    meta = next((r for r in rows if r.get("kind") == "meta"), {})
    lines = [
        f"uag serve vs mlx_lm.server, concurrent requests — {meta.get('date', '?')}, {meta.get('machine', '?')}, "
        f"target {meta.get('target', '?')}, {meta.get('max_tokens', '?')} max tokens, "
        f"repeats {meta.get('repeats', '?')}"
    ]
    header = "".join(n.ljust(w) if i < 2 else n.rjust(w) for i, (n, w) in enumerate(COLUMNS))
    lines += ["", header, "-" * len(header)]
    stats = levels(rows)
    order = list(stats)
    for (name, part, c), s in sorted(stats.items(), key=lambda kv: (kv[0][1] != EDIT, order.index(kv[0]))):
        cells = (
            name,
            part,
            str(c),
            str(len(s.e2e_s)),
            str(s.tokens),
            fmt(s.wall_s, ".1f"),
            fmt(s.tps, ".2f"),
            fmt(percentile(s.ttft_s, 50), ".2f"),
            fmt(percentile(s.ttft_s, 95), ".2f"),
            fmt(percentile(s.e2e_s, 50), ".1f"),
            fmt(percentile(s.e2e_s, 95), ".1f"),
            fmt(s.alpha, ".2f"),
            fmt(sum(s.batch) / len(s.batch) if s.batch else None, ".2f"),
        )
        lines.append("".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, (_, w)) in enumerate(zip(cells, COLUMNS))))
    lines += [
        "",
        "tokens/s: all completion tokens ÷ Σ over waves (first request sent → last reply done); TTFT, e2e in s "
        "(percentiles over requests); batch: uag's mean batch size per request, averaged",
    ]
    per_run = runs(rows)
    lines += medians_lines(per_run)
    fewest = min((len(v) for v in per_run.values()), default=0)
    backend = meta.get("backend") or "cpu"
    lines += ["", f"issue 52's targets ({'GPU' if backend != 'cpu' else 'CPU'}), on medians over runs"]
    if fewest < RUNS:
        lines[-1] += f": a level has {fewest} run(s), and a verdict counts from {RUNS}"
    for what, value, goal, met in targets(per_run, gpu=backend != "cpu"):
        verdict = "not measured" if met is None else "met" if met else "NOT met"
        shown = "-" if value is None else f"±{value:.0%}" if goal.startswith("<=") else f"{value:.2f}x"
        lines.append(f"{what:<72}{shown:>9}  {goal:<9} {verdict}")
    lines += lossless_lines(rows)
    lines += rounds_lines(rows)
    return "\n".join(lines)


# --- the plot ------------------------------------------------------------------------------------------------------
def family(name: str) -> str:
    """The condition a serial or drafting variant belongs to: its line takes that one's colour.

    Example: "uag:lookup:serial" -> "uag:lookup";  "mlx_lm:draft3" -> "mlx_lm";  "uag:off" -> "uag:off"
    """
    return name.removesuffix(":serial").split(":draft")[0]


def figure(stats: dict[Level, Stats], title: str = ""):
    """Aggregate tokens/s against concurrency: one panel per workload, one line per condition (serial and
    same-vocabulary drafting dashed, in their condition's colour)."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    panels = [w for w in (EDIT, CHAT) if any(k[1] == w for k in stats)]
    names = list(dict.fromkeys(name for name, _, _ in stats))
    families = list(dict.fromkeys(family(n) for n in names))
    levels_c = sorted({c for _, _, c in stats})
    fig = make_subplots(rows=1, cols=max(1, len(panels)), subplot_titles=panels, shared_yaxes=False)
    for name in names:
        colour = qualitative.Plotly[families.index(family(name)) % len(qualitative.Plotly)]
        for col, part in enumerate(panels, start=1):
            points = sorted((c, s.tps) for (n, w, c), s in stats.items() if n == name and w == part and s.tps)
            fig.add_trace(
                go.Scatter(
                    x=[c for c, _ in points],
                    y=[t for _, t in points],
                    name=name,
                    legendgroup=name,
                    showlegend=col == 1,
                    mode="lines+markers",
                    line={"color": colour, "dash": "dash" if name != family(name) else "solid"},
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(type="log", tickvals=levels_c, ticktext=[str(c) for c in levels_c], title="concurrent requests")
    fig.update_yaxes(title="aggregate tokens/s", rangemode="tozero", col=1)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(
        title=title,
        template="plotly_white",
        width=1000,
        height=460,
        legend={"orientation": "h", "yanchor": "top", "y": -0.22},
    )
    return fig


def save_plot(fig, path: Path) -> Path:
    """PNG (or what the suffix says) through kaleido; HTML beside it where kaleido cannot render."""
    if path.suffix == ".html":
        fig.write_html(path)
        return path
    try:
        fig.write_image(path, scale=2)
        return path
    except (ImportError, ValueError, RuntimeError) as err:
        html = path.with_suffix(".html")
        fig.write_html(html)
        say(f"no {path.suffix} ({err}): the plot is in {html}")
        return html


def summarize(rows: list[dict], plot: str | None) -> int:
    """Print the summary of concurrency rows and, with `plot`, draw their figure."""
    print(summary(rows))
    if plot:
        meta = next((r for r in rows if r.get("kind") == "meta"), {})
        title = f"{meta.get('target', '?')} · {meta.get('machine', '?')} · {meta.get('date', '?')[:10]}"
        say(f"plot in {save_plot(figure(levels(rows), title), Path(plot))}")
    return 0


# --- main ----------------------------------------------------------------------------------------------------------
def pools(args: argparse.Namespace) -> tuple[list[Conversation], list[tuple[str, str]]]:
    """The edit conversations and chat prompts waves are drawn from; each enough for the largest concurrency."""
    most = max(args.concurrency)
    every = load_conversations("edit")
    known = {c.id: c for c in every}
    edit = [known[i] for i in args.ids if i in known] if args.ids else every[: args.conversations]
    chat = chat_prompts(args.chat_prompts)
    problems = [f"--concurrency {c}: at least 1" for c in args.concurrency if c < 1]
    problems += [f"--ids: no conversation {i!r} in the edit set" for i in args.ids or () if i not in known]
    if edit and len(edit) < most:
        problems.append(f"--conversations {len(edit)}: concurrency {most} needs {most} (the edit set has {len(every)})")
    if chat and len(chat) < most:
        problems.append(
            f"--chat-prompts {args.chat_prompts} gives {len(chat)} prompts (Polish and English): "
            f"concurrency {most} needs --chat-prompts {math.ceil(most / 2)}"
        )
    problems += [
        f"{flag}: not with --concurrency"
        for flag, on in (("--together", args.together), ("--ablate", args.ablate))
        if on
    ]
    if problems:
        raise SystemExit("; ".join(problems))
    return edit, chat


def main(args: argparse.Namespace) -> int:
    """The run `serve.py --concurrency` hands over: every condition at every concurrency, rows to `--out`."""
    work = pools(args)
    conds = conditions(args)
    if any(c.server == "uag" for c in conds):  # every uag server opens from the same profiles and evidence
        snapshot = cache_snapshot()
        conds = [replace(c, cache=snapshot) if c.server == "uag" else c for c in conds]
    out = Path(args.out or f"serve-many-{datetime.now():%Y%m%d-%H%M%S}.jsonl")
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
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "concurrency": args.concurrency,
        "conversations": [c.id for c in work[0]],
        "chat": [i for i, _ in work[1]],
        "conditions": [{"name": c.name, "argv": list(c.argv), "extra_body": c.extra_body} for c in conds],
        "versions": {p: version(p) for p in ("mlx", "mlx-lm", "openai", "uag")},
    }
    with rows_file(out, meta) as (rows, write):
        for repeat in range(args.repeats):
            shift = repeat % len(conds)
            for condition in conds[shift:] + conds[:shift]:
                for concurrency in args.concurrency:
                    level(condition, concurrency, repeat, work, args, logs, write)
        classified(rows, args.target, write)  # every server has stopped: the target fits here now
    say(f"rows in {out}, server logs in {logs}/")
    return summarize(rows, args.plot)
