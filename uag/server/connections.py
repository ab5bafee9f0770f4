"""Connections bounded, for a server people leave running: uvicorn's h11 protocol with the two limits it lacks.

An idle TCP connection holds a file descriptor whether or not it ever sends a request, and uvicorn neither caps
open connections (`limit_concurrency` only answers 503 to requests) nor times out one that has not sent its
headers. `BoundedH11Protocol` keeps at most `max_connections` open, closing the longest-idle one (no request in
flight) to let a new one in, and closes a connection that has not sent a whole request head `idle_timeout_s`
after it opened or after its last response. `server_config` builds uvicorn's Config with it.

    uvicorn.Server(server_config(app, host="127.0.0.1", port=8000, max_connections=768)).run()
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from uag.server.logs import quiet_repeats

log = logging.getLogger(__name__)  # quiet_repeats: each condition once a minute

DEFAULT_IDLE_TIMEOUT_S = 15.0  # to send a request's head; after a response uvicorn's keep-alive (5 s) closes first
MAX_DEFAULT_CONNECTIONS = 1024  # one MLX worker serves requests in turn: more connections only wait
SHUTDOWN_S = 5  # on Ctrl-C, open streams (an app tab's event stream, a reply) get this long, then are closed
FD_RESERVE = 256  # open files kept for the process beside connections: models, logs, uploads, threads


def raise_fd_limit() -> int | None:
    """Raise this process's soft limit on open files to its hard limit; the soft limit now (None: not POSIX).

    Example: soft 1024, hard 1048576 -> 1048576 (macOS, hard unlimited: 10240, its OPEN_MAX)
    """
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    if soft == infinite:
        return 1 << 20
    for wanted in (hard, 10240) if hard != infinite else (10240,):
        if wanted <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            continue
        return wanted
    return soft


def default_max_connections(fd_limit: int | None) -> int:
    """Open connections allowed under an open-file limit, leaving files for the rest of the process.

    Example: 1024 -> 768;  256 -> 192;  1048576 -> 1024;  None -> 1024
    """
    if fd_limit is None:
        return MAX_DEFAULT_CONNECTIONS
    return max(16, min(MAX_DEFAULT_CONNECTIONS, fd_limit - min(FD_RESERVE, fd_limit // 4)))


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a cap on open connections and a timeout for a request's head (the module
    docstring says how). `server_config` makes a subclass with the server's numbers."""

    max_connections: int = MAX_DEFAULT_CONNECTIONS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since = self.loop.time()
        if len(self.connections) > self.max_connections and not self._close_longest_idle():
            log.warning(
                "open connections are at --max-connections (%d) and every one has a request in flight: "
                "new connections are closed",
                self.max_connections,
            )
            transport.abort()
            return
        self._wait_for_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._busy or self.transport.get_protocol() is not self:  # a request in flight, or now a WebSocket's
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._busy and not self.transport.is_closing():
            self._idle_since = self.loop.time()
            self._wait_for_request()

    @property
    def _busy(self) -> bool:
        """A request's head has arrived and its response is not finished."""
        return self.cycle is not None and not self.cycle.response_complete

    def _wait_for_request(self) -> None:
        self._stop_waiting()
        self._idle_timer = self.loop.call_later(self.idle_timeout_s, self._too_slow)

    def _stop_waiting(self) -> None:
        timer, self._idle_timer = getattr(self, "_idle_timer", None), None
        if timer is not None:
            timer.cancel()

    def _too_slow(self) -> None:
        self._idle_timer = None
        if not self._busy and not self.transport.is_closing():
            self.transport.close()

    def _close_longest_idle(self) -> bool:
        """Close the open connection idle longest (no request in flight) to make room; False when none is idle."""
        idle = [
            c
            for c in self.connections
            if isinstance(c, BoundedH11Protocol) and c is not self and not c._busy and not c.transport.is_closing()
        ]
        if not idle:
            return False
        log.warning(
            "open connections reached --max-connections (%d): closing the longest idle to let new ones in",
            self.max_connections,
        )
        min(idle, key=lambda c: c._idle_since).transport.abort()
        return True


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    max_connections: int = MAX_DEFAULT_CONNECTIONS,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's Config for `uag serve`: bounded connections, forwarded headers left to uag.server.guards (uvicorn's
    own would believe 127.0.0.1), uag's logging (no uvicorn access log), repeated errors once a minute, and a
    shutdown that does not wait forever for a connected app tab."""
    if max_connections < 1 or not idle_timeout_s > 0:
        raise ValueError(
            f"max_connections must be at least 1 and idle_timeout_s above 0 (got {max_connections}, {idle_timeout_s})"
        )
    protocol = type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {"max_connections": max_connections, "idle_timeout_s": idle_timeout_s},
    )
    quiet_repeats()
    settings = {
        "log_level": "warning",
        "log_config": None,
        "access_log": False,
        "proxy_headers": False,
        "timeout_graceful_shutdown": SHUTDOWN_S,
        **options,
    }
    return uvicorn.Config(app, host=host, port=port, http=protocol, **settings)
