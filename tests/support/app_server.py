"""Serve the app in-process on a free port, for the API and browser tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(session) -> Iterator[str]:
    """The app for `session` at http://127.0.0.1:<free port>/ while the block runs."""
    from uag.app.ui import api_defaults, build, launch

    demo = build(session)
    url, _ = launch(demo, port=free_port(), quiet=True, defaults=api_defaults(session))
    try:
        yield url
    finally:
        demo.close()
