"""The grammar seam: `response_format` and forced tool calls as constraints, and a matcher the engine follows.

A constraint is a JSON text (what `GenerationConfig.constraint` holds) checked once, without a model, so a bad
schema is refused before any model runs. A `Matcher` compiles it for one target tokenizer with llguidance and
follows the committed target tokens: which tokens it forces next (free drafts), how much of a proposal it allows,
and the masks for every position the target samples or verifies (int32 words, one bit per token id). No mlx.

Example: m = Matcher(TokenTable.of(tokenizer, 151936, [151645, 151643]), response_format_constraint(
{"type": "json_object"})); m.masks(proposed)[0] -> the tokens a JSON object may start with
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnp
import numpy as np

from uag.errors import InputError

log = logging.getLogger(__name__)


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"  # Qwen2.5 / Hermes tags, where the vocabulary has them
# Replies and tool calls are written as json.dumps writes them (no line breaks or indents, ", " and ": "), so that
# keys and punctuation are forced tokens (free drafts) and a small model cannot loop on whitespace.
COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_PAD = re.compile(r"\[PAD(\d+)\]")  # llama.cpp's names for the rows that pad a vocabulary to the lm_head's width


# --- constraints: OpenAI's request parts as one checked JSON text ---------------------------------------------


def response_format_constraint(response_format: Mapping[str, Any] | None) -> str | None:
    """OpenAI's `response_format` as a constraint text, or None where the reply is free text.

    Example: {"type": "json_object"} -> '{"kind":"json_object"}'; {"type": "text"} -> None
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InputError(f"response_format must be an object (got {_shown(response_format)})")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _dumps({"kind": "json_object"})
    if kind != "json_schema":
        raise InputError(f"response_format.type must be text, json_object or json_schema (got {_shown(kind)})")
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InputError(f"response_format.json_schema must be an object with a schema (got {_shown(spec)})")
    name, schema, strict = spec.get("name"), spec.get("schema", {}), spec.get("strict") or False
    if name is not None and not isinstance(name, str):
        raise InputError(f"response_format.json_schema.name must be a string (got {_shown(name)})")
    if not isinstance(schema, Mapping):
        raise InputError(f"response_format.json_schema.schema must be a JSON Schema object (got {_shown(schema)})")
    if not isinstance(strict, bool):
        raise InputError(f"response_format.json_schema.strict must be true or false (got {_shown(strict)})")
    part = "response_format.json_schema.schema"
    _must_finish(schema, part)
    _check(_schema_grammar(schema, {"lenient": not strict}), part)
    if strict:  # after llguidance, which names the JSON Schema keywords it does not implement
        _only_enforced(schema, part)
    return _dumps({"kind": "json_schema", "name": name, "schema": schema, "strict": strict})


def tool_constraint(tools: Sequence[Mapping], name: str | None = None, parallel: bool = True) -> str:
    """A constraint forcing tool calls: of any declared tool (`name` None) or of the named one; one or more calls
    one after another with `parallel`, else exactly one. Each call is {"name": ..., "arguments": ...}, its
    arguments fitting the tool's parameters schema.

    Example: tool_constraint([{"type": "function", "function": {"name": "add", "parameters": {...}}}], "add")
    """
    declared = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InputError(f"{where} must be a function tool: {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InputError(f"{where}.function must be an object with a name")
        parameters = function.get("parameters")
        if parameters is None:  # OpenAI: "omitting parameters defines a function with an empty parameter list"
            parameters = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(parameters, Mapping):
            raise InputError(f"{where}.function.parameters must be a JSON Schema object (got {_shown(parameters)})")
        strict, part = function.get("strict") is True, f"{where}.function.parameters"
        _must_finish(parameters, part)
        _check(_schema_grammar(_call_schema(function["name"], parameters), {"lenient": not strict}), part)
        if strict:
            _only_enforced(parameters, part)
        declared.append({"name": function["name"], "parameters": parameters, "strict": strict})
    if name is not None:
        declared = [tool for tool in declared if tool["name"] == name]
        if not declared:
            raise InputError(f'tool_choice names "{name}", which tools does not declare')
    if not declared:
        raise InputError("tool_choice requires a call, but tools declares no function")
    constraint = {"kind": "tool_calls", "tools": declared, "parallel": bool(parallel)}
    _check(_tool_grammar(constraint, tags=None), "tools")
    return _dumps(constraint)


def describe(constraint: str) -> str:
    """A short label for logs and records.

    Example: a tool constraint over get_weather and add -> "tool calls (get_weather, add)"
    """
    spec = json.loads(constraint)
    if spec["kind"] == "json_schema":
        return f"json_schema {spec['name']}" if spec.get("name") else "json_schema"
    if spec["kind"] == "tool_calls":
        names = ", ".join(tool["name"] for tool in spec["tools"])
        return f"tool calls ({names})" if spec["parallel"] else f"one tool call ({names})"
    return spec["kind"]


def _dumps(spec: Mapping[str, Any]) -> str:
    # Compact and in the client's key order: a schema's property order is the order its keys are written in.
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())


_BROKEN = "\0"  # marks a grammar llguidance would not even build: the rest is its message


def _schema_grammar(schema: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(dict(schema), overrides=dict(options))
    except (ValueError, TypeError) as err:
        return _BROKEN + str(err)


def _check(grammar: str, part: str) -> None:
    """InputError naming `part` where llguidance cannot compile `grammar`, or where it compiles to a grammar that
    cannot start a reply: checked over a vocabulary of the 256 bytes, so no target tokenizer is needed."""
    error = grammar[1:] if grammar.startswith(_BROKEN) else llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InputError(f"{part}: {_one_line(error)}")
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise InputError(f"{part}: {_one_line(matcher.get_error())}")
    if matcher.is_stopped() and not matcher.is_accepting():
        raise InputError(f"{part}: the grammar admits no reply ({matcher.stop_reason()})")


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes and an end token: what `_check` compiles grammars for."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_bytes: llguidance.LLTokenizer | None = None


def _byte_tokenizer() -> llguidance.LLTokenizer:
    global _bytes
    if _bytes is None:
        _bytes = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257)
    return _bytes


# Keywords a strict schema may use: those llguidance enforces, and annotations that constrain nothing. It ignores a
# keyword it does not know ("foo", OpenAPI's "nullable") and refuses the JSON Schema keywords it does not implement.
ENFORCED = frozenset(
    "type enum const anyOf oneOf allOf $ref properties required additionalProperties patternProperties "
    "minProperties maxProperties items prefixItems additionalItems minItems maxItems minLength maxLength pattern "
    "format minimum maximum exclusiveMinimum exclusiveMaximum multipleOf".split()
)
ANNOTATIONS = frozenset(
    "title description default examples $comment deprecated readOnly writeOnly $id $anchor $schema $defs "
    "definitions".split()
)
SUBSCHEMAS = ("additionalProperties", "items", "additionalItems")  # keyword -> one schema
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # keyword -> {name: schema}
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # keyword -> [schema, ...]


def _subschemas(schema: Mapping[str, Any], at: str) -> Iterable[tuple[str, Any]]:
    """(JSON pointer, schema) of each schema directly inside `schema` (at `at`), as the keywords above nest them."""
    for key in SUBSCHEMAS:
        if isinstance(schema.get(key), (Mapping, bool)):
            yield f"{at}/{_escaped(key)}", schema[key]
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), Mapping):
            for name, sub in schema[key].items():
                yield f"{at}/{_escaped(key)}/{_escaped(name)}", sub
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                yield f"{at}/{key}/{i}", sub


def _escaped(name: str) -> str:
    """A name as a JSON pointer's step. Example: a/b~c -> a~1b~0c"""
    return str(name).replace("~", "~0").replace("/", "~1")


def _only_enforced(schema: Mapping[str, Any], part: str) -> None:
    """InputError naming the first keyword of `schema` (or of a schema in it) that a strict schema cannot have:
    one llguidance would not enforce. Example: {"type": "object", "foo": 1} -> InputError naming foo"""
    stack: list[tuple[str, Any]] = [("#", schema)]
    while stack:
        at, node = stack.pop()
        if not isinstance(node, Mapping):
            continue
        for key in node:
            if key not in ENFORCED and key not in ANNOTATIONS:
                raise InputError(
                    f"{part}: strict refuses what it cannot enforce, and {_shown(key)} (at {at}) is not a JSON Schema "
                    "keyword uag enforces: drop it, or send strict false to have it ignored"
                )
        stack.extend(reversed(list(_subschemas(node, at))))


def _must_finish(schema: Mapping[str, Any], part: str) -> None:
    """InputError naming `part` where no finite JSON value fits `schema` (`_finishes`)."""
    if not _finishes(schema):
        raise InputError(
            f"{part}: no finite JSON value fits this schema: every value would contain itself without end (a $ref "
            "cycle, or a required property or non-empty array of the schema itself); make the recursion optional"
        )


def _finishes(schema: Any) -> bool:
    """Whether some finite JSON value fits `schema`: False where every value would have to contain itself without
    end ({"$ref": "#"}, a cycle of $defs, a required property or a non-empty array of the schema itself), which
    llguidance compiles and then cannot finish. Each subschema is reached from the root through the keywords a
    value must satisfy; those that admit a finite value are found by iterating to a fixed point.

    Example: {"type": "object", "properties": {"next": {"$ref": "#"}}} -> True;  add "required": ["next"] -> False
    """
    nodes: dict[str, Any] = {}
    order: list[str] = []  # children before parents, so that one pass settles all but cycles
    stack: list[tuple[str, bool]] = [("#", False)]
    while stack:
        at, done = stack.pop()
        if done:
            order.append(at)
            continue
        if at in nodes:
            continue
        nodes[at] = node = _resolve(schema, at)
        stack.append((at, True))
        stack.extend((child, False) for child, _ in _parts(node, at) if child not in nodes)
    finite: set[str] = set()
    for _ in range(64):  # each pass settles one more level of cycles: real schemas need two or three
        grown = False
        for at in order:
            if at not in finite and _admits(nodes[at], at, finite):
                finite.add(at)
                grown = True
        if not grown:
            return "#" in finite
    return True  # too tangled to settle here: llguidance decides


def _resolve(root: Any, pointer: str) -> Any:
    """The schema at a local JSON pointer ("#", "#/$defs/A"); True (anything) where it leads nowhere."""
    node = root
    for step in pointer[2:].split("/") if pointer != "#" else ():
        step = step.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return True
    return node


def _parts(node: Any, at: str) -> list[tuple[str, str]]:
    """(pointer, role) of each schema a value of `node` may have to fit; role "all": it must (its $ref, allOf),
    "any": one of its kind must (anyOf, oneOf), "object"/"array": an object's required property or an array's
    required item must (only where the value is that type)."""
    if not isinstance(node, Mapping):
        return []
    parts: list[tuple[str, str]] = []
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        parts.append((ref, "all"))
    for key, role in (("allOf", "all"), ("anyOf", "any"), ("oneOf", "any")):
        if isinstance(node.get(key), list):
            parts += [(f"{at}/{key}/{i}", role) for i in range(len(node[key]))]
    properties = node.get("properties") if isinstance(node.get("properties"), Mapping) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    for name in filter(lambda name: isinstance(name, str), required):
        if name in properties:
            parts.append((f"{at}/properties/{_escaped(name)}", "object"))
        elif isinstance(node.get("additionalProperties"), Mapping) and not node.get("patternProperties"):
            parts.append((f"{at}/additionalProperties", "object"))
    least = node.get("minItems") if isinstance(node.get("minItems"), int) else 0
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    for i in range(min(least, len(prefix))):
        parts.append((f"{at}/prefixItems/{i}", "array"))
    if least > len(prefix) and isinstance(node.get("items"), (Mapping, bool)):
        parts.append((f"{at}/items", "array"))
    return parts


def _admits(node: Any, at: str, finite: set[str]) -> bool:
    """Whether `node` admits a finite value, given the schemas already known to (`finite`)."""
    if node is False:
        return False
    parts = _parts(node, at)
    if not all(child in finite for child, role in parts if role == "all"):
        return False
    anys = [child for child, role in parts if role == "any"]
    if anys and not any(child in finite for child in anys):
        return False
    if not isinstance(node, Mapping) or "const" in node or "enum" in node:
        return True
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
    if kinds is None or any(kind not in ("object", "array") for kind in kinds):
        return True  # a string, number, boolean or null needs no other schema
    return any(all(child in finite for child, role in parts if role == kind) for kind in kinds)


def _call_schema(name: str, parameters: Mapping[str, Any], at: str = "#") -> dict[str, Any]:
    """One call's JSON Schema: {"name": <name>, "arguments": <parameters>}, the parameters' own "#..." references
    moved to where the parameters now sit (`at`: this schema's place in the whole)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _rebased(parameters, f"{at}/properties/arguments")},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rebased(schema: Any, at: str) -> Any:
    """`schema` with every local "$ref" ("#", "#/$defs/X") pointing into the copy that sits at `at`.

    Example: _rebased({"$ref": "#/$defs/City"}, "#/properties/arguments")
    -> {"$ref": "#/properties/arguments/$defs/City"}
    """
    if isinstance(schema, Mapping):
        return {
            key: at + value[1:] if key == "$ref" and _local(value) else _rebased(value, at)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_rebased(item, at) for item in schema]
    return schema


def _local(ref: Any) -> bool:
    return isinstance(ref, str) and ref.startswith("#")


def _tool_grammar(spec: Mapping[str, Any], tags: tuple[int, int] | None) -> str:
    """The Lark grammar of tool calls: each `<tool_call>\\n{json}\\n</tool_call>` where `tags` holds the two tags'
    ids, else a bare JSON object; calls separated by "\\n"."""
    tools = spec["tools"]
    if len(tools) == 1:
        call = _call_schema(tools[0]["name"], tools[0]["parameters"])
    else:
        call = {"anyOf": [_call_schema(t["name"], t["parameters"], f"#/anyOf/{i}") for i, t in enumerate(tools)]}
    call["x-guidance"] = {**COMPACT, "lenient": not all(tool["strict"] for tool in tools)}
    body = f"%json {json.dumps(call, ensure_ascii=False)}"
    if tags is not None:  # named by id: llguidance takes every added token as special, so a quoted tag is refused
        body = f'<[{tags[0]}]> "\\n" {body} "\\n" <[{tags[1]}]>'
    # a line break may end the calls as well as part them: the model that writes one after its last call then ends
    # its reply, where a grammar that read every line break as "another call follows" would force one more
    start = 'call ("\\n" call)* "\\n"?' if spec["parallel"] else 'call "\\n"?'
    return llguidance.LLMatcher.grammar_from_lark(f"start: {start}\ncall: {body}\n")


def _grammar(spec: Mapping[str, Any], table: TokenTable) -> str:
    if spec["kind"] == "json_object":
        return _schema_grammar({"type": "object"}, COMPACT)
    if spec["kind"] == "json_schema":
        return _schema_grammar(spec["schema"], {**COMPACT, "lenient": not spec["strict"]})
    if spec["kind"] == "tool_calls":
        return _tool_grammar(spec, table.tool_tags)
    raise InputError(f"unknown constraint kind {_shown(spec['kind'])}")


# --- the target's tokenizer as llguidance sees it -----------------------------------------------------------------


class TokenTable:
    """What llguidance knows of one target tokenizer, and the ids no grammar may allow (ids past the tokenizer's
    real vocabulary, and llama.cpp's "[PAD<id>]" rows: ordinary-looking entries a JSON string would admit).
    Built once per tokenizer (seconds for 150k-260k vocabularies): `TokenTable.of`."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _pinned: dict[int, tuple[Any, dict]] = {}  # tokenizers that take no weak reference, by id (kept alive)
    _lock = threading.Lock()

    def __init__(self, hf_tokenizer: Any, width: int, eos_ids: Iterable[int]):
        self.width = int(width)
        self.words = -(-self.width // 32)  # a mask row's int32 words
        self.eos_ids = tuple(sorted({int(i) for i in eos_ids}))
        vocab = hf_tokenizer.get_vocab()
        size = max(len(hf_tokenizer), max(vocab.values()) + 1)
        # llguidance needs every id the tokenizer has; masks are cut to the logits' width afterwards
        self.lltok = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=max(self.width, size), eos_token=list(self.eos_ids)
        )
        self._fill_words = -(-max(self.width, size) // 32)
        banned = [i for piece, i in vocab.items() if (m := _PAD.fullmatch(piece)) and int(m.group(1)) == i]
        banned += range(size, self.words * 32)  # rows of the lm_head no token has, and the last word's spare bits
        self.banned = frozenset(i for i in banned if i not in self.eos_ids)
        self.allow = np.full(self.words, -1, dtype=np.int32)  # a row's words to AND with: banned ids cleared
        bits = self.allow.view(np.uint32)
        for i in self.banned:
            if i < self.words * 32:
                bits[i >> 5] &= np.uint32(~(1 << (i & 31)) & 0xFFFFFFFF)
        self.tool_tags = (vocab[TOOL_OPEN], vocab[TOOL_CLOSE]) if TOOL_OPEN in vocab and TOOL_CLOSE in vocab else None

    @classmethod
    def of(cls, tokenizer: Any, width: int, eos_ids: Iterable[int]) -> TokenTable:
        """The table for an mlx-lm TokenizerWrapper or an HF tokenizer, for logits `width` wide, with every stop id.
        Cached per tokenizer object, width and stop ids, so a target builds it once per process."""
        key = (int(width), tuple(sorted({int(i) for i in eos_ids})))
        with cls._lock:  # one build at a time: two threads asking for one target build it once
            try:
                tables = cls._cache.setdefault(tokenizer, {})
            except TypeError:  # no weak reference to it
                tables = cls._pinned.setdefault(id(tokenizer), (tokenizer, {}))[1]
            if key not in tables:
                started = time.perf_counter()
                tables[key] = cls(_hf_tokenizer(tokenizer), *key)
                log.info("grammar token table for %d ids built in %.1f s", width, time.perf_counter() - started)
            return tables[key]


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The HF tokenizer in an mlx-lm TokenizerWrapper (or the HF tokenizer itself)."""
    import transformers

    if isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        return tokenizer
    inner = getattr(tokenizer, "_tokenizer", None)
    if isinstance(inner, transformers.PreTrainedTokenizerBase):
        return inner
    raise TypeError(f"not an HF or mlx-lm tokenizer: {type(tokenizer).__name__}")


# --- one run's grammar state ----------------------------------------------------------------------------------------

_executor: llguidance.LLExecutor | None = None


def _masks_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor(num_threads=1)  # a draft's rows are sequential: one thread is enough
    return _executor


class Matcher:
    """One run's grammar state, following the committed target tokens exactly. Every method adds its time to `ms`
    (the grammar's cost, reported per token)."""

    def __init__(self, table: TokenTable, constraint: str):
        started = time.perf_counter()
        self.table, self.constraint, self.ms = table, constraint, 0.0
        self._m = llguidance.LLMatcher(table.lltok, _grammar(json.loads(constraint), table), log_level=0)
        if self._m.is_error():
            raise InputError(
                f"{describe(constraint)} does not compile for this target: {_one_line(self._m.get_error())}"
            )
        self._spend(started)

    def _spend(self, started: float) -> None:
        self.ms += (time.perf_counter() - started) * 1000

    def forced(self) -> list[int]:
        """The tokens the grammar forces next; [] when none or when stopped."""
        started = time.perf_counter()
        forced = [] if self.stopped else list(self._m.compute_ff_tokens())
        self._spend(started)
        return forced

    def valid(self, proposed: Sequence[int]) -> int:
        """How many leading tokens of `proposed` the grammar allows (state unchanged)."""
        started = time.perf_counter()
        n = self._m.validate_tokens(list(proposed)) if proposed else 0
        self._spend(started)
        return n

    def masks(self, proposed: Sequence[int]) -> np.ndarray:
        """int32 (len(proposed) + 1, words): row i holds the tokens allowed after proposed[:i] (row 0: now), banned
        ids cleared; rows past the first refused token are zero. State unchanged."""
        started = time.perf_counter()
        proposed = list(proposed)
        n = self._m.validate_tokens(proposed) if proposed else 0
        rows = np.zeros((len(proposed) + 1, self.table._fill_words), dtype=np.int32)
        if n:
            llnp.fill_next_token_bitmask_par_with_draft_tokens(_masks_executor(), [(self._m, 0, proposed[:n])], rows)
        else:  # llguidance's draft call refuses an empty draft
            llnp.fill_next_token_bitmask(self._m, rows)
        rows = rows[:, : self.table.words] & self.table.allow
        rows[n + 1 :] = 0  # llguidance leaves them as they were; zero says "never read"
        self._spend(started)
        return rows

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over committed tokens, unless the grammar has stopped: then the rest (the stop id) is ignored.
        Where it refuses one: InputError when llguidance gave up on the grammar (it admits no continuation, e.g. a
        schema whose values nest without end), else RuntimeError (a bug: the engine commits only allowed tokens)."""
        started = time.perf_counter()
        tokens = list(tokens)
        if tokens and not self.stopped:
            n = self._m.try_consume_tokens(tokens)
            if n < len(tokens) and not self.stopped:
                self._spend(started)
                if self._m.is_error():
                    error = _one_line(self._m.get_error().partition("<state>")[0])[:200]
                    log.warning("the grammar (%s) gave up: %s", describe(self.constraint), error)
                    raise InputError(f"the grammar ({describe(self.constraint)}) admits no continuation here: {error}")
                raise RuntimeError(
                    f"the grammar ({describe(self.constraint)}) refuses committed token {tokens[n]} "
                    f"after {n} of {tokens}: {self._m.get_error()}"
                )
        self._spend(started)

    @property
    def stopped(self) -> bool:
        """Whether the grammar is done: the reply is complete, so only a stop id may follow, or one was consumed.
        From here on nothing is forced or checked."""
        return self._m.is_stopped() and not self._m.is_error()

    @staticmethod
    def allows(row: np.ndarray, token: int) -> bool:
        """Whether a mask row allows `token`. Example: allows(np.array([0b100], np.int32), 2) -> True"""
        return bool((int(row[token >> 5]) >> (token & 31)) & 1)
