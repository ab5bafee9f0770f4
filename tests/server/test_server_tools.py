"""Tools through `uag serve`: the chat template renders them, the model's calls come back as `tool_calls` (tagged
and bare), streamed as OpenAI streams them, and the tool's answer goes back through the template. A tiny random
Qwen2.5 model carries the real Qwen2.5 template; its replies are scripted (tests/support/server_scripted.py)."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
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


@pytest.fixture(scope="module")
def tiny_server():
    from tests.support.server import serve_args, serving
    from tests.support.server_scripted import Scripted
    from tests.support.tiny_models import build_tiny
    from uag.server.main import build

    folder = str(build_tiny("qwen2", "qwen2.5"))
    args, opts = serve_args("--target", folder, "--drafter", "off", "--no-ui", "--max-tokens", "64")
    script = Scripted()
    app, service = build(args, opts, stream=script)
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
    messages = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "12 C"}]  # fmt: skip
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
