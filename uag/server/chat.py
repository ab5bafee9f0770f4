"""Messages in, target token ids out (the target's chat template, with `tools` where it renders them); the model's
tool calls out of its text. No mlx: the tokenizer is passed in.

Tool calls come in two shapes. Qwen2.5 and Hermes-style templates teach the model to answer
``<tool_call>{"name": …, "arguments": {…}}</tool_call>``; small models often drop the tags and answer with the
call as one JSON object, alone or in a ```json block. The tagged form is always a call; the bare form is one
only when the whole reply is that single object and it names a declared tool with arguments that fit its schema
(anything else a model writes in JSON stays text).

    parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', tools)
        -> ToolReply(content=None, calls=[{"id": "call_…", "type": "function", "function": {"name": "f", …}}])
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from uag.server.errors import bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
FENCED = re.compile(r"^```(?:json)?\s*(\{.*\})\s*```$", re.S)


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
    from jinja2 import TemplateError

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
    content: str | None  # text before the calls (None when there is none)
    calls: list[dict]


def parse_tool_calls(text: str, tools: Sequence[dict]) -> ToolReply | None:
    """The tool calls in a reply, or None when it makes none (see the module doc for the two shapes)."""
    if not tools:
        return None
    if OPEN in text:
        head = text[: text.index(OPEN)].strip()
        calls = [_call(body) for body in TAGGED.findall(text[text.index(OPEN) :])]
        if calls and all(calls):
            return ToolReply(head or None, calls)
        return None
    stripped = text.strip()
    fenced = FENCED.match(stripped)
    candidate = fenced.group(1) if fenced else stripped if stripped.startswith("{") else None
    call = _call(candidate, declared={t["function"]["name"]: t["function"] for t in tools}) if candidate else None
    return ToolReply(None, [call]) if call else None


def _call(body: str, declared: dict[str, dict] | None = None) -> dict | None:
    """One call {"name", "arguments"} as OpenAI's tool call; with `declared`, only a declared tool whose
    arguments fit its parameters' schema."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
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
    """Streamed text of a reply to a request with tools: passes text on, but holds what may be a tool call
    (from a ``<tool_call>`` tag on; or, while nothing has been sent, a reply that opens like a JSON object or a
    code fence) until the reply ends and `parse_tool_calls` decides.

    Example: feed("Sure") -> "Sure";  feed(" <tool_") -> " " (the rest may open a tag);  feed("call>{…") -> ""
    """

    def __init__(self, tools: Sequence[dict]):
        self.tools = tools
        self.text = ""  # the whole reply so far
        self.sent = 0  # characters of it passed on

    def feed(self, piece: str) -> str:
        self.text += piece
        if not self.tools:
            return self._send(len(self.text))
        if OPEN in self.text:
            return self._send(self.text.index(OPEN))
        if not self.sent and _may_open_call(self.text):
            return ""
        return self._send(len(self.text) - _partial_tag(self.text))

    def finish(self) -> tuple[str, list[dict] | None]:
        """(text still to send, the calls or None)."""
        reply = parse_tool_calls(self.text, self.tools)
        if reply is None:
            return self._send(len(self.text)), None
        end = self.text.index(OPEN) if OPEN in self.text else 0
        return self._send(max(end, self.sent)), reply.calls

    def _send(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out


def _may_open_call(text: str) -> bool:
    head = text.lstrip()
    return not head or head.startswith(("{", "```")) or "```".startswith(head)


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that could begin a <tool_call> tag. Example: "ok <tool" -> 5"""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
