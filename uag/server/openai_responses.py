"""OpenAI's Responses API (`POST /v1/responses`, what Codex CLI speaks) over uag's one request path: a body's input
items become chat messages (uag.server.messages' shape), its function tools chat's tools, and the run's `Done` a
`response` object, whole or as Responses' typed event stream. Stored responses (`store`, `previous_response_id`)
are kept in memory per API key. Pure: no mlx, no HTTP.

    parse_responses({"model": "demo-target", "input": "Hi", "instructions": "Be brief."}, defaults, None, stored)
        -> Request("chat", messages=({"role": "system", …}, {"role": "user", "content": "Hi"}), …)

A namespace of functions (Codex's MCP tools) reaches the model as flat names (`mcp__files__` + `read` ->
`mcp__files__read`; `crm` + `find` -> `crm__find`) and its calls go back with `name` and `namespace` apart. Hosted
tools a local server cannot run (web_search, file_search, …) are dropped and named in the response's `notes`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from uag.core.config import MAX_TOKENS
from uag.core.grammar import response_format_constraint
from uag.errors import InputError
from uag.server.dialects import Accepted, Dialect, Done, openai_error
from uag.server.errors import APIError, bad, show
from uag.server.messages import parse_tools, plain, text_of
from uag.server.protocol import Request, ServerDefaults, common_fields, constrained, forced_calls, refused
from uag.server.responses import now

DEFAULT_STORED = 256  # stored responses kept, over all keys
DEFAULT_STORED_BYTES = 64 * 2**20  # their conversations' size in all (JSON bytes)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
UNSEEN = "[an {kind} the model here cannot read]"  # what a tool's image or file output reads as
# Client-run tools of OpenAI's own kinds and hosted ones: the model here can call neither, so they are dropped.
HOSTED = (
    "web_search",
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer_use_preview",
    "computer",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
    "tool_search",
)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
# Fields accepted and not acted on (what a client sends that changes nothing here); the docs list them.
IGNORED = (
    "reasoning",
    "include",
    "prompt_cache_key",
    "prompt_cache_retention",
    "client_metadata",
    "metadata",
    "user",
    "safety_identifier",
    "service_tier",
    "truncation",
    "max_tool_calls",
    "top_logprobs",
    "stream_options",
)
FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "text",
    "stream",
    "store",
    "background",
    "previous_response_id",
    "seed",
    "speculative",
    *SAMPLING,
    *IGNORED,
}
UNSUPPORTED = {
    "conversation": "uag keeps no conversations: send previous_response_id, or the whole input",
    "prompt": "uag has no stored prompt templates: send instructions and input",
    "context_management": "uag does not compact conversations",
}


# --- stored responses --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    """One stored response: the object GET returns, and its conversation (its input and output as chat messages,
    without its instructions: a request continuing it sends its own)."""

    owner: str  # sha256 of the API key that made it ("" hashed for a server without keys)
    response: dict
    conversation: tuple[dict, ...]
    size: int


class StoredResponses:
    """OpenAI's stored responses, in memory: at most `count` of them and `max_bytes` (their JSON) in all, the least
    recently used dropped first. A response belongs to the key that made it: another key reads a 404, as OpenAI
    answers for an id it does not know."""

    def __init__(self, count: int = DEFAULT_STORED, max_bytes: int = DEFAULT_STORED_BYTES):
        self.count, self.max_bytes = count, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, owner: str, response: dict, conversation: tuple[dict, ...]) -> None:
        size = len(json.dumps([response, conversation], ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: never kept (a later previous_response_id gets its 404)
        with self._lock:
            self._items[response["id"]] = Stored(owner, response, conversation, size)
            self._bytes += size
            while len(self._items) > self.count or self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= dropped.size

    def get(self, rid: str, owner: str, param: str | None = None) -> Stored:
        with self._lock:
            stored = self._items.get(rid)
            if stored is None or stored.owner != owner:
                raise _not_found(rid, param)
            self._items.move_to_end(rid)
            return stored

    def delete(self, rid: str, owner: str) -> dict:
        with self._lock:
            stored = self._items.get(rid)
            if stored is None or stored.owner != owner:
                raise _not_found(rid, None)
            del self._items[rid]
            self._bytes -= stored.size
        return {"id": rid, "object": "response", "deleted": True}

    def __len__(self) -> int:
        return len(self._items)


def _not_found(rid: str, param: str | None) -> APIError:
    kept = "kept in memory while the server runs, for the API key that made them, the oldest dropped first"
    return APIError(
        404, f"no response with id {show(rid)} is stored here (responses are {kept})", param=param, code="not_found"
    )


def owner_of(key: str | None) -> str:
    """Whose stored responses a request reads: a hash of its API key, never the key itself."""
    return hashlib.sha256((key or "").encode()).hexdigest()


# --- the request -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    """What a Responses request asked beyond chat's `Request`: what its reply echoes, where its conversation came
    from, whether to store it, and how its flat tool names map back to namespaces."""

    owner: str
    conversation: tuple[dict, ...]  # the messages without the instructions (what a stored response keeps)
    store: bool
    echo: dict  # the request's settings as the response object repeats them
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat name -> (namespace, name)
    notes: tuple[str, ...] = ()


def parse_responses(body: Any, defaults: ServerDefaults, key: str | None, stored: StoredResponses) -> Request:
    """A /v1/responses body as a chat `Request` (its `Turn` in `extra["responses"]`); APIError naming the first
    problem."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for name, why in UNSUPPORTED.items():
        if body.get(name) is not None:
            raise bad(name, why)
    unknown = sorted(set(body) - FIELDS, key=str)
    if unknown:
        raise bad(str(unknown[0]), f"unrecognized request field {show(unknown[0])}", "unknown_parameter")
    if body.get("background") not in (None, False):
        raise bad("background", "uag answers in the foreground only: send background false (or leave it out)")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs", "uag does not return log probabilities; leave it out")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad("store", f"must be true or false (got {show(store)})")
    store = store is not False  # OpenAI's default: stored
    shared = {
        k: body[k] for k in ("model", "stream", "max_output_tokens", "seed", "speculative", *SAMPLING) if k in body
    }
    if shared.get("max_output_tokens") is None:
        # As OpenAI's: no cap of its own (uag's most), not --max-tokens: Codex takes a cut reply for a failed one
        # and sends the whole turn again.
        shared["max_output_tokens"] = MAX_TOKENS
    common = common_fields(shared, defaults, "max_output_tokens")
    owner = owner_of(key)
    previous = body.get("previous_response_id")
    history: tuple[dict, ...] = ()
    if previous is not None:
        history = stored.get(text_of(previous, "previous_response_id"), owner, "previous_response_id").conversation
    tools, namespaces, notes = _tools(body.get("tools"))
    conversation = history + tuple(_input(body.get("input"), namespaces))
    instructions = body.get("instructions")
    if instructions is not None:
        instructions = text_of(instructions, "instructions")
    messages = _leading_system(((instructions,) if instructions else ()), conversation)
    if not messages:
        raise bad("input", "give the model something to read: a string, or a list of message items")
    choice, name = _tool_choice(body.get("tool_choice"), namespaces)
    if choice == "none":
        tools = ()
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be true or false (got {show(parallel)})")
    parallel = parallel is not False
    text, response_format = _text(body.get("text"))
    constraint, param = None, "text.format"
    if response_format is not None:
        try:
            constraint = response_format_constraint(response_format)
        except InputError as err:  # in the words of chat's response_format: said of text.format
            said = (
                str(err).replace("response_format.json_schema", "text.format").replace("response_format", "text.format")
            )
            raise refused(InputError(said), "text.format") from None
    if choice in ("required", "function"):
        constraint, param = forced_calls(tools, name, parallel, constraint, "text.format"), "tool_choice"
    common = constrained(common, constraint, defaults, param)
    for ignored in IGNORED:
        if ignored in body and ignored not in ("stream_options",):
            plain(body[ignored], ignored)  # only text reaches the echo
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": parallel,
        "previous_response_id": previous,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "service_tier": body.get("service_tier") or "default",
        "store": store,
        "temperature": common["config"].temperature,
        "text": text,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": common["config"].top_p,
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
    }
    turn = Turn(owner, conversation, store, echo, namespaces, notes)
    return Request(
        "chat",
        messages=messages,
        tools=tools,
        parallel_tool_calls=parallel,
        extra={"responses": turn},
        **common,
    )


def _leading_system(instructions: tuple[str, ...], conversation: tuple[dict, ...]) -> tuple[dict, ...]:
    """The instructions and the conversation's leading system (developer) messages as one system message, as
    templates that read a system message only first expect; the rest as they are."""
    lead = 0
    while lead < len(conversation) and conversation[lead]["role"] == "system":
        lead += 1
    system = [*instructions, *(m["content"] for m in conversation[:lead])]
    head = ({"role": "system", "content": "\n\n".join(system)},) if system else ()
    return head + conversation[lead:]


def _input(value: Any, namespaces: Mapping[str, tuple[str, str]]) -> list[dict]:
    """The input items as chat messages: messages, function calls (joined into the assistant turn they follow)
    and their outputs; reasoning items are skipped (the model here writes none)."""
    if isinstance(value, str):
        return [{"role": "user", "content": text_of(value, "input")}]
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("input", f"must be a string or a list of items (got {show(value)})")
    flat = {parts: flat for flat, parts in namespaces.items()}
    out: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"must be an item object (got {show(item)})")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)} (got {show(role)})")
            out.append({"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name = text_of(item.get("name"), f"{where}.name")
            namespace = item.get("namespace")
            if namespace is not None:
                namespace = text_of(namespace, f"{where}.namespace")
                name = flat.get((namespace, name), flat_name(namespace, name))
            call = {
                "id": text_of(item.get("call_id"), f"{where}.call_id"),
                "type": "function",
                "function": {"name": name, "arguments": _arguments(item.get("arguments"), f"{where}.arguments")},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, f"{where}.output", UNSEEN)
            call_id = text_of(item.get("call_id"), f"{where}.call_id")
            out.append({"role": "tool", "content": text_of(text, f"{where}.output"), "tool_call_id": call_id})
        elif kind == "reasoning":
            continue
        else:
            raise bad(
                f"{where}.type",
                f"uag reads message, function_call, function_call_output and reasoning items (got {show(kind)})",
            )
    return out


def _content(content: Any, param: str, unseen: str | None = None) -> str:
    """A message's text: a string, or its input_text / output_text parts joined; images and files are a 400, or
    in a tool's output (`unseen`) that text in their place: an agent's next turn goes on without them."""
    if isinstance(content, str):
        return text_of(content, param)
    if not isinstance(content, list):
        raise bad(param, f"must be a string or a list of content parts (got {show(content)})")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            if unseen is not None:
                texts.append(unseen.format(kind=kind.removeprefix("input_")))
                continue
            raise bad(f"{param}[{j}]", f"the model here reads text only: leave {kind} parts out")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{param}[{j}]", f'must be {{"type": "input_text", "text": …}} (got a part of type {show(kind)})')
        texts.append(text_of(part["text"], f"{param}[{j}].text"))
    return "".join(texts)


def _arguments(value: Any, param: str) -> dict:
    """A call's arguments (a JSON string) as the object the chat template takes."""
    text = text_of(value if value is not None else "", param)
    try:
        arguments = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        raise bad(param, "the arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise bad(param, f"must hold a JSON object (got {show(arguments)})")
    return plain(arguments, param)


def flat_name(namespace: str, name: str) -> str:
    """The name a namespaced function has for the model: joined as Codex's MCP names are.

    Example: ("mcp__files__", "read") -> "mcp__files__read";  ("crm", "find") -> "crm__find"
    """
    return namespace + name if namespace.endswith("_") or name.startswith("_") else f"{namespace}__{name}"


def _tools(value: Any) -> tuple[tuple[dict, ...], dict[str, tuple[str, str]], tuple[str, ...]]:
    """(chat's tools, flat name -> (namespace, name), notes on the dropped ones) for the request's `tools`."""
    if value is None:
        return (), {}, ()
    if not isinstance(value, list):
        raise bad("tools", 'must be a list of tools like {"type": "function", "name": …, "parameters": {…}}')
    functions: list[dict] = []
    namespaces: dict[str, tuple[str, str]] = {}
    dropped: list[str] = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            functions.append(_function(tool, f"tools[{i}]"))
        elif kind == "namespace":
            namespace = text_of(tool.get("name"), f"tools[{i}].name")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad(f"tools[{i}].tools", "must be a list of function tools")
            for j, function in enumerate(inner):
                where = f"tools[{i}].tools[{j}]"
                if not isinstance(function, dict) or function.get("type") != "function":
                    dropped.append(f"{where} ({show(function.get('type') if isinstance(function, dict) else None)})")
                    continue
                checked = _function(function, where)
                flat = flat_name(namespace, checked["function"]["name"])
                namespaces[flat] = (namespace, checked["function"]["name"])
                functions.append({**checked, "function": {**checked["function"], "name": flat}})
        elif isinstance(kind, str) and kind:
            dropped.append(f"tools[{i}] ({kind})")
        else:
            raise bad(f"tools[{i}]", f"must be a tool object with a type (got {show(tool)})")
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise bad("tools", f"two tools are called {show(twice)} (namespaced functions count by their joined names)")
    notes = ()
    if dropped:
        notes = (f"tools dropped, which this server cannot run or the model here cannot call: {', '.join(dropped)}",)
    return parse_tools(functions), namespaces, notes


def _function(tool: dict, where: str) -> dict:
    """A Responses function tool (flat: name, description, parameters, strict) as chat's tool."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.name", f"a function tool needs a name (got {show(name)})")
    function = {"name": name}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(value: Any, namespaces: Mapping[str, tuple[str, str]]) -> tuple[str, str | None]:
    """(auto, none, required or function; the function's flat name) for the request's `tool_choice`."""
    if value is None or value in ("auto", "none", "required"):
        return value or "auto", None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        name = text_of(value["name"], "tool_choice")
        namespace = value.get("namespace")
        if namespace is not None:
            name = flat_name(text_of(namespace, "tool_choice"), name)
        return "function", name
    raise bad(
        "tool_choice",
        f'must be "auto", "none", "required" or {{"type": "function", "name": …}} (got {show(value)}); '
        "hosted tools are not run here",
    )


def _text(value: Any) -> tuple[dict, dict | None]:
    """(the `text` the response echoes, chat's response_format or None) for the request's `text`."""
    if value is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise bad("text", f'must be an object like {{"format": {{"type": "json_object"}}}} (got {show(value)})')
    plain(value, "text")
    form = value.get("format") or {"type": "text"}
    if not isinstance(form, dict):
        raise bad("text.format", f"must be an object (got {show(form)})")
    kind = form.get("type")
    if kind == "json_schema":
        spec = {k: form[k] for k in ("name", "schema", "strict") if form.get(k) is not None}
        return {**value, "format": form}, {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object"):
        return {**value, "format": form}, {"type": kind}
    raise bad("text.format", f"type must be text, json_object or json_schema (got {show(kind)})")


# --- the reply ---------------------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(report: dict) -> dict:
    """Chat's usage as the Responses API names it. Example: prompt 40 (32 cached), completion 8 ->
    {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32, …}, "output_tokens": 8, …, "total_tokens": 48}"""
    chat = report["usage"]
    cached = chat["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": chat["prompt_tokens"],
        # the tokens read anew, which the conversation's cache keeps for its next turn
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": chat["prompt_tokens"] - cached},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


class ResponsesReply:
    """One response, whole or as Responses' events: `response.created` and `.in_progress`, the message item (its
    output_text part, the text deltas), each function call (its arguments in one delta), then `response.completed`
    (or `.incomplete` when cut at max_output_tokens) with the usage; a failure mid-stream is `error` then
    `response.failed`. Every event carries `sequence_number`; a finished response is stored when asked."""

    def __init__(self, request: Request, stored: StoredResponses):
        self.request, self.stored, self.turn = request, stored, request.extra["responses"]
        self.rid, self.created = _id("resp"), now()
        self.sequence = 0
        self.message_id = _id("msg")
        self.opened = False  # whether the message item has been added to a stream
        self.text = ""
        self.output: list[dict] = []

    # --- the response object ---
    def _response(self, status: str, done: Done | None = None, error: APIError | None = None) -> dict:
        incomplete = done is not None and done.finish == "length"
        body = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None if error is None else {"code": error.code or "server_error", "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.request.model,
            "output": self.output if done is not None else [],
            "max_tool_calls": None,
            **self.turn.echo,
            "usage": None if done is None else usage(done.report),
        }
        if done is not None:
            body.update({k: v for k, v in done.report.items() if k != "usage"})
        if self.turn.notes:
            body["notes"] = list(self.turn.notes)
        return body

    def _message(self, status: str) -> dict:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}],
        }

    def _calls(self, done: Done) -> list[dict]:
        calls = []
        for call in done.tool_calls or ():
            name = call["function"]["name"]
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "status": "completed",
                "call_id": call["id"],
                "name": name,
                "arguments": call["function"]["arguments"],
            }
            if name in self.turn.namespaces:
                item["namespace"], item["name"] = self.turn.namespaces[name]
            calls.append(item)
        return calls

    def _finish(self, done: Done) -> str:
        """The output items of a finished run, stored when asked; the response's status."""
        status = "incomplete" if done.finish == "length" else "completed"
        calls = self._calls(done)
        message = [self._message(status)] if self.text or not calls else []
        self.output = message + calls
        if self.turn.store:
            said: dict[str, Any] = {"role": "assistant", "content": self.text}
            if done.tool_calls:
                said["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _loaded(c["function"]["arguments"])}}
                    for c in done.tool_calls
                ]
            response = self._response(status, done)
            self.stored.put(self.turn.owner, response, (*self.turn.conversation, said))
        return status

    def whole(self, done: Done) -> dict:
        self.text = done.text or ""
        return self._response(self._finish(done), done)

    # --- the stream ---
    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    def opening(self, accepted: Accepted) -> Iterable[bytes]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))

    def _open_message(self) -> Iterable[bytes]:
        if not self.opened:
            self.opened = True
            item = {**self._message("in_progress"), "content": []}
            yield self._event("response.output_item.added", output_index=0, item=item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self._event(
                "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0, part=part
            )

    def delta(self, text: str) -> Iterable[bytes]:
        if not text:
            return
        yield from self._open_message()
        self.text += text
        yield self._event(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def closing(self, done: Done) -> Iterable[bytes]:
        if done.tail:
            yield from self.delta(done.tail)
        status = self._finish(done)
        index = 0
        if self.output and self.output[0]["type"] == "message":
            yield from self._open_message()
            ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            yield self._event("response.output_text.done", **ids, text=self.text, logprobs=[])
            part = self.output[0]["content"][0]
            yield self._event("response.content_part.done", **ids, part=part)
            yield self._event("response.output_item.done", output_index=0, item=self.output[0])
            index = 1
        for call in self.output[index:]:
            ids = {"item_id": call["id"], "output_index": index}
            yield self._event(
                "response.output_item.added",
                output_index=index,
                item={**call, "arguments": "", "status": "in_progress"},
            )
            yield self._event("response.function_call_arguments.delta", **ids, delta=call["arguments"])
            yield self._event("response.function_call_arguments.done", **ids, arguments=call["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=call)
            index += 1
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(kind, response=self._response(status, done))

    def failed(self, err: APIError) -> bytes:
        error = self._event("error", code=err.code or err.type, message=err.message, param=err.param)
        return error + self._event("response.failed", response=self._response("failed", error=err))


def _loaded(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}


def responses_dialect(stored: StoredResponses | None = None) -> Dialect:
    """The Responses API over its own store of responses (each app makes its own: `Dialect.fresh`)."""
    stored = StoredResponses() if stored is None else stored

    def resource(method: str, rid: str, key: str | None) -> dict:
        owner = owner_of(key)
        if method == "DELETE":
            return stored.delete(rid, owner)
        return stored.get(rid, owner).response

    return Dialect(
        "responses",
        lambda body, defaults, key: parse_responses(body, defaults, key, stored),
        lambda request: ResponsesReply(request, stored),
        openai_error,
        label="an API request (responses)",
        keyed=True,
        fresh=responses_dialect,
        resource=resource,
    )


OPENAI_RESPONSES = responses_dialect()
