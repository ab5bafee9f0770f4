"""The server's front door, as pure ASGI over the whole app (the API and the app at /ui): same-origin by default.

A browser page from another site may send "simple" requests (a text/plain POST) without asking, and a name of its
own that resolves to 127.0.0.1 (DNS rebinding) reaches a loopback server. So the `Guard` refuses a Host that is not
this server's (`Perimeter.host_allowed`), an unsafe request whose Origin is another site's, and an API POST that is
not JSON; it reads forwarded addresses only from trusted proxies, and makes wrong keys cost time (`KeyBackoff`).

    Perimeter().host_allowed("localhost:8000") -> True;  Perimeter().host_allowed("evil.example:8000") -> False
"""

from __future__ import annotations

import ipaddress
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import anyio
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from uag.errors import InputError
from uag.runtime.access import client_of, is_trusted
from uag.server.errors import APIError

log = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
UNSAFE = ("POST", "PUT", "PATCH", "DELETE")
API_PREFIX = "/v1/"
LOGIN_PATHS = ("/ui/login", "/ui/login/")  # Gradio's login form: 200 when the password is right, 400 when not
FREE_FAILURES = 5  # wrong keys a client may send before each further try costs time
FIRST_WAIT_S = 1.0
MAX_WAIT_S = 300.0


def _name(host: str) -> str:
    """A Host header's (or URL netloc's) name, lower case, without port or brackets.

    Example: "[::1]:8000" -> "::1";  "Example.COM:80" -> "example.com";  "localhost." -> "localhost"
    """
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


def _loopback(name: str) -> bool:
    """Example: "localhost", "app.localhost", "127.0.0.1", "::1" -> True;  "0.0.0.0", "example.com" -> False"""
    if name == "localhost" or name.endswith(".localhost"):  # browsers resolve *.localhost to loopback themselves
        return True
    ip = _ip(name)
    return ip is not None and ip.is_loopback


@dataclass(frozen=True)
class Perimeter:
    """Who may talk to the server, and from which pages: the address it is bound to, the names the operator allows
    (`--allowed-host`, "*.example.com" for any subdomain), the origins that may read its answers across sites
    (`--cors-origin`, "*" for any) and the proxies whose forwarded addresses are believed (`--trusted-proxy`)."""

    bind: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    trusted_proxies: tuple[Network, ...] = ()

    @classmethod
    def parse(
        cls,
        bind: str,
        allowed_hosts: Iterable[str] = (),
        cors_origins: Iterable[str] = (),
        trusted_proxies: Iterable[str] = (),
    ) -> Perimeter:
        """From the command line's texts; InputError naming every bad one."""
        problems, networks, origins = [], [], []
        for text in trusted_proxies:
            try:
                networks.append(ipaddress.ip_network(text.strip(), strict=False))
            except ValueError:
                problems.append(f"--trusted-proxy {text!r} is not an IP address or network (e.g. 10.0.0.5, 10.0.0.0/8)")
        for text in cors_origins:
            origin = text.strip().rstrip("/")
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
                problems.append(
                    f"--cors-origin {text!r} is not an origin: scheme://host[:port], e.g. "
                    "https://chat.example.com, or *"
                )
            origins.append(origin)
        allowed_hosts = [h.strip() for h in allowed_hosts]
        for text in allowed_hosts:
            if not text or "/" in text or "@" in text:
                problems.append(
                    f"--allowed-host {text!r} is not a host name: write it as clients do, without "
                    "scheme or path (e.g. uag.example.com)"
                )
        hosts = tuple(h.lower() if h.startswith("*.") else _name(h) for h in allowed_hosts)
        if problems:
            raise InputError("; ".join(problems))
        return cls(bind, hosts, tuple(origins), tuple(networks))

    @property
    def any_host(self) -> bool:
        """Bound beyond loopback with no --allowed-host: clients may use any name for this machine (the API key,
        required there, protects it)."""
        return not self.allowed_hosts and not _loopback(_name(self.bind))

    def _named(self, name: str) -> bool:
        """Whether `name` is loopback, the bound address or an allowed host."""
        if _loopback(name) or name == _name(self.bind):
            return True
        return any(name == h or (h.startswith("*.") and name.endswith(h[1:])) for h in self.allowed_hosts)

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request's Host header names this server (with any port). An IP address always does: DNS
        rebinding needs a name. No Host at all (HTTP/1.0) is no browser's; an empty one names nothing (HTTP/1.1
        refuses it), bound anywhere.

        Example: Perimeter().host_allowed("127.0.0.1:8000") -> True;  ("rebind.example") -> False;  ("") -> False
        """
        if host is None:
            return True
        name = _name(host)
        if not name:
            return False
        if self.any_host:
            return True
        return self._named(name) or _ip(name) is not None

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        """Whether a page from `origin` may send this request: the server's own pages (the Origin names the Host
        it is sent to), a loopback or allowed name, or a --cors-origin. "null" (a sandboxed page, a file) never.

        Example: origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000") -> True
                 origin_allowed("https://evil.example", "127.0.0.1:8000") -> False
        """
        origin = origin.strip().rstrip("/")
        if "*" in self.cors_origins or origin in self.cors_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False
        if host and parts.netloc.lower() == host.strip().lower():
            return True
        return self._named(_name(parts.netloc))

    def is_proxy(self, address: str) -> bool:
        return is_trusted(address, self.trusted_proxies)


class KeyBackoff:
    """Wrong keys cost time, right ones nothing: after a client's `free` wrong keys, the answer to each further one
    is held `first_s` · 2^(wrong − free − 1), at most `cap_s`, and its held answers go out one after another, so that
    guessing in parallel gains nothing. A right key is answered at once and does not clear the count: on loopback
    every local process is one client, so a wait on the address would let any of them lock the key holder out, and
    the holder's requests would reset a guesser's count. A client quiet for `cap_s` after its last answer is
    forgotten.

    Example: free=5, first_s=1: wrong keys 1–5 -> answered at once; the 6th -> after 1 s; the 7th -> 2 s; … 300 s
    """

    def __init__(
        self,
        *,
        free: int = FREE_FAILURES,
        first_s: float = FIRST_WAIT_S,
        cap_s: float = MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ):
        self.free, self.first_s, self.cap_s, self.clock, self.max_clients = free, first_s, cap_s, clock, max_clients
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # client -> (failures, may retry at)
        self._lock = threading.Lock()

    def failed(self, client: str) -> float:
        """Count a wrong key from `client`; the seconds its answer is held (0: none)."""
        now = self.clock()
        with self._lock:
            count, last = self._failures.pop(client, (0, 0.0))
            if now - last > self.cap_s:  # quiet long enough: forgotten
                count = 0
            count += 1
            wait = 0.0 if count <= self.free else min(self.first_s * 2 ** min(count - self.free - 1, 32), self.cap_s)
            hold = min(max(last - now, 0.0) + wait, self.cap_s) if wait else 0.0  # after its earlier held answers
            self._failures[client] = (count, now + hold)  # (wrong keys, when the last answer goes out)
            while len(self._failures) > self.max_clients:  # the longest quiet first
                self._failures.popitem(last=False)
        return hold


class RetryLater(APIError):
    """A 429 or 503 that says when to retry (the Retry-After header, in whole seconds)."""

    def __init__(self, status: int, message: str, *, code: str, seconds: float):
        super().__init__(status, message, code=code)
        self.retry_after = seconds


def answer(
    err: APIError, *, retry_s: float | None = None, shape: Callable[[APIError], dict] | None = None
) -> JSONResponse:
    """The API's error object as a response (`shape`: the dialect's, OpenAI's by default). A `RetryLater` says when
    to retry (`Retry-After`, whole seconds); so does any other 429 or 503 where `retry_s` is given."""
    retry = getattr(err, "retry_after", retry_s if err.status in (429, 503) else None)
    headers = {"Retry-After": str(max(1, math.ceil(retry)))} if retry is not None else None
    return JSONResponse(err.body() if shape is None else shape(err), status_code=err.status, headers=headers)


class Guard:
    """ASGI middleware over the whole app. In order: the real client (from a trusted proxy's forwarded address),
    the Host, the Origin of an unsafe request, JSON for API POSTs; then the app, with trailing slashes of API paths
    dropped, the answers to wrong keys held (`KeyBackoff`: a 401, or a 400 from the app's login form, where the key
    is the password), and a client that leaves mid-body let go quietly."""

    def __init__(self, app: Callable, *, perimeter: Perimeter, backoff: KeyBackoff):
        self.app, self.perimeter, self.backoff = app, perimeter, backoff

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        peer = scope.get("client")
        if peer and self.perimeter.trusted_proxies and self.perimeter.is_proxy(peer[0]):
            scope["client"] = (client_of(peer[0], headers, trusted_proxies=self.perimeter.trusted_proxies), 0)
        refusal = self.refusal(scope, headers)
        if refusal is not None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                await refusal(scope, receive, send)
            return
        path = scope["path"]
        if scope["type"] == "http" and path.endswith("/") and (path.startswith(API_PREFIX) or path == "/health/"):
            scope["path"] = path.rstrip("/")  # OpenAI clients differ on the slash: answer both, never 307
            scope["raw_path"] = (scope.get("raw_path") or path.encode()).rstrip(b"/")
        login = scope["type"] == "http" and scope["method"] == "POST" and path in LOGIN_PATHS
        if login or (scope["type"] == "http" and not path.startswith("/ui")):  # /ui's other 401s are no key tried
            client = scope["client"][0] if scope.get("client") else "unknown"
            send = HoldingWrongKeys(send, self.backoff, client, wrong=400 if login else 401)
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:  # the client left while its body was read: nobody to answer, nothing to log
            log.debug("%s %s: the client left before sending its whole body", scope.get("method"), path)

    def refusal(self, scope, headers: Headers) -> JSONResponse | None:
        """The answer that refuses this request at the door, or None to let it in."""
        host = headers.get("host")
        if not self.perimeter.host_allowed(host):
            named = f"the name {_name(host or '')[:100]!r}" if _name(host or "") else "an empty Host header"
            return answer(
                APIError(
                    403,
                    f"this server does not answer to {named}: use "
                    "its address, localhost, or a name its operator allows (--allowed-host)",
                    code="host_not_allowed",
                )
            )
        method = scope.get("method", "GET")
        origin = headers.get("origin")
        if (method in UNSAFE or scope["type"] == "websocket") and origin is not None:
            if not self.perimeter.origin_allowed(origin, host):
                return answer(
                    APIError(
                        403,
                        f"requests from pages of {origin[:100]!r} are refused: this server "
                        "answers its own pages, and the origins its operator allows (--cors-origin)",
                        code="origin_not_allowed",
                    )
                )
        if method == "POST" and scope["path"].startswith(API_PREFIX):
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return answer(
                    APIError(
                        415,
                        f"the request body must be JSON: send 'Content-Type: application/json'"
                        f" (got {kind[:60] or 'none'!r})",
                        code="unsupported_media_type",
                    )
                )
        return None


class HoldingWrongKeys:
    """An ASGI `send` that holds the answer to a wrong key (a response with status `wrong`) for as long as the
    client's `KeyBackoff` says, and passes everything else on at once."""

    def __init__(self, send: Callable, backoff: KeyBackoff, client: str, wrong: int):
        self.send, self.backoff, self.client, self.wrong = send, backoff, client, wrong

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start" and message["status"] == self.wrong:
            if (hold := self.backoff.failed(self.client)) > 0:
                await anyio.sleep(hold)
        await self.send(message)
