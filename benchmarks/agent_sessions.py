"""Coding agents' sessions replayed: `uag serve` on each agent's own API against `mlx_lm.server` on chat completions.

What a user of Claude Code or Codex CLI gets today from `mlx_lm.server` is a translating proxy in front of it (LiteLLM):
the agent's Anthropic Messages or OpenAI Responses request turned into chat completions. This script replays
sessions recorded from the real clients (`record`, below) both ways, on the same converted folder with the same
OpenBLAS (`serving.Server`, which checks it): each recorded request once to `uag serve` as the client sent it
(`/v1/messages`, `/v1/responses`) and once to `mlx_lm.server` as the same messages and tools on
`/v1/chat/completions` (translated by uag's own parser for that API, so both servers read the same conversation).

Per turn and server, two requests, greedy, streamed, timed at the client:
- a probe of one token: its end-to-end time is the turn's time to first token (a server holds a reply that opens
  a tool call back until the call is complete, so a longer reply's first streamed byte says nothing of its read);
  on a session's first turn nothing is cached: the cold read;
- the whole reply (at most `--max-tokens`), right after: its prompt is then in the server's cache, so its time is
  the generation's; generation tokens/s = completion tokens ÷ that time.
Servers run side by side, each warmed first by a short request (so that no turn pays for a model's load); each turn
goes to both, the order alternating from turn to turn and round to round, so that a machine whose speed drifts slows
both alike. Rounds repeat a session on fresh servers; medians over rounds.
An *edit turn* is one whose uag reply calls an editing tool (`Edit`, `MultiEdit`, `Write`, `apply_patch`, or a shell
command that writes a file).

Targets (issue 51): generation >= 3x mlx_lm.server's on edit turns (pooled over turns and rounds), time to first
token <= 1.05x on cold turns (median).

    python benchmarks/agent_sessions.py record --upstream http://127.0.0.1:8000 --out benchmarks/agent_sessions/x.jsonl
    python benchmarks/agent_sessions.py replay benchmarks/agent_sessions/*.jsonl --rounds 3 --out agents.jsonl
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import httpx
import serving  # benchmarks/serving.py, beside this script

from uag.server.protocol import ServerDefaults
from uag.server.routes import DIALECTS

GENERATING = ("/v1/messages", "/v1/responses", "/v1/chat/completions")
EDIT_TOOLS = {"Edit", "MultiEdit", "Write", "NotebookEdit", "apply_patch"}
WRITES = (">", "sed -i", "apply_patch", "tee ", "cat <<", "mv ", "perl -pi")
GOALS = {"generation_edit": 3.0, "ttft_cold": 1.05}
TIMEOUT_S = 7200.0


# --- recording --------------------------------------------------------------------------------------------------
def record(upstream: str, port: int, out: Path) -> None:
    """A proxy on 127.0.0.1:`port` in front of `upstream` that appends each generating request (path and JSON
    body) to `out`, one line each, and passes every request and streamed answer through unchanged."""
    target = urlsplit(upstream)
    out.parent.mkdir(parents=True, exist_ok=True)

    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _pass(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            path = self.path.split("?")[0]
            if self.command == "POST" and path in GENERATING:
                with out.open("a") as f:
                    f.write(json.dumps({"path": path, "body": json.loads(body)}, ensure_ascii=False) + "\n")
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=TIMEOUT_S)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "accept-encoding")}
            connection.request(self.command, self.path, body or None, headers)
            answer = connection.getresponse()
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(name, value)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            while piece := answer.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            connection.close()

        do_GET = do_POST = do_DELETE = _pass

        def log_message(self, *args) -> None:
            pass

    print(f"recording to {out}: point the client at http://127.0.0.1:{port} (Ctrl-C to stop)", flush=True)
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Proxy).serve_forever()


# --- one request ------------------------------------------------------------------------------------------------
@dataclass
class Answer:
    seconds: float
    output_tokens: int | None
    cached_tokens: int | None
    tool_names: list[str]
    tool_inputs: list[str]
    text: str


def events(response: httpx.Response):
    """The JSON payloads of a server-sent event stream (`data:` lines; `[DONE]` ends it)."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def ask(client: httpx.Client, url: str, path: str, body: dict) -> Answer:
    """One streamed request, timed from sending it to the stream's end, read as its API writes it."""
    names, inputs, text, usage = [], [], [], {}
    started = time.perf_counter()
    with client.stream("POST", url + path, json=body, timeout=TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path} answered {response.status_code}: {response.read()[:500]!r}")
        for event in events(response):
            kind = event.get("type") or event.get("object")
            if kind == "error" or "error" in event and kind is None:
                raise RuntimeError(f"{path} failed mid-stream: {event}")
            if path == "/v1/messages":
                if kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
                    names.append(event["content_block"]["name"])
                    inputs.append("")
                elif kind == "content_block_delta":
                    delta = event["delta"]
                    if delta["type"] == "text_delta":
                        text.append(delta["text"])
                    elif delta["type"] == "input_json_delta":
                        inputs[-1] += delta["partial_json"]
                elif kind == "message_start":
                    usage.update(event["message"].get("usage") or {})
                elif kind == "message_delta":
                    usage.update(event.get("usage") or {})
            elif path == "/v1/responses":
                if kind == "response.output_item.done" and event["item"]["type"] == "function_call":
                    names.append(event["item"]["name"])
                    inputs.append(event["item"]["arguments"])
                elif kind == "response.output_text.delta":
                    text.append(event["delta"])
                elif kind in ("response.completed", "response.incomplete"):
                    usage = event["response"].get("usage") or {}
            else:  # chat completions
                for choice in event.get("choices") or ():
                    delta = choice.get("delta") or {}
                    text.append(delta.get("content") or "")
                    for call in delta.get("tool_calls") or ():
                        function = call.get("function") or {}
                        if function.get("name"):
                            names.append(function["name"])
                            inputs.append("")
                        if function.get("arguments") and inputs:
                            inputs[-1] += function["arguments"]
                if event.get("usage"):
                    usage = event["usage"]
    seconds = time.perf_counter() - started
    output = usage.get("output_tokens", usage.get("completion_tokens"))
    cached = usage.get("cache_read_input_tokens")
    if cached is None:
        details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
    return Answer(seconds, output, cached, names, inputs, "".join(text))


def native(path: str, body: dict, max_tokens: int) -> dict:
    """The recorded request as its client sent it, greedy, streamed, at most `max_tokens`."""
    cap = "max_tokens" if path == "/v1/messages" else "max_output_tokens"
    return {**body, "stream": True, "temperature": 0.0, cap: min(body.get(cap) or max_tokens, max_tokens)}


def as_chat(path: str, body: dict, target: str, max_tokens: int) -> dict:
    """The same conversation as chat completions, as a translating proxy sends it: uag's parser for the client's
    API reads the messages and tools, so that both servers are given the same conversation."""
    defaults = ServerDefaults(model=target, drafter=None, max_tokens=max_tokens, aliases=("*",))
    dialect = DIALECTS[path]
    given = {**body, "model": target}
    request = dialect.parse(given, defaults, None) if dialect.keyed else dialect.parse(given, defaults)
    chat = {"messages": list(request.messages), "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if request.tools:
        chat["tools"] = list(request.tools)
    return {**chat, "stream_options": {"include_usage": True}}


def request(turn: dict, uag_side: bool, max_tokens: int, target: str) -> dict:
    """The turn as uag serve is sent it (natively) or as mlx_lm.server is (chat completions)."""
    if uag_side:
        return native(turn["path"], turn["body"], max_tokens)
    return {**as_chat(turn["path"], turn["body"], target, max_tokens), "model": "default_model"}


def edits(answer: Answer) -> bool:
    """Whether a reply calls a tool that edits a file."""
    for name, arguments in zip(answer.tool_names, answer.tool_inputs):
        if name in EDIT_TOOLS or name in ("exec_command", "shell", "Bash") and any(w in arguments for w in WRITES):
            return True
    return False


def warm_up(client: httpx.Client, server: serving.Server) -> None:
    """A short chat request without tools (`serving.WARM_UP`): mlx_lm.server loads its model on its first request,
    uag serve loads it beside its first ones; neither load belongs to a turn's read."""
    body = {"model": server.condition.model, "messages": serving.WARM_UP, "max_tokens": serving.WARM_UP_TOKENS}
    ask(client, server.url, "/v1/chat/completions", {**body, "temperature": 0.0, "stream": True})


# --- replaying --------------------------------------------------------------------------------------------------
def load(path: Path) -> list[dict]:
    turns = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not turns:
        raise SystemExit(f"{path}: no requests recorded")
    return turns


def replay(args: argparse.Namespace) -> list[dict]:
    uag_argv = (sys.executable, "-m", "uag", "serve", "--target", args.target, "--no-ui", "--drafter", args.drafter)
    uag_argv += ("--drafters", args.drafter, "--model-alias", "*")
    mlx_argv = (sys.executable, "-m", "mlx_lm", "server", "--model", serving.folder(args.target))
    mlx_argv += ("--log-level", "WARNING")
    conditions = [
        serving.Condition(f"uag:{args.drafter}", "uag", uag_argv, args.target),
        serving.Condition("mlx_lm", "mlx_lm", mlx_argv, "default_model"),
    ]
    logs = Path(args.logs)
    rows = []
    for round_ in range(args.rounds):
        for session_path in args.sessions:
            turns = load(Path(session_path))
            with ExitStack() as stack:  # fresh servers per session and round: nothing cached at its first turn
                servers = [
                    stack.enter_context(serving.Server(c, logs / f"{c.name}-{Path(session_path).stem}-{round_}.log"))
                    for c in conditions
                ]
                client = stack.enter_context(httpx.Client())
                for server in servers:  # loaded and warm: the first turn times the cold read, not the start
                    warm_up(client, server)
                for i, turn in enumerate(turns):
                    order = servers if (i + round_) % 2 == 0 else servers[::-1]
                    for server in order:
                        uag_side = server.condition.server == "uag"
                        path = turn["path"] if uag_side else "/v1/chat/completions"
                        probe = ask(client, server.url, path, request(turn, uag_side, 1, args.target))
                        whole = ask(client, server.url, path, request(turn, uag_side, args.max_tokens, args.target))
                        row = {
                            "session": Path(session_path).stem,
                            "turn": i + 1,
                            "round": round_,
                            "server": server.condition.name,
                            "api": turn["path"] if uag_side else "/v1/chat/completions",
                            "ttft_s": probe.seconds,
                            "probe_cached": probe.cached_tokens,
                            "e2e_s": whole.seconds,
                            "output_tokens": whole.output_tokens,
                            "cached_tokens": whole.cached_tokens,
                            "generation_tps": whole.output_tokens / whole.seconds if whole.output_tokens else None,
                            "tools": whole.tool_names,
                            "edits": edits(whole),
                            "text": whole.text[:2000],
                        }
                        rows.append(row)
                        print(json.dumps({k: v for k, v in row.items() if k != "text"}), flush=True)
    return rows


def summary(rows: list[dict]) -> list[str]:
    uag_rows = {(r["session"], r["turn"], r["round"]): r for r in rows if r["server"].startswith("uag")}
    peer = {(r["session"], r["turn"], r["round"]): r for r in rows if r["server"] == "mlx_lm"}
    both = sorted(set(uag_rows) & set(peer))
    lines = []
    edit = [k for k in both if uag_rows[k]["edits"]]

    def pooled(keys, side) -> float | None:
        tokens = sum(side[k]["output_tokens"] or 0 for k in keys)
        seconds = sum(side[k]["e2e_s"] for k in keys)
        return tokens / seconds if seconds else None

    for name, keys in (("edit turns", edit), ("all turns", both)):
        a, b = pooled(keys, uag_rows), pooled(keys, peer)
        ratio = a / b if a and b else None
        lines.append(
            f"generation, {name} ({len(keys)}): uag {a or 0:.2f} tok/s, mlx_lm {b or 0:.2f} tok/s, {ratio or 0:.2f}x"
        )
    cold = [k for k in both if k[1] == 1]
    ratios = [uag_rows[k]["ttft_s"] / peer[k]["ttft_s"] for k in cold]
    if ratios:
        median = statistics.median(ratios)
        lines.append(
            f"cold turns' time to first token, uag / mlx_lm ({len(ratios)}): median {median:.2f}x, "
            f"{min(ratios):.2f}-{max(ratios):.2f}x (target <= {GOALS['ttft_cold']}x)"
        )
    later = [k for k in both if k[1] > 1]
    if later:
        warm = statistics.median(uag_rows[k]["ttft_s"] for k in later)
        first = statistics.median(uag_rows[k]["ttft_s"] for k in cold) if cold else None
        lines.append(f"uag's later turns' time to first token: median {warm:.1f} s (cold turns: {first or 0:.1f} s)")
    if edit:
        a, b = pooled(edit, uag_rows), pooled(edit, peer)
        met = bool(a and b and a / b >= GOALS["generation_edit"])
        lines.append(f"target: edit turns' generation >= {GOALS['generation_edit']}x: {'met' if met else 'not met'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="a recording proxy in front of a server")
    rec.add_argument("--upstream", required=True)
    rec.add_argument("--port", type=int, default=9200)
    rec.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("replay", help="replay recorded sessions against uag serve and mlx_lm.server")
    rep.add_argument("sessions", nargs="+")
    rep.add_argument("--target", default="coder-target")
    rep.add_argument("--drafter", default="lookup")
    rep.add_argument("--max-tokens", type=int, default=512)
    rep.add_argument("--rounds", type=int, default=3)
    rep.add_argument("--out", default="agent-sessions.jsonl")
    rep.add_argument("--logs", default="agent-sessions-logs")
    summ = sub.add_parser("summarize", help="the summary again, from the rows")
    summ.add_argument("rows")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.upstream, args.port, args.out)
        return 0
    if args.command == "summarize":
        rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.strip()]
    else:
        started = datetime.now().isoformat(timespec="minutes")
        rows = replay(args)
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps({**row, "started": started}, ensure_ascii=False) + "\n")
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
