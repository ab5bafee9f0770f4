"""What the server benchmarks share: the conditions (a server's command line and how requests to it are made), a
condition's server process on a free port, one timed streamed request, a turn's JSON row, the rows file.

`benchmarks/serve.py` (sessions, one request at a time, and the summary) and `benchmarks/serve_many.py` (many
requests at once) both run on these, as do `cold_read.py` and `disk_cache.py`:

    with Server(condition, log) as server:
        reply = ask(openai.OpenAI(base_url=server.url + "/v1", api_key="-"), condition, messages, 128)
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

import uag  # first: it loads OpenBLAS, which must precede mlx (uag/_blas.py), and sets CUDA graphs off

# isort: split
import edit_formats  # benchmarks/edit_formats.py, beside this module
import httpx
import openai

from uag import _blas
from uag.core.policy import MECHANISMS
from uag.models import demo
from uag.study.datasets import load_bundled

STARTUP_S = 1800  # a server may take this long to come up (loading the coder pair on a busy CPU)
REQUEST_S = 7200  # one request (a whole file at ~3 tokens/s)
WARM_UP = [{"role": "user", "content": "Say hello in one short sentence."}]
WARM_UP_TOKENS = 8


# --- conditions and servers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Condition:
    """One server configuration and how requests to it are made."""

    name: str  # "uag:lookup+demo-drafter", "uag:off", "mlx_lm", "mlx_lm:draft3"
    server: str  # "uag" or "mlx_lm"
    argv: tuple[str, ...]  # the server's command line, without --port
    model: str  # the request's `model`
    extra_body: dict | None = None
    cache: Path | None = None  # a private copy of this cache folder for each start (UAG_CACHE_DIR); None: the user's


def folder(name: str) -> str:
    """A model's converted folder: an offline name through `demo.ensure`, anything else as given."""
    return str(demo.ensure(name)) if name in demo.MODELS else name


def conditions(args: argparse.Namespace) -> list[Condition]:
    uag_serve = (
        sys.executable,
        "-m",
        "uag",
        "serve",
        "--target",
        args.target,
        "--no-ui",
        "--max-tokens",
        str(args.max_tokens),
        "--time-budget",
        str(REQUEST_S),
    )
    out = [
        Condition(f"uag:{d}", "uag", (*uag_serve, "--drafter", d, "--drafters", d, "--strategy", "auto"), args.target)
        for d in args.drafters
    ]
    if args.ablate:  # auto with one part off, over the first drafter; every auto server opens from the same evidence
        first, snapshot = out[0], cache_snapshot()
        out = [replace(c, cache=snapshot) for c in out]
        out += [
            replace(first, name=f"{first.name}-no-{m}", argv=(*first.argv, "--auto-off", m))
            for m in (MECHANISMS if "all" in args.ablate else args.ablate)
        ]
    if args.without_shared_index:  # each uag drafter also with the index shared across requests off
        out += [replace(c, name=f"{c.name}:noshare", argv=(*c.argv, "--lookup-memory", "0")) for c in list(out)]
    out.append(Condition("uag:off", "uag", (*uag_serve, "--drafter", "off"), args.target, {"speculative": False}))
    target = folder(args.target)
    mlx = (
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        target,
        "--max-tokens",
        str(args.max_tokens),
        "--log-level",
        "WARNING",
    )
    out.append(Condition("mlx_lm", "mlx_lm", mlx, "default_model"))
    if args.peer_draft:
        draft = folder(args.peer_draft)
        out += [
            Condition(
                f"mlx_lm:draft{n}",
                "mlx_lm",
                (*mlx, "--draft-model", draft, "--num-draft-tokens", str(n)),
                "default_model",
            )
            for n in args.num_draft_tokens
        ]
    if args.only:
        unknown = sorted(set(args.only) - {c.name for c in out})
        if unknown:
            raise SystemExit(f"--only: no condition {', '.join(unknown)} (there are {', '.join(c.name for c in out)})")
        out = sorted((c for c in out if c.name in args.only), key=lambda c: args.only.index(c.name))
    return out


def cache_snapshot() -> Path:
    """A copy of the user cache's saved profiles and evidence as they are now, its converted models linked."""
    from uag.machine import cache_dir

    snapshot = Path(tempfile.mkdtemp(prefix="uag-serve-cache-"))
    atexit.register(shutil.rmtree, snapshot, True)
    for name in ("profiles", "evidence"):
        if (cache_dir() / name).is_dir():
            shutil.copytree(cache_dir() / name, snapshot / name)
    (snapshot / "models").symlink_to(cache_dir() / "models")
    return snapshot


def private_cache(snapshot: Path) -> Path:
    """A fresh copy of `snapshot` for one server: what it saves stays its own (the models stay linked)."""
    folder = Path(tempfile.mkdtemp(prefix="uag-serve-run-"))
    atexit.register(shutil.rmtree, folder, True)
    shutil.copytree(snapshot, folder, symlinks=True, dirs_exist_ok=True)
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def openblas() -> str | None:
    """The OpenBLAS library uag loaded into this process (None: uag runs without one here)."""
    return _blas.status.removeprefix("openblas:") if _blas.status.startswith("openblas:") else None


class Server:
    """A condition's server process on a free port, its output in `log`; up once it answers HTTP."""

    def __init__(self, condition: Condition, log: Path):
        self.condition, self.log_path = condition, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None  # from the start of the process to its first answer (uag: "ready")
        self.openblas: bool | None = None  # whether OpenBLAS is in its memory map (None: cannot tell)

    def environment(self) -> dict[str, str]:
        """The server process's environment: this one's, with OpenBLAS preloaded into mlx_lm.server (uag serve loads
        it itself), MLX's own CUDA graphs default for a peer where only uag chose them off (its users run it so), and
        the condition's private cache."""
        env = dict(os.environ)
        library = openblas()
        if library and self.condition.server == "mlx_lm":
            env["LD_PRELOAD"] = " ".join(filter(None, [library, env.get("LD_PRELOAD")]))
        if self.condition.server != "uag" and uag.CUDA_GRAPHS_DEFAULTED:
            env.pop("MLX_USE_CUDA_GRAPHS", None)
        if self.condition.cache is not None:
            env["UAG_CACHE_DIR"] = str(private_cache(self.condition.cache))
        return env

    def __enter__(self) -> Server:
        env, library = self.environment(), openblas()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [*self.condition.argv, "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        log.close()
        try:
            self._wait()
            self.startup_s = time.perf_counter() - started
            self.openblas = self._maps_openblas()
            if library and self.openblas is False:
                raise RuntimeError(f"{self.condition.name} runs without OpenBLAS ({library} is not in its memory map)")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()

    def _wait(self) -> None:
        """Until /health answers: any status from mlx_lm.server, which loads its model on its first request (the
        warm-up replies wait); from uag serve, 200 and "ready", its start-up done: loading its models and, where no
        costs are saved (a fresh machine), measuring them. A request sent before would stop that measurement, and
        auto would run the whole benchmark without measured costs, since the requests leave the server no idle
        moment to measure them in."""
        deadline, wait_s = time.monotonic() + STARTUP_S, 0.5
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.condition.name} exited with status {self.proc.returncode} while starting:\n{self.tail()}"
                )
            try:
                response = httpx.get(self.url + "/health", timeout=5)
                if self.condition.server != "uag" or (response.status_code == 200 and response.json().get("ready", 1)):
                    return
                wait_s = 2.0  # up, still starting (a measurement takes minutes): fewer lines in its log
            except httpx.TransportError:
                pass
            time.sleep(wait_s)
        raise RuntimeError(f"{self.condition.name} did not answer within {STARTUP_S} s:\n{self.tail()}")

    def _maps_openblas(self) -> bool | None:
        """Whether the process has OpenBLAS mapped (None where /proc cannot tell)."""
        try:
            return "libopenblas" in Path(f"/proc/{self.proc.pid}/maps").read_text()
        except OSError:
            return None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


# --- one request ------------------------------------------------------------------------------------------------
@dataclass
class Reply:
    text: str
    ttft_s: float | None
    generation_s: float | None  # from the first content chunk to the last
    e2e_s: float
    usage: dict = field(default_factory=dict)
    speculative: dict | None = None
    timings: dict | None = None
    finish_reason: str | None = None

    @property
    def completion_tokens(self) -> int | None:
        return self.usage.get("completion_tokens")

    @property
    def generation_tps(self) -> float | None:
        """Tokens after the first ÷ the time from the first content chunk to the last."""
        n = self.completion_tokens
        if not n or n < 2 or not self.generation_s:
            return None
        return (n - 1) / self.generation_s


def ask(
    client: openai.OpenAI, condition: Condition, messages: list[dict], max_tokens: int, *, first_only: bool = False
) -> Reply:
    """One greedy streamed chat request, timed on the client; `first_only` closes the stream at the first token."""
    started = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    usage: dict = {}
    extra: dict = {}
    finish = None
    stream = client.chat.completions.create(
        model=condition.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=condition.extra_body,
    )
    try:
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.delta.content:
                    first, last = first or now, now
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                usage, extra = chunk.usage.model_dump(), chunk.model_extra or {}
            if first_only and first is not None:
                break
    finally:
        stream.close()
    ended = time.perf_counter()
    return Reply(
        text="".join(pieces),
        ttft_s=None if first is None else first - started,
        generation_s=None if first is None else last - first,
        e2e_s=ended - started,
        usage=usage,
        speculative=extra.get("speculative"),
        timings=extra.get("timings"),
        finish_reason=finish,
    )


def row(
    condition: Condition,
    repeat: int,
    workload: str,
    item: str,
    turn: int,
    reply: Reply,
    outcome: edit_formats.Outcome | None = None,
) -> dict:
    spec = reply.speculative or {}
    details = reply.usage.get("prompt_tokens_details") or {}
    edited = {} if outcome is None else {"applied": outcome.applied, "edits": outcome.edits, "why": outcome.why}
    return {
        "kind": "turn",
        "condition": condition.name,
        "server": condition.server,
        "repeat": repeat,
        "workload": workload,
        "item": item,
        "turn": turn,
        "prompt_tokens": reply.usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "completion_tokens": reply.completion_tokens,
        "ttft_s": reply.ttft_s,
        "generation_s": reply.generation_s,
        "generation_tps": reply.generation_tps,
        "e2e_s": reply.e2e_s,
        "finish_reason": reply.finish_reason,
        "acceptance": spec.get("acceptance_rate"),
        "drafted": spec.get("drafted_tokens"),
        "accepted": spec.get("accepted_tokens"),
        "sources": spec.get("sources"),
        "lookup": spec.get("lookup"),  # lookup cycles, tokens proposed and kept (uag.server.responses)
        "shared_lookup_cycles": spec.get("shared_lookup_cycles"),
        "server_tps": (reply.timings or {}).get("predicted_per_second"),
        **edited,  # an aider-format turn: whether its edits applied to the file
        "text": reply.text,
    }


# --- prompts, output, rows --------------------------------------------------------------------------------------
def chat_prompts(n: int) -> list[tuple[str, str]]:
    """(id, text): the first n Polish `alpaca` instructions and the first n English `code` instructions, alternating."""
    if n <= 0:
        return []
    polish = load_bundled("alpaca", n)
    english = [p for p in load_bundled("code") if p.chat and "en" in p.tags]
    if n > len(english):
        raise SystemExit(f"--chat-prompts: the code set has {len(english)} English instructions; asked for {n}")
    return [(p.id, p.text) for pair in zip(polish, english[:n]) for p in pair]


def say(text: str) -> None:
    print(f"[serve] {text}", file=sys.stderr, flush=True)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


@contextmanager
def rows_file(out: Path, meta: dict) -> Iterator[tuple[list[dict], Callable[[dict], None]]]:
    """The run's rows, `meta` first, and `write(row)`, which keeps a row and appends it to `out` (flushed, so
    that a run stopped part way keeps what it measured)."""
    rows = [meta]
    with out.open("w") as f:

        def write(r: dict) -> None:
            rows.append(r)
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            f.flush()

        f.write(json.dumps(meta, ensure_ascii=False) + "\n")
        yield rows, write


def joined(files: Sequence[list[dict]]) -> list[dict]:
    """Several rows files' rows as one run's: each file's repeats numbered after the files' before it, the first
    file's meta kept with every file's repeats counted (runs made one command at a time, as a device's time limit
    asks, summarised together).

    Example: two files of repeats 0-1 and 0 -> rows of repeats 0, 1 and 2, one meta with "repeats": 3
    """
    out: list[dict] = []
    meta: dict | None = None
    offset = 0
    for rows in files:
        seen = [r["repeat"] for r in rows if isinstance(r.get("repeat"), int)]
        for r in rows:
            if r.get("kind") == "meta":
                meta = meta or dict(r)
                continue
            out.append(shifted(r, offset))
        offset += max(seen) + 1 if seen else 0
    if meta is None:
        return out
    return [{**meta, "repeats": offset or meta.get("repeats")}, *out]


def shifted(r: dict, by: int) -> dict:
    """A row with its repeat, and the repeats of where it was compared (a near-tie verdict's), moved on by `by`."""
    out = dict(r)
    if isinstance(r.get("repeat"), int):
        out["repeat"] = r["repeat"] + by
    for key in ("where", "reference_where"):
        if isinstance(r.get(key), dict) and isinstance(r[key].get("repeat"), int):
            out[key] = {**r[key], "repeat": r[key]["repeat"] + by}
    return out


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
