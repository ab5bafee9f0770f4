"""The HTTP layer: OpenAI's routes over `uag.server.service.Service`. It owns framing, limits and errors; every
model call is a job on the one MLX worker (`JobRunner`), so it never generates anything itself.

    POST /v1/chat/completions    POST /v1/completions    GET /v1/models[/{id}]    GET|HEAD /health    GET /metrics
    POST /v1/messages[/count_tokens] (Anthropic's; every generating route is a dialect: `DIALECTS`)
    POST /v1/responses    GET|DELETE /v1/responses/{id} (OpenAI's Responses, stored per key)

Limits, in the order a request meets them: open connections and the time to send a request's head
(uag.server.connections); Host, Origin and JSON POSTs (uag.server.guards); the API key (a wrong one's 401 held
longer after each of a client's wrong keys, a right one never); the body size; the fields (uag.server.protocol);
the queue (`max_queue` requests, at most half one client's, then 429); the client's share of the worker
(`per_client`: beyond it a request waits, held back so that others go between); the wait for the worker
(`queue_wait_s`, default 300 s, then 503); the generation time
(`--time-budget`, none by default, then finish_reason "length" and why) and no progress for 10 min (the same).
429 and 503 carry Retry-After. A client that leaves cancels its job within a second.
Errors are OpenAI's error object; internal errors are logged with their traceback and answered with a neutral 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from uag.errors import UserError
from uag.runtime.jobs import Busy, Tick, Waiting
from uag.server.anthropic import ANTHROPIC, count_tokens, parse_count
from uag.server.dialects import OPENAI_CHAT, OPENAI_COMPLETION, Accepted, Delta, Dialect, Done, Reply
from uag.server.errors import APIError
from uag.server.guards import Guard, KeyBackoff, Perimeter, RetryLater, answer
from uag.server.infill import INFILL
from uag.server.keys import ApiKeys, Key
from uag.server.logs import RequestLog, note_served
from uag.server.metrics import CONTENT_TYPE as METRICS_TYPE
from uag.server.openai_responses import OPENAI_RESPONSES
from uag.server.responses import now
from uag.server.service import Service

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 4 * 2**20  # bytes of a request body (a long code conversation is well under 1 MB)
DEFAULT_MAX_QUEUE = 8
DRAIN_BYTES = 64 * 2**20  # of a body over the limit, read and dropped so that its client reads the 413
DEFAULT_QUEUE_WAIT_S = 300.0  # a request that waits this long for the worker gets 503 (the worker is overloaded)
# The generating routes: each path's API over the one request path (uag.server.dialects).
DIALECTS: dict[str, Dialect] = {
    "/v1/chat/completions": OPENAI_CHAT,
    "/v1/messages": ANTHROPIC,
    "/v1/completions": OPENAI_COMPLETION,
    "/v1/responses": OPENAI_RESPONSES,
    "/infill": INFILL,  # llama.cpp's, for editor autocomplete (uag.server.infill)
}
KEEPALIVE_S = 15.0  # a stream quiet this long (a long prompt read) sends its dialect's keep-alive, if it has one
DISCONNECT_CHECK_S = 0.5  # how often a request looks whether its client is still there, whatever arrives
RETRY_FULL_S = 5  # Retry-After when the queue is full: a short request's time
RETRY_OVERLOADED_S = 30  # Retry-After when a request waited too long for the worker
_END = object()


def internal() -> APIError:
    """The neutral 500: what failed is in the server's log, never in the answer."""
    return APIError(
        500, "the server failed on this request (a bug, not your input); it is logged and the server keeps serving"
    )


class Disconnected(Exception):
    """The client went away while its request waited or ran."""


class Gate:
    """At most `limit` requests admitted at once (queued, running, or waiting for their client's turn), and at most
    `per_client` of them one client's; the rest get 429."""

    def __init__(self, limit: int, per_client: int):
        self.limit, self.per_client, self.count = limit, per_client, 0
        self._clients: Counter[str] = Counter()
        self._lock = threading.Lock()

    def enter(self, client: str) -> None:
        with self._lock:
            if self.count >= self.limit:
                raise RetryLater(
                    429,
                    f"the server's queue is full ({self.limit} requests): retry in a moment",
                    code="queue_full",
                    seconds=RETRY_FULL_S,
                )
            if (mine := self._clients[client]) >= self.per_client:
                raise RetryLater(
                    429,
                    f"you already have {mine} requests running or waiting, the most this server "
                    "takes from one client: retry when one has finished",
                    code="too_many_requests",
                    seconds=RETRY_FULL_S,
                )
            self.count += 1
            self._clients[client] += 1

    def leave(self, client: str) -> None:
        with self._lock:
            self.count -= 1
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]


def create_app(
    service: Service,
    *,
    api_key: ApiKeys | str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    max_queue: int = DEFAULT_MAX_QUEUE,
    queue_wait_s: float | None = None,
    perimeter: Perimeter | None = None,
    backoff: KeyBackoff | None = None,
) -> FastAPI:
    """The API as a FastAPI app behind uag.server.guards' `Guard` and one log line per request (uag.server.main
    mounts the Gradio app beside it, behind the same guard)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    perimeter = perimeter or Perimeter()
    backoff = backoff or KeyBackoff()
    gate = Gate(max_queue, max(service.runner.per_client, max_queue // 2))
    wait_s = DEFAULT_QUEUE_WAIT_S if queue_wait_s is None else queue_wait_s
    app.add_middleware(Guard, perimeter=perimeter, backoff=backoff)
    metrics = service.metrics
    app.add_middleware(RequestLog, count=None if metrics is None else metrics.answered)
    if perimeter.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(perimeter.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["Retry-After"],
        )
    _answer_errors(app)
    authorise = _key_check(api_key)
    by_key = isinstance(api_key, ApiKeys) and api_key.from_file  # each key its own client

    if metrics is not None:  # GET /metrics: uag.server.metrics, behind the key
        metrics.name_routes({path: dialect.name for path, dialect in DIALECTS.items()})
        metrics.watch(admitted=lambda: gate.count, worker=service.runner.worker, costs=service.keepers)

        @app.get("/metrics")
        async def scrape(request: Request) -> Response:
            authorise(request)
            return Response(metrics.exposition(), media_type=METRICS_TYPE)

    router = service.router  # the served models a request's `model` picks from (uag.server.protocol)

    def served_model(defaults) -> dict:
        return {"id": defaults.model, "object": "model", "created": now(), "owned_by": "uag"}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        starting = service.starting()  # requests are served meanwhile: "ready" says start-up has finished
        return {"status": "ok", "ready": starting is None, **({"starting": starting} if starting else {})}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorise(request)
        return {"object": "list", "data": [served_model(defaults) for defaults in router.models]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        authorise(request)
        found = router.find(model_id)  # a served model, or an id --model-alias answers as one
        if found is None:
            raise APIError(
                404,
                f"no model {model_id[:100]!r} here: GET /v1/models lists the models this server serves",
                param="model",
                code="model_not_found",
            )
        return served_model(found)

    async def serve(request: Request, dialect: Dialect):
        """One request of any dialect: the key, the body, the checks, the gate, then the job's items written as
        the dialect writes them. An `APIError` before the reply starts is the dialect's error object."""
        try:
            return await _serve(request, dialect)
        except APIError as err:
            return answer(err, retry_s=RETRY_FULL_S, shape=dialect.error)

    async def _serve(request: Request, dialect: Dialect):
        key = authorise(request)
        try:
            body = await read_json(request, max_body)
        except Disconnected:  # left mid-body: nobody to answer
            return Response(status_code=499)
        defaults = router.pick(body, any_model=dialect.any_model)  # the served model the body names (404: none)
        parsed = dialect.parse(body, defaults, key) if dialect.keyed else dialect.parse(body, defaults)
        client = _client(request, key, by_key)
        gate.enter(client)
        feed = Feed(request, _guarded(service, parsed, client, key, dialect.label), wait_s)
        handed_over = False
        try:
            first = await feed.next()  # Accepted, or the error that stopped the request first
            reply = dialect.reply(parsed)
            if parsed.stream:
                handed_over = True  # the stream closes the feed and leaves the gate
                return StreamingResponse(
                    stream(request, reply, feed, first, lambda: gate.leave(client)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            done = first
            while not isinstance(done, Done):
                done = await feed.next()
            note_served(request.scope, done.report)
            return JSONResponse(reply.whole(done))
        except Disconnected:  # nobody to answer; closing the feed cancels the job
            return Response(status_code=499)
        finally:
            if not handed_over:
                feed.close()
                gate.leave(client)

    for path, dialect in DIALECTS.items():
        dialect = dialect.fresh() if dialect.fresh else dialect  # state of this app's own (stored responses)
        app.add_api_route(path, _route(serve, dialect), methods=["POST"])
        if dialect.resource is not None:
            app.add_api_route(path + "/{item_id}", _resource(authorise, dialect), methods=["GET", "DELETE"])

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request):
        """Anthropic's token count: the request's prompt rendered on the worker as /v1/messages renders it (its
        errors are Anthropic's: the path is under /v1/messages)."""
        key = authorise(request)
        try:
            body = await read_json(request, max_body)
        except Disconnected:
            return Response(status_code=499)
        parsed = parse_count(body, router.pick(body))
        client = _client(request, key, by_key)
        gate.enter(client)
        job = partial(count_tokens, service)
        feed = Feed(request, _guarded(service, parsed, client, key, "an API request (count_tokens)", job), wait_s)
        try:
            counted = await feed.next()
            return {"input_tokens": counted.prompt_tokens}
        except Disconnected:
            return Response(status_code=499)
        finally:
            feed.close()
            gate.leave(client)

    return app


def _route(serve: Callable[[Request, Dialect], Any], dialect: Dialect) -> Callable[[Request], Any]:
    async def route(request: Request):
        return await serve(request, dialect)

    route.__name__ = dialect.name
    return route


def _resource(authorise: Callable[[Request], str | None], dialect: Dialect) -> Callable[..., Any]:
    """GET and DELETE {path}/{id}: an object the dialect keeps for the request's key (a stored response)."""

    async def resource(request: Request, item_id: str) -> dict:
        return dialect.resource(request.method, item_id, authorise(request))

    resource.__name__ = f"{dialect.name}_stored"
    return resource


def _answer_errors(app: FastAPI) -> None:
    """Every failure as OpenAI's error object: an APIError as raised, Starlette's 404 and 405 in words, anything
    else logged with its traceback and answered with the neutral 500."""

    def shape(request: Request) -> Callable[[APIError], dict]:  # the error object of the API the path belongs to
        path = request.url.path
        for prefix, dialect in DIALECTS.items():
            if path == prefix or path.startswith(prefix + "/"):
                return dialect.error
        return OPENAI_CHAT.error

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return answer(err, retry_s=RETRY_FULL_S, shape=shape(request))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        messages = {
            404: f"no such route: {request.method} {request.url.path[:100]}",
            405: f"{request.method} is not allowed on {request.url.path[:100]}",
        }
        error = APIError(err.status_code, messages.get(err.status_code, "the request could not be served"))
        return JSONResponse(shape(request)(error), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.error("a request failed with an internal error", exc_info=err)
        return JSONResponse(shape(request)(internal()), status_code=500)


def _key_check(api_key: ApiKeys | str | None) -> Callable[[Request], Key | None]:
    """What every /v1 route calls first: 401 unless the request carries one of the server's keys (`api_key`: its
    one key, or its key file's: uag.server.keys) as its bearer token or, as Anthropic's clients send it, its
    `x-api-key` header (nothing to check when the server has no key). A right key always passes; the Guard holds the
    answers to a client's wrong keys (uag.server.guards.KeyBackoff). It returns the key the request presented as a
    `Key` (its digest, and its name; None without keys): what the request may draft from, the conversation caches
    it may reuse and the responses it may read are that key's alone."""
    keys = ApiKeys.one(api_key) if isinstance(api_key, str) else api_key

    def authorise(request: Request) -> Key | None:
        if keys is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" and "x-api-key" in request.headers:
            scheme, given = "bearer", request.headers["x-api-key"]
        key = keys.match(given.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            raise APIError(
                401,
                "a valid API key is required: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key",
            )
        return key

    return authorise


def _client(request: Request, key: Key | None = None, by_key: bool = False) -> str:
    """Who the request counts as for the per-client limits: with a key file (`by_key`), its key; else its address
    (the Guard has already put a trusted proxy's forwarded address here)."""
    if by_key and key is not None:
        return f"key {key.name}"
    return request.client.host if request.client else "unknown"


def _guarded(service: Service, parsed, client: str, key: str | None, label: str, job=None) -> Iterator[Any]:
    """The job's items (`job`: the job function, `service.job` by default); the errors a user can fix as 400/429,
    anything else logged and answered with a 500. Beyond its client's share the job waits its turn (it was admitted
    by the gate)."""
    items = service.runner.run(
        job or service.job,
        parsed,
        key,
        label=label,
        client=client,
        wait=True,
        shared=service.batched,
    )
    metrics, running = service.metrics, False
    try:
        for item in items:
            if metrics is not None and not running and not isinstance(item, Waiting):
                running = True  # its job started on the worker (GET /metrics counts it running until it ends)
                metrics.began()
            yield item
    except (APIError, GeneratorExit):
        raise
    except Busy as err:
        raise RetryLater(429, str(err), code="too_many_requests", seconds=RETRY_FULL_S) from None
    except UserError as err:
        raise APIError(400, " ".join(str(err).split())) from None
    except Exception as err:
        log.error("an API request failed with an internal error", exc_info=err)
        raise internal() from None
    finally:
        if running:
            metrics.ended()
        items.close()


class Feed:
    """A job's items as a request reads them: the next one that says something (`Accepted`, `Delta`, `Done`),
    or what the job raised. At least every `DISCONNECT_CHECK_S` it looks whether the client is still there,
    whatever arrives (a whole reply mostly receives deltas), and whether the queue has held it too long."""

    def __init__(self, request: Request, items: Iterator[Any], wait_s: float | None):
        self.request, self.items, self.wait_s = request, items, wait_s
        self._checked = self._said = time.monotonic()
        self._loop, self._ready, self._arrived = asyncio.get_running_loop(), deque(), asyncio.Event()
        self._stop = threading.Event()
        threading.Thread(target=self._pump, name="uag-feed", daemon=True).start()

    def _pump(self) -> None:
        """On a thread of its own, the job's items into `_ready` as they come (its generator blocks between them), then
        `_END`, or what it raised. A hop to a worker thread for every item (anyio's `run_sync`) cost the event loop
        about as much per token as the MLX worker's own Python spent, holding the GIL beside the worker; a wake-up per
        item is what is left (docs/results.md, br). Closed by `close`, at its next item: within a heartbeat, since a
        quiet job says `Tick`."""
        try:
            for item in self.items:
                if not self._post(item) or self._stop.is_set():
                    return
            self._post(_END)
        except BaseException as err:  # the job's error, or a user's (RetryLater, APIError): `next` raises it
            self._post(_Raised(err))
        finally:
            self.items.close()  # cancels the job when it is not done (a held or queued job never starts)

    def _post(self, item: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._arrive, item)
            return True
        except RuntimeError:  # the event loop is closed (the server stopped): nobody reads on
            return False

    def _arrive(self, item: Any) -> None:  # on the event loop
        self._ready.append(item)
        self._arrived.set()

    async def next(self, quiet_s: float | None = None) -> Any:
        """The next item that says something; with `quiet_s`, also a `Tick` once nothing has for that long. Deltas
        waiting together come as one (a stream behind its tokens catches up in one event, not one per token)."""
        while True:
            while not self._ready:
                self._arrived.clear()
                await self._arrived.wait()
            item = self._ready.popleft()
            if item is _END or isinstance(item, _Raised):
                self._ready.appendleft(item)  # what ended the job, again to any later call
                if item is _END:
                    raise RuntimeError("the job ended without a final item")
                raise item.error
            while isinstance(item, Delta) and self._ready and isinstance(self._ready[0], Delta):
                item = Delta(item.text + self._ready.popleft().text)
            if isinstance(item, Waiting) and self.wait_s is not None and item.seconds > self.wait_s:
                waited = f"this request waited {item.seconds:.0f} s for the model worker"
                raise RetryLater(
                    503,
                    f"the server is overloaded: {waited}; retry later",
                    code="overloaded",
                    seconds=RETRY_OVERLOADED_S,
                )
            if time.monotonic() - self._checked >= DISCONNECT_CHECK_S:
                self._checked = time.monotonic()
                if await self.request.is_disconnected():
                    raise Disconnected
            if isinstance(item, (Accepted, Delta, Done)) or (
                isinstance(item, Tick) and quiet_s is not None and time.monotonic() - self._said >= quiet_s
            ):
                self._said = time.monotonic()
                return item

    def close(self) -> None:
        """Stop reading the job: its generator is closed at its next item, which cancels the job when it is not done."""
        self._stop.set()


@dataclass(frozen=True)
class _Raised:
    """What a job's items raised, on its way to the request that reads them."""

    error: BaseException


async def stream(
    request: Request, reply: Reply, feed: Feed, first: Any, leave: Callable[[], None]
) -> AsyncIterator[bytes]:
    """The SSE body as the dialect frames it: its opening, the content deltas, its closing (finish reason, tool
    calls, usage). An error after the stream started is the dialect's one error event, and the stream ends. A
    dialect whose reply has a `keepalive` event (Anthropic's ping) sends it whenever the stream has been quiet for
    `KEEPALIVE_S`: clients drop a stream silent for minutes (Claude Code after 3), and a long prompt read is."""
    keepalive = getattr(reply, "keepalive", None)
    try:
        for part in reply.opening(first):
            yield part
        item = first
        while not isinstance(item, Done):
            if isinstance(item, Delta):
                for part in reply.delta(item.text):
                    yield part
            elif isinstance(item, Tick):
                yield keepalive
            item = await feed.next(KEEPALIVE_S if keepalive else None)
        note_served(request.scope, item.report)
        for part in reply.closing(item):
            yield part
    except APIError as err:
        yield reply.failed(err)
    except Disconnected:
        return
    except Exception as err:
        log.error("a streamed request failed with an internal error", exc_info=err)
        yield reply.failed(internal())
    finally:
        feed.close()  # cancels the job when the client left early
        leave()


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, at most `limit` bytes (413 beyond it, also when Content-Length lies or is absent);
    Disconnected when the client leaves before sending all of it. The rest of a body over the limit is read and
    dropped (up to `DRAIN_BYTES`) before the 413: most clients read nothing until they have sent all of it, and a
    connection closed under them would be a reset, not the 413."""
    declared = request.headers.get("content-length")
    over = declared is not None and declared.isdigit() and int(declared) > limit
    if over and request.headers.get("expect", "").lower() == "100-continue":
        raise _too_large(limit)  # the client waits for a go-ahead before sending its body: it sends none
    data, dropped = bytearray(), 0
    try:
        async for part in request.stream():
            if not over:
                data += part
                over = len(data) > limit
            dropped += len(part) if over else 0
            if dropped > DRAIN_BYTES:
                break  # a client that sends this much over the limit may find its connection closed
    except ClientDisconnect:
        raise Disconnected from None
    if over:
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
    return APIError(
        413, f"the request body is over this server's limit of {limit / 2**20:g} MB", code="request_too_large"
    )
