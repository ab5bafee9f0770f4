"""OpenAI's wire format for uag: a request body checked into one `Request` (a `GenerationConfig` and a drafter);
its error object is in uag.server.errors, responses and chunks in uag.server.responses. Pure: no mlx, no HTTP.

    parse_chat({"model": "demo-target", "messages": [{"role": "user", "content": "Hi"}], "top_k": 40}, defaults)
        -> Request(config=GenerationConfig(translation="context", k=16, k_policy="adaptive", top_k=40, …), …)

Accepted, typed and bounded as the engine bounds them (null: absent): temperature, top_p, seed, presence_penalty,
frequency_penalty, and the top_k, min_p, repetition_penalty that llama.cpp, vLLM and Open WebUI send; uag's
`speculative` object; `response_format` and a forcing `tool_choice` as the config's grammar (uag.core.grammar).
OpenAI fields uag does not implement (n, logprobs, logit_bias, …) pass only at their neutral value; unknown fields
are refused by name. Every problem is one 4xx `APIError` naming its `param`, never a 500."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any

from uag.core.config import DEFAULT_K, FIELD, MAX_K, MAX_WINDOW, SPECULATIVE, DrafterSpec, GenerationConfig, adaptive_k
from uag.core.grammar import response_format_constraint, tool_constraint
from uag.errors import InputError
from uag.server.errors import APIError, bad, show
from uag.server.fim import STOPS as FIM_STOPS
from uag.server.fim import Fill
from uag.server.messages import parse_message, parse_tools, plain, text_of

MAX_STOP = 16  # stop sequences (OpenAI allows 4; Continue sends 9 with a FIM template, DeepSeek takes 16)
TOOL_CHOICES = ("auto", "none", "required")  # or {"type": "function", "function": {"name": …}}
MAX_MESSAGE = 300  # characters of a grammar engine's error a 400 repeats


@dataclass(frozen=True)
class ServerDefaults:
    """What the operator's command line set: the served model, the default speculation, the drafters allowed."""

    model: str  # the target's name, as /v1/models lists it
    drafter: str | None  # the default drafter ("lookup+demo-drafter"); None: speculation off by default
    strategy: str = "auto"
    k: int = 16  # the most a request may ask for (auto: its longest draft)
    window: int = 4
    max_tokens: int = 512
    drafters: tuple[str, ...] = ()  # drafters a request may pick (the default is always among them)
    checks: bool = True  # whether a request may ask for `"check": true` or a grammar (neither under --shard)
    aliases: tuple[str, ...] = ()  # glob patterns of other model ids answered as `model` (--model-alias "claude-*")

    def serves(self, model: str) -> bool:
        """Whether a request naming `model` is answered: the served model, or an id one of `aliases` matches (case
        sensitive). Example: aliases ("claude-*",): "claude-haiku-4-5" -> True;  "gpt-4o" -> False"""
        return model == self.model or any(fnmatchcase(model, pattern) for pattern in self.aliases)

    @property
    def allowed(self) -> tuple[str, ...]:
        default = () if self.drafter is None else (self.drafter,)
        return tuple(dict.fromkeys((*default, *self.drafters)))


@dataclass(frozen=True)
class ModelRouter:
    """The models one server serves (`uag serve --serve`), each with its own defaults; the first is the default
    model (the app at /ui, and an id that /infill's clients name at random). A request's `model` picks one: a
    served name first, then the models' aliases in order.

    Example: names ("demo-target", "coder"), coder's aliases ("claude-*",): pick("claude-haiku") -> coder's
    defaults;  pick("gpt-4o") -> APIError 404 model_not_found"""

    models: tuple[ServerDefaults, ...]

    def __post_init__(self):
        names = [m.model for m in self.models]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a server serves one or more models, each under its own name (got {names})")

    @property
    def default(self) -> ServerDefaults:
        return self.models[0]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.model for m in self.models)

    def find(self, model: str) -> ServerDefaults | None:
        """The served model a request naming `model` is answered by (None: none)."""
        named = next((m for m in self.models if m.model == model), None)
        return named or next((m for m in self.models if m.serves(model)), None)

    def pick(self, body: Any, *, any_model: bool = False) -> ServerDefaults:
        """The served model a request body names; the default one when the body names none that the dialect can
        check (not an object, no model, not a string: its parse says what is wrong) or, with `any_model`, one not
        served here (llama.cpp's /infill answers whatever id a client sends). APIError 404 otherwise."""
        model = body.get("model") if isinstance(body, Mapping) else None
        if not isinstance(model, str):
            return self.default
        found = self.find(model)
        if found is None and any_model:
            return self.default
        if found is None:
            raise unknown_model(model, self.names)
        return found


def unknown_model(model: str, names: Sequence[str]) -> APIError:
    """OpenAI's 404 for a model id a server does not serve, naming those it does."""
    served = show(names[-1])
    if len(names) > 1:
        served = f"{', '.join(map(show, names[:-1]))} and {served}"
    return APIError(
        404,
        f"the model {show(model)} does not exist on this server: it serves {served} (GET /v1/models; uag serve "
        "--model-alias answers other ids as one of them)",
        param="model",
        code="model_not_found",
    )


@dataclass(frozen=True)
class Request:
    """One checked request: what to read (messages or a prompt), how to generate, and how to answer."""

    kind: str  # "chat" or "completion"
    model: str
    config: GenerationConfig  # strategy "baseline" when speculation is off; chat=False (uag.server.chat renders)
    drafter: str | None  # None: the target alone
    messages: tuple[dict, ...] = ()
    prompt: str = ""
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    tools: tuple[dict, ...] = ()
    parallel_tool_calls: bool = True  # False: a reply's first tool call only
    check: bool = False  # also run the target alone and say whether the outputs agree (uag.runtime.divergence)
    extra: dict = field(default_factory=dict)
    fill: Fill | None = None  # fill-in-the-middle: `prompt` is its prefix; the target's FIM tokens lay it out


# --- request fields -------------------------------------------------------------------------------------------
SAMPLERS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "user",
    "logit_bias",
    "logprobs",
    "speculative",
    "metadata",
    "store",
    *SAMPLERS,
}
CHAT = COMMON | {
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
    "response_format",
    "service_tier",
    "reasoning_effort",
    "modalities",
    "prediction",
    "functions",
}
COMPLETION = COMMON | {"prompt", "echo", "suffix", "best_of", "response_format"}
# Fields accepted only at a value that asks for nothing (what uag does anyway).
NEUTRAL = {
    "logit_bias": ({}, None),
    "logprobs": (False, None),
    "top_logprobs": (None, 0),
    "echo": (False, None),
    "best_of": (1, None),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "functions": (None,),
}
SPECULATIVE_KEYS = ("drafter", "k", "strategy", "window", "check")


def _object(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed, key=str)
    if unknown:
        raise bad(str(unknown[0]), f"unrecognized request field {show(unknown[0])}", "unknown_parameter")
    for name, values in NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in values):
            raise bad(name, f"uag does not support {name} (got {show(value)}); leave it out")
    return body


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers. Example: 0.0 ~ 0 -> True;  false ~ 0 -> False"""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _where(name: str, param: str | None) -> tuple[str, str]:
    """(the param an error names, the words that open its message): a nested key names itself after its field."""
    return (name, "") if param is None else (param, f"{name} ")


def _whole(body: Mapping, name: str, lo: int, hi: int, *, param: str | None = None) -> int | None:
    """body[name] as an int from lo to hi (None when absent or null); `param`: the field it sits in."""
    value = body.get(name)
    if value is None:
        return None
    where, label = _where(name, param)
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        raise bad(where, f"{label}must be a whole number (got {show(value)})")
    if not lo <= value <= hi:
        raise bad(where, f"{label}must be from {lo} to {hi} (got {show(value)})")
    return int(value)


def _number(body: Mapping, name: str, lo: float, hi: float, *, above: bool = False) -> float | None:
    """body[name] as a float from lo (`above`: greater than lo) to hi; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"must be a number (got {show(value)})")
    if not (lo < value if above else lo <= value) or not value <= hi:  # NaN fails here too
        first = f"above {lo:g} and at most" if above else f"from {lo:g} to"
        raise bad(name, f"must be {first} {hi:g} (got {show(value)})")
    return float(value)


def _flag(body: Mapping, name: str, param: str | None = None) -> bool:
    """body[name] as a bool (absent: False); `param`: the field to name in the error when `name` is nested."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        where, label = _where(name, param)
        raise bad(where, f"{label}must be true or false (got {show(value)})")
    return value


def _stop(body: Mapping) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOP:
        raise bad("stop", f"must be a string or a list of 1 to {MAX_STOP} strings (got {show(value)})")
    out = tuple(text_of(s, "stop") for s in stops)
    if not all(out):
        raise bad("stop", "a stop sequence cannot be empty")
    return out


def _samplers(body: Mapping) -> dict[str, float | int]:
    """The sampling fields the request sets (absent and null left out), typed and bounded as the engine bounds
    them (uag.core.config.SAMPLING_FIELDS); top_k 0, min_p 0, top_p 1, repetition_penalty 1 and the two
    penalties 0 are off. Example: {"top_k": 40, "min_p": null} -> {"top_k": 40}"""
    given = {}
    for name in SAMPLERS:
        lo, hi = FIELD[name].lo, FIELD[name].hi
        if name == "top_k":
            given[name] = _whole(body, name, int(lo), int(hi))
        else:  # top_p 0 would keep no token, repetition_penalty 0 divide by zero
            given[name] = _number(body, name, lo, hi, above=name in ("top_p", "repetition_penalty"))
    return {name: value for name, value in given.items() if value is not None}


def common_fields(body: Mapping, defaults: ServerDefaults, max_tokens_field: str) -> dict[str, Any]:
    """The fields every dialect shares (chat, completions, and those of uag.server.dialects' other APIs): model,
    sampling, stop, streaming, n, speculation."""
    model = body.get("model")
    if model is None:
        raise bad("model", f"required: name the model to use ({show(defaults.model)}, see GET /v1/models)")
    if not isinstance(model, str):
        raise bad("model", f"must be a string (got {show(model)})")
    if not defaults.serves(model):
        raise unknown_model(model, (defaults.model,))
    if _whole(body, "n", 1, 2**31) not in (None, 1):
        raise bad("n", f"uag generates one choice per request: n must be 1 (got {show(body['n'])})")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise bad("stream_options", f'takes {{"include_usage": true|false}} (got {show(options)})')
        include_usage = _flag(options, "include_usage", param="stream_options")
    max_tokens = _whole(body, max_tokens_field, 1, 2**31)
    if max_tokens_field != "max_tokens" and (older := _whole(body, "max_tokens", 1, 2**31)) is not None:
        if max_tokens is None:
            max_tokens, max_tokens_field = older, "max_tokens"
        elif older != max_tokens:  # neither is silently dropped
            raise bad(
                "max_tokens",
                f"max_tokens ({older}) and {max_tokens_field} ({max_tokens}) disagree: send one of them "
                f"({max_tokens_field} is the newer name)",
            )
    fields = {
        "max_tokens": defaults.max_tokens if max_tokens is None else max_tokens,
        "temperature": _number(body, "temperature", 0, 2) or 0.0,
        "seed": _whole(body, "seed", 0, 2**31 - 1),
        **_samplers(body),
    }
    drafter, speculation, check = _speculative(body.get("speculative"), defaults)
    if check and fields["temperature"]:
        raise bad("speculative", "check compares greedy outputs token for token: send temperature 0 (or none)")
    try:
        config = GenerationConfig.parse(**fields, **speculation, chat=False)  # the request's one parse
    except InputError as err:
        raise _blamed(err, fields, max_tokens_field) from None
    return {
        "model": model,
        "config": config,
        "drafter": drafter,
        "stop": _stop(body),
        "stream": stream,
        "include_usage": include_usage,
        "check": check,
    }


def _blamed(err: InputError, fields: Mapping[str, Any], max_tokens_field: str) -> APIError:
    """The 400 for a config that did not parse, naming the request field at fault: the first of `fields` that
    fails alone (only on this error path is a field parsed by itself), else `speculative`, whose settings are
    the rest. Example: {"max_tokens": 5000} from max_completion_tokens -> 400 param "max_completion_tokens"."""
    for name, value in fields.items():
        try:
            GenerationConfig.parse(**{name: value})
        except InputError as alone:
            return bad(max_tokens_field if name == "max_tokens" else name, str(alone))
    return bad("speculative", str(err))


def _speculative(value: Any, defaults: ServerDefaults) -> tuple[str | None, dict[str, Any], bool]:
    """(drafter or None, config fields, check) for the request's `speculative`: false, true/absent, or an object
    whose keys are each optional (null: absent). `check`: also run the target alone and compare (greedy only; see
    uag.server.service)."""
    if value is None or value is True:
        if defaults.drafter is None:
            return None, {"strategy": "baseline"}, False
        return defaults.drafter, {"strategy": defaults.strategy, "k": defaults.k, "window": defaults.window}, False
    if value is False:
        return None, {"strategy": "baseline"}, False
    if not isinstance(value, dict):
        raise bad(
            "speculative", f'must be false, true or an object like {{"drafter": "lookup", "k": 4}} (got {show(value)})'
        )
    unknown = sorted(set(value) - set(SPECULATIVE_KEYS), key=str)
    if unknown:
        raise bad("speculative", f"unknown key {show(unknown[0])}: it takes {', '.join(SPECULATIVE_KEYS)}")
    check = _flag(value, "check", param="speculative")
    if check and not defaults.checks:
        raise bad(
            "speculative",
            "check is not available on a sharded server (--shard): its near-tie margins need "
            "the whole target on one machine; compare with `uag generate --strategy baseline` there",
        )
    allowed = defaults.allowed
    drafter = defaults.drafter if value.get("drafter") is None else value["drafter"]
    if drafter is None:
        raise bad("speculative", f"name a drafter: this server allows {_listed(allowed)}")
    if not isinstance(drafter, str):
        raise bad("speculative", f"drafter must be a string (got {show(drafter)})")
    try:
        normal = str(DrafterSpec.parse(drafter))
    except InputError:
        normal = drafter
    if normal not in allowed:
        raise bad("speculative", f"drafter {show(drafter)} is not served here: choose one of {_listed(allowed)}")
    strategy = defaults.strategy if value.get("strategy") is None else value["strategy"]
    if not isinstance(strategy, str) or strategy not in SPECULATIVE:
        raise bad(
            "speculative",
            f"strategy must be one of {', '.join(SPECULATIVE)} (got {show(strategy)}); "
            'for the target alone send "speculative": false',
        )
    k = _whole(value, "k", 1, MAX_K, param="speculative")
    if k is None:  # auto's -k is its longest draft, not a fixed length
        k = min(defaults.k, DEFAULT_K) if not adaptive_k(strategy) and adaptive_k(defaults.strategy) else defaults.k
    if k > defaults.k:
        raise bad("speculative", f"k must be from 1 to {defaults.k}, this server's -k (got {k})")
    window = _whole(value, "window", 0, MAX_WINDOW, param="speculative")
    window = defaults.window if window is None else window
    return normal, {"strategy": strategy, "k": k, "window": window}, check


def _listed(names: Sequence[str]) -> str:
    return ", ".join(show(n) for n in names) if names else "no drafter (speculation is off on this server)"


# --- chat and completions ---------------------------------------------------------------------------------------
def parse_chat(body: Any, defaults: ServerDefaults) -> Request:
    """A /v1/chat/completions body as a `Request`; APIError naming the first problem."""
    body = _object(body, CHAT)
    common = common_fields(body, defaults, "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", 'give at least one message: a list of {"role": …, "content": …} objects')
    checked = tuple(parse_message(m, i) for i, m in enumerate(messages))
    tools = parse_tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"))
    if choice == "none":
        tools = ()
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be true or false (got {show(parallel)})")
    parallel = parallel is not False
    constraint = _response_format(body)
    forcing = choice in ("required", "function")
    if forcing:
        constraint = forced_calls(tools, name, parallel, constraint)
    common = constrained(common, constraint, defaults, "tool_choice" if forcing else "response_format")
    return Request("chat", messages=checked, tools=tools, parallel_tool_calls=parallel, **common)


def forced_calls(
    tools: Sequence[dict], name: str | None, parallel: bool, form: str | None, form_field: str = "response_format"
) -> str:
    """The grammar of a forcing tool_choice: a call of the function `name` (None: of any declared one), one or
    (`parallel`) several. A 400 when no tool is declared, or when `form` (the reply's form from `form_field`:
    response_format, or another API's name for it) is set too."""
    asked = f"tool_choice {show(name)}" if name else 'tool_choice "required"'
    if not tools:
        raise bad(
            "tool_choice",
            f"{asked.removeprefix('tool_choice ')} asks for a tool call, but tools declares "
            'none: declare the functions in tools, or send tool_choice "auto"',
        )
    if form is not None:
        raise bad(
            form_field,
            f"{form_field} and {asked} both set the reply's form: drop "
            f"{form_field} to have the tool called, or tool_choice to have JSON written",
        )
    try:
        return tool_constraint(tools, name, parallel)
    except InputError as err:
        raise refused(err, "tool_choice") from None


def parse_completion(body: Any, defaults: ServerDefaults) -> Request:
    """A /v1/completions body as a `Request`; APIError naming the first problem."""
    body = _object(body, COMPLETION)
    common = common_fields(body, defaults, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", f"must be one string (got {show(prompt)})")
    prompt = text_of(prompt, "prompt")
    suffix = text_of(body.get("suffix") or "", "suffix")
    if not prompt.strip() and not suffix.strip():  # with a suffix, the cursor may be at the file's start
        raise bad("prompt", "the prompt is empty")
    common = constrained(common, _response_format(body), defaults, "response_format")
    if suffix:  # fill-in-the-middle: the reply goes between the prompt and the suffix (uag.server.fim)
        common["stop"] = (*common["stop"], *FIM_STOPS)
        return Request("completion", prompt=prompt, fill=Fill(prompt, suffix), **common)
    return Request("completion", prompt=prompt, **common)


# --- structured output: response_format and a forcing tool_choice, as the config's grammar ----------------------
def _response_format(body: Mapping) -> str | None:
    """The request's `response_format` as a constraint (uag.core.grammar), None for none or {"type": "text"}."""
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("response_format", f'must be an object like {{"type": "json_object"}} (got {show(value)})')
    plain(value, "response_format")
    try:
        return response_format_constraint(value)
    except InputError as err:
        raise refused(err, "response_format") from None


def _tool_choice(value: Any) -> tuple[str, str | None]:
    """(auto, none, required or function; the function's name) for the request's `tool_choice` (null: auto)."""
    if value is None:
        return "auto", None
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise bad(
            "tool_choice",
            f'must be "auto", "none", "required" or {{"type": "function", "function": '
            f'{{"name": …}}}} (got {show(value)})',
        )
    return "function", text_of(name, "tool_choice")


def refused(err: InputError, param: str) -> APIError:
    """The grammar's refusal as a 400 naming `param`, or the tool whose schema it names ("tools[1].function…")."""
    message = " ".join(str(err).split())
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 1] + "…"
    tool = re.match(r"tools\[\d+\][\w.]*", message)
    if tool and param != "response_format":
        param = tool.group(0)
    return APIError(400, message if message.startswith(param) else f"{param}: {message}", param=param)


def constrained(common: dict[str, Any], constraint: str | None, defaults: ServerDefaults, param: str) -> dict:
    """The request's fields with `constraint` in their config; a 400 naming `param` on a sharded server."""
    if constraint is None:
        return common
    if not defaults.checks:
        fix = 'send tool_choice "auto"' if param == "tool_choice" else "leave response_format out"
        raise bad(
            param,
            f"structured output is not available on a sharded server (--shard): its ranks apply no grammar; {fix}",
        )
    return {**common, "config": replace(common["config"], constraint=constraint)}
