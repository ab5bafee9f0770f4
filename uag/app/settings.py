"""One comparison's settings as the app takes them: the pair's names and one `GenerationConfig`.

Raw input (form fields, JSON from the API) goes through `Settings.parse`, which leaves every decoding
check to `GenerationConfig.parse`; the prompt through `check_prompt`. Standard library only.

    Settings.parse(target="demo-target", k=2.0, seed="")  -> Settings(target="demo-target", generation=…k=2…)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from uag.core.config import FIELDS, SPECULATIVE, GenerationConfig
from uag.errors import InputError
from uag.models.dtypes import parse_dtype
from uag.runtime.presets import DEFAULT

MAX_PROMPT_CHARS = 20_000  # the app's bound on a prompt; the target's context bounds it again in tokens
# The app opens on auto with k ≤ 8: with the default preset it wins on structured prompts (docs/results.md). The
# library's own defaults (GenerationConfig: context, k = 2) are left as they are.
DEFAULT_GENERATION = GenerationConfig(k=8, k_policy="adaptive")  # strategy "auto"


@dataclass(frozen=True)
class Settings:
    """One comparison: the target alone always runs first, then `generation.strategy` with the drafter."""

    target: str = DEFAULT.target
    drafter: str = DEFAULT.drafter
    generation: GenerationConfig = DEFAULT_GENERATION
    target_dtype: str | None = None  # uag.models.dtypes; None: as stored (the offline models: float32)
    drafter_dtype: str | None = None

    @classmethod
    def parse(
        cls, target: Any = None, drafter: Any = None, *, target_dtype: Any = None, drafter_dtype: Any = None, **raw: Any
    ) -> Settings:
        """Settings from loosely typed input; InputError lists every problem. A setting left out (None for
        the names and dtypes) takes the app's default (DEFAULT, DEFAULT_GENERATION; dtypes: as stored).

        Example: Settings.parse(k=40, strategy="baseline") -> InputError("strategy must be one of …; k …")
        """
        problems = []
        strategy = raw.get("strategy", DEFAULT_GENERATION.strategy)
        if strategy not in SPECULATIVE:
            problems.append(f"strategy must be one of {', '.join(SPECULATIVE)} (got {strategy!r})")
            raw = {**raw, "strategy": DEFAULT_GENERATION.strategy}
        try:
            generation = DEFAULT_GENERATION.replace(**raw)  # a strategy names the translation and the k policy
        except InputError as err:
            problems.append(str(err))
        dtypes = {}
        for role, value in (("target", target_dtype), ("drafter", drafter_dtype)):
            try:
                text = value if isinstance(value, str) or value is None else repr(value)
                dtypes[role] = parse_dtype(text, flag=f"the {role} dtype")
            except InputError as err:
                problems.append(str(err))
        if problems:
            raise InputError("; ".join(problems))
        names = {}
        for role, value, default in (("target", target, cls.target), ("drafter", drafter, cls.drafter)):
            if value is not None and not isinstance(value, str):
                raise InputError(f"the {role} must be a name (got {value!r})")
            names[role] = default if value is None else value.strip()
        return cls(names["target"], names["drafter"], generation, dtypes["target"], dtypes["drafter"])

    @property
    def strategy(self) -> str:
        return self.generation.strategy

    def config(self, strategy: str | None = None) -> GenerationConfig:
        """The generation config of one of the comparison's runs ("baseline", or the speculative strategy)."""
        return self.generation if strategy is None else self.generation.replace(strategy=strategy)

    def flat(self) -> dict[str, Any]:
        """target, drafter and every decoding setting the app has a control for (`FIELDS`) in one flat dict
        (stats and history rows; the app leaves the samplers and penalties neutral)."""
        dtypes = {"target_dtype": self.target_dtype, "drafter_dtype": self.drafter_dtype}
        controls = {f.name: getattr(self.generation, f.name) for f in FIELDS}
        return {"target": self.target, "drafter": self.drafter, **dtypes, **controls}


def check_prompt(prompt: Any) -> str:
    """The prompt as typed if the app can run it; InputError saying what is wrong otherwise.

    Example: check_prompt("  ") -> InputError("the prompt is empty: …");  check_prompt("\\ud800") -> InputError
    """
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        kind = "a number" if isinstance(prompt, (int, float)) else "a list" if isinstance(prompt, list) else "not text"
        raise InputError(f"the prompt must be text (got {kind})")
    if not prompt.strip():  # but generate from the prompt as typed: trailing spaces change the tokens
        raise InputError("the prompt is empty: type one or pick an example")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InputError(f"the prompt is {len(prompt)} characters; the app takes at most {MAX_PROMPT_CHARS}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(
            f"the prompt holds a character that is not valid text at position {err.start + 1} (a lone "
            "surrogate, e.g. half of an emoji): remove it or paste the text again"
        ) from None
    if "\x00" in prompt:
        raise InputError("the prompt holds a NUL character: remove it")
    return prompt
