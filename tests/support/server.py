"""`uag serve` in-process on a free port (uvicorn in a thread), for the server tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.app_server import free_port


def serve_args(*argv: str):
    """`uag serve`'s command line parsed and checked (a `ServeSettings`, what `build` takes)."""
    from uag.server.main import ServeSettings, build_parser

    return ServeSettings.parse(build_parser().parse_args(list(argv)))


@contextmanager
def serving(app, **limits) -> Iterator[str]:
    """`app` at http://127.0.0.1:<free port> while the block runs, configured as `uag serve` configures uvicorn
    (`limits`: max_connections, idle_timeout_s)."""
    import uvicorn

    from uag.server.connections import server_config

    port = free_port()
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port, lifespan="on", **limits))
    thread = threading.Thread(target=server.run, name="uag-serve-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def until(condition, timeout_s: float = 120.0) -> None:
    """Wait until `condition()` holds; a bound on the wait, not a claim about speed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there"
        time.sleep(0.02)


@contextmanager
def held(service):
    """The server's worker busy with a job of the test's while the block queues requests; they start when it ends."""
    gate = threading.Event()

    def hold(job):
        gate.wait(300)
        yield "released"

    holder = service.runner.worker.submit(hold, label="the test holds the worker")
    until(holder.started.is_set)
    try:
        yield
    finally:
        gate.set()
        assert list(holder) == ["released"]
