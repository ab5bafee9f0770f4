"""Text out of a run, as OpenAI clients read it: stop sequences cut (their text never sent), tool calls held back,
and server-sent events framed. Pure: no mlx, no HTTP.

Deltas never split a UTF-8 character: the engine's streaming detokenizer gives a token no text until its
character is complete, and everything here cuts text as Python strings, never bytes.

    out = ReplyText(stops=("\\n\\n",), tools=())
    out.feed("Hello\\n")     -> ("Hello", False)   # "\\n" may begin the stop sequence: held
    out.feed("\\nWorld")     -> ("", True)         # the stop sequence: the reply ends before it
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from uag.server.chat import ToolHold

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event: `data: {json}` and a blank line (compact JSON, UTF-8 as is)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class StopText:
    """Cuts a stream of text at the first stop sequence, holding back any end of it that could begin one.

    Example: stops ("END",): feed("abc E") -> ("abc ", False);  feed("ND more") -> ("", True);  text -> "abc "
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        self.pending = ""
        self.text = ""  # everything sent, the reply so far
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the reply (the earliest; the first listed)

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop sequence ended the reply)."""
        if self.stopped:
            return "", True
        self.pending += piece
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            out, self.pending, self.stopped = self.pending[:at], "", True
        else:
            keep = max((_overlap(self.pending, s) for s in self.stops), default=0)
            out, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        self.text += out
        return out, self.stopped

    def flush(self) -> str:
        """What was held at the end of a reply that no stop sequence ended."""
        out, self.pending = self.pending, ""
        self.text += out
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a start of `stop`. Example: ("abc E", "END") -> 1"""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


class ReplyText:
    """A reply's text through its stop sequences, then its tool-call hold (`uag.server.chat.ToolHold`)."""

    def __init__(self, stops: Sequence[str] = (), tools: Sequence[dict] = ()):
        self.stop = StopText(stops)
        self.hold = ToolHold(tools)

    def feed(self, piece: str) -> tuple[str, bool]:
        """(content to send now, whether a stop sequence ended the reply)."""
        text, stopped = self.stop.feed(piece)
        return self.hold.feed(text), stopped

    def finish(self) -> tuple[str, list[dict] | None]:
        """(content still to send, the tool calls or None)."""
        self.hold.feed(self.stop.flush())
        return self.hold.finish()

    @property
    def text(self) -> str:
        """The reply's text (stop sequences cut)."""
        return self.hold.text
