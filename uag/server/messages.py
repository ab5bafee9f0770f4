"""A chat request's messages and tools, typed and checked as the chat template takes them (uag.server.protocol
parses the rest of a request). Every problem is one 400 `APIError` naming its `param`. Pure: no mlx, no HTTP.

    parse_message({"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, 0)
        -> {"role": "system", "content": "Be brief."}
"""

from __future__ import annotations

import json
from typing import Any

from uag.core.prompt_input import check_text
from uag.errors import InputError
from uag.server.errors import bad, show

MAX_DEPTH = 32  # nesting of a tool's schema or a call's arguments (real ones are a few levels deep)
ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer": OpenAI's newer name for system


def text_of(value: Any, param: str) -> str:
    """A string field as valid text (no lone surrogates); a 400 naming `param` otherwise."""
    if not isinstance(value, str):
        raise bad(param, f"must be a string (got {show(value)})")
    try:
        return check_text(value, param)
    except InputError as err:
        raise bad(param, str(err).removeprefix(f"{param} ")) from None


def plain(value: Any, param: str, depth: int = 0) -> Any:
    """`value` (JSON) unchanged, or 400 when a string in it (a key too) is not valid text or it nests deeper than
    MAX_DEPTH: what reaches the chat template and the tokenizer. Example: plain({"a": ["\\ud800"]}, "p") -> 400"""
    if depth > MAX_DEPTH:
        raise bad(param, f"is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str):
        text_of(value, param)
    elif isinstance(value, dict):
        for key, item in value.items():
            text_of(key, param)
            plain(item, param, depth + 1)
    elif isinstance(value, list):
        for item in value:
            plain(item, param, depth + 1)
    return value


def parse_message(message: Any, i: int) -> dict:
    """One message as the chat template takes it: role, content text, and an assistant's tool calls."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad(where, f"must be an object with role and content (got {show(message)})")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)} (got {show(role)})")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = message.get("content")
    calls = message.get("tool_calls")
    if content is None and not (role == "assistant" and calls):
        raise bad(f"{where}.content", "required (null only for an assistant message with tool_calls)")
    out["content"] = "" if content is None else _content(content, f"{where}.content")
    if calls is not None:
        if role != "assistant":
            raise bad(f"{where}.tool_calls", "only assistant messages carry tool calls")
        out["tool_calls"] = _calls(calls, f"{where}.tool_calls")
    if role == "tool":  # as OpenAI: a tool's result says which call it answers
        if message.get("tool_call_id") is None:
            raise bad(f"{where}.tool_call_id", "required: the id of the tool call this tool message answers")
        out["tool_call_id"] = text_of(message["tool_call_id"], f"{where}.tool_call_id")
    if message.get("name") is not None:
        out["name"] = text_of(message["name"], f"{where}.name")
    return out


def _content(content: Any, param: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return text_of(content, param)
    if not isinstance(content, list):
        raise bad(param, f"must be a string or a list of text parts (got {show(content)})")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad(
                param,
                f'uag reads text only: parts must be {{"type": "text", "text": …}} (got a part of type {show(kind)})',
            )
        texts.append(text_of(part["text"], param))
    return "".join(texts)


def _calls(calls: Any, param: str) -> list[dict]:
    """An assistant's tool calls as the template takes them: id, name, and the arguments as an object."""
    if not isinstance(calls, list):
        raise bad(param, f"must be a list of tool calls (got {show(calls)})")
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(where, 'each tool call needs {"function": {"name": …, "arguments": …}}')
        name = text_of(function["name"], f"{where}.function.name")
        call_id = None if call.get("id") is None else text_of(call["id"], f"{where}.id")
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            text = text_of(arguments, f"{where}.function.arguments")
            try:
                arguments = json.loads(text) if text.strip() else {}
            except (ValueError, RecursionError):
                raise bad(f"{where}.function.arguments", f"the arguments of {show(name)} are not JSON") from None
        if not isinstance(arguments, dict):
            raise bad(
                f"{where}.function.arguments", f"must be a JSON object, or a string holding one (got {show(arguments)})"
            )
        plain(arguments, f"{where}.function.arguments")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def parse_tools(tools: Any) -> tuple[dict, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad("tools", 'must be a list of {"type": "function", "function": {…}} objects')
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"tools[{i}]", 'must be {"type": "function", "function": {"name": …, "parameters": {…}}}')
        plain(function, f"tools[{i}].function")  # its name, description and schema reach the template as text
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        _schema(parameters, f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return tuple(out)


def _schema(schema: dict, param: str) -> None:
    """400 unless the keywords uag.server.chat.fits reads (type, enum, required, properties, items) have the
    shapes JSON Schema gives them, here and in every nested schema. Example: {"required": "city"} -> 400"""
    kinds, properties = schema.get("type"), schema.get("properties")
    if kinds is not None and not _strings(kinds, alone=True):
        raise bad(param, f"type must be a string or a list of strings (got {show(kinds)})")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise bad(param, f"enum must be a list (got {show(schema['enum'])})")
    if "required" in schema and not _strings(schema["required"]):
        raise bad(param, f"required must be a list of strings (got {show(schema['required'])})")
    if properties is not None and not isinstance(properties, dict):
        raise bad(param, f"properties must be an object (got {show(properties)})")
    for sub in [*(properties or {}).values(), schema.get("items")]:
        if isinstance(sub, dict):
            _schema(sub, param)


def _strings(value: Any, alone: bool = False) -> bool:
    """Whether `value` is a list of strings (`alone`: or one string)."""
    return (alone and isinstance(value, str)) or isinstance(value, list) and all(isinstance(v, str) for v in value)
