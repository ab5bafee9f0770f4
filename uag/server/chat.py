"""Messages in, target token ids out (the target's chat template, with `tools` where it renders them); the model's
tool calls out of its text. No mlx: the tokenizer is passed in.

Small models make tool calls in several shapes, one call or several in a reply: tagged, as Qwen2.5 and Hermes-style
templates teach (``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, one block after another); in ```json
blocks; as a JSON array of calls; or bare, one JSON object after another (what a forced call's grammar writes where
the vocabulary has no tags). A tagged call is always a call; a fenced or bare one only where it names a declared
tool with arguments that fit its schema, and bare JSON only where the whole reply is calls. The text outside the
calls is the reply's content; a call cut off before its JSON ends is no call, and its text stays content.

    parse_tool_calls('Sure.\\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', tools)
        -> ToolReply(content="Sure.", calls=[{"id": "call_…", "type": "function", "function": {"name": "f", …}}])
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from uag.server.errors import bad

log = logging.getLogger(__name__)

OPEN, CLOSE, FENCE = "<tool_call>", "</tool_call>", "```"
FENCED_CALLS = ("", "json")  # the info strings of a code block that may hold calls
HELD = "held"  # what a scan says of a reply's end that may still become a call
# Small models write code into a call's JSON strings with the line breaks and tabs unescaped (a `Write` of a whole
# file); JSON forbids them there, but what they mean is plain, so a call is read with them.
_DECODER = json.JSONDecoder(strict=False)
_SPACE = re.compile(r"\s*")


def render(tokenizer: Any, messages: Sequence[dict], tools: Sequence[dict] = ()) -> list[int]:
    """The conversation as the target reads it: its chat template with a generation prompt, `tools` passed to
    the template. A target without a template (a base model) reads the messages' text one after another,
    separated by blank lines: a single message is exactly its text, as `uag generate` reads a prompt.

    APIError (400) when the template rejects the messages (its own words) or cannot render `tools`.
    """
    if not tokenizer.has_chat_template:
        if tools:
            raise bad("tools", "the target has no chat template, so it cannot be told about tools; leave tools out")
        return list(tokenizer.encode("\n\n".join(m["content"] for m in messages if m["content"])))
    try:
        ids = tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, add_generation_prompt=True)
        if tools and ids == tokenizer.apply_chat_template(list(messages), add_generation_prompt=True):
            raise bad("tools", "the target's chat template does not render tools; leave tools out")
    except TemplateError as err:  # the template's raise_exception(): a rule about roles or their order
        raise bad("messages", f"the target's chat template rejects these messages: {_one_line(str(err))}") from None
    return list(ids)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


@dataclass(frozen=True)
class ToolReply:
    content: str | None  # the text outside the calls (None when there is none)
    calls: list[dict]


Piece = str | list  # a reply cut into text and the calls of one block (a tagged or fenced block, or bare JSON)


def parse_tool_calls(text: str, tools: Sequence[dict]) -> ToolReply | None:
    """The tool calls in a reply and the text outside them, or None when it makes none (the module doc says which
    shapes count)."""
    if not tools:
        return None
    declared = _declared(tools)
    bare = _bare(text, declared, final=True)
    pieces = [bare] if bare else _scan(text, declared, final=True)[0]
    calls = [call for piece in pieces if isinstance(piece, list) for call in piece]
    return ToolReply(_content(pieces, final=True) or None, calls) if calls else None


def _declared(tools: Sequence[dict]) -> dict[str, dict]:
    return {tool["function"]["name"]: tool["function"] for tool in tools}


def _scan(text: str, declared: dict[str, dict], *, final: bool, pos: int = 0) -> tuple[list[Piece], int, int]:
    """`text` from `pos` cut into text pieces and calls, left to right, and (how many of the pieces, the position
    after them) no later text can change: those up to the last finished block. Not `final` (the reply goes on),
    the pieces stop where a block that may still be a call begins: an unfinished tag or fence, or the start of one
    at the very end."""
    pieces: list[Piece] = []
    settled = (0, pos)
    while True:
        start, tagged = _next_block(text, pos)
        if start < 0:
            end = len(text) if final else _opening_at(text, pos)
            pieces.append(text[pos:end])
            return pieces, *settled
        pieces.append(text[pos:start])
        end, calls = (_tagged if tagged else _fenced)(text, start, declared, final)
        if end is None:
            return pieces, *settled
        pieces.append(calls or text[start:end])
        pos = end
        if end < len(text):  # closed: a block that runs to the end (unclosed code) may go on
            settled = (len(pieces), pos)


def _next_block(text: str, pos: int) -> tuple[int, bool]:
    """(where the next tag or code fence from `pos` begins, whether it is a tag); (-1, False) when none does."""
    tag, fence = text.find(OPEN, pos), text.find(FENCE, pos)
    while fence >= 0 and not _line_start(text, fence):  # a fence opens a line
        fence = text.find(FENCE, fence + 1)
    if tag >= 0 and (fence < 0 or tag < fence):
        return tag, True
    return fence, False


def _line_start(text: str, i: int) -> bool:
    return not text[text.rfind("\n", 0, i) + 1 : i].strip()


def _opening_at(text: str, pos: int) -> int:
    """Where, at or after `pos`, the end of `text` may be the start of a tag or a fence (len(text): nowhere).
    Example: ("ok <tool", 0) -> 3;  ("ok\\n``", 0) -> 3;  ("a `b", 0) -> 4"""
    for n in range(min(len(OPEN) - 1, len(text) - pos), 0, -1):
        if OPEN.startswith(text[-n:]):
            return len(text) - n
    ticks = len(text) - len(text.rstrip("`"))
    if 0 < ticks < len(FENCE) and len(text) - ticks >= pos and _line_start(text, len(text) - ticks):
        return len(text) - ticks
    return len(text)


def _tagged(text: str, start: int, declared: dict, final: bool) -> tuple[int | None, list | None]:
    """(where the tagged block at `start` ends, its calls or None); (None, None) while it is unfinished. Any
    name counts: the tag says it is a call."""
    body_at = start + len(OPEN)
    close = text.find(CLOSE, body_at)
    if close < 0 and not final:
        return None, None
    if close >= 0:
        return close + len(CLOSE), _calls(text[body_at:close], None)
    body = text[body_at:]  # ended without its closing tag (at EOS, or cut)
    return len(text), _calls(body[: len(body) - _partial_end(body, CLOSE)], None)


def _fenced(text: str, start: int, declared: dict, final: bool) -> tuple[int | None, list | None]:
    """(where the code block at `start` ends, its calls or None); (None, None) while it may still be a call."""
    newline = text.find("\n", start + len(FENCE))
    if newline < 0:  # its info string is not finished
        return (None, None) if not final else (len(text), None)
    close = text.find(FENCE, newline + 1)
    end = len(text) if close < 0 else close + len(FENCE)
    body = text[newline + 1 : close if close >= 0 else len(text)]
    head = body.lstrip()[:1]
    if text[start + len(FENCE) : newline].strip().lower() not in FENCED_CALLS or head and head not in "{[":
        return end, None  # code, or JSON that is no call: text
    if close < 0 and not final:
        return None, None
    if close < 0:  # ended without its closing fence: a few of its backticks may have come
        body = body.rstrip().rstrip("`")
    return end, _calls(body, declared) if head else None


def _partial_end(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`. Example: ("x</tool", "</tool_call>") -> 6"""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _bare(text: str, declared: dict[str, dict], *, final: bool) -> list | str | None:
    """The calls where the whole reply is bare JSON calls one after another (objects, or arrays of them); None
    where it is not; HELD while, not `final`, it may still be."""
    pos = len(text) - len(text.lstrip())
    if pos == len(text) or text[pos] not in "{[":
        return None
    calls: list[dict] = []
    while pos < len(text):
        if text[pos] not in "{[":
            return None
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):  # not JSON, or not yet all of it
            return HELD if not final else None
        found = _as_calls(value, declared)
        if found is None:
            return None
        calls += found
        pos = _SPACE.match(text, pos).end()
    return calls if final else HELD


def _calls(body: str, declared: dict[str, dict] | None) -> list[dict] | None:
    """The calls a block holds: JSON calls one after another (objects, or arrays of them), all calls, else None."""
    calls, pos = [], _SPACE.match(body).end()
    while pos < len(body):
        try:
            value, pos = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError):
            return None
        found = _as_calls(value, declared)
        if found is None:
            return None
        calls += found
        pos = _SPACE.match(body, pos).end()
    return calls or None


def _as_calls(value: Any, declared: dict[str, dict] | None) -> list[dict] | None:
    """A JSON call, or a non-empty array of them, as OpenAI's tool calls; None unless every one is a call."""
    values = value if isinstance(value, list) and value else [value]
    calls = [_call(obj, declared) for obj in values]
    return None if None in calls else calls


def _call(obj: Any, declared: dict[str, dict] | None = None) -> dict | None:
    """One call {"name", "arguments"} as OpenAI's tool call; with `declared`, only a declared tool whose
    arguments fit its parameters' schema."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = _DECODER.decode(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    if declared is not None:
        tool = declared.get(obj["name"])
        if tool is None or set(obj) - {"name", "arguments", "parameters"} or not fits(arguments, tool["parameters"]):
            return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _content(pieces: Sequence[Piece], *, final: bool) -> str:
    """The text outside the calls: the whitespace before each call, after the calls where nothing precedes, and at
    the end of a reply with calls dropped, every other character kept. Not `final`, the trailing whitespace is
    held (a call may follow it). Example: ["Sure.\\n", [call], "\\n", [call], "\\n"] -> "Sure." """
    out, called, run = "", False, ""
    for piece in pieces:
        if isinstance(piece, str):
            run += piece
            continue
        out += run.rstrip() if out or not called else run.strip()
        run, called = "", True
    out += run if out or not called else run.lstrip()
    return out.rstrip() if called or not final else out


JSON_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def fits(value: Any, schema: Any) -> bool:
    """Whether `value` fits a JSON Schema's common keywords: type, properties, required,
    additionalProperties: false, items, enum (others are not checked).

    Example: fits({"city": "Oslo"}, {"type": "object", "required": ["city"]}) -> True;  fits({}, same) -> False
    """
    if not isinstance(schema, dict):
        return True
    if "enum" in schema and value not in schema["enum"]:
        return False
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    if kinds and not any(JSON_TYPES.get(kind, lambda _: True)(value) for kind in kinds):
        return False
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        if any(name not in value for name in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(properties):
            return False
        return all(fits(v, properties[k]) for k, v in value.items() if k in properties)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return all(fits(v, schema["items"]) for v in value)
    return True


class ToolHold:
    """Streamed text of a reply to a request with tools: passes on the text outside calls as it comes, and holds
    what may still be a call (a tag or code fence not yet closed; a reply that opens like JSON; whitespace that may
    precede a call) until `parse_tool_calls` can decide. What it sends is always the start of the reply's content.

    Example: feed("Sure") -> "Sure";  feed(" <tool_") -> "" (" " and the rest may precede a call);
             feed("call>{…") -> ""
    """

    def __init__(self, tools: Sequence[dict]):
        self.tools = tools
        self.declared = _declared(tools)
        self.text = ""  # the whole reply so far
        self.sent = ""  # the content passed on so far
        self.content: str | None = None  # the reply's content, once `finish` has run (None: only calls)
        self._bare = True  # whether the reply may still be bare JSON calls
        self._settled: list[Piece] = []  # the reply's pieces up to its last finished block (`_scan`), and where
        self._pos = 0  # they end: each feed scans on from there

    def feed(self, piece: str) -> str:
        self.text += piece
        if not self.tools:
            return self._send(self.text)
        if self._bare:
            head = self.text.lstrip()[:1]
            if head in ("{", "[") and not self.text.rstrip().endswith(("}", "]")):
                return ""  # JSON not yet whole: it may still be calls
            if head and _bare(self.text, self.declared, final=False) == HELD:
                return ""
            self._bare = not head  # a reply that has begun otherwise is no bare call
        pieces, n, self._pos = _scan(self.text, self.declared, final=False, pos=self._pos)
        self._settled += pieces[:n]
        return self._send(_content(self._settled + pieces[n:], final=False))

    def finish(self) -> tuple[str, list[dict] | None]:
        """(content still to send, the calls or None)."""
        reply = parse_tool_calls(self.text, self.tools)
        self.content = self.text if reply is None else reply.content
        return self._send(self.content or ""), None if reply is None else reply.calls

    def _send(self, content: str) -> str:
        if not content.startswith(self.sent):  # a bug: what was sent is decided
            log.error(
                "tool-call hold: the content %r does not continue what was sent, %r", content[:80], self.sent[-80:]
            )
            return ""
        out, self.sent = content[len(self.sent) :], content
        return out
