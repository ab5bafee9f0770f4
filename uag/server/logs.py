"""What `uag serve` writes to its log: one line per request (`RequestLog`, logger "uag.server"), as text or as one
JSON object per line (`--log-format json`), and each repeated error once per minute (`QuietRepeats`), so that a
flood of failing connections cannot fill the disk. Pure logging and ASGI: no mlx.

    POST /v1/chat/completions 200 127.0.0.1 1.52 s | prompt 35 (20 cached), generated 64 at 26.6 tok/s |
    drafter lookup, α 0.71, saved 0.80 s
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, MutableMapping
from datetime import datetime, timezone
from typing import Any

from uag.command import log_to_stderr

log = logging.getLogger("uag.server")

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "[uag] %(levelname)s %(name)s: %(message)s"
REPEAT_WINDOW_S = 60.0
SERVED = "uag.served"  # where a request's run report waits for its log line (in the ASGI scope's state)
# Loggers whose records repeat under load: asyncio's accept errors, uvicorn's, and the connection cap's.
NOISY = ("asyncio", "uvicorn", "uvicorn.error", "uag.server.connections")


# Characters that a client's text must not bring into a log as they are: C0 and C1 controls (a line break forges a
# line, ESC drives the operator's terminal), line and paragraph separators, and the bidi controls that reorder text.
_OTHERS = "\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069"  # beyond C0: what JSON leaves as it is
_CONTROLS = re.compile("[\x00-\x1f" + _OTHERS + "]")
_CONTROLS_BUT_LINES = re.compile("[\x00-\x09\x0b-\x1f" + _OTHERS + "]")
_JSON_RAW = re.compile("[" + _OTHERS + "]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def printable(text: str, *, lines: bool = False) -> str:
    """`text` with every control character written as its escape (`lines`: line breaks kept, for a traceback).

    Example: "/v1/x" + a line break + "[uag] INFO forged" -> "/v1/x\\n[uag] INFO forged" (one line);  ESC -> "\\x1b"
    """
    return (_CONTROLS_BUT_LINES if lines else _CONTROLS).sub(_escape, text)


def note_served(scope: MutableMapping[str, Any], report: dict) -> None:
    """Keep a run's usage/speculative/timings report for this request's log line."""
    scope.setdefault("state", {})[SERVED] = report


def request_fields(
    method: str, path: str, status: int | None, client: str, seconds: float, report: dict | None = None
) -> dict[str, Any]:
    """One request as the log records it: the HTTP facts, and for a generation what the run did.

    Example: a chat request that generated 64 tokens in 2.0 s with speedup 1.4 -> {..., "saved_s": 0.8}
    """
    fields: dict[str, Any] = {  # the method, path and client as the client sent them, escaped
        "method": printable(method),
        "path": printable(path),
        "status": status,
        "client": printable(client),
        "seconds": round(seconds, 3),
    }
    if report:
        usage, spec, timings = (report.get(key) or {} for key in ("usage", "speculative", "timings"))
        speedup, generation_s = spec.get("estimated_speedup"), (timings.get("predicted_ms") or 0) / 1000
        fields |= {
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "generated_tokens": usage.get("completion_tokens"),
            "tokens_per_second": timings.get("predicted_per_second"),
            "drafter": spec.get("drafter"),
            "acceptance": spec.get("acceptance_rate"),
            "saved_s": generation_s * (speedup - 1) if speedup is not None else None,  # as the Server tab's
        }
    return fields


def request_line(fields: dict[str, Any]) -> str:
    """`request_fields` as one line of text (the module docstring shows one)."""
    status = fields["status"] if fields["status"] is not None else "-"
    line = f"{fields['method']} {fields['path']} {status} {fields['client']} {fields['seconds']:.2f} s"
    if "prompt_tokens" not in fields:
        return line
    cached = f" ({fields['cached_tokens']} cached)" if fields["cached_tokens"] else ""
    speed = f" at {fields['tokens_per_second']:.1f} tok/s" if fields["tokens_per_second"] else ""
    line += f" | prompt {fields['prompt_tokens']}{cached}, generated {fields['generated_tokens']}{speed}"
    if fields["drafter"] is None:
        return line + " | target alone"
    alpha = f", α {fields['acceptance']:.2f}" if fields["acceptance"] is not None else ""
    saved = f", saved {fields['saved_s']:.2f} s" if fields["saved_s"] is not None else ""
    return line + f" | drafter {fields['drafter']}{alpha}{saved}"


def level(path: str, status: int | None) -> int:
    """How loudly a request is logged: the API, /health and every refusal or failure at INFO; the app's own
    pages and assets under /ui (a page load fetches dozens) and a scraper's GET /metrics (every few seconds) at DEBUG.

    Example: level("/v1/chat/completions", 200) -> INFO;  level("/ui/assets/index.js", 200) -> DEBUG;
             level("/ui/login", 400) -> INFO;  level("/metrics", 200) -> DEBUG
    """
    if status is None or status >= 400 or not (path in ("/", "/metrics") or path.startswith("/ui")):
        return logging.INFO
    return logging.DEBUG


class NotingStatus:
    """An ASGI `send` that passes every message on and keeps the response's status (None until it starts)."""

    def __init__(self, send: Callable):
        self.send, self.status = send, None

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class RequestLog:
    """ASGI middleware: one line per HTTP request on "uag.server" once its response has been sent (a stream: when
    it ends), with its status, client, time and, for a generation, the run's report (`note_served`); at the
    `level` its path and status call for; `count(path, status)` is told of each (GET /metrics' request counter)."""

    def __init__(
        self, app: Callable, *, logger: logging.Logger = log, count: Callable[[str, int | None], None] | None = None
    ):
        self.app, self.logger, self.count = app, logger, count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, sending, failed = time.perf_counter(), NotingStatus(send), False
        try:
            await self.app(scope, receive, sending)
        except Exception:
            failed = True
            raise
        finally:
            status = sending.status or (500 if failed else None)
            client = (scope.get("client") or ("unknown",))[0]
            report = (scope.get("state") or {}).get(SERVED)
            fields = request_fields(
                scope["method"], scope["path"], status, client, time.perf_counter() - started, report
            )
            self.logger.log(level(scope["path"], status), "%s", request_line(fields), extra={"request": fields})
            if self.count is not None:
                self.count(scope["path"], status)


class PrintableText(logging.Formatter):
    """The text format, with control characters in a record's message escaped (`printable`): a client's text
    (a path, a schema's name) cannot forge a log line or reach the operator's terminal as an escape sequence."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei) -> str:
        return printable(super().formatException(ei), lines=True)


class JSONLines(logging.Formatter):
    """One JSON object per record: time, level, logger, message, a request's fields, and an error's traceback.
    JSON escapes control characters itself; the C1 controls, separators and bidi controls it would leave as they
    are are written as \\u escapes too."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "request", {}),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return _JSON_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(entry, ensure_ascii=False, default=str))


class QuietRepeats(logging.Filter):
    """Lets each condition through once per `window_s`: the same logger, message and exception (type and errno)
    within the window is counted, not logged, and the next one after it says how many were left out.

    Example: 5,000 "socket.accept() out of system resource" records in a minute -> 1 record, then 1 saying 4,999
    """

    def __init__(self, window_s: float = REPEAT_WINDOW_S, *, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self._seen: dict[tuple, list] = {}  # condition -> [when it was last let through, records left out since]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        key = (record.name, record.levelno, str(record.msg), type(error).__name__, getattr(error, "errno", None))
        now = self.clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.window_s:
                seen[1] += 1
                return False
            left_out = seen[1] if seen else 0
            self._seen[key] = [now, 0]
            if len(self._seen) > 1000:  # conditions long gone
                self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
        if left_out:
            record.msg = f"{record.getMessage()} ({left_out} more like this in the last {self.window_s:g} s "
            record.msg += "were not logged)"
            record.args = None
        return True


_QUIET = QuietRepeats()


def quiet_repeats(names: Iterable[str] = NOISY) -> None:
    """Put the shared `QuietRepeats` filter on these loggers (once each)."""
    for name in names:
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)


def configure(log_format: str = "text") -> logging.Handler:
    """`uag serve`'s logging: one stderr handler (text or JSON lines) for uag, uvicorn and asyncio; uag at INFO
    (one line per request), the others at WARNING; repeated errors once per minute."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {LOG_FORMATS} (got {log_format!r})")
    formatter = JSONLines() if log_format == "json" else PrintableText(TEXT_FORMAT)
    handler = log_to_stderr(formatter, {"uag": logging.INFO, "uvicorn": logging.WARNING, "asyncio": logging.WARNING})
    quiet_repeats()
    return handler
