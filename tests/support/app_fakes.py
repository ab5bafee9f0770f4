"""Stand-ins for the app's handler tests: a worker no job may reach, and the request Gradio hands a handler."""

from __future__ import annotations

from types import SimpleNamespace


class NoWorker:
    """Fails the test if a job is submitted: what is refused must be refused before it reaches the models."""

    current = None
    max_batch = 1  # as a worker that runs one job at a time
    batch = None

    def submit(self, *args, **kwargs):
        raise AssertionError("this must not reach the worker")


def request(host="127.0.0.1", headers=None, tab="tab-1"):
    """What a handler reads of gradio's Request: the client's address, the headers, the browser tab."""
    return SimpleNamespace(client=SimpleNamespace(host=host), headers=headers or {}, session_hash=tab)
