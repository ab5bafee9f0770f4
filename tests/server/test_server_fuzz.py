"""The server's requests fuzzed (issue 35): bodies shaped like OpenAI's chat and completions requests, with wrong
types, nulls, lone surrogates, control characters, huge numbers, deep nesting and extra keys mixed in. The parser
returns a `Request` or raises a 4xx `APIError` whose body encodes as UTF-8; over HTTP every body is answered 2xx, or
4xx with OpenAI's error object; never a 500. Valid bodies are accepted. No model: the HTTP test's service replies
with fixed text (a tool call when the request declares tools), through the real stop and tool-call handling.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uag.core.config import MAX_TOKENS, SPECULATIVE
from uag.server.errors import APIError
from uag.server.messages import ROLES
from uag.server.protocol import ModelRouter, Request, ServerDefaults, parse_chat, parse_completion

DEFAULTS = ServerDefaults(model="demo-target", drafter="lookup+demo-drafter", k=8, drafters=("lookup",))
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


# --- values ---------------------------------------------------------------------------------------------------
def _nested(depth: int) -> Any:
    value: Any = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


TEXT = st.text(max_size=12)  # valid Unicode text (hypothesis leaves surrogates out unless asked)
NAME = st.text(min_size=1, max_size=12)
HOSTILE = st.text(
    st.one_of(st.characters(), st.characters(codec=None, categories=["Cs"]), st.sampled_from("\x00\x1b\n\u2028\u202e")),
    max_size=12,
)
NUMBERS = st.one_of(
    st.integers(), st.floats(), st.sampled_from([10**400, -(10**30), 2**63, 1e308, 5e-324, float("nan")])
)
# Lone surrogates, control characters, numbers past what a float holds, empties.
NASTY = [
    "\ud800",
    "a\udcff",
    "\udfff\ud800",
    ["\udc80"],
    {"\ud800": 1},
    "\x00\x1b[31m\n",
    "\u2028",
    10**400,
    float("inf"),
    -1,
    True,
    "",
    [],
    {},
]
LEAVES = st.one_of(st.sampled_from(NASTY), st.none(), st.booleans(), NUMBERS, HOSTILE)
JUNK = st.one_of(
    st.recursive(
        LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(HOSTILE, inner, max_size=3), max_leaves=8
    ),
    st.integers(33, 300).map(_nested),  # deeper than MAX_DEPTH, within what json.loads reads
)
PLAIN = st.recursive(  # valid JSON values, as tool arguments and metadata hold them
    st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=False), TEXT),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)


def _or_junk(valid: st.SearchStrategy, junk: bool) -> st.SearchStrategy:
    """`valid`, or with `junk` one time in eight a wrong value (a wrong type, null, a surrogate, deep nesting): rarely
    enough that most bodies get past their first fields to the later ones. (`one_of(valid, valid, …, JUNK)` would
    not weigh: it draws each distinct branch alike.)"""
    return st.sampled_from([valid] * 7 + [JUNK]).flatmap(lambda chosen: chosen) if junk else valid


def _object(required: dict, optional: dict, junk: bool) -> st.SearchStrategy:
    """An object of the given keys (the optional ones present or not); with `junk`, values may be wrong and an
    unknown key may come along."""
    shape = st.fixed_dictionaries(
        {k: _or_junk(v, junk) for k, v in required.items()},
        optional={k: _or_junk(v, junk) for k, v in optional.items()},
    )
    if not junk:
        return shape
    extra = st.dictionaries(HOSTILE, JUNK, max_size=1)
    return st.tuples(shape, extra, st.integers(0, 9)).map(lambda t: {**t[0], **t[1]} if t[2] == 0 else t[0])


# --- request fields -------------------------------------------------------------------------------------------------
def _schemas(junk: bool) -> st.SearchStrategy:
    types = st.sampled_from(["string", "integer", "number", "boolean", "null", "array", "object"])
    leaf = _object(
        {},
        {"type": types | st.lists(types, max_size=2), "enum": st.lists(PLAIN, max_size=3), "description": TEXT},
        junk,
    )
    return st.recursive(
        leaf,
        lambda inner: _object(
            {"type": st.just("object")},
            {
                "properties": st.dictionaries(NAME, inner, max_size=3),
                "required": st.lists(NAME, max_size=2),
                "additionalProperties": st.booleans(),
            },
            junk,
        )
        | _object({"type": st.just("array")}, {"items": inner}, junk),
        max_leaves=4,
    )


def _tools(junk: bool) -> st.SearchStrategy:
    function = _object({"name": NAME}, {"description": TEXT, "parameters": _schemas(junk)}, junk)
    return st.lists(_object({"type": st.just("function"), "function": function}, {}, junk), max_size=2)


def _messages(junk: bool) -> st.SearchStrategy:
    arguments = st.dictionaries(TEXT, PLAIN, max_size=3)
    call = _object(
        {"function": _object({"name": NAME, "arguments": arguments | arguments.map(json.dumps)}, {}, junk)},
        {"id": TEXT, "type": st.just("function")},
        junk,
    )
    part = _object({"type": st.just("text"), "text": TEXT}, {}, junk)
    content = TEXT | st.lists(part, max_size=2)
    said = _object(
        {"role": st.sampled_from([r for r in ROLES if r != "tool"]), "content": content}, {"name": NAME}, junk
    )
    calls = _object(
        {"role": st.just("assistant"), "tool_calls": st.lists(call, min_size=1, max_size=2)},
        {"content": st.none() | content},
        junk,
    )
    answer = _object({"role": st.just("tool"), "content": content, "tool_call_id": TEXT}, {}, junk)
    message = said | calls | answer
    return st.lists(_or_junk(message, junk), min_size=1, max_size=3)


def _speculative(junk: bool) -> st.SearchStrategy:
    keys = {
        "drafter": st.sampled_from(DEFAULTS.allowed),
        "k": st.integers(1, DEFAULTS.k),
        "strategy": st.sampled_from(SPECULATIVE),
        "window": st.integers(0, 64),
        "check": st.booleans(),
    }
    return st.booleans() | _object({}, keys, junk)


def _fields(kind: str, junk: bool) -> tuple[dict, dict]:
    """(required, optional) field strategies of a `kind` request, as OpenAI and uag define them."""
    unit = st.floats(0, 1)
    optional = {
        "max_tokens": st.integers(1, MAX_TOKENS),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(0, 1000),
        "min_p": unit,
        "repetition_penalty": st.floats(0, 10, exclude_min=True),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "seed": st.integers(0, 2**31 - 1),
        "n": st.just(1),
        "stop": NAME | st.lists(NAME, min_size=1, max_size=4),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "user": TEXT,
        "metadata": st.dictionaries(TEXT, TEXT, max_size=2),
        "logprobs": st.just(False),
        "logit_bias": st.just({}),
        "speculative": _speculative(junk),
    }
    if kind == "chat":
        optional |= {
            "max_completion_tokens": st.integers(1, MAX_TOKENS),
            "tools": _tools(junk),
            "tool_choice": st.sampled_from(["auto", "none"]),
            "parallel_tool_calls": st.booleans(),
            "response_format": st.just({"type": "text"}),
        }
        return {"model": st.just(DEFAULTS.model), "messages": _messages(junk)}, optional
    prompt = TEXT.filter(str.strip)
    return {"model": st.just(DEFAULTS.model), "prompt": prompt | st.lists(prompt, min_size=1, max_size=1)}, optional


def _consistent(body: dict) -> dict:
    """The fields that depend on each other, made to agree (check is greedy; stream_options streams; max_tokens is
    max_completion_tokens), so that a body is refused for its wrong values, not for these."""
    speculative = body.get("speculative")
    if isinstance(speculative, dict) and speculative.get("check"):
        body.pop("temperature", None)
    if "stream_options" in body:
        body["stream"] = True
    if "max_completion_tokens" in body and "max_tokens" in body:  # two names of one setting: they must agree
        body["max_tokens"] = body["max_completion_tokens"]
    return body


def bodies(kind: str, junk: bool) -> st.SearchStrategy:
    """Request bodies for /v1/chat/completions (`kind` "chat") or /v1/completions ("completion"); with `junk`,
    now and then no object at all."""
    required, optional = _fields(kind, junk)
    shaped = _object(required, optional, junk)
    shaped = shaped.map(_consistent)
    return _or_junk(shaped, junk)


PARSE = {"chat": parse_chat, "completion": parse_completion}


# --- the parser -----------------------------------------------------------------------------------------------------
def _answered(kind: str, body: Any) -> Request | APIError:
    """What the parser makes of `body`: a Request whose text is all valid, or a 4xx that encodes as UTF-8."""
    try:
        request = PARSE[kind](body, DEFAULTS)
    except APIError as err:
        assert 400 <= err.status < 500, err.message
        json.dumps(err.body(), ensure_ascii=False).encode("utf-8")
        assert err.message.isprintable() and (err.param is None or err.param.isprintable())
        return err
    seen = (request.messages, request.tools, request.prompt, request.stop)  # what reaches the template, tokenizer
    json.dumps(seen, ensure_ascii=False).encode("utf-8")
    return request


@pytest.mark.parametrize("kind", ["chat", "completion"])
@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_the_parser_answers_every_body_with_a_request_or_a_4xx(kind, data):
    _answered(kind, data.draw(bodies(kind, junk=True)))


@pytest.mark.parametrize("kind", ["chat", "completion"])
@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_valid_bodies_are_accepted(kind, data):
    body = data.draw(bodies(kind, junk=False))
    request = _answered(kind, body)
    assert isinstance(request, Request), request.message
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if name in body:
            assert getattr(request.config, name) == body[name]


# --- over HTTP ----------------------------------------------------------------------------------------------------
class Replying:
    """A Service without models: each request is accepted and answered at once with fixed text, or with a call
    of its first tool, through the same `ReplyText` (stop sequences, tool calls) the real service uses."""

    REPORT = {
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": 3,
            "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    }

    def __init__(self):
        from uag.runtime.jobs import JobRunner
        from uag.runtime.worker import MLXWorker

        self.defaults = DEFAULTS
        self.router = ModelRouter((DEFAULTS,))  # the one model it serves
        self.runner = JobRunner(MLXWorker(name="uag-fuzz"), heartbeat_s=0.05)
        self.batched = False  # one request at a time, as on a server started with --max-batch 1
        self.metrics = None  # no GET /metrics

    def job(self, job, request: Request, key: str | None = None):
        from uag.server.service import Accepted, Delta, Done
        from uag.server.streaming import ReplyText

        yield Accepted(1)
        text = ReplyText(request.stop, request.tools)
        call = {"name": request.tools[0]["function"]["name"], "arguments": {}} if request.tools else None
        out, _ = text.feed("Ala ma kota." if call is None else json.dumps(call))
        if out:
            yield Delta(out)
        tail, calls = text.finish()
        yield Done(text.text if calls is None else None, "tool_calls" if calls else "stop", self.REPORT, calls, tail)


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from uag.server.routes import create_app

    service = Replying()
    yield TestClient(create_app(service), base_url="http://127.0.0.1:8000")  # a Host the default perimeter allows
    service.runner.worker.close(5)


def _post(client, path: str, data: bytes):
    return client.post(path, content=data, headers={"Content-Type": "application/json"})


def _check_answer(response, stream: bool) -> None:
    """2xx with a reply (a stream that ends in [DONE]), or 4xx with OpenAI's error object."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(response.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
    elif stream:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.text.endswith("data: [DONE]\n\n") and '"error"' not in response.text
    else:
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "tool_calls")


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_the_server_answers_every_body_2xx_or_4xx(client, data):
    kind = data.draw(st.sampled_from(["chat", "completion"]))
    body = data.draw(bodies(kind, junk=data.draw(st.sampled_from([True, True, True, False]))))
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    stream = isinstance(body, dict) and body.get("stream") is True
    _check_answer(_post(client, path, json.dumps(body).encode()), stream)  # "\ud800" goes as the escape \\ud800


ATTACKS = [  # issue 35: each was answered 500 (a value the error echoed could not be encoded, or a TypeError)
    ("/v1/chat/completions", {"n": "\ud800"}),
    ("/v1/chat/completions", {"speculative": {"strategy": "\ud800"}}),
    ("/v1/chat/completions", {"\ud800": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]}),
    ("/v1/chat/completions", {"tool_choice": "\ud800"}),
    ("/v1/chat/completions", {"max_tokens": 10**400}),
    ("/v1/completions", {"prompt": ["\ud800", "b"]}),
    ("/v1/chat/completions", {"speculative": {"k": None}}),  # null: the server's k
]


@pytest.mark.parametrize(("path", "fields"), ATTACKS)
def test_the_bodies_that_made_500s_are_answered(client, path, fields):
    body = {"model": DEFAULTS.model, "messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", **fields}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    response = _post(client, path, json.dumps(body).encode())
    assert response.status_code == (200 if fields == {"speculative": {"k": None}} else 400)
    _check_answer(response, stream=False)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff",
        b"[" * 100_000,
        b'{"model": 1e999999}',
        b"NaN",
        b'"\\ud800"',
        b'{"\\ud800": 1}',
        b'{"model": "demo-target", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
    ],
)
def test_raw_bodies_are_answered_4xx(client, data):
    response = _post(client, "/v1/completions", data)
    assert 400 <= response.status_code < 500
    _check_answer(response, stream=False)
