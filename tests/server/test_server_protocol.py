"""The server's pure parts: request checks, structured output's requests, tool-call parsing, stop sequences, SSE
framing, the cache LRU."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from uag.core.config import GenerationConfig
from uag.core.grammar import response_format_constraint, tool_constraint
from uag.server.chat import ToolHold, fits, parse_tool_calls
from uag.server.errors import APIError
from uag.server.prompt_cache import MIN_FORK, ConversationCaches
from uag.server.protocol import ServerDefaults, parse_chat, parse_completion
from uag.server.streaming import ReplyText, StopText, sse

DEFAULTS = ServerDefaults(model="demo-target", drafter="lookup+demo-drafter", k=8, drafters=("lookup",))
HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _schema(parameters) -> dict:
    """Request fields declaring one tool with these `parameters` (what uag.server.chat.fits later reads)."""
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}


def chat(**fields):
    return parse_chat({"model": "demo-target", "messages": HI, **fields}, DEFAULTS)


def test_a_plain_request_takes_the_servers_defaults():
    request = chat()
    assert request.drafter == "lookup+demo-drafter"
    assert (request.config.strategy, request.config.k, request.config.temperature) == ("auto", 8, 0.0)
    assert request.config.max_tokens == DEFAULTS.max_tokens and not request.config.chat


def test_max_tokens_and_max_completion_tokens_are_one_setting_never_silently_dropped():
    assert chat(max_completion_tokens=7).config.max_tokens == 7
    assert chat(max_tokens=5).config.max_tokens == 5
    assert chat(max_tokens=7, max_completion_tokens=7).config.max_tokens == 7
    with pytest.raises(APIError, match=r"max_tokens \(5\) and max_completion_tokens \(7\) disagree") as caught:
        chat(max_tokens=5, max_completion_tokens=7)
    assert (caught.value.status, caught.value.param) == (400, "max_tokens")


def test_a_request_is_parsed_into_its_config_once_and_a_bad_one_names_its_own_field(monkeypatch):
    parses = []
    original = GenerationConfig.parse.__func__
    monkeypatch.setattr(
        GenerationConfig, "parse", classmethod(lambda cls, **raw: parses.append(raw) or original(cls, **raw))
    )
    request = chat(max_completion_tokens=7, temperature=0.5, top_k=40, speculative={"k": 4})
    assert len(parses) == 1 and (request.config.max_tokens, request.config.top_k, request.config.k) == (7, 40, 4)
    with pytest.raises(APIError, match="max tokens must be a whole number from 1 to 4096") as caught:
        chat(max_completion_tokens=10**6, top_k=40)
    assert (caught.value.status, caught.value.param) == (400, "max_completion_tokens")


@pytest.mark.parametrize(
    ("speculative", "drafter", "strategy", "k"),
    [
        (False, None, "baseline", None),
        (True, "lookup+demo-drafter", "auto", 8),
        ({"drafter": "lookup", "k": 4}, "lookup", "auto", 4),
        ({"strategy": "context", "k": 2}, "lookup+demo-drafter", "context", 2),
        ({"strategy": "context"}, "lookup+demo-drafter", "context", 2),  # auto's -k is a most, not a fixed length
        ({"strategy": "context", "k": 6}, "lookup+demo-drafter", "context", 6),
    ],
)
def test_speculative_narrows_the_defaults(speculative, drafter, strategy, k):
    request = chat(speculative=speculative)
    assert (request.drafter, request.config.strategy) == (drafter, strategy)
    if k is not None:
        assert request.config.k == k


@pytest.mark.parametrize(
    ("fields", "status", "param", "words"),
    [
        ({"n": 2}, 400, "n", "n must be 1"),
        ({"top_p": 0}, 400, "top_p", "above 0 and at most 1"),
        ({"top_k": -1}, 400, "top_k", "from 0 to"),
        ({"top_k": 2.5}, 400, "top_k", "whole number"),
        ({"min_p": 1.5}, 400, "min_p", "from 0 to 1"),
        ({"repetition_penalty": 0}, 400, "repetition_penalty", "above 0 and at most 10"),
        ({"presence_penalty": 3}, 400, "presence_penalty", "from -2 to 2"),
        ({"frequency_penalty": "some"}, 400, "frequency_penalty", "must be a number"),
        ({"temperature": 3}, 400, "temperature", "from 0 to 2"),
        ({"temperature": "hot"}, 400, "temperature", "must be a number"),
        ({"seed": -1}, 400, "seed", "from 0 to"),
        ({"max_tokens": 0}, 400, "max_tokens", "from 1"),
        ({"max_tokens": 10**6}, 400, "max_tokens", "max tokens"),
        ({"stop": [chr(97 + i) for i in range(17)]}, 400, "stop", "1 to 16"),
        ({"stop": [""]}, 400, "stop", "cannot be empty"),
        ({"stream": "yes"}, 400, "stream", "true or false"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed when stream"),
        ({"logprobs": True}, 400, "logprobs", "does not support logprobs"),
        ({"logit_bias": {"15": 5}}, 400, "logit_bias", "does not support"),
        ({"frobnicate": 1}, 400, "frobnicate", "unrecognized"),
        ({"model": "gpt-4"}, 404, "model", "does not exist"),
        ({"messages": []}, 400, "messages", "at least one message"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "must be one of"),
        ({"messages": [{"role": "user"}]}, 400, "messages[0].content", "required"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content", "text"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages[0].content", "UTF-8"),
        ({"speculative": {"drafter": "org/other"}}, 400, "speculative", "not served here"),
        ({"speculative": {"k": 9}}, 400, "speculative", "from 1 to 8"),
        ({"speculative": {"strategy": "baseline"}}, 400, "speculative", 'speculative": false'),
        ({"speculative": {"drafter": "lookup", "speed": 2}}, 400, "speculative", "unknown key"),
        ({"speculative": "fast"}, 400, "speculative", "must be false, true or an object"),
        ({"speculative": {"window": "4"}}, 400, "speculative", "window must be a whole number"),
        ({"speculative": {"strategy": ["auto"]}}, 400, "speculative", "strategy must be one of"),
        ({"n": 10**400}, 400, "n", "from 1 to"),
        ({"temperature": 10**400}, 400, "temperature", "from 0 to 2"),
        ({"max_tokens": float("inf")}, 400, "max_tokens", "whole number"),
        ({"messages": [{"role": "user", "content": "x", "name": 5}]}, 400, "messages[0].name", "must be a string"),
        ({"messages": [{"role": "tool", "content": "12 C"}]}, 400, "messages[0].tool_call_id", "required"),
        (
            {"messages": [*HI, {"role": "tool", "content": "x", "tool_call_id": None}]},
            400,
            "messages[1].tool_call_id",
            "id",
        ),
        ({"tools": [{"type": "function"}]}, 400, "tools[0]", "function"),
        ({"tool_choice": "required"}, 400, "tool_choice", "auto"),
        (_schema({"required": "city"}), 400, "tools[0].function.parameters", "required must be a list of strings"),
        (_schema({"properties": {"a": {"enum": None}}}), 400, "tools[0].function.parameters", "enum must be a list"),
        (_schema({"type": 3}), 400, "tools[0].function.parameters", "type must be a string"),
    ],
)
def test_bad_fields_are_one_clear_error(fields, status, param, words):
    with pytest.raises(APIError) as caught:
        chat(**fields)
    err = caught.value
    assert (err.status, err.param) == (status, param)
    assert words in err.message and "\n" not in err.message
    for python in ("Traceback", "float", "NoneType", "dict", "str object", "/work/"):
        assert python not in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_completions_take_one_prompt_string():
    request = parse_completion({"model": "demo-target", "prompt": ["Ala"], "max_tokens": 3}, DEFAULTS)
    assert (request.prompt, request.config.max_tokens) == ("Ala", 3)
    with pytest.raises(APIError, match="one string"):
        parse_completion({"model": "demo-target", "prompt": ["a", "b"]}, DEFAULTS)
    with pytest.raises(APIError, match="unrecognized"):
        parse_completion({"model": "demo-target", "prompt": "a", "messages": HI}, DEFAULTS)


def test_assistant_tool_calls_reach_the_template_as_objects():
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
    ]
    request = chat(messages=messages, tools=[WEATHER])
    assert request.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert request.messages[2] == {"role": "tool", "content": "12 C", "tool_call_id": "c1"}


# --- tool calls ---------------------------------------------------------------------------------------------------
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'


def _names(reply) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.calls]


@pytest.mark.parametrize(
    "text",
    [
        f"<tool_call>\n{OSLO}\n</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',  # unterminated at EOS
        f"```json\n{OSLO}\n```",
        f"```\n{OSLO}\n```",
        f"  {OSLO}\n",
        f"[{OSLO}]",
        f"```json\n[{OSLO}]\n```",
        f"<tool_call>\n{OSLO}\n</",  # the closing tag cut, the call whole
    ],
)
def test_one_tool_call_is_found_in_every_shape(text):
    reply = parse_tool_calls(text, [WEATHER])
    assert reply is not None and reply.content is None
    (call,) = reply.calls
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert call["id"].startswith("call_") and call["type"] == "function"


@pytest.mark.parametrize(
    "text",
    [
        f"<tool_call>\n{OSLO}\n</tool_call>\n<tool_call>\n{PARIS}\n</tool_call>",
        f"<tool_call>\n{OSLO}\n{PARIS}\n</tool_call>",  # two calls in one tag
        f"<tool_call>[{OSLO}, {PARIS}]</tool_call>",
        f"```json\n{OSLO}\n```\n```json\n{PARIS}\n```",
        f"```json\n{OSLO}\n{PARIS}\n```",
        f"```json\n[{OSLO}, {PARIS}]\n```",
        f"[{OSLO}, {PARIS}]",
        f"{OSLO}\n{PARIS}\n",  # what a forced call's grammar writes without tags
        f'{OSLO[:-1]}\n}}\n{{"name": "get_weather",\n "arguments": {{"city": "Paris", "unit": "C"}}}}',  # spread
    ],
)
def test_several_calls_in_one_reply_are_all_found(text):
    reply = parse_tool_calls(text, [WEATHER])
    assert reply is not None and reply.content is None
    assert _names(reply) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Paris", "unit": "C"})]
    assert len({call["id"] for call in reply.calls}) == 2


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (f"Let me check.\n<tool_call>{OSLO}</tool_call>", "Let me check."),
        (f"Both cities:\n<tool_call>{OSLO}</tool_call>\n<tool_call>{PARIS}</tool_call>\n", "Both cities:"),
        (f"Checking.\n```json\n{OSLO}\n```\n```json\n{PARIS}\n```\nOne moment.", "Checking.\nOne moment."),
        (f"<tool_call>{OSLO}</tool_call>\nThen I will answer.", "Then I will answer."),
        (f"```python\nx = 1\n```\n```json\n{OSLO}\n```", "```python\nx = 1\n```"),  # code is content
    ],
)
def test_the_text_outside_the_calls_is_the_content(text, content):
    reply = parse_tool_calls(text, [WEATHER])
    assert reply.content == content and reply.calls[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"name": "get_time", "arguments": {}}\n```',  # not a declared tool
        '```json\n{"name": "get_weather", "arguments": {"town": "Oslo"}}\n```',  # does not fit the schema
        '```json\n{"name": "get_weather", "arguments": {"city": ["Oslo", "Paris"]}}\n```',  # a list for a string
        '```json\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}\n```',  # not in the enum
        f'```json\n[{OSLO}, {{"name": "get_time", "arguments": {{}}}}]\n```',  # one of them no call
        f"Here: {OSLO}",  # bare, and not the whole reply
        f"{OSLO}\nDone.",
        "<tool_call>not json</tool_call>",
        "The weather is fine.",
        "```json\n[1, 2]\n```",
        "",
    ],
)
def test_other_text_stays_text(text):
    assert parse_tool_calls(text, [WEATHER]) is None


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', 0, None),
        ('```json\n{"name": "get_weather", "arguments": {"city": "Os', 0, None),
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "get_w', 0, None),
        (
            f'<tool_call>{OSLO}</tool_call>\n<tool_call>\n{{"name": "get_weather", "argu',
            1,
            '<tool_call>\n{"name": "get_weather", "argu',
        ),
    ],
)
def test_a_call_cut_off_is_no_call_and_its_text_stays(text, calls, content):
    """max_tokens cut the reply inside a call: no call is made of it, and its text is content, every character."""
    reply = parse_tool_calls(text, [WEATHER])
    if not calls:
        assert reply is None
    else:
        assert len(reply.calls) == calls and reply.content == content


def test_no_tools_no_calls():
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>', []) is None


def test_schema_fit():
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "xs": {"type": "array", "items": {"type": "string"}}},
        "required": ["n"],
    }
    assert fits({"n": 1, "xs": ["a"]}, schema)
    assert not fits({"n": True}, schema) and not fits({"n": 1, "xs": [1]}, schema) and not fits({}, schema)


def test_tool_hold_sends_text_but_holds_what_may_be_a_call():
    hold = ToolHold([WEATHER])
    assert hold.feed("Sure") == "Sure"
    assert hold.feed(" <tool_") == ""  # the space may precede a call, the rest may open a tag
    assert hold.feed(f"call>{OSLO}</tool_call>") == ""
    tail, calls = hold.finish()
    assert tail == "" and calls[0]["function"]["name"] == "get_weather" and hold.content == "Sure"


def test_tool_hold_releases_json_that_is_no_call_once_it_is_whole():
    hold = ToolHold([WEATHER])
    assert hold.feed('{"a": ') == ""  # may be a bare call: held
    assert hold.feed("1}") == '{"a": 1}'  # a whole object that is no call
    assert hold.finish() == ("", None) and hold.content == '{"a": 1}'


def test_tool_hold_passes_code_blocks_on_as_they_come():
    hold = ToolHold([WEATHER])
    assert hold.feed("Try:\n```") == "Try:"
    assert hold.feed("python\nprint(1)") == "\n```python\nprint(1)"
    assert hold.feed("\n```\n```json\n{") == "\n```"  # a JSON block may be a call
    assert hold.feed('"a": 1}\n```') == '\n```json\n{"a": 1}\n```'


REPLIES = [
    f"Sure, both:\n<tool_call>\n{OSLO}\n</tool_call>\n<tool_call>\n{PARIS}\n</tool_call>\n",
    f"```json\n{OSLO}\n```",  # the issue's reply: content was its text with the last backtick missing
    f"Checking.\n```json\n{OSLO}\n```\n```json\n{PARIS}\n```\nOne moment.",
    f"{OSLO}\n{PARIS}",
    f"[{OSLO}, {PARIS}]",
    f'<tool_call>{OSLO}</tool_call>\n<tool_call>\n{{"name": "get_weather", "argu',
    '{"name": "get_weather", "arguments": {"town": "Oslo"}}',
    "Code:\n```python\nprint('<tool_call>')\n```\nand <b>tags</b> `x` ``y``\n``",
    f"```python\nx = 1\n```\n```json\n{OSLO}\n```",  # a code block closes before the call's opens
    "  Plain text with trailing space \n",
    "<tool_call>not json</tool_call> after",
]


@pytest.mark.parametrize("text", REPLIES)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streamed_content_is_the_whole_replys_content(text, size):
    """However a reply arrives, the hold sends exactly its content (the text outside the calls, or all of it where
    it makes none), and the same calls."""
    hold = ToolHold([WEATHER])
    sent = "".join(hold.feed(text[i : i + size]) for i in range(0, len(text), size))
    tail, calls = hold.finish()
    whole = parse_tool_calls(text, [WEATHER])
    assert sent + tail == (text if whole is None else whole.content or "")
    assert hold.content == (text if whole is None else whole.content)
    assert (calls is None) == (whole is None) and (
        whole is None
        or _names(whole) == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    )


# --- structured output: response_format, tool_choice, parallel_tool_calls -------------------------------------------
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    ],
)
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_response_format_is_the_configs_constraint(response_format, kind):
    parse = parse_chat if kind == "chat" else parse_completion
    body = {"model": "demo-target", "response_format": response_format}
    config = parse({**body, **({"messages": HI} if kind == "chat" else {"prompt": "Ala"})}, DEFAULTS).config
    assert config.constraint == response_format_constraint(response_format) and config.constraint


def test_text_and_no_response_format_constrain_nothing():
    assert chat(response_format={"type": "text"}).config.constraint is None
    assert chat(response_format=None).config.constraint is None and chat().config.constraint is None


@pytest.mark.parametrize("parallel", [True, False])
def test_a_forcing_tool_choice_is_the_configs_constraint(parallel):
    required = chat(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=parallel)
    assert required.config.constraint == tool_constraint([WEATHER, ADD], None, parallel)
    named = chat(
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=parallel,
    )
    assert named.config.constraint == tool_constraint([WEATHER, ADD], "get_weather", parallel)
    assert named.parallel_tool_calls is parallel and named.tools


def test_auto_and_none_constrain_nothing_and_none_hides_the_tools():
    auto = chat(tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False)
    assert auto.config.constraint is None and auto.tools and auto.parallel_tool_calls is False
    assert chat(tools=[WEATHER]).parallel_tool_calls is True
    none = chat(tools=[WEATHER], tool_choice="none")
    assert none.config.constraint is None and none.tools == ()


NAMED = {"type": "function", "function": {"name": "get_time"}}
# Schemas no finite JSON value fits: llguidance compiles them, then cannot finish a reply (a 500 on the worker once).
ENDLESS = [
    {"$ref": "#"},
    {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"allOf": [{"$ref": "#"}]},
    {"type": "object", "required": ["x"], "additionalProperties": {"$ref": "#"}},
]
# Recursive schemas that do finish: an optional or nullable link, an array that may be empty, an alternative.
RECURSIVE = [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
    {
        "$defs": {"N": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/N"}}}}},
        "$ref": "#/$defs/N",
        "required": ["kids"],
    },
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
]


def _json_schema(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize("schema", RECURSIVE)
def test_a_recursive_schema_that_can_finish_is_taken(schema):
    assert chat(response_format=_json_schema(schema)).config.constraint is not None
    assert chat(tools=[_tool(schema)], tool_choice="required").config.constraint is not None


def test_strict_refuses_a_keyword_it_cannot_enforce_and_lenient_ignores_it():
    unknown = {"type": "object", "properties": {"a": {"type": "string"}}, "foo": 1}
    assert chat(response_format=_json_schema(unknown, strict=False)).config.constraint is not None
    annotated = {"type": "object", "title": "T", "description": "d", "$defs": {}, "properties": {"foo": {}}}
    assert chat(response_format=_json_schema(annotated)).config.constraint is not None  # a property may be "foo"


NOPE = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}  # compiles to no grammar
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}, "strict": True}}


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": BAD_SCHEMA}, "response_format", "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON, "strict": 1}}},
            "response_format",
            "strict must be true or false",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tools declares none"),
        ({"tool_choice": NAMED}, "tool_choice", "tools declares none"),
        ({"tool_choice": NAMED, "tools": [WEATHER]}, "tool_choice", '"get_time"'),
        ({"tool_choice": {"type": "function"}}, "tool_choice", '"required" or {"type": "function"'),
        ({"tool_choice": "any"}, "tool_choice", '"auto", "none", "required"'),
        (
            {"tool_choice": "required", "tools": [WEATHER], "response_format": {"type": "json_object"}},
            "response_format",
            "drop response_format to have the tool called, or tool_choice",
        ),
        (
            {"tool_choice": "required", "tools": [WEATHER, NOPE]},
            "tools[1].function.parameters",
            "tools[1].function.parameters",
        ),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
        *[({"response_format": _json_schema(schema)}, "response_format", "no finite JSON value") for schema in ENDLESS],
        *[
            ({"tool_choice": "required", "tools": [WEATHER, _tool(schema)]}, "tools[1].function.parameters", "finite")
            for schema in ENDLESS
        ],
        ({"response_format": _json_schema({"type": "object", "foo": 1})}, "response_format", "'foo' (at #)"),
        (
            {
                "response_format": _json_schema(
                    {"type": "object", "properties": {"a": {"type": "string", "nullable": 1}}}
                )
            },
            "response_format",
            "'nullable' (at #/properties/a)",
        ),
        (
            {
                "tool_choice": "required",
                "tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True, "parameters": {"x-y": 1}}}],
            },
            "tools[0].function.parameters",
            "'x-y'",
        ),
    ],
)
def test_bad_structured_output_is_one_clear_error(fields, param, words):
    with pytest.raises(APIError) as caught:
        chat(**fields)
    err = caught.value
    assert (err.status, err.param) == (400, param)
    assert words in err.message and "\n" not in err.message and err.message.isprintable()
    assert len(err.message) <= 320


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_grammar_is_refused_on_a_sharded_server(fields, param):
    """The sharded ranks run the config they are sent without a grammar: a 400 naming --shard, not a reply that
    ignores the schema."""
    sharded = ServerDefaults(model="m", drafter="lookup", checks=False)
    with pytest.raises(APIError, match="not available on a sharded server \\(--shard\\)") as err:
        parse_chat({"model": "m", "messages": HI, **fields}, sharded)
    assert (err.value.status, err.value.param) == (400, param)
    assert parse_chat({"model": "m", "messages": HI, "tools": [WEATHER]}, sharded).config.constraint is None


# --- stop sequences and framing ------------------------------------------------------------------------------------
def test_stop_text_never_sends_a_stop_sequence():
    stop = StopText(["END", "\n\n"])
    assert stop.feed("abc E") == ("abc ", False)
    assert stop.feed("N") == ("", False)
    assert stop.feed("D more") == ("", True)
    assert stop.text == "abc "


@pytest.mark.parametrize("cut", range(1, 12))
def test_stop_text_is_the_same_however_the_text_is_split(cut):
    text = "Ala ma kota\n\nA kot ma Alę"
    out = ReplyText(stops=["\n\n"])
    first, stopped = out.feed(text[:cut])
    second, stopped = out.feed(text[cut:]) if not stopped else ("", True)
    assert first + second == "Ala ma kota" and stopped


def test_sse_frames_compact_utf8_json():
    assert sse({"a": "ę"}) == 'data: {"a":"ę"}\n\n'.encode()


# --- the conversation caches ---------------------------------------------------------------------------------------
@dataclass
class Held:
    target_ids: list[int]
    size: int = 10
    extra: list = field(default_factory=list)

    def nbytes(self) -> int:
        return self.size

    def prefix(self, n: int) -> Held:
        return Held(self.target_ids[:n], self.size, ["copy of", self])


def test_the_longest_shared_prefix_wins_and_leaves_the_lru():
    lru = ConversationCaches(max_bytes=100)
    a, b = Held([1, 2, 3]), Held([1, 9, 9])
    lru.put("t", a)
    lru.put("t", b)
    assert lru.take("t", [1, 2, 3, 4]) is a
    assert lru.take("t", [1, 2, 3, 4]) is None  # taken: no two runs share it
    assert lru.take("other", [1, 9, 9]) is None and lru.take("t", [1, 9, 9]) is b


def test_another_conversation_does_not_take_a_cache_it_shares_little_with():
    lru = ConversationCaches(max_bytes=100)
    held = Held([1, 2, 3, 4, 5, 6])
    lru.put("t", held)
    assert lru.take("t", [1, 2, 7]) is None
    assert lru.take("t", [1, 2, 3]) is held  # a retried turn: its prompt is held


def test_a_long_shared_head_is_copied_out_of_an_entry_the_prompt_may_not_take():
    """aider re-sends a long head, then rewrites what follows: the head is copied and the entry stays."""
    lru = ConversationCaches(max_bytes=100)
    head = list(range(MIN_FORK))
    held = Held([*head, *range(1000, 1400)])
    lru.put("t", held)
    copy = lru.take("t", [*head, *range(2000, 2500)])
    assert copy.target_ids == head and copy.extra == ["copy of", held]
    assert len(lru) == 1 and lru.forks == 1 and lru.hits == 0
    assert lru.take("t", [*head[:-1], *range(3000, 3400)]) is None  # a shorter head is read cold
    assert lru.take("other", [*head, 5]) is None
    assert lru.take("t", [*head, *range(1000, 1400), 7]) is held  # its own next turn still takes it


def test_the_least_recent_entries_go_beyond_the_budget():
    lru = ConversationCaches(max_bytes=25)
    first, second, third = Held([1], 10), Held([2], 10), Held([3], 10)
    for held in (first, second, third):
        lru.put("t", held)
    assert len(lru) == 2 and lru.evictions == 1
    assert lru.take("t", [1, 5]) is None and lru.take("t", [3, 5]) is third
    lru.put("t", Held([4], 30))  # larger than the whole budget: not kept
    assert lru.take("t", [4, 5]) is None


def test_forgetting_a_model_drops_its_entries():
    lru = ConversationCaches(max_bytes=100)
    lru.put("demo-target", Held([1, 2]))
    lru.forget("demo-target")
    assert len(lru) == 0


def test_serve_takes_the_dtypes_generate_takes():
    """`uag serve --target-dtype/--drafter-dtype`, checked as `uag generate` checks them, every bad flag named."""
    from tests.support.server import serve_args
    from uag.errors import InputError

    settings = serve_args("--target-dtype", "bf16", "--drafter-dtype", "4-bit")
    assert settings.target_dtype == "bfloat16" and settings.drafter_dtype == "q4"
    assert serve_args().target_dtype is None  # as stored
    with pytest.raises(InputError, match="--target-dtype: unknown dtype 'int3'.*; --drafter-dtype: unknown"):
        serve_args("--target-dtype", "int3", "--drafter-dtype", "fp7")


def test_auto_off_switches_parts_of_auto_off_and_only_where_auto_runs():
    """`uag serve --auto-off NAME` (an ablation, repeatable): AutoSettings with those switches off; refused with a
    fixed strategy, which has no auto to switch, and with --shard."""
    from tests.support.server import serve_args
    from uag.core.policy import AutoSettings
    from uag.errors import InputError

    assert serve_args().auto is None  # as shipped
    auto = serve_args("--auto-off", "stop_rule", "--auto-off", "carried").auto
    assert auto == AutoSettings(stop_rule=False, carried=False)
    with pytest.raises(InputError, match="--auto-off switches off parts of auto: --strategy context has none"):
        serve_args("--strategy", "context", "--auto-off", "stop_rule")
    with pytest.raises(SystemExit):  # argparse names the choices
        serve_args("--auto-off", "pace")


def test_check_is_greedy_only_and_a_bool():
    defaults = ServerDefaults(model="m", drafter="lookup")
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse_chat({**body, "speculative": {"check": True}}, defaults).check is True
    assert parse_chat(body, defaults).check is False
    for bad_value, words in (({"check": 1}, "check must be true or false"), ({"check": True}, "temperature 0")):
        extra = {"temperature": 0.5} if words == "temperature 0" else {}
        with pytest.raises(APIError, match=words):
            parse_chat({**body, **extra, "speculative": bad_value}, defaults)


def test_check_is_refused_on_a_sharded_server():
    """Under --shard the near-tie margins would need the target on rank 0 alone: a 400 naming --shard, not a
    request that fails half way."""
    sharded = ServerDefaults(model="m", drafter="lookup", checks=False)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(APIError, match="not available on a sharded server \\(--shard\\)") as err:
        parse_chat({**body, "speculative": {"check": True}}, sharded)
    assert err.value.status == 400 and err.value.param == "speculative"
    assert parse_chat({**body, "speculative": {"check": False}}, sharded).check is False


def test_serve_k_defaults_to_autos_longest_draft_and_the_studys_k_for_a_fixed_strategy():
    """`-k` is auto's longest draft (16: a long lookup match copies that far in one pass); a fixed strategy
    drafts k every cycle, so without -k it keeps the study's k = 2; -k given is kept either way."""
    from tests.support.server import serve_args

    assert serve_args().config.k == 16
    assert serve_args("--strategy", "context").config.k == 2
    assert serve_args("--strategy", "context", "-k", "5").config.k == 5
    assert serve_args("-k", "8").config.k == 8


# --- samplers, nulls, and values no error may echo raw ------------------------------------------------------------
SAMPLING = {
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_samplers_clients_send_reach_the_config(kind):
    body = {"model": "demo-target", "temperature": 0.7, **SAMPLING}
    parse = parse_chat if kind == "chat" else parse_completion
    config = parse({**body, **({"messages": HI} if kind == "chat" else {"prompt": "Ala"})}, DEFAULTS).config
    assert {name: getattr(config, name) for name in SAMPLING} == SAMPLING and config.temperature == 0.7
    plain = chat(**dict.fromkeys(SAMPLING)).config  # null: as if absent, every sampler off
    assert (plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (1, 0, 0, 1)
    assert plain.presence_penalty == plain.frequency_penalty == 0


def test_check_takes_penalties_at_temperature_0():
    """Greedy with a penalty is still deterministic, so the check compares it; sampling still is refused."""
    request = chat(repetition_penalty=1.3, top_k=5, speculative={"check": True})
    assert request.check and request.config.repetition_penalty == 1.3
    with pytest.raises(APIError, match="temperature 0"):
        chat(temperature=0.5, repetition_penalty=1.3, speculative={"check": True})


def test_null_keys_of_speculative_take_the_servers_defaults():
    request = chat(speculative={"k": None, "window": None, "strategy": None, "drafter": None, "check": None})
    assert (request.drafter, request.config.strategy, request.config.k) == ("lookup+demo-drafter", "auto", 8)
    assert request.config.window == DEFAULTS.window and not request.check


LONE = "\ud800"  # what a client's JSON "\\ud800" decodes to: no UTF-8 encoding exists for it


def _called(*calls) -> dict:
    """Request fields whose second message is an assistant's with these tool calls."""
    return {"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": list(calls)}]}


TOOL = {"type": "function", "function": {"name": "f"}}
ARGUMENTS = "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": LONE}, "n"),
        ({"model": LONE}, "model"),
        ({LONE: 1}, "\\ud800"),
        ({"speculative": {"strategy": LONE}}, "speculative"),
        ({"speculative": {"drafter": LONE}}, "speculative"),
        ({"speculative": {LONE: 1}}, "speculative"),
        ({"messages": [{"role": LONE, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": LONE}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": [{"type": LONE}]}]}, "messages[0].content"),
        (_called({"id": LONE, "function": {"name": "f", "arguments": "{}"}}), "messages[1].tool_calls[0].id"),
        (_called({"function": {"name": "f", "arguments": {"x": [LONE]}}}), ARGUMENTS),
        (_called({"function": {"name": "f", "arguments": '{"x": "\\ud800"}'}}), ARGUMENTS),  # the escape, in JSON text
        ({"tool_choice": LONE}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": LONE}}, "tools": [WEATHER]}, "tool_choice"),
        ({"response_format": {"type": LONE}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": [LONE]}}}}, "response_format"),
        ({"tools": [{**TOOL, "function": {"name": LONE}}]}, "tools[0].function"),
        ({"tools": [{**TOOL, "function": {"name": "f", "description": LONE}}]}, "tools[0].function"),
        ({"stop": [LONE]}, "stop"),
        ({"logprobs": LONE}, "logprobs"),
        ({"stream": True, "stream_options": {"include_usage": LONE}}, "stream_options"),
    ],
)
def test_no_error_echoes_a_lone_surrogate(body, param):
    """Found by an attacker: "\\ud800" echoed into a message could not be encoded, and the server answered 500."""
    with pytest.raises(APIError) as caught:
        parse_chat({"model": "demo-target", "messages": HI, **body}, DEFAULTS)
    err = caught.value
    assert (err.status // 100, err.param) == (4, param)
    json.dumps(err.body(), ensure_ascii=False).encode("utf-8")  # what the HTTP layer does: no UnicodeEncodeError
    assert err.message.isprintable()


def test_a_completions_prompt_list_is_echoed_printable():
    with pytest.raises(APIError) as caught:
        parse_completion({"model": "demo-target", "prompt": [LONE, "\x1b[31m"]}, DEFAULTS)
    assert '"\\ud800", "\\u001b[31m"' in caught.value.message


def test_assistant_tool_calls_are_typed():
    def calls(*items):
        return chat(**_called(*items))

    blank = calls({"id": "c1", "function": {"name": "f", "arguments": "  "}}).messages[1]["tool_calls"][0]
    assert blank["function"]["arguments"] == {} and blank["id"] == "c1"
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    for call, words in (
        ({"id": 7, "function": {"name": "f"}}, "must be a string"),
        ({"function": {"name": "f", "arguments": "[1]"}}, "must be a JSON object"),
        ({"function": {"name": "f", "arguments": "{"}}, "not JSON"),
        ({"function": {"name": "f", "arguments": {"a": deep}}}, "nested more than 32 levels"),
    ):
        with pytest.raises(APIError, match=words):
            calls(call)
