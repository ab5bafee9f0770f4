"""Anthropic's Messages API through `uag serve` (uag.server.anthropic): parsing and replies without a model; tool
round trips and Claude Code's own request against a tiny random Qwen2.5 (the real template, scripted replies); the
official `anthropic` SDK against the demo pair (slow: one module server, max_tokens ≤ 8, few runs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from uag.server.anthropic import AnthropicReply, anthropic_error, parse, parse_count
from uag.server.dialects import Accepted, Done
from uag.server.errors import APIError
from uag.server.protocol import ServerDefaults

anthropic = pytest.importorskip("anthropic")

KEY = "test-key"
MODEL = "demo-target"
DEFAULTS = ServerDefaults(model=MODEL, drafter="lookup", aliases=("claude-*",))
CLAUDE_CODE = Path(__file__).parents[1] / "fixtures" / "agents" / "claude_code_2.1.332_messages.json"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "cache_control": {"type": "ephemeral"},
}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
REPORT = {
    "usage": {
        "prompt_tokens": 100,
        "completion_tokens": 5,
        "total_tokens": 105,
        "prompt_tokens_details": {"cached_tokens": 80},
    },
    "speculative": {"drafter": "lookup"},
    "timings": {"predicted_n": 5},
}


def body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 8, "messages": ASK, **fields}


def refusal(request: dict, defaults: ServerDefaults = DEFAULTS) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(request, defaults)
    return caught.value


# --- parsing and replies, no model ------------------------------------------------------------------------------
def test_a_tool_round_trip_maps_onto_chat_messages():
    request = parse(
        body(
            system=[
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Use tools."},
            ],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "Oslo."}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "…", "signature": "s"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "12 C"}],
                        },
                        {"type": "text", "text": "And now?"},
                    ],
                },
                {"role": "user", "content": "Quickly."},  # consecutive user turns merge, as Anthropic merges them
            ],
            tools=[WEATHER, TIME],
            stop_sequences=["###"],
            temperature=0.5,
            top_k=40,
        ),
        DEFAULTS,
    )
    assert request.messages == (
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather?\n\nOslo."},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "content": "12 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And now?\n\nQuickly."},
    )
    assert [t["function"]["name"] for t in request.tools] == ["get_weather", "get_time"]
    assert request.tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    assert request.stop == ("###",) and request.config.temperature == 0.5 and request.config.top_k == 40
    assert request.config.constraint is None and request.parallel_tool_calls
    assert request.extra["ignored"] == ["thinking"]  # the earlier reply's thinking block, left out


def test_an_error_result_says_so_and_tool_choice_maps_onto_chat_s():
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city", "is_error": True}
    turns = [
        *ASK,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]},
    ]
    request = parse(body(messages=[*turns, {"role": "user", "content": [result]}], tools=[TIME]), DEFAULTS)
    assert request.messages[-1] == {"role": "tool", "content": "Error: no such city", "tool_call_id": "toolu_1"}
    forced = parse(
        body(tools=[WEATHER, TIME], tool_choice={"type": "any", "disable_parallel_tool_use": True}), DEFAULTS
    )
    assert forced.config.constraint and not forced.parallel_tool_calls
    named = parse(body(tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"}), DEFAULTS)
    assert "get_time" in named.config.constraint and "get_weather" not in named.config.constraint
    assert parse(body(tools=[WEATHER], tool_choice={"type": "none"}), DEFAULTS).tools == ()
    assert parse(body(tools=[WEATHER], tool_choice={"type": "auto"}), DEFAULTS).config.constraint is None
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    formatted = parse(
        body(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "high"}), DEFAULTS
    )
    assert formatted.config.constraint and formatted.extra["ignored"] == ["output_config.effort"]


def test_claude_code_s_request_is_accepted_and_what_it_asks_for_in_vain_is_named():
    recorded = json.loads(CLAUDE_CODE.read_text())["body"]
    request = parse(recorded, ServerDefaults(model="coder-target", drafter="lookup"))
    assert request.stream and request.model == "coder-target"
    assert [m["role"] for m in request.messages] == ["system", "user", "system"]  # its system turn stays in place
    names = [t["function"]["name"] for t in request.tools]
    assert "Edit" in names and "DeferredToolPlaceholder" not in names  # defer_loading: not shown until loaded
    assert len(names) == len(recorded["tools"]) - 1
    assert request.extra["ignored"] == [
        "thinking",
        "context_management",
        "max_tokens above 4096 (capped: uag generates at most 4096 a reply)",
        "output_config.effort",
    ]
    assert request.config.max_tokens == 4096
    counted = parse_count(
        {k: v for k, v in recorded.items() if k != "max_tokens"}, ServerDefaults("coder-target", None)
    )
    assert counted.messages == request.messages and counted.tools == request.tools and counted.drafter is None


def test_a_deferred_tool_loads_once_a_tool_reference_names_it():
    deferred = {**TIME, "defer_loading": True}
    assert [t["function"]["name"] for t in parse(body(tools=[WEATHER, deferred]), DEFAULTS).tools] == ["get_weather"]
    search = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "x"}}],
    }
    found = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "tool_reference", "tool_name": "get_time"}],
    }
    request = parse(
        body(messages=[*ASK, search, {"role": "user", "content": [found]}], tools=[WEATHER, deferred]), DEFAULTS
    )
    assert [t["function"]["name"] for t in request.tools] == ["get_weather", "get_time"]
    assert request.messages[-1]["content"] == "Tool loaded: get_time"


@pytest.mark.parametrize(
    ("fields", "status", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "reads text only"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400, "reads text only"),
        ({"messages": [*ASK, {"role": "assistant", "content": "The weather is"}]}, 400, "prefill"),
        ({"max_tokens": None}, 400, "max_tokens: required"),
        ({"temperature": 1.5}, 400, "from 0 to 1"),
        ({"model": "gpt-4o"}, 404, "--model-alias"),
        ({"tool_choice": {"type": "any"}}, 400, "tools declares none"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, 400, "nope"),
        ({"tool_choice": {"type": "sometimes"}, "tools": [WEATHER]}, 400, "tool_choice"),
        ({"tools": [{"name": "f", "input_schema": {"required": "x"}}]}, 400, "tools[0].input_schema"),
        ({"stop_sequences": [""]}, 400, "cannot be empty"),
        ({"messages": []}, 400, "at least one message"),
    ],
)
def test_what_would_change_the_reply_and_cannot_be_honoured_is_refused(fields, status, words):
    err = refusal({k: v for k, v in body(**fields).items() if v is not None})
    assert err.status == status and words in err.message, err.message


def test_fields_that_do_not_apply_pass_and_aliases_answer_as_the_served_model():
    request = parse(
        body(
            model="claude-haiku-4-5-20251001",
            metadata={"user_id": "u"},
            service_tier="auto",
            thinking={"type": "disabled"},
            mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}],
            some_field_of_the_next_release={"a": 1},
            tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
        ),
        DEFAULTS,
    )
    assert request.model == "claude-haiku-4-5-20251001"
    assert request.extra["ignored"] == [
        "mcp_servers",
        "some_field_of_the_next_release",
        'tools[1] ("web_search_20250305": a tool of Anthropic\'s own, run by its servers)',
    ]
    assert DEFAULTS.serves(MODEL) and DEFAULTS.serves("claude-opus-4-6") and not DEFAULTS.serves("Claude-x")


def test_the_reply_whole_and_streamed_as_anthropic_writes_them():
    from anthropic.lib.streaming._messages import accumulate_event

    request = parse(body(tools=[WEATHER], stream=True, thinking={"type": "enabled", "budget_tokens": 1024}), DEFAULTS)
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    done = Done("Let me look.", "tool_calls", REPORT, [call], tail=" look.")
    whole = AnthropicReply(request).whole(done)
    assert whole["id"].startswith("msg_") and whole["type"] == "message" and whole["role"] == "assistant"
    assert whole["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
    assert whole["usage"] == {
        "input_tokens": 20,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 80,
    }
    assert whole["speculative"] == {"drafter": "lookup"} and whole["ignored"] == ["thinking"]

    reply = AnthropicReply(request)
    raw = b"".join([*reply.opening(Accepted(100)), *reply.delta("Let me"), *reply.closing(done)]).decode()
    events = [part.split("\n") for part in raw.split("\n\n") if part]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    datas = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [d["type"] for d in datas] == names  # each data names its event
    snapshot = None
    for data in datas:
        if data["type"] != "ping":
            snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs={})
    assert snapshot.to_dict()["content"] == whole["content"]
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.cache_read_input_tokens == 80
    assert snapshot.usage.input_tokens == 20 and snapshot.usage.output_tokens == 5

    stopped = Done("Hi", "stop", REPORT, stop_sequence="###")
    assert AnthropicReply(request).whole(stopped)["stop_reason"] == "stop_sequence"
    assert AnthropicReply(request).whole(stopped)["stop_sequence"] == "###"
    assert AnthropicReply(request).whole(Done("", "length", REPORT))["stop_reason"] == "max_tokens"
    assert AnthropicReply(request).whole(Done("", "stop", REPORT))["content"] == []
    failed = AnthropicReply(request).failed(APIError(500, "the server failed")).decode()
    assert failed.startswith("event: error\ndata: ") and '"type":"api_error"' in failed


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_errors_are_anthropic_s_error_object(status, kind):
    assert anthropic_error(APIError(status, "why")) == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_the_stop_text_names_the_stop_sequence_that_ended_the_reply():
    from uag.server.streaming import StopText

    text = StopText(("END", "##"))
    assert text.feed("abc #") == ("abc ", False) and text.matched is None
    assert text.feed("#x END") == ("", True) and text.matched == "##"


# --- tool calls through the server: a tiny Qwen2.5 with the real template, scripted replies ----------------------
@pytest.fixture(scope="module")
def tiny():
    """(base URL, Service, Script) of `uag serve` on a tiny random Qwen2.5, `--model-alias coder-target`; a reply
    waits `script.pause_s` before its first token (a long prompt read)."""
    from tests.server.test_server_tools import Script
    from tests.support.server import serve_args, serving
    from tests.support.tiny_models import build_tiny
    from uag.server.main import build

    folder = str(build_tiny("qwen2", "qwen2.5"))
    settings = serve_args(
        "--target", folder, "--drafter", "off", "--no-ui", "--max-tokens", "64", "--model-alias", "coder-target"
    )
    script = Script()
    script.pause_s = 0.0

    def stream(*args, **kw):
        time.sleep(script.pause_s)
        yield from script(*args, **kw)

    app, service = build(settings, stream=stream)
    try:
        with serving(app) as url:
            yield url, service, script
    finally:
        service.costs.close()


def _prompt(service, script) -> str:
    return service.store.get(service.target_name).tokenizer.decode(script.prompts[-1])


def test_a_tool_use_round_trip_through_the_sdk(tiny):
    url, service, script = tiny
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    script.replies += ["Let me check.\n" + CALL, "It is 12 C in Oslo."]
    first = client.messages.create(model="coder-target", max_tokens=64, messages=ASK, tools=[WEATHER])
    assert "get_weather" in _prompt(service, script)
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
    text, call = first.content
    assert text.text == "Let me check." and call.id.startswith("toolu_")
    assert call.name == "get_weather" and call.input == {"city": "Oslo"}
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "12 C"}
    messages = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = client.messages.create(model="coder-target", max_tokens=64, messages=messages, tools=[WEATHER])
    prompt = _prompt(service, script)
    assert "<tool_response>\n12 C\n</tool_response>" in prompt and '"city": "Oslo"' in prompt
    assert second.content[0].text == "It is 12 C in Oslo." and second.stop_reason == "end_turn"


def test_a_fenced_json_call_reaches_the_client_as_a_streamed_tool_use(tiny):
    url, _, script = tiny
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    script.replies.append(FENCED)
    with client.messages.stream(model="coder-target", max_tokens=64, messages=ASK, tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert not [e for e in events if e.type == "text"]  # the JSON never went out as text
    assert [e.delta.type for e in events if e.type == "content_block_delta"] == ["input_json_delta"]
    (call,) = final.content
    assert call.type == "tool_use" and call.input == {"city": "Oslo"} and final.stop_reason == "tool_use"


def test_claude_code_s_recorded_request_is_served(tiny):
    url, service, script = tiny
    recorded = json.loads(CLAUDE_CODE.read_text())
    script.replies.append(
        "I will rename it.\n"
        + FENCED.replace("get_weather", "Read").replace('"city": "Oslo"', '"file_path": "/tmp/calc.py"')
    )
    headers = {**recorded["headers"], "Content-Type": "application/json"}
    response = httpx.post(url + recorded["path"], json=recorded["body"], headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    events = [part.split("\n") for part in response.text.split("\n\n") if part]
    datas = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert datas[0]["message"]["ignored"][0] == "thinking" and datas[-1]["type"] == "message_stop"
    uses = [d["content_block"] for d in datas if d["type"] == "content_block_start"]
    assert [u["type"] for u in uses] == ["text", "tool_use"] and uses[1]["name"] == "Read"
    prompt = _prompt(service, script)
    assert "Rename add to plus in calc.py" in prompt and '"name": "Edit"' in prompt
    counted = httpx.post(url + "/v1/messages/count_tokens?beta=true", json=recorded["body"], headers=headers)
    assert counted.json() == {"input_tokens": len(script.prompts[-1])}


def test_a_quiet_stream_is_kept_open_with_pings(tiny, monkeypatch):
    from uag.server import routes

    url, _, script = tiny
    monkeypatch.setattr(routes, "KEEPALIVE_S", 0.3)
    script.replies.append("Hi.")
    script.pause_s = 1.5
    try:
        response = httpx.post(url + "/v1/messages", json=body(model="coder-target", stream=True), timeout=60)
    finally:
        script.pause_s = 0.0
    names = [part.split("\n")[0].removeprefix("event: ") for part in response.text.split("\n\n") if part]
    first = names.index("content_block_start")
    assert names[0] == "message_start" and names[1:first] == ["ping"] * (first - 1) and first >= 4, names
    assert names[first:] == [
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which(os.environ.get("UAG_CLAUDE", "claude")), reason="Claude Code is not installed")
def test_claude_code_renames_a_function_through_uag_serve(tiny, tmp_path):
    """Claude Code itself (`npm install @anthropic-ai/claude-code@2.1.332`; UAG_CLAUDE: its path) against the server:
    the scripted model reads the file and edits it with fenced calls, and the client runs both tools."""
    url, _, script = tiny
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    path = str(repo / "calc.py")
    read = {"name": "Read", "arguments": {"file_path": path}}
    edit = {"name": "Edit", "arguments": {"file_path": path, "old_string": "def add(", "new_string": "def plus("}}
    script.replies += [f"```json\n{json.dumps(read)}\n```", f"Renaming it.\n```json\n{json.dumps(edit)}\n```", "Done."]
    env = {**os.environ, "HOME": str(tmp_path), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "none"}
    env.update(DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")
    command = [shutil.which(os.environ.get("UAG_CLAUDE", "claude")), "-p", "Rename add to plus in calc.py"]
    command += ["--model", "coder-target", "--permission-mode", "acceptEdits", "--max-turns", "4"]
    command += ["--output-format", "stream-json", "--verbose"]
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    uses = [
        b["name"] for m in lines if m["type"] == "assistant" for b in m["message"]["content"] if b["type"] == "tool_use"
    ]
    assert done.returncode == 0 and lines[-1]["subtype"] == "success", done.stdout[-2000:] + done.stderr[-2000:]
    assert uses == ["Read", "Edit"] and lines[-1]["result"] == "Done."
    assert (repo / "calc.py").read_text() == "def plus(a, b):\n    return a + b\n"


# --- the demo pair, as the SDK sees it (slow) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(store):
    """Base URL of `uag serve --api-key … --max-tokens 8 --model-alias 'claude-*'` on the demo pair."""
    from tests.support.server import serve_args, serving
    from uag.server.main import build

    settings = serve_args("--api-key", KEY, "--max-tokens", "8", "--per-client", "4", "--model-alias", "claude-*")
    app, service = build(settings, store=store)
    try:
        with serving(app) as url:
            yield url
    finally:
        service.costs.close()


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served, api_key=KEY, max_retries=0)


SAY = [{"role": "user", "content": "Stolica Polski to"}]


@pytest.mark.slow
def test_messages_whole_and_streamed_and_greedy_as_chat_completions(served, client):
    openai = pytest.importorskip("openai")
    whole = client.messages.create(model=MODEL, max_tokens=6, messages=SAY, system="Odpowiadaj krótko.")
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens <= 6
    assert whole.model_extra["speculative"]["drafter"] == "lookup+demo-drafter"
    with client.messages.stream(model=MODEL, max_tokens=6, messages=SAY, system="Odpowiadaj krótko.") as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    text_events = kinds.count("text")  # the SDK's own event beside each text delta
    assert kinds[:2] == ["message_start", "content_block_start"]  # the SDK drops the ping
    assert kinds[2:-3] == ["content_block_delta", "text"] * text_events and text_events >= 1
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert streamed.content[0].text == whole.content[0].text  # lossless: the same greedy text
    assert streamed.usage.cache_read_input_tokens > 0  # the same head again
    off = {"speculative": False}
    ours = client.messages.create(model=MODEL, max_tokens=6, messages=SAY, system="Odpowiadaj krótko.", extra_body=off)
    chat = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL,
        max_tokens=6,
        messages=[{"role": "system", "content": "Odpowiadaj krótko."}, *SAY],
        extra_body=off,
    )
    assert ours.content[0].text == chat.choices[0].message.content == whole.content[0].text
    assert ours.model_extra["speculative"]["strategy"] == "baseline"


@pytest.mark.slow
def test_a_second_turn_reads_its_head_from_the_cache(client):
    ask = [{"role": "user", "content": "Ala ma kota, a kot ma"}]  # a head no earlier test sent
    first = client.messages.create(model="claude-haiku-4-5-20251001", max_tokens=4, messages=ask)
    assert first.model == "claude-haiku-4-5-20251001"  # an alias answers as the served model
    turns = [*ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": "A pies?"}]
    second = client.messages.create(model=MODEL, max_tokens=4, messages=turns)
    assert second.usage.cache_read_input_tokens > max(first.usage.cache_read_input_tokens, 2)
    assert second.usage.input_tokens > 0 and second.usage.cache_creation_input_tokens == 0


@pytest.mark.slow
def test_count_tokens_and_errors_as_typed_sdk_exceptions(served, client):
    counted = client.messages.count_tokens(model=MODEL, messages=SAY, system="Odpowiadaj krótko.")
    assert counted.input_tokens > 5
    again = client.messages.count_tokens(model="claude-sonnet-4-5", messages=SAY)
    assert again.input_tokens < counted.input_tokens
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=served, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=SAY
        )
    assert err.value.body["error"]["type"] == "authentication_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "reads text only" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="gpt-4o", max_tokens=4, messages=SAY)
    assert err.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": err.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="gpt-4o", messages=SAY)


# --- fuzzed bodies: a Request or a 4xx, never anything else --------------------------------------------------------
def _bodies():
    from hypothesis import strategies as st

    from tests.server.test_server_fuzz import JUNK, NAME, PLAIN, TEXT

    def maybe(valid):  # a wrong value one time in six, so that most bodies reach their later fields
        return st.sampled_from([valid] * 5 + [JUNK]).flatmap(lambda chosen: chosen)

    def block(kind, **fields):
        return st.fixed_dictionaries({"type": st.just(kind), **{k: maybe(v) for k, v in fields.items()}})

    text = block("text", text=TEXT)
    use = block("tool_use", id=NAME, name=NAME, input=st.dictionaries(TEXT, PLAIN, max_size=2))
    result = block("tool_result", tool_use_id=NAME, content=TEXT | st.lists(text, max_size=2), is_error=st.booleans())
    blocks = st.lists(maybe(st.one_of(text, use, result, block("thinking"), block("tool_reference"))), max_size=3)
    message = st.fixed_dictionaries(
        {"role": maybe(st.sampled_from(["user", "assistant", "system"])), "content": maybe(TEXT | blocks)}
    )
    schema = st.fixed_dictionaries({"type": st.just("object")}, optional={"properties": maybe(st.just({}))})
    tool = st.fixed_dictionaries(
        {"name": maybe(NAME), "input_schema": maybe(schema)},
        optional={"type": maybe(st.sampled_from(["custom", "web_search_20250305"])), "defer_loading": JUNK},
    )
    choice = st.fixed_dictionaries(
        {"type": maybe(st.sampled_from(["auto", "any", "tool", "none"]))},
        optional={"name": maybe(NAME), "disable_parallel_tool_use": maybe(st.booleans())},
    )
    optional = {
        "system": TEXT | st.lists(text, max_size=2),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": choice,
        "stop_sequences": st.lists(NAME, max_size=2),
        "temperature": st.floats(0, 1),
        "top_k": st.integers(0, 100),
        "thinking": JUNK,
        "output_config": st.fixed_dictionaries({}, optional={"effort": TEXT, "format": JUNK}),
        "junk_field": JUNK,
    }
    return st.fixed_dictionaries(
        {
            "model": st.just(MODEL),
            "max_tokens": maybe(st.integers(1, 10**5)),
            "messages": maybe(st.lists(message, max_size=3)),
        },
        optional={k: maybe(v) for k, v in optional.items()},
    )


def test_fuzzed_bodies_are_a_request_or_a_4xx():
    from hypothesis import given

    from tests.server.test_server_fuzz import FUZZ

    @FUZZ
    @given(_bodies())
    def check(request):
        try:
            parsed = parse(request, DEFAULTS)
        except APIError as err:
            assert 400 <= err.status < 500
            json.dumps(anthropic_error(err), ensure_ascii=False).encode()
            return
        assert parsed.messages and parsed.messages[-1]["role"] != "assistant"

    check()
