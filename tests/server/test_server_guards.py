"""`uag serve`'s HTTP layer as a service people leave running, on a fake Service (no model): bounded connections,
same-origin by default, forwarded addresses only from trusted proxies, a client's requests beyond its share waiting
their turn, failed keys costing time, one log line per request, and what operators expect of the routes."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import closing

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tests.support.server import serving
from uag.runtime.jobs import JobRunner
from uag.runtime.worker import MLXWorker
from uag.server.guards import KeyBackoff, Perimeter
from uag.server.logs import TEXT_FORMAT, JSONLines, PrintableText, QuietRepeats, request_fields, request_line
from uag.server.protocol import ModelRouter, ServerDefaults
from uag.server.routes import create_app
from uag.server.service import Accepted, Delta, Done

KEY = "a-test-key-of-24-chars!!"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hej"}], "max_tokens": 4}
LOCAL = "http://127.0.0.1:8000"
REPORT = {
    "usage": {
        "prompt_tokens": 35,
        "completion_tokens": 64,
        "total_tokens": 99,
        "prompt_tokens_details": {"cached_tokens": 20},
    },
    "speculative": {"drafter": "lookup", "acceptance_rate": 0.71, "estimated_speedup": 1.4},
    "timings": {"predicted_ms": 2000.0, "predicted_per_second": 32.0},
}


class FakeService:
    """What the HTTP layer needs of `Service`: a runner, the defaults, its metrics (none) and a job. The job answers
    "Hej" at once, or waits for `release` first, or (with `forever`) sends deltas until it is cancelled."""

    metrics = None  # GET /metrics is tested in test_server_metrics.py

    def __init__(self, runner: JobRunner):
        self.runner, self.defaults = runner, ServerDefaults(model=MODEL, drafter=None)
        self.router = ModelRouter((self.defaults,))  # the one model it serves
        self.batched = runner.worker.max_batch > 1
        self.release, self.started, self.cancelled = threading.Event(), threading.Event(), threading.Event()
        self.release.set()
        self.forever = False
        self.doing: str | None = None  # what `starting` says (None: start-up finished)

    def starting(self) -> str | None:
        return self.doing

    def job(self, job, parsed, key: str | None = None) -> Iterator:
        self.started.set()
        yield Accepted(3)
        while self.forever and not job.cancelled.is_set():
            yield Delta("x")
            time.sleep(0.01)
        if job.cancelled.is_set():
            self.cancelled.set()
            return
        self.release.wait(30)
        yield Delta("Hej")
        yield Done("Hej", "stop", REPORT)


@pytest.fixture
def fake():
    worker = MLXWorker(name="test-guards")
    yield FakeService(JobRunner(worker, per_client=2, heartbeat_s=0.05))
    worker.close(timeout=10)


def _ui() -> Starlette:
    """A stand-in for the Gradio app at /ui: a JSON route, and a login form that takes the key as password."""

    async def run(_request):
        return JSONResponse({"ok": True})

    async def login(request):
        form = await request.form()
        return JSONResponse(
            {"success": True} if form.get("password") == KEY else {"detail": "no"},
            status_code=200 if form.get("password") == KEY else 400,
        )

    return Starlette(routes=[Route("/gradio_api/run", run, methods=["POST"]), Route("/login", login, methods=["POST"])])


def _app(fake, **options):
    app = create_app(fake, api_key=KEY, **options)
    app.mount("/ui", _ui())
    return app


# --- same origin ------------------------------------------------------------------------------------------------
def test_a_cross_site_text_plain_post_is_refused(fake):
    http = TestClient(_app(fake), base_url=LOCAL)
    # what a page on another site can send without asking (a CORS "simple" request): text/plain, its own Origin
    response = http.post(
        "/v1/chat/completions",
        content=json.dumps(CHAT),
        headers={**AUTH, "Content-Type": "text/plain", "Origin": "https://evil.example"},
    )
    assert response.status_code == 403 and response.json()["error"]["code"] == "origin_not_allowed"
    response = http.post(
        "/v1/chat/completions", content=json.dumps(CHAT), headers={**AUTH, "Content-Type": "text/plain"}
    )
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"
    assert not fake.started.is_set()


def test_a_foreign_host_is_refused_dns_rebinding(fake):
    http = TestClient(_app(fake), base_url="http://rebind.attacker.example:8000")
    for path in ("/health", "/v1/models", "/ui/gradio_api/run"):
        response = http.get(path, headers=AUTH)
        assert response.status_code == 403 and response.json()["error"]["code"] == "host_not_allowed", path
    assert "rebind.attacker.example" in response.json()["error"]["message"]


def test_an_empty_host_is_refused_as_a_foreign_one(fake):
    with serving(_app(fake)) as url, closing(_connect(url)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: \r\n\r\n")
        answer = sock.recv(4096)
        while not answer.endswith(b"}"):  # the JSON body may come apart from the head
            answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 403 ") and b"an empty Host header" in answer


def test_a_foreign_origin_post_to_the_app_is_refused(fake):
    http = TestClient(_app(fake), base_url=LOCAL)
    refused = http.post("/ui/gradio_api/run", json={"data": []}, headers={"Origin": "https://evil.example"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
    for origin in (LOCAL, "http://localhost:3000", None):  # its own pages, another local page, no browser at all
        headers = {"Origin": origin} if origin else {}
        assert http.post("/ui/gradio_api/run", json={"data": []}, headers=headers).json() == {"ok": True}, origin
    assert http.post("/ui/gradio_api/run", json={}, headers={"Origin": "null"}).status_code == 403  # a sandboxed page


@pytest.mark.parametrize(
    "bind, allowed, host, ok",
    [
        ("127.0.0.1", (), "127.0.0.1:8000", True),
        ("127.0.0.1", (), "localhost:8000", True),
        ("127.0.0.1", (), "[::1]:8000", True),
        ("127.0.0.1", (), "evil.example:8000", False),
        ("127.0.0.1", ("uag.example.com",), "UAG.example.com", True),
        ("127.0.0.1", ("*.example.com",), "a.example.com:443", True),
        ("127.0.0.1", ("*.example.com",), "example.com.evil:443", False),
        ("0.0.0.0", (), "my-mac.local:8000", True),  # beyond loopback, no --allowed-host: the key protects it
        ("0.0.0.0", ("uag.example.com",), "my-mac.local:8000", False),
        ("0.0.0.0", ("uag.example.com",), "192.168.1.5:8000", True),  # an address is never a rebinding
        ("my-mac.local", ("uag.example.com",), "my-mac.local:8000", True),  # the name it is bound to
        ("127.0.0.1", (), "", False),  # an empty Host names nothing (HTTP/1.1 refuses it), bound anywhere
        ("0.0.0.0", (), " ", False),
        ("0.0.0.0", (), ":8000", False),
        ("127.0.0.1", (), None, True),  # none at all: HTTP/1.0, no browser's
    ],
)
def test_the_host_rule(bind, allowed, host, ok):
    assert Perimeter.parse(bind, allowed).host_allowed(host) is ok


def test_cors_is_off_unless_an_origin_is_given(fake):
    preflight = {
        "Origin": "https://chat.example.com",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    closed = TestClient(_app(fake), base_url=LOCAL)
    assert "access-control-allow-origin" not in closed.options("/v1/chat/completions", headers=preflight).headers
    opened = TestClient(
        _app(fake, perimeter=Perimeter.parse("127.0.0.1", cors_origins=["https://chat.example.com"])), base_url=LOCAL
    )
    answer = opened.options("/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://chat.example.com"
    posted = opened.post("/v1/chat/completions", json=CHAT, headers={**AUTH, "Origin": "https://chat.example.com"})
    assert posted.status_code == 200 and posted.headers["access-control-allow-origin"] == "https://chat.example.com"


def test_bad_perimeter_flags_are_named():
    from uag.errors import InputError

    with pytest.raises(
        InputError,
        match="--trusted-proxy 'proxy' is not an IP.*--cors-origin 'chat.example.com' is "
        "not an origin.*--allowed-host 'https://uag.example.com' is not a host name",
    ):
        Perimeter.parse("127.0.0.1", ["https://uag.example.com"], ["chat.example.com"], ["proxy"])


# --- who a request counts as --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "peer, trusted, counted", [("198.51.100.7", (), "198.51.100.7"), ("10.0.0.1", ("10.0.0.0/8",), "203.0.113.9")]
)
def test_forwarded_addresses_are_read_only_from_a_trusted_proxy(fake, caplog, peer, trusted, counted):
    perimeter = Perimeter.parse("0.0.0.0", trusted_proxies=trusted)
    http = TestClient(_app(fake, perimeter=perimeter), base_url=LOCAL, client=(peer, 40000))
    caplog.set_level(logging.INFO, logger="uag.server")
    assert http.get("/v1/models", headers={**AUTH, "X-Forwarded-For": "203.0.113.9"}).status_code == 200
    (record,) = [r for r in caplog.records if r.name == "uag.server"]
    assert record.request["client"] == counted


# --- failed keys cost time ---------------------------------------------------------------------------------------
def test_key_backoff_holds_wrong_answers_longer_one_after_another_and_forgets():
    now = [0.0]
    backoff = KeyBackoff(free=3, first_s=1, cap_s=8, clock=lambda: now[0])
    holds = []
    for _ in range(8):  # one after another: each waits out its answer
        holds.append(backoff.failed("a"))
        now[0] += holds[-1]
    assert holds == [0, 0, 0, 1, 2, 4, 8, 8] and backoff.failed("b") == 0
    now[0] += 8.5  # quiet for cap_s after its last answer: forgotten
    assert backoff.failed("a") == 0
    at_once = KeyBackoff(free=3, first_s=1, cap_s=8, clock=lambda: now[0])
    assert [at_once.failed("a") for _ in range(8)] == [0, 0, 0, 1, 3, 7, 8, 8]  # in parallel: answered in turn


def _held(call) -> tuple[threading.Thread, list]:
    """`call()` in a thread (a wrong key whose answer is held); the thread and, once it is done, its status."""
    status: list = []
    thread = threading.Thread(target=lambda: status.append(call().status_code), daemon=True)
    thread.start()
    return thread, status


def test_a_right_key_always_passes_and_only_wrong_ones_wait_also_at_the_app_login(fake):
    """On loopback every local process is one client: wrong keys from it must not lock the key holder out. The
    answer to a wrong key is held (here 2 s after the first); a right key is answered meanwhile, and does not
    clear the count either."""
    http = TestClient(_app(fake, backoff=KeyBackoff(free=1, first_s=2)), base_url=LOCAL)
    wrong = {"Authorization": "Bearer nope"}
    assert http.get("/v1/models", headers=wrong).status_code == 401  # the free one: answered at once
    guess, status = _held(lambda: http.get("/v1/models", headers=wrong))
    time.sleep(0.2)
    assert http.get("/v1/models", headers=AUTH).status_code == 200 and guess.is_alive()
    assert http.post("/ui/login", data={"username": "x", "password": KEY}).status_code == 200 and guess.is_alive()
    guess.join(30)
    assert status == [401]
    login, status = _held(lambda: http.post("/ui/login", data={"username": "x", "password": "no"}))  # held 4 s
    time.sleep(0.2)
    assert http.get("/v1/models", headers=AUTH).status_code == 200 and login.is_alive()
    login.join(30)
    assert status == [400]


# --- routes as operators expect ------------------------------------------------------------------------------------
def test_health_head_trailing_slashes_and_one_model(fake):
    http = TestClient(_app(fake), base_url=LOCAL, follow_redirects=False)
    assert http.head("/health").status_code == 200 and http.get("/health/").json() == {"status": "ok", "ready": True}
    fake.doing = "measuring auto's costs (stops for a request)"  # start-up not finished: requests are served
    assert http.get("/health").json() == {"status": "ok", "ready": False, "starting": fake.doing}
    assert http.get("/v1/models/", headers=AUTH).json()["data"][0]["id"] == MODEL
    assert http.get(f"/v1/models/{MODEL}", headers=AUTH).json()["id"] == MODEL
    missing = http.get("/v1/models/gpt-4o", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert http.get("/v1/models/gpt-4o").status_code == 401
    answer = http.post("/v1/chat/completions/", json=CHAT, headers=AUTH)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "Hej"


def test_one_log_line_per_request_as_text_and_as_json(fake, caplog):
    http = TestClient(_app(fake), base_url=LOCAL)
    caplog.set_level(logging.INFO, logger="uag.server")
    http.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    http.get("/health")
    generation, health = [r for r in caplog.records if r.name == "uag.server"]
    line = generation.getMessage()
    assert line.startswith("POST /v1/chat/completions 200 testclient ")
    assert "prompt 35 (20 cached), generated 64 at 32.0 tok/s | drafter lookup, α 0.71, saved 0.80 s" in line
    assert health.getMessage().startswith("GET /health 200 testclient")
    entry = json.loads(JSONLines().format(generation))
    assert entry["logger"] == "uag.server" and entry["status"] == 200 and entry["saved_s"] == pytest.approx(0.8)
    assert (entry["prompt_tokens"], entry["cached_tokens"], entry["generated_tokens"]) == (35, 20, 64)
    assert request_line(request_fields("GET", "/x", None, "a", 0.5)) == "GET /x - a 0.50 s"


def test_a_path_cannot_forge_a_log_line_or_reach_the_terminal(fake, caplog):
    """No key needed: every refusal is logged, so a web page's <img> could send this path. Its line break, ESC and
    C1 CSI, and bidi override come out escaped, in the record's fields, the text line and the JSON line alike."""
    http = TestClient(_app(fake), base_url=LOCAL)
    caplog.set_level(logging.INFO, logger="uag.server")
    http.get("/v1/x%0a[uag] INFO uag.server: POST /v1/chat/completions 200%1b[2J%c2%9b31m%e2%80%ae")
    (record,) = [r for r in caplog.records if r.name == "uag.server"]
    lines = [PrintableText(TEXT_FORMAT).format(record), JSONLines().format(record), record.request["path"]]
    for line in lines:
        assert "\n" not in line and "\x1b" not in line and "\x9b" not in line and "\u202e" not in line, line
    assert "/v1/x\\n[uag] INFO uag.server: POST /v1/chat/completions 200\\x1b[2J\\x9b31m\\u202e 404" in lines[0]
    assert json.loads(lines[1])["path"] == record.request["path"]
    error = logging.LogRecord("uag.core.grammar", logging.WARNING, "f", 1, "the grammar (%s) gave up", ("a\nb",), None)
    assert PrintableText(TEXT_FORMAT).format(error).endswith("the grammar (a\\nb) gave up")  # any record's text


def test_repeated_errors_are_logged_once_a_minute():
    now = [0.0]
    quiet = QuietRepeats(60, clock=lambda: now[0])
    error = OSError(24, "Too many open files")

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, (OSError, error, None))

    passed = [quiet.filter(record("socket.accept() out of system resource")) for _ in range(5000)]
    assert passed.count(True) == 1 and quiet.filter(record("another condition"))
    now[0] = 61
    again = record("socket.accept() out of system resource")
    assert quiet.filter(again) and "4999 more like this" in again.getMessage()


# --- against a real uvicorn ---------------------------------------------------------------------------------------
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Authorization: Bearer " + KEY.encode() + b"\r\n"
)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_flood_of_idle_connections_leaves_health_answering_and_the_log_quiet(fake, caplog):
    caplog.set_level(logging.WARNING)
    with serving(_app(fake), max_connections=50, idle_timeout_s=60) as url:
        flood = [_connect(url) for _ in range(300)]  # each holds a connection and never sends a byte
        try:
            health = httpx.get(url + "/health", timeout=1)
            assert health.status_code == 200
            closed = 0
            for sock in flood:
                sock.settimeout(0.01)
                try:
                    closed += sock.recv(1) == b""
                except TimeoutError:
                    pass
                except ConnectionError:
                    closed += 1
            assert closed >= 300 - 50  # the server kept at most its cap of them open
        finally:
            for sock in flood:
                sock.close()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(noisy) <= 2, [r.getMessage() for r in noisy]


def test_a_connection_that_never_finishes_its_head_is_closed(fake):
    with serving(_app(fake), idle_timeout_s=0.3) as url, closing(_connect(url)) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and nothing more (slowloris)
        assert slow.recv(1) == b""  # closed by the server (the socket's own timeout is 10 s)
        assert httpx.get(url + "/health").status_code == 200


def test_the_sdk_passes_and_four_requests_at_once_from_one_client_all_answer(fake):
    openai = pytest.importorskip("openai")
    fake.release.clear()
    with serving(_app(fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        replies = []
        threads = [
            threading.Thread(target=lambda: replies.append(client.chat.completions.create(**CHAT))) for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for _ in range(200):  # bounded, not timed: all four admitted, two queued, two held back
            if fake.runner.held("127.0.0.1") == 2:
                break
            time.sleep(0.05)
        assert fake.runner.queued("127.0.0.1") == 2 and fake.runner.held("127.0.0.1") == 2
        fifth = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=AUTH)  # half the queue (8) is one's most
        assert fifth.status_code == 429 and fifth.headers["Retry-After"] == "5"
        fake.release.set()
        for thread in threads:
            thread.join(30)
        assert [r.choices[0].message.content for r in replies] == ["Hej"] * 4


def test_a_request_that_waits_too_long_gets_503_with_retry_after(fake):
    fake.release.clear()
    with serving(_app(fake, queue_wait_s=0.2)) as url:
        first = threading.Thread(
            target=lambda: httpx.post(url + "/v1/chat/completions", json=CHAT, headers=AUTH, timeout=30)
        )
        first.start()
        while not fake.started.is_set():
            time.sleep(0.01)
        waited = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=AUTH)
        fake.release.set()
        first.join(30)
    assert waited.status_code == 503 and waited.headers["Retry-After"] == "30"


def test_a_whole_reply_is_cancelled_when_its_client_leaves(fake):
    fake.forever = True
    body = json.dumps(CHAT).encode()
    with serving(_app(fake)) as url, closing(_connect(url)) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert fake.started.wait(10)
        sock.close()  # the client leaves while its (non-streamed) reply is being generated
        assert fake.cancelled.wait(10)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_client_still_sending_a_body_over_the_limit_reads_its_413(fake, chunked):
    """A client that sends its whole body before it reads (httpx, requests) must find the 413 waiting, not a reset:
    the server reads the rest of the body and drops it. Here the client sends 3 MB over a 1 MB limit slowly
    enough to outlast the time an answered connection may wait for its next request (--idle-timeout, cut to 0.3 s
    from 15 s so that the test is quick): a server that answered at once closed it mid-body."""
    body = b'{"model": "' + b"x" * (3 * 2**20) + b'"}'
    framing = b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Content-Length: %d\r\n\r\n" % len(body)
    with serving(_app(fake, max_body=2**20), idle_timeout_s=0.3) as url, closing(_connect(url)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2**16)
        sock.sendall(HEAD + framing)
        started = time.monotonic()
        for i in range(0, len(body), 2**16):
            part = body[i : i + 2**16]
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            time.sleep(max(0.0, started + 0.02 * i / 2**16 - time.monotonic()))  # about 1 s in all
        sock.sendall(b"0\r\n\r\n" if chunked else b"")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413 ")


def test_a_client_that_leaves_mid_body_is_no_internal_error(fake, caplog):
    caplog.set_level(logging.INFO)
    with serving(_app(fake)) as url:
        with closing(_connect(url)) as sock:
            sock.sendall(HEAD + b'Content-Length: 1000\r\n\r\n{"model"')  # 8 bytes of 1000, then it leaves
        for _ in range(200):  # bounded: until the request's log line says how it ended
            if any(r.name == "uag.server" for r in caplog.records):
                break
            time.sleep(0.05)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "uag.server"]
    assert line.startswith("POST /v1/chat/completions 499 127.0.0.1")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_port_taken_binds_as_uvicorn_does_so_a_restart_finds_its_port_free():
    from uag.command import port_taken

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server closes first: its side of the connection waits in TIME_WAIT
            client.recv(1)
    assert not port_taken("127.0.0.1", port)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", port))
        holder.listen()
        assert port_taken("127.0.0.1", port)  # a server still listening is still found


def test_connection_cap_defaults_from_the_open_file_limit():
    from uag.server.connections import default_max_connections, raise_fd_limit

    assert [default_max_connections(n) for n in (1024, 256, 1048576, None)] == [768, 192, 1024, 1024]
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_fd_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= soft


def test_the_apps_assets_are_logged_quietly_and_the_api_and_refusals_loudly():
    import logging

    from uag.server.logs import level

    assert level("/v1/chat/completions", 200) == level("/health", 200) == logging.INFO
    assert level("/ui/assets/index.js", 200) == level("/", 307) == logging.DEBUG
    assert level("/ui/login", 400) == level("/ui/gradio_api/queue/join", None) == logging.INFO
