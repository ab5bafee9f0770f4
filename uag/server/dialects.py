"""The seam between one request path and the APIs that reach it. A `Dialect` is one API's wire format: how its
body becomes uag's checked `Request` (uag.server.protocol), how a run's items — `Accepted`, `Delta`s, one `Done`,
which uag.server.service yields — are written back, whole or as that API's stream of events, and how an error
reads. The HTTP layer (uag.server.routes) owns everything else — keys, limits, the queue, cancelling — once, for
every dialect. Pure: no mlx, no HTTP.

    OPENAI_CHAT.parse(body, defaults) -> Request;  OPENAI_CHAT.reply(request).whole(done) -> a chat.completion

OpenAI's chat and completions are here; Anthropic's Messages (uag.server.anthropic), OpenAI's Responses
(uag.server.openai_responses) and llama.cpp's /infill (uag.server.infill) are the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from uag.server.errors import APIError
from uag.server.protocol import Request, ServerDefaults, parse_chat, parse_completion
from uag.server.responses import chat_response, chunk, completion_response, new_id, now, usage_chunk
from uag.server.streaming import DONE, sse


@dataclass(frozen=True)
class Accepted:
    """The prompt passed its checks and generation starts (a stream may now send its first chunk)."""

    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """Content to send now."""

    text: str


@dataclass(frozen=True)
class Done:
    """The end of a request: the reply, why it ended, and the usage/speculative/timings report."""

    text: str  # the whole content (stop sequences cut; without the tool calls)
    finish: str  # OpenAI's finish_reason: stop, length, tool_calls
    report: dict
    tool_calls: list | None = None
    tail: str = ""  # content not yet sent as a Delta
    stop_sequence: str | None = None  # the request's stop sequence that ended the reply (None: none did)


class Reply(Protocol):
    """How one API answers one request: the whole answer, or its events as a run goes (SSE bytes)."""

    def whole(self, done: Done) -> dict: ...

    def opening(self, accepted: Accepted) -> Iterable[bytes]: ...

    def delta(self, text: str) -> Iterable[bytes]: ...

    def closing(self, done: Done) -> Iterable[bytes]: ...

    def failed(self, err: APIError) -> bytes: ...


def openai_error(err: APIError) -> dict:
    return err.body()


@dataclass(frozen=True)
class Dialect:
    """One API over the one request path: `parse` checks a body into a `Request` (an `APIError` naming the first
    problem), `reply` writes a checked request's answer, `error` is the API's error object for an `APIError`."""

    name: str  # as the log and the metrics label it
    parse: Callable[[Any, ServerDefaults], Request]
    reply: Callable[[Request], Reply]
    error: Callable[[APIError], dict] = openai_error
    label: str = "an API request"  # what the worker's queue calls its jobs
    any_model: bool = False  # a `model` no server model answers to is served by the default one (llama.cpp's /infill)
    # An API that keeps state per key (OpenAI's stored responses): `parse(body, defaults, key)` with the API key the
    # request presented; `fresh()` its dialect for a new app (state of its own); `resource(method, id, key)` answers
    # GET and DELETE {path}/{id} (an APIError when the key has no such object).
    keyed: bool = False
    fresh: Callable[[], Dialect] | None = None
    resource: Callable[[str, str, str | None], dict] | None = None


class OpenAIReply:
    """OpenAI's chat completion or text completion, whole or as `chat.completion.chunk` / `text_completion` events:
    the role, content deltas, tool calls as OpenAI streams them (the name, then the arguments), the finish reason,
    the usage chunk when asked, `[DONE]`."""

    def __init__(self, request: Request):
        self.request, self.kind, self.model = request, request.kind, request.model
        self.rid, self.created = new_id(request.kind), now()

    def whole(self, done: Done) -> dict:
        if self.kind == "chat":
            return chat_response(
                self.rid, self.created, self.model, done.text, done.finish, done.report, done.tool_calls
            )
        return completion_response(self.rid, self.created, self.model, done.text, done.finish, done.report)

    def _piece(self, delta: Any, finish: str | None = None) -> bytes:
        return sse(chunk(self.kind, self.rid, self.created, self.model, delta, finish))

    def opening(self, accepted: Accepted) -> Iterable[bytes]:
        if self.kind == "chat":
            yield self._piece({"role": "assistant", "content": ""})

    def delta(self, text: str) -> Iterable[bytes]:
        yield self._piece({"content": text} if self.kind == "chat" else text)

    def closing(self, done: Done) -> Iterable[bytes]:
        if done.tail:
            yield from self.delta(done.tail)
        for i, call in enumerate(done.tool_calls or ()):
            function = call["function"]
            head = {
                "index": i,
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": ""},
            }
            yield self._piece({"tool_calls": [head]})
            yield self._piece({"tool_calls": [{"index": i, "function": {"arguments": function["arguments"]}}]})
        last = chunk(self.kind, self.rid, self.created, self.model, {} if self.kind == "chat" else "", done.finish)
        yield sse({**last, **{k: done.report[k] for k in ("uag",) if k in done.report}})  # why a reply was cut
        if self.request.include_usage:
            yield sse(usage_chunk(self.kind, self.rid, self.created, self.model, done.report))
        yield DONE

    def failed(self, err: APIError) -> bytes:
        return sse(err.body())


OPENAI_CHAT = Dialect("chat", parse_chat, OpenAIReply, label="an API request (chat)")
OPENAI_COMPLETION = Dialect("completion", parse_completion, OpenAIReply, label="an API request (completion)")
