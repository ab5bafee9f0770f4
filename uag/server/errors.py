"""OpenAI's error object for uag's server: `APIError` (an HTTP status, a message, the `param` it names) and `bad`, the
400 every checked field raises. A client's value is repeated printable and short (`show`), so that an error always
encodes as UTF-8 and reads on one line. Pure: no mlx, no HTTP.

    bad("n", "only n = 1 is supported").body()
        -> {"error": {"message": "n: only n = 1 is supported", "type": "invalid_request_error", "param": "n", …}}
"""

from __future__ import annotations

import json
from typing import Any

SHOWN = 60  # characters of a client's value an error message repeats


def printable(text: str) -> str:
    """`text` with every character Python would not print (lone surrogates, control and format characters,
    line separators) written as its escape, so that an error message always encodes as UTF-8 and reads on one line.

    Example: printable("a\\ud800\\n") -> "a\\\\ud800\\\\n"
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def show(value: Any, limit: int = SHOWN) -> str:
    """A client's value as JSON, printable and at most `limit` characters: what an error message repeats.

    Example: show("\\ud800") -> '"\\\\ud800"';  show("x" * 100) -> '"xxx…'
    """
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]  # the cut shows below (the closing quote goes)
    try:
        text = printable(json.dumps(value, ensure_ascii=False))
    except (ValueError, TypeError, RecursionError):  # over 4300 digits, nested past the stack, not JSON
        text = "(a value too large to show)"
    return text if len(text) <= limit else text[: limit - 1] + "…"


class APIError(Exception):
    """An OpenAI error object with its HTTP status. The message and param are made printable (`printable`)."""

    TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        message, param = printable(message), None if param is None else printable(param)[:SHOWN]
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = self.TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    """A 400 about `param`. Example: bad("n", "only n = 1 is supported") -> 400, message "n: only n = 1 …" """
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=code)
