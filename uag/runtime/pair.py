"""One way in for every front end: load a pair, read its prompt, check a run against the target alone.

The CLI, the app, the server (and, where a sharded target allows, the sharded server) all go through these, so
they load, refuse and compare alike; `auto`'s inputs are opened by `uag.costs.pair.open_auto`.

    loaded = open_pair(store, "demo-target", "lookup+demo-drafter")
    ids = prompt_ids_for(loaded, "Stolica Polski to", config)
    run = uag.core.engine.generate(loaded.target, loaded.choice, ids, config)
    check_against_target(loaded, ids, config, run).to_dict()    # {"kind": "identical", …}
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from uag.core.config import DrafterSpec, GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice, check_drafter_fits
from uag.core.engine import PromptCaches, prompt_ids
from uag.core.engine import stream as engine_stream
from uag.core.prompt_input import check_context
from uag.core.records import Event, Run
from uag.core.translate import Translator
from uag.costs.pair import saved_profile
from uag.errors import InputError
from uag.models.loading import check_memory, load_model
from uag.models.store import LoadedModel, ModelStore, Pair, check_pair
from uag.runtime.divergence import Divergence
from uag.runtime.margins import compare_runs

Progress = Callable[[str], None]


class Load(Protocol):
    """How a front end loads one model: `uag.models.loading.load_model`'s signature (the app's says more)."""

    def __call__(
        self,
        store: ModelStore,
        name: str,
        *,
        role: str,
        progress: Progress | None = None,
        keep: Collection[str] = (),
        dtype: str | None = None,
    ) -> LoadedModel: ...


@dataclass(frozen=True)
class Loaded:
    """A target and a drafter choice, loaded and checked as a pair; `pair` when the drafter has a model, `choice`
    None for the target alone."""

    target: LoadedModel
    choice: DrafterChoice | None
    pair: Pair | None

    @property
    def r(self) -> float | None:
        """Drafter bytes / target bytes (None without a drafter model)."""
        return self.pair.r if self.pair is not None else None

    @property
    def drafter(self) -> DrafterChoice | LoadedModel | None:
        """What the engine takes as its drafter: the model itself, or the choice for lookup and the hybrid."""
        if self.choice is None:
            return None
        return self.choice if self.choice.lookup else self.choice.model

    def uses(self, model: LoadedModel) -> bool:
        return model is self.target or (self.choice is not None and model is self.choice.model)

    def saved_profile(self) -> CostProfile | None:
        """The pair's saved costs on this machine, for `auto` (None without them, or a damaged file)."""
        return saved_profile(self.target, self.choice)


def pair_of(target: LoadedModel, choice: DrafterChoice | None) -> Loaded:
    """`target` with `choice` checked for speculation (`check_pair`; lookup alone needs a trimmable target).
    ModelError saying what to fix when they cannot speculate."""
    if choice is None:
        return Loaded(target, None, None)
    if choice.model is not None:
        return Loaded(target, choice, check_pair(target, choice.model))
    target.check_trimmable("target")
    return Loaded(target, choice, None)


def open_pair(
    store: ModelStore,
    target: str,
    drafter: str | DrafterSpec | None,
    *,
    target_dtype: str | None = None,
    drafter_dtype: str | None = None,
    progress: Progress | None = None,
    between: Callable[[], None] | None = None,
    load: Load = load_model,
) -> Loaded:
    """The target and the drafter (None: the target alone) in their dtypes, loaded once through `store` and
    checked as a pair: memory first (nothing is loaded when they would not fit), then the target, the drafter,
    the target again so that loading the drafter did not unload it. Failures are `ModelError`s (`UserError`)
    saying what to fix. `between()` runs after the target, before the drafter (a server stops a cancelled
    request there); `load` is how each model loads (the app reports more than `progress` hears).

    Example: open_pair(store, "demo-target", "lookup").choice -> DrafterChoice(lookup=True, model=None)
    """
    spec = drafter if isinstance(drafter, DrafterSpec) or drafter is None else DrafterSpec.parse(drafter)
    model = None if spec is None else spec.model
    check_memory(store, [("target", target, target_dtype), ("drafter", model, drafter_dtype)])
    loaded = load(store, target, role="target", progress=progress, dtype=target_dtype)
    if spec is None:
        return pair_of(loaded, None)
    if between is not None:
        between()
    drafter_model = None
    if model is not None:
        drafter_model = load(store, model, role="drafter", progress=progress, keep=[target], dtype=drafter_dtype)
        loaded = load(store, target, role="target", keep=[model], dtype=target_dtype)  # held: no progress to say
    return pair_of(loaded, DrafterChoice(lookup=spec.lookup, model=drafter_model))


_PER_TOKEN: dict[str, int | None] = {}  # target name -> `chars_per_token` of its tokenizer, worked out once


def chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the characters one token of `tokenizer` stands for: its longest vocabulary entry (a
    byte-level or SentencePiece entry is at least as long as the text it decodes to); None when the tokenizer
    does not list its vocabulary. So a prompt of more than context × this many characters cannot fit.

    Example: vocabulary {"a": 0, "▁hello": 1, "<0x0A>": 2} -> 6
    """
    vocab = getattr(tokenizer, "get_vocab", None)
    if vocab is None:
        return None
    try:
        return max((len(piece) for piece in vocab()), default=None)
    except (TypeError, AttributeError, NotImplementedError):
        return None


def max_prompt_chars(target: LoadedModel) -> int | None:
    """The most characters a prompt may have to fit the target's context (context × `chars_per_token`, worked
    out once per model); None when either is unknown."""
    if target.name not in _PER_TOKEN:
        _PER_TOKEN[target.name] = chars_per_token(target.tokenizer)
    per_token = _PER_TOKEN[target.name]
    return None if per_token is None or not target.context_length else target.context_length * per_token


def check_prompt_chars(target: LoadedModel, chars: int) -> None:
    """InputError when a prompt of `chars` characters cannot fit the target's context however it is tokenised
    (`max_prompt_chars`): refused before tokenising it. A prompt no longer than the context always passes."""
    if not target.context_length or chars <= target.context_length:
        return
    bound = max_prompt_chars(target)
    if bound is not None and chars > bound:
        raise InputError(
            f"the prompt's {chars:,} characters are more than the target {target.name}'s context of "
            f"{target.context_length:,} tokens can hold (at most {bound // target.context_length} characters a "
            "token): shorten it"
        )


class PromptIds(NamedTuple):
    """A prompt as the target's ids, checked (`checked_prompt`), and the translator the drafter's check started on
    them (None: nothing to check), which a run may take rather than translate the prompt again."""

    ids: list[int]
    translator: Translator | None = None


def checked_prompt(loaded: Loaded, prompt: str | Sequence[int], config: GenerationConfig) -> PromptIds:
    """The prompt as the target's ids, checked against the target's context and the drafter's: text through
    the target's tokenizer (its chat template with `config.chat`: uag.core.engine.prompt_ids; one far too long
    for the context is refused first, `check_prompt_chars`), or ids as given (a server renders a conversation
    and its tools first, after the same character check). InputError saying what to shorten. The drafter's check
    translates the prompt (uag.core.drafters.check_drafter_fits): a server hands that translator to the run, which
    does not translate the prompt again."""
    target = loaded.target
    if isinstance(prompt, str):
        check_prompt_chars(target, len(prompt))  # a prompt far too long is not tokenised
        ids = prompt_ids(target, prompt, chat=config.chat)  # empty, and the target's context
    else:
        ids = list(prompt)
        if not ids:
            raise InputError("the prompt is empty")
        check_context(len(ids), target.context_length, "target", target.name)
    return PromptIds(ids, check_drafter_fits(target, loaded.choice, ids, config))


def prompt_ids_for(loaded: Loaded, prompt: str | Sequence[int], config: GenerationConfig) -> list[int]:
    """`checked_prompt`'s ids.

    Example: prompt_ids_for(loaded, "Stolica Polski to", GenerationConfig()) -> [1, 29879, …]
    """
    return checked_prompt(loaded, prompt, config).ids


@dataclass(frozen=True)
class Checked:
    """A greedy run set against the target alone on the same prompt: the verdict (uag.runtime.divergence), or
    why there is none (`why_not`)."""

    run: Run
    baseline: Run | None
    divergence: Divergence | None
    why_not: str | None = None

    @property
    def measured_speedup(self) -> float | None:
        """The run's tokens/s over the target alone's (measured, not estimated)."""
        tps = None if self.baseline is None else self.baseline.tokens_per_second
        return self.run.tokens_per_second / tps if tps and self.run.tokens_per_second else None

    def to_dict(self) -> dict[str, Any]:
        """What `uag generate --compare --json` prints as `divergence` and a server reply's `speculative.check`.

        Example: not compared -> {"kind": None, "message": "not compared: the reply has no tokens"}
        """
        if self.divergence is None:
            return {"kind": None, "message": f"not compared: {self.why_not}"}
        tps = self.baseline.tokens_per_second if self.baseline is not None else None
        measured = self.measured_speedup
        return {**self.divergence.to_dict(), "baseline_tokens_per_second": tps, "measured_speedup": measured}


def check_against_target(
    loaded: Loaded | LoadedModel,
    ids: Sequence[int],
    config: GenerationConfig,
    run: Run,
    *,
    baseline: Run | None = None,
    cancel: threading.Event | None = None,
    stream: Callable[..., Iterator[Event]] | None = None,
) -> Checked:
    """`run` against the target alone on the prompt `ids`: the target alone for as many tokens as the run (read
    cold, as `uag generate --strategy baseline` would), unless the caller ran it already (`baseline`), and the
    verdict on the two greedy outputs (uag.runtime.margins.compare_runs): identical, a near-tie the dtype's
    rounding may turn, or a mismatch (a bug). `stream`: the engine's (a sharded server's runs over its ranks).

    A server checks a request where it ran: in a batch, the baseline and the margins' passes are rows of whatever
    batch runs then, not of the run's own batched passes, which no one can repeat. That is sound: every computation
    of the target's gap sits within a batched pass's drift of one-token steps, so a flip between any two needs a
    margin under twice that drift in each, and the dtype's bound covers twice it (uag.runtime.divergence)."""
    target = loaded.target if isinstance(loaded, Loaded) else loaded
    if run.generated == 0:
        return Checked(run, baseline, None, "the reply has no tokens")
    if baseline is None:
        plain = config.replace(strategy="baseline", max_tokens=run.generated)
        for event in (stream or engine_stream)(target, None, ids, plain, cancel=cancel, caches=PromptCaches.empty()):
            baseline = event.run
        if baseline is None or baseline.finish_reason == "stopped":
            return Checked(run, baseline, None, "the target alone's run was stopped")
    verdict = compare_runs(target, baseline, run)
    why = None if verdict is not None else "sampled or stopped runs cannot be compared token for token"
    return Checked(run, baseline, verdict, why)


def what_ran(target: LoadedModel, choice: DrafterChoice | None, config: GenerationConfig) -> dict[str, Any]:
    """What a run ran, as `uag generate` says it on the console: the models with their dtypes, the translation
    and the k policy (None where the target ran alone).

    Example: demo pair, strategy auto, k 8 -> {"target": "demo-target", "target_dtype": "float32", "drafter":
             "demo-drafter", "drafter_dtype": "float32", "translation": "context", "k_policy": "adaptive", "k": 8}
    """
    speculative = config.speculative and choice is not None
    model = None if choice is None else choice.model
    return {
        "target": target.name,
        "target_dtype": target.dtype,
        "drafter": choice.name if speculative else None,
        "drafter_dtype": model.dtype if speculative and model is not None else None,
        "translation": config.translation if speculative else None,
        "k_policy": config.k_policy if speculative else None,
        "k": config.k if speculative else None,
    }
