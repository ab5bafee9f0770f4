"""Tools and structured output through `uag serve`: the chat template renders the tools, the model's calls come back
as `tool_calls` (every shape, several in a reply, the text outside them as content), streamed as OpenAI streams
them, and the tool's answer goes back through the template; `response_format` and a forcing `tool_choice` reach the
engine as the config's grammar. A tiny random Qwen2.5 model carries the real Qwen2.5 template; its replies are
scripted (tests/support/server_scripted.py). The last tests run the demo pair under a JSON schema (slow)."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BARE = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n```'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Script:
    """The scripted replies (tests/support/server_scripted.py), cut at the request's max_tokens (a scripted token is
    3 characters), keeping each request's config."""

    def __init__(self):
        from tests.support.server_scripted import Scripted

        self.scripted, self.configs = Scripted(), []
        self.replies, self.prompts = self.scripted.replies, self.scripted.prompts

    def __call__(self, target, drafter, ids, config, **kw):
        self.configs.append(config)
        for event in self.scripted(target, drafter, ids, config, **kw):
            if len(event.run.tokens) >= config.max_tokens and event.run.finish_reason is None:
                event.run.finish_reason = "length"
                yield event
                return
            yield event


@pytest.fixture(scope="module")
def tiny_server():
    from tests.support.server import serve_args, serving
    from tests.support.tiny_models import build_tiny
    from uag.server.main import build

    folder = str(build_tiny("qwen2", "qwen2.5"))
    settings = serve_args("--target", folder, "--drafter", "off", "--no-ui", "--max-tokens", "64")
    script = Script()
    app, service = build(settings, stream=script)
    try:
        with serving(app) as url:
            yield url, service, script, folder
    finally:
        service.costs.close()  # no measuring in the background during later tests


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server[0] + "/v1", api_key="none", max_retries=0)


def _prompt(service, script) -> str:
    return service.store.get(service.target_name).tokenizer.decode(script.prompts[-1])


def test_a_tool_call_round_trip(tiny_server, client):
    _, service, script, model = tiny_server
    script.replies += [CALL, "It is 12 C in Oslo."]
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER])
    assert "<tools>" in _prompt(service, script) and "get_weather" in _prompt(service, script)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    messages = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12 C"},
    ]
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER])
    prompt = _prompt(service, script)
    assert "<tool_response>\n12 C\n</tool_response>" in prompt and '"city": "Oslo"' in prompt
    assert second.choices[0].message.content == "It is 12 C in Oslo." and second.choices[0].finish_reason == "stop"


def test_a_bare_json_call_is_streamed_as_tool_call_deltas(tiny_server, client):
    _, _, script, model = tiny_server
    script.replies.append(BARE)
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], stream=True))
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # the JSON never went out as text
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == {"city": "Oslo", "unit": "C"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_json_that_fits_no_tool_is_text(tiny_server, client):
    _, _, script, model = tiny_server
    script.replies.append('{"name": "get_time", "arguments": {}}')
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER])
    assert reply.choices[0].message.content == '{"name": "get_time", "arguments": {}}'
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls


def test_a_failure_mid_stream_ends_it_with_one_neutral_error_event(tiny_server):
    url, _, script, model = tiny_server
    script.replies.append(RuntimeError("boom in /secret/path"))
    body = {"model": model, "messages": ASK, "stream": True}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    events = response.content.decode().split("\n\n")[:-1]
    assert response.status_code == 200 and "[DONE]" not in response.text
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "secret" not in error["message"] and "Runtime" not in error["message"]
    script.replies.append("ok")  # and it keeps serving
    assert httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}).status_code == 200


def test_a_template_that_rejects_the_roles_is_a_400():
    import mlx_lm

    from tests.support.tiny_models import build_tiny
    from uag.server.chat import render
    from uag.server.errors import APIError

    _, tokenizer = mlx_lm.load(str(build_tiny("mistral", "mistral-v1")))
    with pytest.raises(APIError) as caught:
        render(tokenizer, [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert caught.value.status == 400 and "chat template rejects" in caught.value.message


# --- several calls, the text outside them, a call cut off ---------------------------------------------------------
def _streamed(client, model, **kw) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed reply, as a client puts the chunks together."""
    chunks = list(client.chat.completions.create(model=model, messages=ASK, stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, list] = {}
    for delta in (d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []):
        call = calls.setdefault(delta.index, [None, ""])
        call[0] = delta.function.name or call[0]
        call[1] += delta.function.arguments or ""
    return content, [(name, json.loads(args)) for name, args in calls.values()], chunks[-1].choices[0].finish_reason


def _whole(client, model, **kw) -> tuple[str | None, list[tuple[str, dict]], str]:
    choice = client.chat.completions.create(model=model, messages=ASK, **kw).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


OSLO_PARIS = [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Paris"})]
FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "%s"}}\n```'


@pytest.mark.parametrize(
    ("reply", "content", "calls"),
    [
        (f"{CALL}\n{PARIS}", None, OSLO_PARIS),
        (FENCED % "Oslo", None, OSLO_PARIS[:1]),  # the reply: its text was content, a backtick short
        (f"Both cities.\n{FENCED % 'Oslo'}\n{FENCED % 'Paris'}", "Both cities.", OSLO_PARIS),
        (
            '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            None,
            OSLO_PARIS,
        ),
        (
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}',
            None,
            OSLO_PARIS,
        ),
        (f"{CALL}\nI asked for Oslo.", "I asked for Oslo.", OSLO_PARIS[:1]),
        # a string written with its line break and tab unescaped, as a small model writes a file into a call
        (
            '{"name": "get_weather", "arguments": {"city": "Oslo\n\tNorway"}}',
            None,
            [("get_weather", {"city": "Oslo\n\tNorway"})],
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_every_shape_of_calls_comes_back_as_tool_calls(tiny_server, client, reply, content, calls, stream):
    _, _, script, model = tiny_server
    script.replies.append(reply)
    got = (_streamed if stream else _whole)(client, model, tools=[WEATHER])
    assert got == ((content or "") if stream else content, calls, "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(tiny_server, client, stream):
    _, _, script, model = tiny_server
    script.replies.append(f"{CALL}\n{PARIS}")
    got = (_streamed if stream else _whole)(client, model, tools=[WEATHER], parallel_tool_calls=False)
    assert got[1:] == (OSLO_PARIS[:1], "tool_calls") and not got[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_text_and_the_reply_says_length(tiny_server, client, stream):
    """No call is made of a call max_tokens cut, and its text stays content to the last character."""
    _, _, script, model = tiny_server
    ask = _streamed if stream else _whole
    reply = f"{CALL}\n{PARIS}"
    script.replies.append(reply)
    tokens = (len(CALL) + 30) // 3  # a scripted token is 3 characters: the second call cut in its JSON
    cut = reply[: tokens * 3][len(CALL) :].lstrip()
    assert cut.startswith("<tool_call>") and ask(client, model, tools=[WEATHER], max_tokens=tokens) == (
        cut,
        OSLO_PARIS[:1],
        "length",
    )
    script.replies.append(CALL)
    assert ask(client, model, tools=[WEATHER], max_tokens=5) == (CALL[:15], [], "length")


# --- structured output reaches the engine as the config's grammar -------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_response_format_and_a_forced_call_reach_the_engine(tiny_server, client):
    from uag.core.grammar import response_format_constraint, tool_constraint

    _, _, script, model = tiny_server
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    script.replies.append('{"city": "Oslo"}')
    reply = client.chat.completions.create(model=model, messages=ASK, response_format=response_format)
    assert reply.choices[0].message.content == '{"city": "Oslo"}'
    assert script.configs[-1].constraint == response_format_constraint(response_format)
    script.replies.append(CALL)
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice=named, parallel_tool_calls=False
    )
    assert forced.choices[0].finish_reason == "tool_calls"
    assert script.configs[-1].constraint == tool_constraint([WEATHER], "get_weather", parallel=False)
    script.replies.append("Ala")
    client.completions.create(model=model, prompt="Ala", extra_body={"response_format": {"type": "json_object"}})
    assert script.configs[-1].constraint == response_format_constraint({"type": "json_object"})


def test_a_schema_that_does_not_compile_is_a_400_naming_the_part(tiny_server):
    url, _, script, model = tiny_server
    asked = len(script.configs)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}, "strict": True}}
    response = httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": ASK, "response_format": bad})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "response_format"
    assert (
        error["message"].startswith("response_format.json_schema.schema: ") and error["type"] == "invalid_request_error"
    )
    body = {"model": model, "messages": ASK, "tool_choice": "required"}
    response = httpx.post(url + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert len(script.configs) == asked  # refused before any model ran


# --- the demo pair under a JSON schema (slow: it loads the demo models) ---------------------------------------------
CAPITAL = {
    "type": "object",
    "properties": {"capital": {"type": "string", "maxLength": 16}, "big": {"type": "boolean"}},
    "required": ["capital", "big"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo_server(store):
    from tests.support.server import serve_args, serving
    from uag.server.main import build

    settings = serve_args("--max-tokens", "48", "--no-ui")
    app, service = build(settings, store=store)
    try:
        with serving(app) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    finally:
        service.costs.close()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_reply_on_the_demo_pair_fits_and_is_the_targets_own(demo_server, stream):
    """The demo target (a base model, no chat template) writes JSON that parses and fits the schema, speculating
    (auto over lookup + SmolLM2) or not, token for token the same greedy reply."""
    from uag.server.chat import fits

    response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL, "strict": True}}
    ask = {
        "model": "demo-target",
        "messages": [{"role": "user", "content": "Poland's capital city, as JSON:"}],
        "response_format": response_format,
    }
    replies = []
    for speculative in (True, False):
        if stream:
            chunks = list(
                demo_server.chat.completions.create(**ask, stream=True, extra_body={"speculative": speculative})
            )
            replies.append(
                (
                    "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                    chunks[-1].choices[0].finish_reason,
                )
            )
        else:
            choice = demo_server.chat.completions.create(**ask, extra_body={"speculative": speculative}).choices[0]
            replies.append((choice.message.content, choice.finish_reason))
    (content, finish), plain = replies
    assert finish == "stop" and fits(json.loads(content), CAPITAL) and set(json.loads(content)) == {"capital", "big"}
    assert plain == (content, finish)
