"""Raw REST calls of an API endpoint: parameters left out at the end take their documented defaults.

gradio_client fills in every parameter, but a plain `POST /gradio_api/call/compare` with `{"data":
["Stolica Polski to"]}` would be refused by the web server before the endpoint ran (and with no reason
given). This ASGI middleware pads such a call's `data` with the endpoint's defaults, so docs/app.md's
promise holds: everything but the prompt has a default. An empty `data` becomes a call with no prompt,
which the endpoint answers with "the prompt is empty". Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any


def padded(data: Any, defaults: Sequence[Any]) -> Any:
    """`data` with the defaults of the parameters it leaves out (the first, the prompt, defaults to None).

    Example: padded(["Hej"], ["demo-target", 2]) -> ["Hej", "demo-target", 2];  padded([], [1]) -> [None, 1]
    """
    if not isinstance(data, list) or len(data) > len(defaults) + 1:
        return data
    head = data if data else [None]
    return [*head, *defaults[len(head) - 1 :]]


class FillDefaults:
    """Pads the `data` of `POST …/call/<api_name>` requests with the endpoint's defaults."""

    def __init__(self, app: Callable, *, api_name: str, defaults: Sequence[Any]):
        self.app = app
        self.suffix = f"/call/{api_name}"
        self.defaults = list(defaults)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].rstrip("/").endswith(self.suffix):
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        if isinstance(payload, dict) and "data" in payload:
            payload["data"] = padded(payload["data"], self.defaults)
            body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:
                return await receive()  # after the body: wait for the client to disconnect, as usual
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
