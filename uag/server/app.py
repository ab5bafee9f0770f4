"""The HTTP layer: OpenAI's routes over `uag.server.service.Service`. It owns framing, limits and errors; every
model call is a job on the one MLX worker (`JobRunner`), so it never generates anything itself.

    POST /v1/chat/completions    POST /v1/completions    GET /v1/models    GET /health

Limits, in the order a request meets them: the API key (constant-time compare), the body size, the request's
fields (uag.server.protocol), the queue (`max_queue` requests admitted at once, then 429), the client's share of
the worker (`JobRunner.per_client`, then 429), the wait for the worker (`queue_wait_s`, then 503), the generation
time (`JobRunner.budget_s`, then finish_reason "length"). A client that disconnects, or closes its stream,
cancels its job within a cycle. Every error is OpenAI's error object; internal errors are logged with their
traceback and answered with a neutral 500.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from uag.errors import UserError
from uag.runtime.access import client_of
from uag.runtime.jobs import Busy, OutOfTime, Status, Tick, Waiting
from uag.server.protocol import APIError, parse_chat, parse_completion
from uag.server.responses import chat_response, chunk, completion_response, new_id, now, usage_chunk
from uag.server.service import Accepted, Delta, Done, Service
from uag.server.streaming import DONE, sse

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 4 * 2**20  # bytes of a request body (a long code conversation is well under 1 MB)
DEFAULT_MAX_QUEUE = 8
_END = object()


def internal() -> APIError:
    """The neutral 500: what failed is in the server's log, never in the answer."""
    return APIError(500, "the server failed on this request (a bug, not your input); it is logged and the server "
                    "keeps serving")  # fmt: skip


class Disconnected(Exception):
    """The client went away while its request waited or ran."""


class Gate:
    """At most `limit` requests admitted at once (queued or running); the rest get 429."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self.count >= self.limit:
                raise APIError(429, f"the server's queue is full ({self.limit} requests): retry in a moment",
                               code="queue_full")  # fmt: skip
            self.count += 1

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


def create_app(
    service: Service,
    *,
    api_key: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    max_queue: int = DEFAULT_MAX_QUEUE,
    queue_wait_s: float | None = None,
) -> FastAPI:
    """The API as a FastAPI app (uag.server.main mounts the Gradio app beside it)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    gate = Gate(max_queue)
    wait_s = queue_wait_s if queue_wait_s is not None else service.runner.budget_s

    @app.exception_handler(APIError)
    async def api_error(_request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        messages = {404: f"no such route: {request.method} {request.url.path[:100]}",
                    405: f"{request.method} is not allowed on {request.url.path[:100]}"}  # fmt: skip
        error = APIError(err.status_code, messages.get(err.status_code, "the request could not be served"))
        return JSONResponse(error.body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, err: Exception) -> JSONResponse:
        log.error("a request failed with an internal error", exc_info=err)
        return JSONResponse(internal().body(), status_code=500)

    def authorise(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key")  # fmt: skip

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorise(request)
        model = {"id": service.defaults.model, "object": "model", "created": now(), "owned_by": "uag"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, parse_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, parse_completion)

    async def serve(request: Request, parse: Callable[..., Any]):
        authorise(request)
        parsed = parse(await read_json(request, max_body), service.defaults)
        gate.enter()
        items = _guarded(service, parsed, client_of(request.client.host if request.client else None, request.headers))
        handed_over = False
        try:
            first = await pull(request, items, wait_s)  # Accepted, or the error that stopped the request first
            if parsed.stream:
                handed_over = True  # the stream closes the items and leaves the gate
                return StreamingResponse(
                    stream(request, parsed, items, first, gate, wait_s),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            done = first
            while not isinstance(done, Done):
                done = await pull(request, items, wait_s)
            return JSONResponse(_whole(parsed, done))
        except Disconnected:  # nobody to answer; closing the items cancels the job
            return Response(status_code=499)
        finally:
            if not handed_over:
                items.close()
                gate.leave()

    return app


def _guarded(service: Service, parsed, client: str) -> Iterator[Any]:
    """The job's items; the errors a user can fix as 400/429, anything else logged and answered with a 500."""
    items = service.runner.run(service.job, parsed, label=f"an API request ({parsed.kind})", client=client)
    try:
        yield from items
    except (APIError, GeneratorExit):
        raise
    except Busy as err:
        raise APIError(429, str(err), code="too_many_requests") from None
    except UserError as err:
        raise APIError(400, " ".join(str(err).split())) from None
    except Exception as err:
        log.error("an API request failed with an internal error", exc_info=err)
        raise internal() from None
    finally:
        items.close()


async def pull(request: Request, items: Iterator[Any], wait_s: float | None) -> Any:
    """The job's next item that says something (`Accepted`, `Delta`, `Done`); raises what the job raised.
    While it waits it checks that the client is still there, and that the queue has not held it too long."""
    while True:
        # Not abandoned on cancel: `next` returns within a heartbeat, so the generator is never closed under it.
        item = await anyio.to_thread.run_sync(next, items, _END)
        if item is _END:
            raise RuntimeError("the job ended without a final item")
        if isinstance(item, (Accepted, Delta, Done)):
            return item
        if isinstance(item, Waiting) and wait_s is not None and item.seconds > wait_s:
            raise APIError(503, f"the server is overloaded: this request waited {item.seconds:.0f} s for the model "
                           "worker; retry later", code="overloaded")  # fmt: skip
        if isinstance(item, (Waiting, Tick, Status, OutOfTime)) and await request.is_disconnected():
            raise Disconnected


def _whole(parsed, done: Done) -> dict:
    rid, created = new_id(parsed.kind), now()
    if parsed.kind == "chat":
        return chat_response(rid, created, parsed.model, done.text, done.finish, done.report, done.tool_calls)
    return completion_response(rid, created, parsed.model, done.text, done.finish, done.report)


async def stream(
    request: Request, parsed, items: Iterator[Any], first: Any, gate: Gate, wait_s: float | None
) -> AsyncIterator[bytes]:
    """The SSE body: the role, content deltas, the finish reason, the usage chunk if asked, [DONE]. An error
    after the stream started is one error event, and the stream ends."""
    rid, created, kind, model = new_id(parsed.kind), now(), parsed.kind, parsed.model

    def piece(delta: Any, finish: str | None = None) -> bytes:
        return sse(chunk(kind, rid, created, model, delta, finish))

    try:
        if kind == "chat":
            yield piece({"role": "assistant", "content": ""})
        item = first
        while not isinstance(item, Done):
            if isinstance(item, Delta):
                yield piece({"content": item.text} if kind == "chat" else item.text)
            item = await pull(request, items, wait_s)
        if item.tail:
            yield piece({"content": item.tail} if kind == "chat" else item.tail)
        for i, call in enumerate(item.tool_calls or ()):  # as OpenAI streams them: the name, then the arguments
            head = {"index": i, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}  # fmt: skip
            yield piece({"tool_calls": [head]})
            yield piece({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]})
        yield piece({} if kind == "chat" else "", item.finish)
        if parsed.include_usage:
            yield sse(usage_chunk(kind, rid, created, model, item.report))
        yield DONE
    except APIError as err:
        yield sse(err.body())
    except Disconnected:
        return
    except Exception as err:
        log.error("a streamed request failed with an internal error", exc_info=err)
        yield sse(internal().body())
    finally:
        items.close()  # cancels the job when the client left early
        gate.leave()


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, at most `limit` bytes (413 beyond it, also when Content-Length lies or is absent)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise _too_large(limit)
    if not data:
        raise APIError(400, "the request has no body: send a JSON object")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not UTF-8 (byte {err.start + 1})") from None
    except ValueError as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this server's limit of {limit / 2**20:g} MB",
                    code="request_too_large")  # fmt: skip
