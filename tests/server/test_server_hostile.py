"""What a held-out probe of hostile requests found in `uag serve`, end to end on the demo pair: a recursive `$ref`
that no finite JSON value fits is a 400 naming its param before any model runs, and a grammar llguidance gives up
on mid-reply (one that got past those checks) is the request's 4xx with one clear message, never a 500; the server
keeps serving after each. The pure checks are in test_server_protocol.py, the guards' in test_server_guards.py."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

KEY = "a-hostile-test-key-24chr"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "demo-target"
CHAT = "/v1/chat/completions"
LOOP = {"$ref": "#"}
SELF = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}


@pytest.fixture(scope="module")
def served(store):
    """(base URL, Service) of `uag serve --api-key … --max-tokens 4` on the demo pair, the target alone."""
    from tests.support.server import serve_args, serving
    from uag.server.main import build

    settings = serve_args("--api-key", KEY, "--max-tokens", "4", "--no-ui")
    app, service = build(settings, store=store)
    try:
        with serving(app) as url:
            yield url, service
    finally:
        service.costs.close()


def _chat(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hej"}], "speculative": False, **fields}
    return httpx.post(url + CHAT, json=body, headers=AUTH, timeout=300)


def _schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "endless", "schema": schema, "strict": True}}


def _generates(url: str) -> None:
    after = _chat(url, max_tokens=1)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("schema", [LOOP, SELF, CYCLE])
def test_a_schema_no_finite_value_fits_is_a_400_before_any_model_runs(served, schema):
    url, service = served
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    for fields, param in (
        ({"response_format": _schema(schema)}, "response_format"),
        ({"tools": [tool], "tool_choice": "required"}, "tools[0].function.parameters"),
    ):
        answer = _chat(url, **fields)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param and "no finite JSON value fits this schema" in error["message"]
    assert service.runner.worker.current is None
    _generates(url)


def test_a_grammar_given_up_on_the_worker_is_the_requests_error_not_a_500(served, monkeypatch, caplog):
    """With the request's check switched off, {"$ref": "#"} reaches the worker as it did before the fix: llguidance
    allows only the stop token, then refuses it. The whole reply and the stream both say the grammar admits no
    continuation (400, and the stream's error event), nothing is logged as an internal error, and the server
    serves the next request."""
    import uag.core.grammar

    url, _ = served
    monkeypatch.setattr(uag.core.grammar, "_must_finish", lambda schema, part: None)
    monkeypatch.setattr(uag.core.grammar, "_check", lambda grammar, part: None)
    whole = _chat(url, response_format=_schema(LOOP))
    assert whole.status_code == 400, whole.text
    assert "the grammar (json_schema endless) admits no continuation here" in whole.json()["error"]["message"]
    with httpx.stream(
        "POST",
        url + CHAT,
        headers=AUTH,
        timeout=300,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hej"}],
            "speculative": False,
            "stream": True,
            "response_format": _schema(LOOP),
        },
    ) as streamed:
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.status_code == 200  # the reply had started: its error is the stream's last event
    (failed,) = [json.loads(event)["error"] for event in events if event != "[DONE]" and "error" in json.loads(event)]
    assert "admits no continuation" in failed["message"]
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
    _generates(url)
