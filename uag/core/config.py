"""`GenerationConfig`: the decoding settings of one run, and the one set of checks every interface uses.

The CLI, the app, its API, sweeps and results all hold a `GenerationConfig`; each parses its raw input
through `GenerationConfig.parse`, so a setting accepted in one place is accepted everywhere, with the same
message when it is not. The UI builds its controls from `FIELDS`; the samplers and penalties OpenAI's clients send
(`SAMPLING_FIELDS`, mlx-lm's meanings) are settings of the engine and the server, not controls. Standard library only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from uag.core.translate import DEFAULT_WINDOW, STRATEGIES
from uag.errors import InputError

DEFAULT_K = 2  # the draft length when none is given: a fixed k's (the study's), and auto's most outside uag serve
# uag serve's longest draft under auto when -k is not given: a copy from a long prompt-lookup match drafts this far
# in one pass. On a CPU a pass over 16 tokens costs about what one over 8 does, so edit turns that copy run faster
# with 16 than with 8 (docs/results.md#the-server-against-mlx_lmserver-benchmarksservepy).
DEFAULT_K_AUTO = 16
MAX_K = 32
DEFAULT_MAX_TOKENS = 64
MAX_TOKENS = 4096  # a cap, not a target: a run is also bounded by the target's context and any time budget
MAX_WINDOW = 64
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**31 - 1  # what mx.random.seed takes
MAX_TOP_K = 1_000_000  # above any vocabulary: a top_k at or above the target's keeps every token
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range, -2..2
TRANSLATIONS = ("baseline", *STRATEGIES)  # how a drafter's tokens become the target's; baseline: the target alone
K_POLICIES = ("fixed", "adaptive")  # adaptive: k re-decided each cycle, with config.k the most (uag.core.policy)
AUTO = "auto"  # a strategy name's mark of adaptive k: "auto" alone is context translation, "tli+auto" tli
# Strategy names: a translation and a k policy in one word, as the CLI, the app, the server and results files use them.
SPECULATIVE = (*STRATEGIES, AUTO, *(f"{t}+{AUTO}" for t in STRATEGIES if t != "context"))
MODES = ("baseline", *SPECULATIVE)


@dataclass(frozen=True)
class Field:
    """How one setting is shown and bounded (the CLI's flags and the app's controls read these)."""

    name: str
    label: str
    lo: float | None = None
    hi: float | None = None
    help: str = ""


FIELDS: tuple[Field, ...] = (
    Field("strategy", "strategy", help="baseline = target alone; none / naive / context / tli; auto: adaptive k"),
    Field("k", "k (draft length)", 1, MAX_K, "tokens drafted per cycle (auto: the most it may draft)"),
    Field("window", "context window W", 0, MAX_WINDOW, "committed tokens re-encoded with each draft"),
    Field("max_tokens", "max tokens", 1, MAX_TOKENS, "tokens to generate at most"),
    Field("temperature", "temperature", 0, MAX_TEMPERATURE, "0 = greedy"),
    Field("seed", "seed", 0, MAX_SEED, "random seed for temperature > 0 (empty: none)"),
    Field("chat", "chat template", help="wrap the prompt in the target's chat template"),
)
# The samplers and penalties of OpenAI-style requests, named as the clients send them (mlx-lm's sample_utils
# applies them: uag.core.sampling); neutral by default. Not among FIELDS: the app shows no control for them.
SAMPLING_FIELDS: tuple[Field, ...] = (
    Field("top_p", "top_p", 0, 1, "keep the likeliest tokens up to this probability mass (1 = off)"),
    Field("top_k", "top_k", 0, MAX_TOP_K, "keep the k likeliest tokens (0 = off)"),
    Field("min_p", "min_p", 0, 1, "keep tokens at least this share of the likeliest one's probability (0 = off)"),
    Field("repetition_penalty", "repetition_penalty", 0, MAX_REPETITION_PENALTY, "scale recent tokens' logits down"),
    Field("presence_penalty", "presence_penalty", -MAX_PENALTY, MAX_PENALTY, "subtract from recent tokens' logits"),
    Field("frequency_penalty", "frequency_penalty", -MAX_PENALTY, MAX_PENALTY, "the same, once per occurrence"),
)
# The two halves of a strategy, as GenerationConfig holds them (the app's one control names both).
STRATEGY_FIELDS: tuple[Field, ...] = (
    Field("translation", "translation", help=f"{' / '.join(TRANSLATIONS)}; baseline = target alone"),
    Field("k_policy", "k policy", help="fixed: k every cycle; adaptive: k re-decided each cycle, at most k"),
)
FIELD = {f.name: f for f in (*FIELDS, *STRATEGY_FIELDS, *SAMPLING_FIELDS)}


def strategy_name(translation: str, k_policy: str) -> str:
    """A translation and a k policy in one name (`GenerationConfig.strategy`).

    Example: ("context", "adaptive") -> "auto";  ("tli", "adaptive") -> "tli+auto";  ("tli", "fixed") -> "tli"
    """
    if k_policy != "adaptive" or translation == "baseline":
        return translation
    return AUTO if translation == "context" else f"{translation}+{AUTO}"


def split_strategy(name: str) -> tuple[str, str | None] | None:
    """The translation and k policy a strategy name says (a plain translation leaves the k policy unsaid: None);
    None for a name that is not one.

    Example: "auto" -> ("context", "adaptive");  "tli+auto" -> ("tli", "adaptive");  "tli" -> ("tli", None)
    """
    if name in TRANSLATIONS:
        return name, None
    head, plus, tail = name.partition("+")
    if name == AUTO or (plus and tail == AUTO and head in STRATEGIES and head != "context"):
        return head if plus else "context", "adaptive"
    return None


def adaptive_k(strategy: str) -> bool:
    """Whether a strategy name re-decides k each cycle. Example: "auto" -> True;  "tli+auto" -> True;  "tli" -> False"""
    said = split_strategy(strategy)
    return said is not None and said[1] == "adaptive"


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how. `translation="baseline"` runs the target alone; otherwise it says how a drafter
    model's tokens become the target's, and `k_policy` whether k tokens are drafted every cycle ("fixed") or the
    draft length is re-decided each cycle with `k` as its maximum ("adaptive"); `strategy` names the two at once
    ("auto": context and adaptive). The samplers (top_p, top_k, min_p: they act at temperature > 0) and penalties
    (at any temperature) are mlx-lm's; speculation applies them to the target at every position it verifies, so
    its output stays the target's (uag.core.sampling)."""

    translation: str = "context"
    k: int = DEFAULT_K
    k_policy: str = field(default="fixed", kw_only=True)  # keyword only: GenerationConfig("tli", 4) stays k = 4
    window: int = DEFAULT_WINDOW
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int | None = None
    chat: bool = False
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # a grammar the reply must follow (uag.core.grammar: response_format, forced tool calls), as JSON text; the
    # target is masked by it at every position it samples or verifies, drafts included
    constraint: str | None = None

    @property
    def speculative(self) -> bool:
        return self.translation != "baseline"

    @property
    def strategy(self) -> str:
        """The translation and the k policy in one name, as records, labels and results files keep it.

        Example: GenerationConfig(k_policy="adaptive").strategy -> "auto";  GenerationConfig("tli").strategy ->
                 "tli";  GenerationConfig("tli", k_policy="adaptive").strategy -> "tli+auto"
        """
        return strategy_name(self.translation, self.k_policy)

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the target's logits (then each position's token history matters)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def truncated(self) -> bool:
        """Whether top_p, top_k or min_p cut the target's distribution (they act when it samples)."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0 or self.min_p > 0)

    def validate(self) -> GenerationConfig:
        """Raise InputError listing every setting out of bounds; return self."""
        GenerationConfig.parse(**asdict(self))
        return self

    def replace(self, **changes: Any) -> GenerationConfig:
        """A copy with `changes` applied, parsed and checked like user input. A `strategy` among them names the
        translation and the k policy both (unless `k_policy` is given too).

        Example: GenerationConfig.parse(strategy="auto").replace(strategy="baseline").k_policy -> "fixed"
        """
        current = asdict(self)
        if "strategy" in changes:
            del current["translation"], current["k_policy"]
        return GenerationConfig.parse(**{**current, **changes})

    @classmethod
    def parse(cls, **raw: Any) -> GenerationConfig:
        """Settings from loosely typed input (form fields, JSON, flags); InputError lists every problem. A
        `strategy` (a name of SPECULATIVE or "baseline") may stand for the translation and the k policy; a plain
        translation's k policy is `k_policy`, fixed unless given.

        Example: GenerationConfig.parse(k=2.0, seed="") -> GenerationConfig(k=2, seed=None, …)
                 GenerationConfig.parse(k=40, temperature=-1) -> InputError("k (draft length) must be …; …")
                 GenerationConfig.parse(strategy="tli", k_policy="adaptive").strategy -> "tli+auto"
                 GenerationConfig.parse(strategy="auto", k_policy="fixed") -> InputError("strategy 'auto' means …")
        """
        unknown = set(raw) - {f.name for f in fields(cls)} - {"strategy"}
        if unknown:
            raise InputError(f"unknown settings: {', '.join(sorted(unknown))}")
        defaults = cls()
        values = {f.name: raw.get(f.name, getattr(defaults, f.name)) for f in fields(cls)}
        problems: list[str] = []
        if "strategy" in raw:
            _read_strategy(raw, values, problems)
        if values["translation"] not in TRANSLATIONS:
            problems.append(f"translation must be one of {', '.join(TRANSLATIONS)} (got {values['translation']!r})")
        if values["k_policy"] not in K_POLICIES:
            problems.append(f"k policy must be one of {', '.join(K_POLICIES)} (got {values['k_policy']!r})")
        elif values["translation"] == "baseline" and values["k_policy"] == "adaptive":
            problems.append("k policy adaptive needs a drafter: the baseline runs the target alone")
        for name in ("k", "window", "max_tokens"):
            values[name] = _whole(values[name], FIELD[name], problems)
        values["temperature"] = _number(values["temperature"], FIELD["temperature"], problems)
        if values["seed"] is None or (isinstance(values["seed"], str) and not values["seed"].strip()):
            values["seed"] = None
        else:
            values["seed"] = _whole(values["seed"], FIELD["seed"], problems)
        values["chat"] = _flag(values["chat"], FIELD["chat"], problems)
        values["top_k"] = _whole(values["top_k"], FIELD["top_k"], problems)
        for name in ("min_p", "presence_penalty", "frequency_penalty"):
            values[name] = _number(values[name], FIELD[name], problems)
        for name in ("top_p", "repetition_penalty"):  # 0 would keep no token / divide by zero
            values[name] = _number(values[name], FIELD[name], problems, above_lo=True)
        if values["constraint"] is not None and not (isinstance(values["constraint"], str) and values["constraint"]):
            problems.append("constraint must be a grammar from uag.core.grammar (or none)")
        if problems:
            raise InputError("; ".join(problems))
        return cls(**values)


def _read_strategy(raw: dict[str, Any], values: dict[str, Any], problems: list[str]) -> None:
    """The translation and k policy that raw["strategy"] says, into `values`; a problem where it is no strategy or
    says otherwise than raw's own translation or k_policy."""
    name = raw["strategy"]
    said = split_strategy(name) if isinstance(name, str) else None
    if said is None:
        problems.append(f"strategy must be one of {', '.join(MODES)} (got {name!r})")
        return
    for key, value in zip(("translation", "k_policy"), said):
        if value is None:
            continue
        if key in raw and raw[key] != value:
            label = FIELD[key].label
            problems.append(f"strategy {name!r} means {label} {value}, not {raw[key]!r}: give one of the two")
        values[key] = value


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _whole(value: Any, field: Field, problems: list[str]) -> Any:
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if isinstance(value, bool) or not number.is_integer() or not field.lo <= number <= field.hi:
        problems.append(
            f"{field.label} must be a whole number from {_bound(field.lo)} to {_bound(field.hi)} (got {value!r})"
        )
        return value
    return int(number)


def _number(value: Any, field: Field, problems: list[str], *, above_lo: bool = False) -> Any:
    """A float within the field's bounds (`above_lo`: the lower bound itself excluded)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    low_ok = field.lo < number if above_lo else field.lo <= number
    if isinstance(value, bool) or not (low_ok and number <= field.hi):  # NaN and ±inf fail here too
        span = f"above {_bound(field.lo)}, up to" if above_lo else f"from {_bound(field.lo)} to"
        problems.append(f"{field.label} must be a number {span} {_bound(field.hi)} (got {value!r})")
        return value
    return number


def _flag(value: Any, field: Field, problems: list[str]) -> Any:
    """A real boolean, or the words true/false (JSON and forms): "no" is not a way to say False."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    problems.append(f"{field.label} must be true or false (got {value!r})")
    return value


LOOKUP = "lookup"
GRAMMAR = "grammar"  # a draft of the tokens a constraint's grammar forces (uag.core.grammar): no drafter makes it


@dataclass(frozen=True)
class DrafterSpec:
    """What drafts: a model (hub id, folder, preset name), prompt `lookup` (no model), or both
    (`lookup+<model>`: lookup where the context offers a match, the model elsewhere).

    Example: DrafterSpec.parse("lookup+demo-drafter") -> DrafterSpec(lookup=True, model="demo-drafter")
             DrafterSpec.parse("lookup") -> DrafterSpec(lookup=True, model=None)
    """

    lookup: bool = False
    model: str | None = None

    @classmethod
    def parse(cls, text: str | None) -> DrafterSpec:
        text = (text or "").strip()
        if not text:
            raise InputError("no drafter given: name a model, lookup, or lookup+<model>")
        if text == LOOKUP:
            return cls(lookup=True)
        head, plus, rest = text.partition("+")
        if plus and head.strip() == LOOKUP:
            if not rest.strip() or rest.strip() == LOOKUP:
                raise InputError(f"{text!r}: after lookup+ name a drafter model, e.g. lookup+demo-drafter")
            return cls(lookup=True, model=rest.strip())
        return cls(model=text)

    @property
    def kind(self) -> str:
        """ "model", "lookup" or "hybrid"."""
        return "hybrid" if self.lookup and self.model else LOOKUP if self.lookup else "model"

    def __str__(self) -> str:
        return f"{LOOKUP}+{self.model}" if self.lookup and self.model else LOOKUP if self.lookup else str(self.model)


def short_name(model: str) -> str:
    """The last part of a hub id or a path, for labels; a lookup drafter keeps its "lookup+".

    Example: "mlx-community/Qwen2.5-1.5B-Instruct-4bit" -> "Qwen2.5-1.5B-Instruct-4bit";
             "/models/drafter/" -> "drafter";  "lookup+org/d-1B" -> "lookup+d-1B";  "lookup" -> "lookup"
    """
    head, plus, rest = model.partition("+")
    if plus and head == "lookup" and rest:
        return f"lookup+{short_name(rest)}"
    return model.rstrip("/").rsplit("/", 1)[-1] or model
