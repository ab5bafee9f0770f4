"""OpenAI's Responses API (`POST /v1/responses`) through `uag serve`, driven by the official `openai` SDK.

Parsing, stored responses and the event writer are tested without a model; a tiny random Qwen2.5 model with scripted
replies (tests/support/server_scripted.py) carries the real chat template for tool round trips and Codex CLI's own
recorded request (tests/fixtures/agents); the demo pair (slow) checks that greedy output equals chat completions' and
that a turn re-sending its head reads it from the prompt cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from uag.core.config import MAX_TOKENS
from uag.server.dialects import Accepted, Done
from uag.server.errors import APIError
from uag.server.openai_responses import ResponsesReply, StoredResponses, flat_name, owner_of, parse_responses
from uag.server.protocol import ServerDefaults, parse_chat

openai = pytest.importorskip("openai")

DEFAULTS = ServerDefaults(model="m", drafter=None)
CODEX = json.loads((Path(__file__).parents[1] / "fixtures/agents/codex_0.171.0_responses.json").read_text())["body"]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}
FILES = {
    "type": "namespace",
    "name": "mcp__files__",
    "description": "Files of the project.",
    "tools": [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}}],
}


def parse(body: dict, key: str | None = None, stored: StoredResponses | None = None):
    return parse_responses({"model": "m", **body}, DEFAULTS, key, stored or StoredResponses())


def refused(body: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(body)
    return caught.value


# --- parsing: no model -------------------------------------------------------------------------------------------
def test_codex_clis_recorded_request_is_accepted():
    request = parse({**CODEX, "model": "m"})
    assert [m["role"] for m in request.messages] == ["system", "user", "user"]
    developer = ["".join(part["text"] for part in item["content"]) for item in CODEX["input"][:2]]
    assert request.messages[0]["content"] == "\n\n".join(developer)  # both developer items, one system message
    names = [tool["function"]["name"] for tool in request.tools]
    assert "exec_command" in names and "multi_agent_v1__spawn_agent" in names and "web_search" not in names
    turn = request.extra["responses"]
    assert turn.namespaces["multi_agent_v1__spawn_agent"] == ("multi_agent_v1", "spawn_agent")
    assert "web_search" in turn.notes[0] and not turn.store and request.stream
    assert request.config.constraint is None and request.parallel_tool_calls


def test_input_items_become_the_chat_conversation():
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "read", "namespace": "mcp__files__", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "12 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "x = 1"}]},
        {"type": "function_call_output", "call_id": "c3", "output": [{"type": "input_image", "image_url": "x"}]},
    ]
    request = parse({"input": items, "instructions": "You are a helper.", "tools": [WEATHER, FILES]})
    system, user, assistant, tool1, tool2, image = request.messages
    assert system == {"role": "system", "content": "You are a helper.\n\nBe brief."}
    assert user == {"role": "user", "content": "Weather in Oslo?"}
    assert assistant["content"] == "Checking."
    assert [c["function"] for c in assistant["tool_calls"]] == [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "mcp__files__read", "arguments": {}},
    ]
    assert tool1 == {"role": "tool", "content": "12 C", "tool_call_id": "c1"} and tool2["content"] == "x = 1"
    assert image["content"] == "[an image the model here cannot read]"  # a tool's image: the agent goes on
    assert parse({"input": "Hi"}).messages == ({"role": "user", "content": "Hi"},)
    # no max_output_tokens: uag's most, not the server's --max-tokens (Codex retries a reply cut short)
    assert parse({"input": "Hi"}).config.max_tokens == MAX_TOKENS
    assert parse({"input": "Hi", "max_output_tokens": 5}).config.max_tokens == 5


def test_namespaced_functions_get_flat_names():
    assert flat_name("mcp__files__", "read") == "mcp__files__read"
    assert flat_name("mcp__codex_apps__gmail", "_search") == "mcp__codex_apps__gmail_search"
    assert flat_name("crm", "find") == "crm__find"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
        ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "messages": []}, "messages"),
        ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": []}, "input"),
    ],
)
def test_a_bad_request_is_one_400_naming_its_field(body, param):
    err = refused(body)
    assert err.status == 400 and err.param == param and "\n" not in err.message


def test_a_forcing_tool_choice_and_text_format_are_chats_grammars():
    ask = [{"role": "user", "content": "Oslo?"}]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    named = parse({"input": "Oslo?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    chat = parse_chat(
        {
            "model": "m",
            "messages": ask,
            "tools": [chat_tool],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
        DEFAULTS,
    )
    assert named.config.constraint is not None and named.config.constraint == chat.config.constraint
    assert parse({"input": "x", "tools": [WEATHER], "tool_choice": "required"}).config.constraint is not None
    assert parse({"input": "x", "tools": [WEATHER], "tool_choice": "none"}).tools == ()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    form = {"type": "json_schema", "name": "A", "schema": schema, "strict": True}
    answer = parse({"input": "x", "text": {"format": form}})
    response_format = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    chat = parse_chat({"model": "m", "messages": ask, "response_format": response_format}, DEFAULTS)
    assert answer.config.constraint == chat.config.constraint is not None
    assert parse({"input": "x", "text": {"format": {"type": "json_object"}}}).config.constraint is not None


def test_stored_responses_belong_to_their_key_and_are_bounded():
    stored = StoredResponses(count=2)
    mine, theirs = owner_of("key-a"), owner_of("key-b")
    for rid in ("resp_1", "resp_2"):
        stored.put(mine, {"id": rid, "object": "response"}, ({"role": "user", "content": rid},))
    assert stored.get("resp_1", mine).conversation == ({"role": "user", "content": "resp_1"},)
    with pytest.raises(APIError) as caught:
        stored.get("resp_1", theirs)
    assert caught.value.status == 404  # another key's response is as absent as an unknown one
    stored.put(mine, {"id": "resp_3", "object": "response"}, ())  # resp_2, used least recently, goes
    with pytest.raises(APIError):
        stored.get("resp_2", mine)
    assert stored.delete("resp_3", mine)["deleted"] and len(stored) == 1
    small = StoredResponses(max_bytes=300)
    for i in range(5):
        small.put(mine, {"id": f"resp_{i}", "object": "response"}, ({"role": "user", "content": "x" * 50},))
    assert 1 <= len(small) < 5
    request = parse({"input": "Again", "previous_response_id": "resp_1"}, key="key-a", stored=stored)
    assert [m["content"] for m in request.messages] == ["resp_1", "Again"]
    with pytest.raises(APIError) as caught:
        parse({"input": "Again", "previous_response_id": "resp_1"}, key="key-b", stored=stored)
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"


def _report(prompt: int, completion: int, cached: int = 0) -> dict:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return {"usage": usage, "speculative": {"drafter": None}, "timings": {}}


def _sse(parts) -> list[dict]:
    """The events of a stream, each checked: its `event:` line names the type its data says."""
    events = []
    for block in b"".join(parts).decode().split("\n\n")[:-1]:
        head, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return events


def _typed(event: dict) -> None:
    """`event` validated as the SDK's type for its `type` (every field the SDK requires, of its type)."""
    from typing import get_args

    from openai.types.responses import ResponseStreamEvent

    kinds = {get_args(c.model_fields["type"].annotation)[0]: c for c in get_args(get_args(ResponseStreamEvent)[0])}
    kinds[event["type"]].model_validate(event)


def test_the_event_stream_parses_as_the_sdks_types():
    from openai.types.responses import Response

    stored = StoredResponses()
    request = parse({"input": "Oslo?", "tools": [WEATHER, FILES]}, stored=stored)
    reply = ResponsesReply(request, stored)
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "mcp__files__read", "arguments": "{}"}},
    ]
    done = Done("Checking.", "tool_calls", _report(10, 8, 4), calls, tail=".")
    parts = [*reply.opening(Accepted(10)), *reply.delta("Checking"), *reply.closing(done)]
    events = _sse(parts)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        _typed(event)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(events[-1]["response"])
    message, weather, read = final.output
    assert message.content[0].text == "Checking." and final.output_text == "Checking."
    assert (weather.name, weather.call_id, weather.arguments) == ("get_weather", "call_1", '{"city": "Oslo"}')
    assert (read.name, read.namespace) == ("read", "mcp__files__") and read.id.startswith("fc_")
    assert final.usage.input_tokens_details.cached_tokens == 4 and final.usage.total_tokens == 18
    kept = stored.get(final.id, owner_of(None)).conversation  # stored by default, as OpenAI does
    assert kept[-1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    cut = ResponsesReply(parse({"input": "x", "store": False}, stored=stored), stored)
    whole = Response.model_validate(cut.whole(Done("abc", "length", _report(3, 8))))
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert len(stored) == 1  # store false: not kept
    failed = _sse([cut.failed(APIError(500, "the server failed"))])
    assert [e["type"] for e in failed] == ["error", "response.failed"]
    for event in failed:
        _typed(event)


# --- a tiny Qwen2.5 with scripted replies: the template, tool round trips, Codex's request ------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.support.server import serve_args, serving
    from tests.support.server_scripted import Scripted
    from tests.support.tiny_models import build_tiny
    from uag.server.main import build

    folder = str(build_tiny("qwen2", "qwen2.5"))
    settings = serve_args("--target", folder, "--drafter", "off", "--no-ui", "--max-tokens", "64")
    script = Scripted()
    app, service = build(settings, stream=script)
    try:
        with serving(app) as url:
            yield url, service, script, folder
    finally:
        service.costs.close()


@pytest.fixture(scope="module")
def tiny_client(tiny):
    return openai.OpenAI(base_url=tiny[0] + "/v1", api_key="none", max_retries=0)


def _prompt(tiny) -> str:
    _, service, script, _ = tiny
    return service.store.get(service.target_name).tokenizer.decode(script.prompts[-1])


def test_a_function_call_round_trip_with_a_namespaced_tool(tiny, tiny_client):
    _, _, script, model = tiny
    script.replies += ['<tool_call>\n{"name": "mcp__files__read", "arguments": {}}\n</tool_call>', "x is 1."]
    first = tiny_client.responses.create(model=model, input="What is x?", tools=[WEATHER, FILES])
    assert "mcp__files__read" in _prompt(tiny) and "get_weather" in _prompt(tiny)
    (call,) = first.output
    assert call.type == "function_call" and (call.name, call.namespace, call.arguments) == (
        "read",
        "mcp__files__",
        "{}",
    )
    assert first.status == "completed" and first.output_text == ""
    follow = [
        {"role": "user", "content": "What is x?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "x = 1"},
    ]
    second = tiny_client.responses.create(model=model, input=follow, tools=[WEATHER, FILES], store=False)
    prompt = _prompt(tiny)
    assert "<tool_response>\nx = 1\n</tool_response>" in prompt and '"name": "mcp__files__read"' in prompt
    assert second.output_text == "x is 1." and second.output[0].type == "message"
    with pytest.raises(openai.NotFoundError):
        tiny_client.responses.retrieve(second.id)  # store false
    # previous_response_id: the stored first turn (its input and its call) is read again before the new items
    script.replies.append("x is still 1.")
    third = tiny_client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "x = 1"}],
        tools=[WEATHER, FILES],
    )
    assert "What is x?" in _prompt(tiny) and "<tool_response>\nx = 1\n</tool_response>" in _prompt(tiny)
    assert third.previous_response_id == first.id and third.output_text == "x is still 1."
    assert tiny_client.responses.retrieve(first.id).output[0].call_id == call.call_id
    tiny_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        tiny_client.responses.retrieve(first.id)


def test_codex_clis_request_streams_events_the_sdk_reads(tiny):
    url, _, script, model = tiny
    script.replies.append('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "ls"}}\n</tool_call>')
    response = httpx.post(url + "/v1/responses", json={**CODEX, "model": model}, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _sse([response.content])
    for event in events:
        _typed(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    (call,) = events[-1]["response"]["output"]
    assert call["name"] == "exec_command" and json.loads(call["arguments"]) == {"cmd": "ls"}
    assert "web_search" in events[-1]["response"]["notes"][0]
    assert "exec_command" in _prompt(tiny) and "spawn_agent" in _prompt(tiny)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(tiny):
    url, _, script, model = tiny
    script.replies.append(RuntimeError("boom in /secret/path"))
    body = {"model": model, "input": "Hi", "stream": True}
    events = _sse([httpx.post(url + "/v1/responses", json=body, timeout=60).content])
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert "secret" not in json.dumps(events[-2:]) and events[-1]["response"]["status"] == "failed"


# --- the demo pair: equality with chat completions, the prompt cache, the SDK's stream helpers --------------------
KEY = "test-key"
MODEL = "demo-target"
PROMPT = "Stolica Polski to"


@pytest.fixture(scope="module")
def demo(store):
    from tests.support.server import serve_args, serving
    from uag.server.main import build

    settings = serve_args("--api-key", KEY, "--max-tokens", "8", "--no-ui")
    app, service = build(settings, store=store)
    try:
        with serving(app) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    finally:
        service.costs.close()


@pytest.mark.slow
def test_greedy_output_equals_chat_completions_and_turn_two_reads_the_cache(demo):
    chat = demo.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=6, extra_body={"speculative": False}
    )
    first = demo.responses.create(model=MODEL, input=PROMPT, max_output_tokens=6)  # speculating (the default)
    assert first.output_text == chat.choices[0].message.content
    assert first.usage.input_tokens == chat.usage.prompt_tokens and first.usage.output_tokens == 6
    cut = chat.choices[0].finish_reason == "length"
    assert first.status == ("incomplete" if cut else "completed")
    assert (first.incomplete_details.reason if cut else first.incomplete_details) == (
        "max_output_tokens" if cut else None
    )
    assert first.model_extra["speculative"]["drafter"] is not None
    turn = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": first.output_text}]
    second = demo.responses.create(
        model=MODEL, input=[*turn, {"role": "user", "content": "I dalej?"}], max_output_tokens=2
    )
    assert second.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_streamed_with_both_sdk_helpers(demo):
    events = list(demo.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text and events[-1].response.usage.output_tokens == 4
    with demo.responses.stream(model=MODEL, input="Ala ma", max_output_tokens=4, store=False) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    whole = demo.responses.create(model=MODEL, input="Ala ma", max_output_tokens=4, store=False)
    assert streamed == whole.output_text


@pytest.mark.slow
def test_errors_are_typed_sdk_exceptions(demo):
    with pytest.raises(openai.NotFoundError):
        demo.responses.create(model="nope", input="x")
    with pytest.raises(openai.NotFoundError):
        demo.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    with pytest.raises(openai.BadRequestError) as caught:
        demo.responses.create(
            model=MODEL, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
        )
    assert caught.value.body["param"] == "input[0].content[0]"
    wrong = openai.OpenAI(base_url=str(demo.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model=MODEL, input="x")
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.retrieve("resp_x")
