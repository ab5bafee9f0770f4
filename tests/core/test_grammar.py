"""The grammar seam (uag.core.grammar) on real tokenizers: constraints checked up front, a matcher that follows
replies token by token, masks that equal consuming one by one, forced tokens, stop ids, banned rows.

Tokenizers: Qwen2.5's (rebuilt offline, 151665 ids under a 151936-wide lm_head, with the <tool_call> tags), the
demo target's Gemma-3 SentencePiece (262k, stop ids 1 and 106; slow: it converts on a fresh machine) and, where
converted, the coder target's Qwen folder (its "[PAD151665]".. rows). Only tokenizers load, never weights.
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest

from tests.support import real_tokenizers
from tests.support.coder import needs_coder_pair
from uag.core.grammar import (
    Matcher,
    TokenTable,
    describe,
    response_format_constraint,
    tool_constraint,
)
from uag.errors import InputError, ModelError

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
UNIQUE = {"type": "array", "uniqueItems": True}  # a keyword llguidance cannot enforce
BROKEN_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
JSON_OBJECT = response_format_constraint({"type": "json_object"})
SCHEMA = response_format_constraint(
    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
)


class Target:
    """A target's tokenizer with its grammar table: width = the lm_head's rows, every stop id."""

    def __init__(self, hf, width: int, eos_ids: list[int]):
        self.hf, self.eos_ids = hf, eos_ids
        self.table = TokenTable.of(hf, width, eos_ids)

    def ids(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def text(self, ids) -> str:
        return self.hf.decode(ids)

    def matcher(self, constraint: str, reply: str = "") -> Matcher:
        matcher = Matcher(self.table, constraint)
        matcher.consume(self.ids(reply))
        return matcher


def _folder(name: str):
    from uag.models import demo

    try:
        return demo.ensure(name)
    except ModelError as err:
        pytest.skip(f"{name} cannot be converted here: {err}")


@cache
def _load(name: str) -> Target:
    from transformers import AutoTokenizer

    if name == "qwen2.5":
        return Target(real_tokenizers.load(name), 151936, [151645, 151643])
    folder = _folder(name)
    config = json.loads((folder / "config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    return Target(AutoTokenizer.from_pretrained(folder), config["vocab_size"], eos)


TARGETS = [
    "qwen2.5",
    pytest.param("demo-target", marks=pytest.mark.slow),
    pytest.param("coder-target", marks=needs_coder_pair),
]


@pytest.fixture(scope="module", params=TARGETS)
def target(request) -> Target:
    return _load(request.param)


@pytest.fixture(scope="module")
def qwen() -> Target:
    return _load("qwen2.5")


def allowed(row: np.ndarray) -> set[int]:
    """Every id a mask row allows."""
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


# --- a matcher following replies ------------------------------------------------------------------------------------


@pytest.mark.parametrize("constraint", [JSON_OBJECT, SCHEMA], ids=["json_object", "json_schema"])
def test_a_valid_reply_is_allowed_token_by_token_and_then_only_the_stop_ids(target, constraint):
    reply = target.ids('{"name": "Zażółć Jaźń", "age": 42, "tags": ["x", {"y": null}]}')
    matcher = target.matcher(constraint)
    assert matcher.valid(reply) == len(reply)
    for token in reply:
        row = matcher.masks([])[0]
        assert Matcher.allows(row, token), target.text([token])
        assert not any(Matcher.allows(row, stop) for stop in target.eos_ids)  # not accepting yet
        matcher.consume([token])
    assert allowed(matcher.masks([])[0]) == set(target.eos_ids)  # the object is closed: only a stop id ends it
    assert matcher.stopped and matcher.forced() == [] and matcher.valid(target.ids("\n")) == 0
    matcher.consume([target.eos_ids[-1]])  # the stop id the engine samples, ignored
    assert matcher.stopped and matcher.forced() == []
    assert allowed(matcher.masks([])[0]) == set(target.eos_ids)
    assert matcher.ms > 0


def test_valid_stops_at_the_first_token_the_schema_refuses(target):
    good = target.ids('{"name": "Ala", "age":')
    reply = target.ids('{"name": "Ala", "age": true}')  # a boolean where an integer is declared
    assert reply[: len(good)] == good
    matcher = target.matcher(SCHEMA)
    assert matcher.valid(reply) == len(good)
    assert matcher.valid(reply) == len(good)  # state unchanged
    matcher.consume(good)
    assert matcher.valid(reply[len(good) :]) == 0
    assert matcher.valid(target.ids(" 7}")) == len(target.ids(" 7}"))


def test_json_object_refuses_what_is_not_an_object(target):
    assert target.matcher(JSON_OBJECT).valid(target.ids("[1, 2]")) == 0
    assert target.matcher(JSON_OBJECT).valid(target.ids("Sure! {")) == 0


def test_masks_for_a_draft_equal_consuming_it_one_by_one(target):
    reply = target.ids('{"name": "Ala", "age": 42, "tags": ["x"]}')
    draft = reply[3:9] + target.ids(" oops") + reply[9:12]
    matcher, sequential = target.matcher(SCHEMA), target.matcher(SCHEMA)
    matcher.consume(reply[:3])
    sequential.consume(reply[:3])
    before = matcher.masks([])
    n = matcher.valid(draft)
    assert n == 6
    rows = matcher.masks(draft)
    assert rows.shape == (len(draft) + 1, target.table.words) and rows.dtype == np.int32
    for i in range(n + 1):
        np.testing.assert_array_equal(rows[i], sequential.masks([])[0], err_msg=f"row {i}")
        if i < n:
            sequential.consume([draft[i]])
    assert not rows[n + 1 :].any()
    np.testing.assert_array_equal(matcher.masks([]), before)  # state unchanged


def test_committing_a_refused_token_is_a_bug(qwen):
    matcher = qwen.matcher(JSON_OBJECT, "{")
    with pytest.raises(RuntimeError, match="refuses committed token"):
        matcher.consume(qwen.ids("]"))


@pytest.mark.parametrize(
    "schema",
    [{"$ref": "#"}, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}],
)
def test_a_grammar_llguidance_gives_up_on_is_the_requests_error_not_a_bug(qwen, schema):
    """Schemas no finite value fits, sent past the request's checks: llguidance compiles them, then gives up (only
    the stop id allowed, or an endless forced prefix). Committing then says so as an InputError (a 4xx), not the
    RuntimeError of an engine bug (a 500)."""
    constraint = {"kind": "json_schema", "name": "endless", "schema": schema, "strict": True}
    matcher = Matcher(qwen.table, json.dumps(constraint))
    matcher.masks([])
    with pytest.raises(InputError, match=r"the grammar \(json_schema endless\) admits no continuation here"):
        matcher.consume(matcher.forced() or qwen.eos_ids[:1])
    with pytest.raises(InputError, match="no finite JSON value fits this schema"):
        response_format_constraint({"type": "json_schema", "json_schema": {"schema": schema}})


def test_banned_rows_are_never_allowed_even_inside_a_string(target):
    matcher = target.matcher(JSON_OBJECT, '{"a": "x')
    row = matcher.masks([])[0]
    assert Matcher.allows(row, target.ids("y")[0])
    assert not allowed(row) & target.table.banned
    assert max(allowed(row)) < target.table.width
    if target.table.width > len(target.hf):  # Qwen: 151665 ids (stock) or "[PAD151665]".. rows under 151936
        assert {151665, 151935} <= target.table.banned


@needs_coder_pair
def test_the_coder_targets_pad_rows_are_banned():
    coder = _load("coder-target")
    assert len(coder.hf) == 151936 and coder.hf.convert_ids_to_tokens(151665) == "[PAD151665]"
    assert set(range(151665, 151936)) <= coder.table.banned
    assert coder.table.banned.isdisjoint(coder.eos_ids)


# --- tool calls -----------------------------------------------------------------------------------------------------


def _call(target: Target, name: str, arguments: str) -> str:
    call = f'{{"name": "{name}", "arguments": {arguments}}}'
    return f"<tool_call>\n{call}\n</tool_call>" if target.table.tool_tags else call


def test_a_named_tools_call_is_forced_up_to_its_first_argument(target):
    matcher = target.matcher(tool_constraint(TOOLS, "get_weather"))
    call = '{"name": "get_weather", "arguments": {"city":'  # the name and the keys are free drafts
    assert target.text(matcher.forced()) == ("<tool_call>\n" if target.table.tool_tags else "") + call


def test_any_tools_call_forces_the_keys_but_lets_the_model_pick_the_name(qwen):
    matcher = qwen.matcher(tool_constraint(TOOLS))
    assert qwen.text(matcher.forced()) == '<tool_call>\n{"name":'  # then ' "' or a token running into the name
    matcher.consume(matcher.forced() + qwen.ids(' "add'))
    assert qwen.text(matcher.forced()) == '", "arguments": {"a":'
    matcher = qwen.matcher(tool_constraint(TOOLS, "get_weather"), "<tool_call>\n{")
    assert qwen.text(matcher.forced()) == '"name": "get_weather", "arguments": {"city":'


def test_parallel_calls_follow_one_another_unless_one_is_asked_for(target):
    one = _call(target, "get_weather", '{"city": "Kraków"}')
    two = one + "\n" + _call(target, "add", '{"a": 1, "b": 2.5}')
    parallel = target.matcher(tool_constraint(TOOLS))
    assert parallel.valid(target.ids(two)) == len(target.ids(two))
    single = target.matcher(tool_constraint(TOOLS, parallel=False), one)
    assert set(target.eos_ids) < allowed(single.masks([])[0])  # the call is done: a stop id, or a line break
    rest = target.ids("\n" + two[len(one) + 1 :])  # (a model may end its last call's line before it stops)
    assert single.valid(rest) < len(rest)  # but never a second call


def test_arguments_must_fit_the_tools_schema(target):
    matcher = target.matcher(tool_constraint(TOOLS, "get_weather"))
    matcher.consume(matcher.forced())
    assert matcher.valid(target.ids(' "Kraków"}}')) > 0
    assert matcher.valid(target.ids(' ["Kraków", "Łódź"]}}')) == 0  # a list where a string is declared


def test_a_tools_local_references_still_resolve_inside_the_call(qwen):
    tool = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "$defs": {"City": {"type": "string", "enum": ["Kraków", "Łódź"]}},
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/City"}},
                "required": ["to"],
                "additionalProperties": False,
            },
        },
    }
    constraint = tool_constraint([tool, TOOLS[1]])
    good = qwen.ids(_call(qwen, "book", '{"to": "Łódź"}'))
    bad = qwen.ids(_call(qwen, "book", '{"to": "Paris"}'))
    assert qwen.matcher(constraint).valid(good) == len(good)
    assert qwen.matcher(constraint).valid(bad) < len(bad)


def test_a_tokenizer_without_the_tags_gets_bare_json_calls(qwen):
    from transformers import AutoTokenizer

    mistral = AutoTokenizer.from_pretrained(real_tokenizers.build("mistral-v1"))
    bare = Target(mistral, 32000, [mistral.eos_token_id])
    assert bare.table.tool_tags is None and qwen.table.tool_tags == (151657, 151658)
    matcher = bare.matcher(tool_constraint(TOOLS, "add"))
    assert bare.text(matcher.forced()).startswith('{"name": "add", "arguments": {"')


# --- constraints checked up front -----------------------------------------------------------------------------------


def test_text_and_nothing_are_no_constraint():
    assert response_format_constraint(None) is None
    assert response_format_constraint({"type": "text"}) is None


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ({"type": "xml"}, "response_format.type must be text, json_object or json_schema (got 'xml')"),
        ("json", "response_format must be an object"),
        ({"type": "json_schema"}, "response_format.json_schema must be an object with a schema"),
        ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema.schema must be"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}, "response_format.json_schema.schema: "),
        (
            {"type": "json_schema", "json_schema": {"strict": True, "schema": UNIQUE}},
            'response_format.json_schema.schema: Unimplemented keys: ["uniqueItems"]',
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict must be",
        ),
    ],
)
def test_a_bad_response_format_is_refused_naming_the_part(response_format, message):
    with pytest.raises(InputError) as caught:
        response_format_constraint(response_format)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_what_strict_refuses_a_lenient_schema_ignores():
    constraint = response_format_constraint({"type": "json_schema", "json_schema": {"name": "s", "schema": UNIQUE}})
    assert json.loads(constraint)["strict"] is False


@pytest.mark.parametrize(
    ("tools", "name", "message"),
    [
        ([TOOLS[0], BROKEN_TOOL], None, "tools[1].function.parameters: "),
        (TOOLS, "x", 'tool_choice names "x", which tools does not declare'),
        ([{"type": "retrieval"}], None, "tools[0] must be a function tool"),
        ([{"type": "function", "function": {}}], None, "tools[0].function must be an object with a name"),
        ([], None, "tool_choice requires a call, but tools declares no function"),
    ],
)
def test_bad_tools_are_refused_naming_the_part(tools, name, message):
    with pytest.raises(InputError) as caught:
        tool_constraint(tools, name)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_function_without_parameters_takes_empty_arguments(qwen):
    constraint = tool_constraint([{"type": "function", "function": {"name": "now"}}])
    matcher = qwen.matcher(constraint)
    assert qwen.text(matcher.forced()) == '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    good = qwen.ids('<tool_call>\n{"name": "now", "arguments":')
    assert matcher.valid(good + qwen.ids(' {"when": 1}}')) == len(good)


def test_describe():
    assert describe(JSON_OBJECT) == "json_object"
    assert describe(SCHEMA) == "json_schema person"
    assert describe(response_format_constraint({"type": "json_schema", "json_schema": {"schema": {}}})) == "json_schema"
    assert describe(tool_constraint(TOOLS)) == "tool calls (get_weather, add)"
    assert describe(tool_constraint(TOOLS, "add", parallel=False)) == "one tool call (add)"


def test_constraints_are_json_texts_that_keep_the_schemas_key_order():
    constraint = response_format_constraint({"type": "json_schema", "json_schema": {"schema": PERSON}})
    assert list(json.loads(constraint)["schema"]["properties"]) == ["name", "age", "tags"]
    assert constraint == response_format_constraint({"type": "json_schema", "json_schema": {"schema": PERSON}})


# --- the token table ------------------------------------------------------------------------------------------------


def test_a_token_table_is_built_once_per_tokenizer(qwen):
    assert TokenTable.of(qwen.hf, 151936, [151643, 151645]) is qwen.table
    assert qwen.table.width == 151936 and qwen.table.words == 4748


def test_an_mlx_lm_tokenizer_wrapper_is_read_through_to_its_hf_tokenizer(qwen):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from uag.core.grammar import _hf_tokenizer

    assert _hf_tokenizer(TokenizerWrapper(qwen.hf)) is qwen.hf
