"""Anthropic's Messages API over uag's one request path (POST /v1/messages, /v1/messages/count_tokens): a Messages
body checked into the chat `Request` (uag.server.protocol), the reply written as a Message, whole or as Anthropic's
stream of events, and errors as Anthropic's error object. Pure: no mlx, no HTTP.

    parse({"model": "demo-target", "max_tokens": 64, "system": "Be brief.",
           "messages": [{"role": "user", "content": "Hi"}]}, defaults)
        -> Request("chat", messages=({"role": "system", …}, {"role": "user", "content": "Hi"}), …)

Tool calls are chat's: a `tool_use` block is an assistant's tool call with the same id, a `tool_result` block the
tool message answering it, a tool's `input_schema` its function's parameters. Fields that do not apply to a local
model (thinking, context_management, …) are accepted and named in the reply's `ignored` list; what would change the
output and cannot be honoured (an image, a document, a prefilled reply) is a 400.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from uag.core.config import MAX_TOKENS
from uag.core.grammar import response_format_constraint, tool_constraint
from uag.errors import InputError
from uag.server.dialects import Accepted, Dialect, Done
from uag.server.errors import APIError, bad, show
from uag.server.messages import parse_message, parse_tools, plain, text_of
from uag.server.protocol import Request, ServerDefaults, common_fields, constrained, refused
from uag.server.streaming import sse

MAX_STOP_SEQUENCES = 64
# The fields uag reads; of the rest, those that say nothing about the reply pass silently, any other is accepted and
# named in the reply's `ignored` list (Claude Code sends new fields with each release).
READ = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k"}
READ |= {"tools", "tool_choice", "output_config", "output_format", "speculative"}
SILENT = {"metadata", "service_tier"}
BLOCKS_DROPPED = ("thinking", "redacted_thinking")  # an earlier reply's reasoning: not part of the conversation here
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}  # as protocol.py's


# --- requests -------------------------------------------------------------------------------------------------
def parse(body: Any, defaults: ServerDefaults) -> Request:
    """A /v1/messages body as a chat `Request`; APIError naming the first problem. `extra["ignored"]`: the fields
    accepted but not applied."""
    return _parse(body, defaults, counting=False)


def parse_count(body: Any, defaults: ServerDefaults) -> Request:
    """A /v1/messages/count_tokens body (no max_tokens) as the `Request` whose prompt is counted: the target alone."""
    return _parse(body, defaults, counting=True)


def _parse(body: Any, defaults: ServerDefaults, *, counting: bool) -> Request:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    ignored = [name for name in body if name not in READ | SILENT and _asks(name, body[name])]
    shared = {name: body[name] for name in ("model", "top_p", "top_k", "speculative", "stream") if name in body}
    shared["temperature"] = _temperature(body.get("temperature"))
    shared["max_tokens"] = 1 if counting else _max_tokens(body.get("max_tokens"), ignored)
    if counting:
        shared.update(stream=False, speculative=False)  # counting loads the target alone
    common = {**common_fields(shared, defaults, "max_tokens"), "stop": _stop_sequences(body.get("stop_sequences"))}
    loaded: set[str] = set()  # deferred tools a tool_reference has loaded
    messages = _system(body.get("system")) + _messages(body.get("messages"), ignored, loaded)
    tools = _tools(body.get("tools"), ignored, loaded)
    choice, name, parallel = _tool_choice(body.get("tool_choice"))
    if choice == "none":
        tools = ()
    constraint = _output_format(body, ignored)
    forcing = choice in ("required", "function")
    if forcing:
        asked = f'tool_choice {{"type": "tool", "name": {show(name)}}}' if name else 'tool_choice {"type": "any"}'
        if not tools:
            raise bad("tool_choice", f"{asked} asks for a tool call, but tools declares none")
        if constraint is not None:
            raise bad(
                "output_config",
                f"output_config.format and {asked} both set the reply's form: drop one of them",
            )
        try:
            constraint = tool_constraint(tools, name, parallel)
        except InputError as err:
            raise refused(err, "tool_choice") from None
    common = constrained(common, constraint, defaults, "tool_choice" if forcing else "output_config")
    return Request(
        "chat", messages=messages, tools=tools, parallel_tool_calls=parallel, extra={"ignored": ignored}, **common
    )


def _asks(name: str, value: Any) -> bool:
    """Whether a field uag does not apply asks for something (null, empty and thinking "disabled" ask for nothing)."""
    if value is None or value == [] or value == {}:
        return False
    return not (name == "thinking" and isinstance(value, dict) and value.get("type") == "disabled")


def _temperature(value: Any) -> Any:
    """Anthropic's temperature runs from 0 to 1 (absent: greedy, as every uag endpoint)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
        raise bad("temperature", f"must be a number from 0 to 1 (got {show(value)})")
    return value


def _max_tokens(value: Any, ignored: list[str]) -> Any:
    """Required, as in Anthropic's API; above what uag generates in one reply, capped (and said in `ignored`)."""
    if value is None:
        raise bad("max_tokens", "required: the most tokens the reply may have")
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
        ignored.append(f"max_tokens above {MAX_TOKENS} (capped: uag generates at most {MAX_TOKENS} a reply)")
        return MAX_TOKENS
    return value


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STOP_SEQUENCES:
        raise bad("stop_sequences", f"must be a list of at most {MAX_STOP_SEQUENCES} strings (got {show(value)})")
    stops = tuple(text_of(stop, "stop_sequences") for stop in value)
    if not all(stops):
        raise bad("stop_sequences", "a stop sequence cannot be empty")
    return stops


def _system(value: Any, param: str = "system") -> tuple[dict, ...]:
    """The system prompt, a string or a list of text blocks (joined by blank lines), as chat's system message."""
    if value is None:
        return ()
    if isinstance(value, list):
        texts = []
        for j, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, dict) else None
                raise bad(f"{param}[{j}]", f'must be a text block {{"type": "text", "text": …}} (got {show(kind)})')
            texts.append(text_of(block.get("text"), f"{param}[{j}].text"))
        value = "\n\n".join(texts)
    else:
        value = text_of(value, param)
    return ({"role": "system", "content": value},) if value else ()


def _messages(value: Any, ignored: list[str], loaded: set[str]) -> tuple[dict, ...]:
    """Anthropic's turns as chat's messages: a user turn's tool results as tool messages (in their order among its
    text), an assistant turn's tool_use blocks as its tool calls, a system turn (Claude Code sends one after the
    first user turn) as a system message where it stands; consecutive turns of one role merged, as Anthropic merges
    them. `loaded`: gets the tools that tool_reference blocks name."""
    if not isinstance(value, list) or not value:
        raise bad("messages", 'give at least one message: a list of {"role": "user", "content": …} objects')
    out: list[dict] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"must be an object with role and content (got {show(message)})")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad(f"{where}.role", f'must be "user", "assistant" or "system" (got {show(role)})')
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad(f"{where}.content", f"must be a string or a list of content blocks (got {show(content)})")
        if role == "system":
            turns = _system(content, f"{where}.content")
        elif role == "user":
            turns = _user(blocks, f"{where}.content", loaded)
        else:
            turns = _assistant(blocks, f"{where}.content", ignored)
        for turn in turns:
            _join(out, parse_message(turn, i))
    if not out:
        raise bad("messages", "the messages hold no turn to answer")
    if out[-1]["role"] == "assistant":
        raise bad(
            f"messages[{len(value) - 1}]",
            "a reply that continues a final assistant message (a prefill) is not supported here: end with a user turn",
        )
    return tuple(out)


def _user(blocks: list, where: str, loaded: set[str]) -> Iterator[dict]:
    """A user turn's blocks: text (joined by blank lines) as user messages, each tool_result as a tool message."""
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "text":
            texts.append(text_of(block.get("text"), f"{where}[{j}].text"))
        elif kind == "tool_result":
            if texts:
                yield {"role": "user", "content": "\n\n".join(texts)}
                texts = []
            yield _tool_result(block, f"{where}[{j}]", loaded)
        else:
            raise _unreadable(kind, f"{where}[{j}]", "text and tool_result")
    if texts or not blocks:
        yield {"role": "user", "content": "\n\n".join(texts)}


def _assistant(blocks: list, where: str, ignored: list[str]) -> Iterator[dict]:
    """An assistant turn's blocks: its text and its tool_use blocks as one message with tool calls."""
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind, at = _kind(block, f"{where}[{j}]"), f"{where}[{j}]"
        if kind == "text":
            texts.append(text_of(block.get("text"), f"{at}.text"))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad(f"{at}.input", f"must be a JSON object (got {show(arguments)})")
            calls.append(
                {
                    "id": text_of(call_id, f"{at}.id"),
                    "type": "function",
                    "function": {"name": text_of(name, f"{at}.name"), "arguments": arguments},
                }
            )
        elif kind in BLOCKS_DROPPED:
            if kind not in ignored:
                ignored.append(kind)
        else:
            raise _unreadable(kind, at, "text, tool_use and thinking")
    yield {"role": "assistant", "content": "\n\n".join(texts), **({"tool_calls": calls} if calls else {})}


def _tool_result(block: dict, where: str, loaded: set[str]) -> dict:
    """A tool_result as the tool message answering the call of the same id; `is_error` said in its text. A
    tool_reference in it (a client's tool search) loads the deferred tool it names (`loaded`)."""
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = text_of(content, f"{where}.content")
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = _kind(part, f"{where}.content[{j}]")
            if kind == "tool_reference":
                name = text_of(part.get("tool_name"), f"{where}.content[{j}].tool_name")
                loaded.add(name)
                parts.append(f"Tool loaded: {name}")
                continue
            if kind != "text":
                raise _unreadable(kind, f"{where}.content[{j}]", "text and tool_reference")
            parts.append(text_of(part.get("text"), f"{where}.content[{j}].text"))
        text = "\n\n".join(parts)
    else:
        raise bad(f"{where}.content", f"must be a string or a list of text blocks (got {show(content)})")
    error = block.get("is_error")
    if error is not None and not isinstance(error, bool):
        raise bad(f"{where}.is_error", f"must be true or false (got {show(error)})")
    return {
        "role": "tool",
        "tool_call_id": text_of(block.get("tool_use_id"), f"{where}.tool_use_id"),
        "content": f"Error: {text}" if error else text,
    }


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(where, f'must be a content block {{"type": …}} (got {show(block)})')
    return block["type"]


def _unreadable(kind: str, where: str, readable: str) -> APIError:
    if kind in ("image", "document"):
        return bad(where, f"the served model reads text only: send the {kind}'s content as text")
    return bad(where, f"uag reads {readable} blocks here (got a block of type {show(kind)})")


def _join(out: list[dict], message: dict) -> None:
    """Append `message`, merged into the last one where both are the same role's turn (tool messages stay apart)."""
    last = out[-1] if out else None
    if last is None or last["role"] != message["role"] or message["role"] not in ("user", "assistant"):
        out.append(message)
        return
    last["content"] = "\n\n".join(text for text in (last["content"], message["content"]) if text)
    if message.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]


def _tools(value: Any, ignored: list[str], loaded: set[str]) -> tuple[dict, ...]:
    """Anthropic's tools ({name, description, input_schema}) as chat's function tools, checked as chat's are. Left
    out: a tool with `defer_loading` until a tool_reference has loaded it (`loaded`), as Anthropic's tool search
    does, and a tool of Anthropic's own (typed, without a schema: web_search, bash_…), named in `ignored`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("tools", 'must be a list of {"name": …, "description": …, "input_schema": {…}} objects')
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, f'must be {{"name": …, "input_schema": {{…}}}} (got {show(tool)})')
        if tool.get("type") not in (None, "custom"):
            ignored.append(f"{where} ({show(tool['type'])}: a tool of Anthropic's own, run by its servers)")
            continue
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad(
                f"{where}.input_schema", f"required: the tool's input as a JSON Schema object (got {show(schema)})"
            )
        if tool.get("defer_loading") is True and not (isinstance(tool.get("name"), str) and tool["name"] in loaded):
            continue
        function = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        try:
            out += parse_tools([{"type": "function", "function": function}])
        except APIError as err:  # said in Anthropic's names
            param = (
                (err.param or "tools[0]").replace("tools[0]", where).replace(".function.parameters", ".input_schema")
            )
            message = err.message.replace("tools[0].function.parameters", f"{where}.input_schema")
            raise APIError(400, message.replace("tools[0]", where), param=param.replace(".function", "")) from None
    return tuple(out)


def _tool_choice(value: Any) -> tuple[str, str | None, bool]:
    """(auto, none, required or function — as protocol.py's tool_choice; the tool's name; parallel calls)."""
    if value is None:
        return "auto", None, True
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in TOOL_CHOICES:
        raise bad(
            "tool_choice",
            'must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": …} or {"type": "none"} '
            f"(got {show(value)})",
        )
    single = value.get("disable_parallel_tool_use")
    if single is not None and not isinstance(single, bool):
        raise bad("tool_choice", f"disable_parallel_tool_use must be true or false (got {show(single)})")
    name = text_of(value.get("name"), "tool_choice.name") if kind == "tool" else None
    if kind == "tool" and not name:
        raise bad("tool_choice", "name the tool to call")
    return TOOL_CHOICES[kind], name, not single


def _output_format(body: dict, ignored: list[str]) -> str | None:
    """Structured output (`output_config.format`, or the older `output_format`: {"type": "json_schema", "schema"})
    as the grammar's constraint; output_config's other settings (effort, …) go to `ignored`."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad("output_config", f"must be an object (got {show(config)})")
    ignored += [f"output_config.{name}" for name, v in (config or {}).items() if name != "format" and v is not None]
    value, param = (config or {}).get("format"), "output_config.format"
    if body.get("output_format") is not None:
        value, param = body["output_format"], "output_format"
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema" or not isinstance(value.get("schema"), dict):
        raise bad(param, f'must be {{"type": "json_schema", "schema": {{…}}}} (got {show(value)})')
    plain(value, param)
    try:
        return response_format_constraint({"type": "json_schema", "json_schema": {"schema": value["schema"]}})
    except InputError as err:
        raise refused(err, param) from None


# --- replies --------------------------------------------------------------------------------------------------
def usage(report: dict) -> dict:
    """OpenAI's usage as Anthropic counts it: input_tokens are the prompt tokens read now, cache_read_input_tokens
    those the prompt cache held. Example: prompt 100, cached 80, completion 5 -> input 20, cache read 80, output 5"""
    given = report["usage"]
    cached = given["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": given["prompt_tokens"] - cached,
        "output_tokens": given["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_reason(done: Done) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for how a run ended. Example: finish "stop" by "###" -> ("stop_sequence", "###")"""
    if done.finish in STOP_REASONS:
        return STOP_REASONS[done.finish], None
    return ("end_turn", None) if done.stop_sequence is None else ("stop_sequence", done.stop_sequence)


def tool_use(call: dict) -> dict:
    """An OpenAI-shaped tool call as a tool_use block (its id kept, "toolu_" in place of "call_")."""
    function = call["function"]
    call_id = call["id"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id,
        "name": function["name"],
        "input": json.loads(function["arguments"]),
    }


def event(name: str, obj: dict) -> bytes:
    """One event of Anthropic's stream: `event: <name>` and its `data:` line."""
    return f"event: {name}\n".encode() + sse(obj)


def anthropic_error(err: APIError) -> dict:
    """Anthropic's error object: its type by the status, the message."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


class AnthropicReply:
    """A Message, whole or as Anthropic's events: message_start and a ping; a text block opened at the first text
    (content_block_start, text_delta's, content_block_stop); each tool call as a tool_use block whose input comes as
    one input_json_delta; message_delta with the stop reason and the usage; message_stop. Another ping goes out
    whenever the stream is quiet for a while (a long prompt read)."""

    keepalive = event("ping", {"type": "ping"})  # what uag.server.routes sends while a stream is quiet

    def __init__(self, request: Request):
        self.model, self.ignored = request.model, list(request.extra.get("ignored", ()))
        self.mid = f"msg_{uuid.uuid4().hex[:24]}"
        self.blocks = 0  # content blocks started so far
        self.text_block: int | None = None  # the open text block's index

    def message(self, content: list, stop: tuple[str | None, str | None], used: dict) -> dict:
        out = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": content}
        out.update(stop_reason=stop[0], stop_sequence=stop[1], usage=used)
        if self.ignored:
            out["ignored"] = self.ignored
        return out

    def whole(self, done: Done) -> dict:
        content = [{"type": "text", "text": done.text}] if done.text else []
        content += [tool_use(call) for call in done.tool_calls or ()]
        return {**self.message(content, stop_reason(done), usage(done.report)), **_uag(done.report)}

    def opening(self, accepted: Accepted) -> Iterable[bytes]:
        read = {"input_tokens": accepted.prompt_tokens, "output_tokens": 0}  # message_delta's usage corrects it
        read.update(cache_creation_input_tokens=0, cache_read_input_tokens=0)
        yield event("message_start", {"type": "message_start", "message": self.message([], (None, None), read)})
        yield self.keepalive

    def delta(self, text: str) -> Iterable[bytes]:
        if not text:
            return
        if self.text_block is None:
            self.text_block, started = self._start({"type": "text", "text": ""})
            yield started
        delta = {"type": "text_delta", "text": text}
        yield event("content_block_delta", {"type": "content_block_delta", "index": self.text_block, "delta": delta})

    def closing(self, done: Done) -> Iterable[bytes]:
        yield from self.delta(done.tail)
        if self.text_block is not None:
            yield self._stop(self.text_block)
        for call in done.tool_calls or ():
            block = tool_use(call)
            index, started = self._start({**block, "input": {}})
            yield started
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            yield event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            yield self._stop(index)
        reason, sequence = stop_reason(done)
        ending = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
        yield event("message_delta", {**ending, "usage": usage(done.report), **_uag(done.report)})
        yield event("message_stop", {"type": "message_stop"})

    def failed(self, err: APIError) -> bytes:
        return event("error", anthropic_error(err))

    def _start(self, block: dict) -> tuple[int, bytes]:
        """(the next block's index, its content_block_start event)."""
        index, self.blocks = self.blocks, self.blocks + 1
        return index, event(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}
        )

    def _stop(self, index: int) -> bytes:
        return event("content_block_stop", {"type": "content_block_stop", "index": index})


def _uag(report: dict) -> dict:
    """uag's own blocks beside Anthropic's fields: what speculation did, llama.cpp's timings."""
    return {name: report[name] for name in ("speculative", "timings") if name in report}


ANTHROPIC = Dialect("messages", parse, AnthropicReply, anthropic_error, label="an API request (messages)")


# --- count_tokens: a job on the model worker ----------------------------------------------------------------
def count_tokens(service: Any, job: Any, request: Request, key: str | None = None) -> Iterator[Accepted]:
    """The job function behind /v1/messages/count_tokens (`JobRunner.run(partial(count_tokens, service), request,
    key, …)`): the target loaded, the request's prompt rendered and checked as `Service.job` renders it, its
    length as one `Accepted`. `key` is unused: counting reads no earlier request."""
    loaded = service.load(job, None, host=service.host_for(request.model))
    yield Accepted(len(service.prompt(loaded, request).ids))
