"""OpenAI's wire format for uag: a request body checked into one `Request` (a `GenerationConfig` and a drafter)
and OpenAI error objects; the response and chunk objects are in uag.server.responses. Pure: no mlx, no HTTP.

    request = parse_chat({"model": "demo-target", "messages": [{"role": "user", "content": "Hi"}]}, defaults)
    request.config             # GenerationConfig(strategy="auto", k=16, max_tokens=512, temperature=0.0, …)
    parse_chat({"model": "demo-target", "messages": [], "n": 2}, defaults)
        -> APIError(400, "messages: give at least one message …", param="messages")

Every problem is one `APIError` with the HTTP status, OpenAI's error `type`, the `param` at fault and a message
that says how to fix it; it never names a Python type or a path. Fields OpenAI defines but uag does not
implement are accepted at their neutral value (`presence_penalty: 0`) and refused otherwise, by name; fields
OpenAI does not define are refused, as OpenAI refuses them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from uag.core.config import DEFAULT_K, MAX_K, SPECULATIVE, DrafterSpec, GenerationConfig
from uag.core.prompt_input import check_text
from uag.errors import InputError

MAX_STOP = 4  # stop sequences, as OpenAI allows
ROLES = ("system", "developer", "user", "assistant", "tool")  # "developer": OpenAI's newer name for system


class APIError(Exception):
    """An OpenAI error object with its HTTP status."""

    TYPES = {401: "authentication_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = self.TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    """A 400 about `param`. Example: bad("n", "only n = 1 is supported") -> 400, message "n: only n = 1 …" """
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=code)


@dataclass(frozen=True)
class ServerDefaults:
    """What the operator's command line set: the served model, the default speculation, the drafters allowed."""

    model: str  # the target's name, as /v1/models lists it
    drafter: str | None  # the default drafter ("lookup+demo-drafter"); None: speculation off by default
    strategy: str = "auto"
    k: int = 16  # the most a request may ask for (auto: its longest draft)
    window: int = 4
    max_tokens: int = 512
    drafters: tuple[str, ...] = ()  # drafters a request may pick (the default is always among them)
    checks: bool = True  # whether a request may ask for `"check": true` (not under --shard)

    @property
    def allowed(self) -> tuple[str, ...]:
        default = () if self.drafter is None else (self.drafter,)
        return tuple(dict.fromkeys((*default, *self.drafters)))


@dataclass(frozen=True)
class Request:
    """One checked request: what to read (messages or a prompt), how to generate, and how to answer."""

    kind: str  # "chat" or "completion"
    model: str
    config: GenerationConfig  # strategy "baseline" when speculation is off; chat=False (uag.server.chat renders)
    drafter: str | None  # None: the target alone
    messages: tuple[dict, ...] = ()
    prompt: str = ""
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    tools: tuple[dict, ...] = ()
    check: bool = False  # also run the target alone and say whether the outputs agree (uag.study.divergence)
    extra: dict = field(default_factory=dict)


# --- request fields -------------------------------------------------------------------------------------------
COMMON = {
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "speculative", "metadata", "store",
}  # fmt: skip
CHAT = COMMON | {
    "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs",
    "response_format", "service_tier", "reasoning_effort", "modalities", "prediction", "functions",
}  # fmt: skip
COMPLETION = COMMON | {"prompt", "echo", "suffix", "best_of"}
# Fields accepted only at a value that asks for nothing (what uag does anyway).
NEUTRAL = {
    "frequency_penalty": (0, None), "presence_penalty": (0, None), "logit_bias": ({}, None),
    "logprobs": (False, None), "top_logprobs": (None, 0), "echo": (False, None), "suffix": (None, ""),
    "best_of": (1, None), "response_format": (None, {"type": "text"}), "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,), "modalities": (None, ["text"]), "prediction": (None,), "functions": (None,),
}  # fmt: skip


def _object(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unrecognized request field {unknown[0]!r}", "unknown_parameter")
    for name, values in NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in values):
            raise bad(name, f"uag does not support {name} (got {_show(value)}); leave it out")
    return body


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers. Example: 0.0 ~ 0 -> True;  false ~ 0 -> False"""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _show(value: Any) -> str:
    """A value as the client wrote it (JSON), shortened."""
    import json

    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "…"


def _whole(body: Mapping, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise bad(name, f"must be a whole number (got {_show(value)})")
    if not lo <= value <= hi:
        raise bad(name, f"must be from {lo} to {hi} (got {_show(value)})")
    return int(value)


def _number(body: Mapping, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"must be a number (got {_show(value)})")
    if not lo <= value <= hi:
        raise bad(name, f"must be from {lo:g} to {hi:g} (got {_show(value)})")
    return float(value)


def _flag(body: Mapping, name: str, param: str | None = None) -> bool:
    """body[name] as a bool (absent: False); `param`: the field to name in the error when `name` is nested."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        where = name if param is None else param
        raise bad(where, f"{'' if param is None else name + ' '}must be true or false (got {_show(value)})")
    return value


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad(param, f"must be a string (got {_show(value)})")
    try:
        return check_text(value, param)
    except InputError as err:
        raise bad(param, str(err).removeprefix(f"{param} ")) from None


def _stop(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP:
        raise bad("stop", f"must be a string or a list of 1 to {MAX_STOP} strings (got {_show(value)})")
    out = tuple(_text(s, "stop") for s in stops)
    if not all(out):
        raise bad("stop", "a stop sequence cannot be empty")
    return out


def _common(body: Mapping, defaults: ServerDefaults, max_tokens_field: str) -> dict[str, Any]:
    """The fields chat and completions share: model, sampling, stop, streaming, n, speculation."""
    model = body.get("model")
    if model is None:
        raise bad("model", f"required: name the model to use ({defaults.model!r}, see GET /v1/models)")
    if not isinstance(model, str):
        raise bad("model", f"must be a string (got {_show(model)})")
    if model != defaults.model:
        raise APIError(
            404,
            f"the model {model[:80]!r} does not exist on this server: it serves {defaults.model!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    if _whole(body, "n", 1, 2**31) not in (None, 1):
        raise bad("n", f"uag generates one choice per request: n must be 1 (got {_show(body['n'])})")
    top_p = _number(body, "top_p", 0, 1)
    if top_p is not None and top_p != 1:
        raise bad("top_p", f"uag samples from the whole distribution: top_p must be 1 (got {top_p:g}); use temperature")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise bad("stream_options", f'takes {{"include_usage": true|false}} (got {_show(options)})')
        include_usage = _flag(options, "include_usage")
    max_tokens = _whole(body, max_tokens_field, 1, 2**31)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens, max_tokens_field = _whole(body, "max_tokens", 1, 2**31), "max_tokens"
    fields = {
        "max_tokens": defaults.max_tokens if max_tokens is None else max_tokens,
        "temperature": _number(body, "temperature", 0, 2) or 0.0,
        "seed": _whole(body, "seed", 0, 2**31 - 1),
    }
    drafter, speculation, check = _speculative(body.get("speculative"), defaults)
    if check and fields["temperature"]:
        raise bad("speculative", "check compares greedy outputs token for token: send temperature 0 (or none)")
    fields.update(speculation)
    names = {"max_tokens": max_tokens_field, "temperature": "temperature", "seed": "seed"}
    for name, value in fields.items():  # each checked alone, so that the message names its request field
        try:
            GenerationConfig.parse(**{name: value})
        except InputError as err:
            param = names.get(name, "speculative")
            raise bad(param, str(err)) from None
    config = GenerationConfig.parse(**fields, chat=False)
    return {"model": model, "config": config, "drafter": drafter, "stop": _stop(body), "stream": stream,
            "include_usage": include_usage, "check": check}  # fmt: skip


def _speculative(value: Any, defaults: ServerDefaults) -> tuple[str | None, dict[str, Any], bool]:
    """(drafter or None, config fields, check) for the request's `speculative`: false, true/absent, or an object.
    `check`: also run the target alone and compare (greedy only; see uag.server.service)."""
    base = {"strategy": defaults.strategy, "k": defaults.k, "window": defaults.window}
    if value is None or value is True:
        if defaults.drafter is None:
            return None, {"strategy": "baseline"}, False
        return defaults.drafter, base, False
    if value is False:
        return None, {"strategy": "baseline"}, False
    if not isinstance(value, dict):
        raise bad("speculative", f'must be false, true or an object like {{"drafter": "lookup", "k": 4}} '
                  f"(got {_show(value)})")  # fmt: skip
    unknown = sorted(set(value) - {"drafter", "k", "strategy", "window", "check"})
    if unknown:
        raise bad("speculative", f"unknown key {unknown[0]!r}: it takes drafter, k, strategy, window and check")
    check = _flag(value, "check", param="speculative")
    if check and not defaults.checks:
        raise bad("speculative", "check is not available on a sharded server (--shard): its near-tie margins need "
                  "the whole target on one machine; compare with `uag generate --strategy baseline` there")  # fmt: skip
    allowed = defaults.allowed
    drafter = value.get("drafter", defaults.drafter)
    if drafter is None:
        raise bad("speculative", f"name a drafter: this server allows {_listed(allowed)}")
    if not isinstance(drafter, str):
        raise bad("speculative", f"drafter must be a string (got {_show(drafter)})")
    try:
        normal = str(DrafterSpec.parse(drafter))
    except InputError:
        normal = drafter
    if normal not in allowed:
        raise bad("speculative", f"drafter {drafter[:80]!r} is not served here: choose one of {_listed(allowed)}")
    strategy = value.get("strategy", defaults.strategy)
    if strategy not in SPECULATIVE:
        raise bad("speculative", f"strategy must be one of {', '.join(SPECULATIVE)} (got {_show(strategy)}); "
                  "for the target alone send \"speculative\": false")  # fmt: skip
    if "k" in value:
        k = _whole(value, "k", 1, MAX_K)
    elif strategy != "auto" and defaults.strategy == "auto":  # auto's -k is its longest draft, not a fixed length
        k = min(defaults.k, DEFAULT_K)
    else:
        k = defaults.k
    if k > defaults.k:
        raise bad("speculative", f"k must be from 1 to {defaults.k}, this server's -k (got {k})")
    window = value.get("window", defaults.window)
    return normal, {**base, "strategy": strategy, "k": k, "window": window}, check


def _listed(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names) if names else "no drafter (speculation is off on this server)"


# --- chat and completions ---------------------------------------------------------------------------------------
def parse_chat(body: Any, defaults: ServerDefaults) -> Request:
    """A /v1/chat/completions body as a `Request`; APIError naming the first problem."""
    body = _object(body, CHAT)
    common = _common(body, defaults, "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", 'give at least one message: a list of {"role": …, "content": …} objects')
    checked = tuple(_message(m, i) for i, m in enumerate(messages))
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad("tool_choice", f'uag supports "auto" and "none" (got {_show(choice)})')
    if choice == "none":
        tools = ()
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be true or false (got {_show(parallel)})")
    return Request("chat", messages=checked, tools=tools, **common)


def parse_completion(body: Any, defaults: ServerDefaults) -> Request:
    """A /v1/completions body as a `Request`; APIError naming the first problem."""
    body = _object(body, COMPLETION)
    common = _common(body, defaults, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", f"must be one string (got {_show(prompt)})")
    prompt = _text(prompt, "prompt")
    if not prompt.strip():
        raise bad("prompt", "the prompt is empty")
    return Request("completion", prompt=prompt, **common)


def _message(message: Any, i: int) -> dict:
    """One message as the chat template takes it: role, content text, and an assistant's tool calls."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad(where, f"must be an object with role and content (got {_show(message)})")
    role = message.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)} (got {_show(role)})")
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
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None:
            out["tool_call_id"] = _text(call_id, f"{where}.tool_call_id")
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _content(content: Any, param: str) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return _text(content, param)
    if not isinstance(content, list):
        raise bad(param, f"must be a string or a list of text parts (got {_show(content)})")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad(param, f"uag reads text only: parts must be {{\"type\": \"text\", \"text\": …}} "
                      f"(got a part of type {_show(kind)})")  # fmt: skip
        texts.append(_text(part["text"], param))
    return "".join(texts)


def _calls(calls: Any, param: str) -> list[dict]:
    import json

    if not isinstance(calls, list):
        raise bad(param, "must be a list of tool calls")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(param, 'each tool call needs {"function": {"name": …, "arguments": …}}')
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise bad(param, f"the arguments of {function['name']!r} are not JSON") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})  # fmt: skip
    return out


def _tools(tools: Any) -> tuple[dict, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad("tools", 'must be a list of {"type": "function", "function": {…}} objects')
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"tools[{i}]", 'must be {"type": "function", "function": {"name": …, "parameters": {…}}}')
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return tuple(out)
