"""Baseline and speculative generation on mlx-lm models, as streams of `Event`s.

Layers, as in mlx-lm: `stream_baseline` / `stream_speculative` yield one `Event` per committed step;
`stream` picks one from a `GenerationConfig`; `generate` drains a stream into its `Run`.

A speculative cycle: the drafter proposes k tokens; the translator turns them into target tokens; the
target scores its pending token plus the proposal in one forward pass; the longest prefix the target
agrees with is accepted, plus the target's own next token; both caches are trimmed back to what was
committed. The drafter is re-synced lazily: the tokens it has not seen yet are fed in the same forward
pass that produces its next draft, so a fully accepted draft costs no extra drafter pass.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from uag.models import LoadedModel, ModelError, Pair, check_pair
from uag.records import Cycle, Event, Run, Token
from uag.translate import DEFAULT_WINDOW, STRATEGIES, Translator, longest_common_prefix, make_translator

DEFAULT_K = 2
MAX_K = 32
DEFAULT_MAX_TOKENS = 64
PREFILL_STEP = 512
MODES = ("baseline", *STRATEGIES)


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how. `strategy="baseline"` runs the target alone."""

    strategy: str = "context"
    k: int = DEFAULT_K
    window: int = DEFAULT_WINDOW
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int | None = None
    chat: bool = False

    def validate(self) -> GenerationConfig:
        if self.strategy not in MODES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(MODES)}")
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"k (draft length) must be between 1 and {MAX_K} (got {self.k})")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if self.window < 0:
            raise ValueError(f"window must be >= 0 (got {self.window})")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        return self


def prompt_ids(target: LoadedModel, prompt: str, *, chat: bool = False) -> list[int]:
    """Token ids of the prompt for the target (its chat template applied once, when asked)."""
    if not prompt or not prompt.strip():
        raise ValueError("the prompt is empty")
    if chat:
        if not target.tokenizer.has_chat_template:
            raise ModelError(f"{target.name!r} has no chat template; run without --chat")
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = target.tokenizer.encode(prompt)
    limit = target.context_length
    if limit is not None and len(ids) >= limit:
        raise ValueError(f"the prompt is {len(ids)} tokens; {target.name!r} has a context of {limit}")
    return list(ids)


def _token_budget(target: LoadedModel, n_prompt: int, max_tokens: int) -> int:
    limit = target.context_length
    return max_tokens if limit is None else min(max_tokens, limit - n_prompt)


def _sampler(temperature: float) -> Callable[[mx.array], mx.array]:
    return make_sampler(temperature)


def _rewind(cache: list, length: int) -> None:
    """Trim every layer's cache back to `length` tokens (a no-op where it holds fewer)."""
    for layer in cache:
        extra = layer.offset - length
        if extra > 0:
            layer.trim(extra)


def _prefill(model, cache: list, ids: Sequence[int]) -> mx.array | None:
    """Feed `ids` in chunks; return the last position's logits (None when `ids` is empty)."""
    logits = None
    for start in range(0, len(ids), PREFILL_STEP):
        logits = model(mx.array(ids[start : start + PREFILL_STEP])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return None if logits is None else logits[:, -1, :]


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class _Pieces:
    """Streaming detokenizer: each committed target token gets its piece of the output text."""

    def __init__(self, target: LoadedModel):
        self._detokenizer = target.tokenizer.detokenizer
        self._eos = target.eos_ids

    def __call__(self, ids: Sequence[int], from_draft: Sequence[bool]) -> tuple[Token, ...]:
        tokens = []
        for token_id, drafted in zip(ids, from_draft):
            text = ""
            if token_id not in self._eos:
                self._detokenizer.add_token(token_id)
                text = self._detokenizer.last_segment
            tokens.append(Token(token_id, text, drafted))
        return tuple(tokens)

    def flush(self) -> str:
        self._detokenizer.finalize()
        return self._detokenizer.last_segment


def _finish(run: Run, pieces: _Pieces, reason: str) -> None:
    run.finish_reason = reason
    tail = pieces.flush()
    if tail and run.tokens:  # text held back by the detokenizer (an incomplete final character)
        last = run.tokens[-1]
        run.tokens[-1] = replace(last, text=last.text + tail)


# --- baseline ------------------------------------------------------------------------------------


def stream_baseline(
    target: LoadedModel,
    prompt: Sequence[int],
    config: GenerationConfig,
    *,
    cache: list | None = None,
    cancel: threading.Event | None = None,
) -> Iterator[Event]:
    """The target alone, through mlx-lm's own `generate_step` (the reference users know)."""
    config.validate()
    cache = target.make_cache() if cache is None else cache
    budget = _token_budget(target, len(prompt), config.max_tokens)
    run = Run(
        "baseline",
        target.name,
        temperature=config.temperature,
        seed=config.seed,
        max_tokens=config.max_tokens,
        prompt_ids=list(prompt),
    )
    pieces = _Pieces(target)
    if config.seed is not None:
        mx.random.seed(config.seed)
    steps = generate_step(
        mx.array(prompt), target.model, max_tokens=budget, sampler=_sampler(config.temperature), prompt_cache=cache
    )
    tic = time.perf_counter()
    reason = "length"
    try:
        for token_id, _ in steps:
            now = time.perf_counter()
            if run.first_token_s is None:
                run.first_token_s, run.prompt_ms = now, (now - tic) * 1000
                cycle = None
            else:
                cycle = Cycle(
                    index=len(run.cycles),
                    k=0,
                    draft_ids=[],
                    proposed_ids=[],
                    accepted=0,
                    emitted=1,
                    verify_ms=(now - run.last_token_s) * 1000,
                )
                run.cycles.append(cycle)
            run.last_token_s = now
            tokens = pieces([token_id], [False])
            run.tokens.extend(tokens)
            if token_id in target.eos_ids:
                reason = "eos"
            elif cancel is not None and cancel.is_set():
                reason = "stopped"
            yield Event(tokens, cycle, run)
            if reason != "length":
                break
    except GeneratorExit:
        reason = "stopped"
        raise
    finally:
        steps.close()
        _rewind(cache, len(prompt) + run.generated - 1)
        _finish(run, pieces, reason)


# --- speculative ---------------------------------------------------------------------------------


def _drafter_resumes_at(seen: int, cut: int, length: int) -> int:
    """Tokens the drafter cache keeps after a re-sync: what it saw, up to `cut`, and never all of
    the sequence (its next pass must feed at least one token to produce logits)."""
    return min(seen, cut, length - 1)


def stream_speculative(
    pair: Pair,
    prompt: Sequence[int],
    config: GenerationConfig,
    *,
    translator: Translator | None = None,
    caches: tuple[list, list] | None = None,
    cancel: threading.Event | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
) -> Iterator[Event]:
    """Draft → translate → verify → re-sync cycles. Lossless: every token is one the target chose."""
    config.validate()
    target, drafter = pair.target, pair.drafter
    if translator is None:
        translator = make_translator(
            config.strategy, target.vocab, drafter.vocab, window=config.window, shared=pair.shared_vocabulary
        )
    t_cache, d_cache = caches if caches is not None else (target.make_cache(), drafter.make_cache())
    sampler = sampler or _sampler(config.temperature)
    budget = _token_budget(target, len(prompt), config.max_tokens)
    strategy = "identity" if pair.shared_vocabulary else config.strategy
    run = Run(
        strategy,
        target.name,
        drafter.name,
        k=config.k,
        window=config.window,
        temperature=config.temperature,
        seed=config.seed,
        max_tokens=config.max_tokens,
        prompt_ids=list(prompt),
        notes=list(pair.notes),
    )
    pieces = _Pieces(target)
    eos = target.eos_ids
    if config.seed is not None:
        mx.random.seed(config.seed)

    # `t_seen` / `d_seen`: tokens each cache holds. The target has seen every committed token but
    # the newest; the drafter has seen drafter_ids[:d_seen] and gets the rest in its next pass.
    t_seen = d_seen = 0
    reason = "length"
    tic = time.perf_counter()
    try:
        # Prompt pass: the target reads the whole prompt and chooses the first token itself.
        first = sampler(_logprobs(_prefill(target.model, t_cache, prompt))).item()
        t_seen = len(prompt)
        drafter_prompt = translator.start(prompt)
        _prefill(drafter.model, d_cache, drafter_prompt[:-1])
        d_seen = len(drafter_prompt) - 1
        cut = translator.commit([], [first]).cut
        d_seen = _drafter_resumes_at(d_seen, cut, len(translator.drafter_ids))
        _rewind(d_cache, d_seen)
        now = time.perf_counter()
        run.first_token_s = run.last_token_s = now
        run.prompt_ms = (now - tic) * 1000
        tokens = pieces([first], [False])
        run.tokens.extend(tokens)
        if first in eos:
            reason = "eos"
        yield Event(tokens, None, run)

        while reason == "length" and run.generated < budget:
            if cancel is not None and cancel.is_set():
                reason = "stopped"
                break
            remaining = budget - run.generated
            k = min(config.k, remaining - 1)
            cycle = Cycle(index=len(run.cycles), k=k, draft_ids=[], proposed_ids=[], accepted=0, emitted=0)

            # 1. Draft: the first pass also feeds whatever the drafter has not seen yet.
            t0 = time.perf_counter()
            drafts: list[int] = []
            if k > 0:
                d_base = len(translator.drafter_ids)
                y = mx.array(translator.drafter_ids[d_seen:])
                guesses = []
                for _ in range(k):
                    y = mx.argmax(drafter.model(y[None], cache=d_cache)[:, -1, :], axis=-1)
                    mx.async_eval(y)
                    guesses.append(y)
                drafts = mx.concatenate(guesses).tolist()
                d_seen = d_base + k - 1  # every draft but the last has been fed back
                cycle.drafter_passes = k
            t1 = time.perf_counter()

            # 2. Translate into target tokens (never more than the token budget can take).
            usable = translator.usable(drafts)
            proposal = translator.propose(usable)
            proposed = proposal.ids[: remaining - 1]
            t2 = time.perf_counter()

            # 3. Verify: one target pass over its pending token and the proposal.
            pending = translator.target_ids[-1]
            logits = target.model(mx.array([pending, *proposed])[None], cache=t_cache)[0]
            choices = sampler(_logprobs(logits)).tolist()
            t_seen += 1 + len(proposed)
            t3 = time.perf_counter()

            # 4. Commit the agreed prefix plus the target's own next token; stop at EOS.
            n_accepted = longest_common_prefix(proposed, choices)  # target's choice per position
            new = [*proposed[:n_accepted], choices[n_accepted]]
            stop = next((i for i, t in enumerate(new) if t in eos), None)
            if stop is not None:
                new, reason = new[: stop + 1], "eos"
            n_accepted = min(n_accepted, len(new))
            resync = translator.commit(usable, new)
            t_seen = len(translator.target_ids) - 1
            _rewind(t_cache, t_seen)
            d_seen = _drafter_resumes_at(d_seen, resync.cut, len(translator.drafter_ids))
            _rewind(d_cache, d_seen)
            t4 = time.perf_counter()

            cycle.draft_ids, cycle.proposed_ids = drafts, proposed
            cycle.accepted, cycle.emitted = n_accepted, len(new)
            cycle.draft_ms, cycle.translate_ms = (t1 - t0) * 1000, (t2 - t1) * 1000
            cycle.verify_ms, cycle.resync_ms = (t3 - t2) * 1000, (t4 - t3) * 1000
            cycle.absorbed, cycle.fallback, cycle.empty = proposal.absorbed, proposal.fallback, proposal.empty
            cycle.resync_absorbed = resync.absorbed
            run.cycles.append(cycle)
            run.last_token_s = t4
            tokens = pieces(new, [i < n_accepted for i in range(len(new))])
            run.tokens.extend(tokens)
            yield Event(tokens, cycle, run)
    except GeneratorExit:
        reason = "stopped"
        raise
    finally:
        # Leave both caches holding exactly the committed sequences, however we got here.
        if translator.target_ids:
            _rewind(t_cache, min(t_seen, len(translator.target_ids) - 1))
            _rewind(d_cache, min(d_seen, len(translator.drafter_ids) - 1))
        _finish(run, pieces, reason)


# --- entry points --------------------------------------------------------------------------------


def stream(
    target: LoadedModel,
    drafter: LoadedModel | None,
    prompt: str | Sequence[int],
    config: GenerationConfig,
    *,
    cancel: threading.Event | None = None,
) -> Iterator[Event]:
    """Baseline or speculative generation for a text prompt (or ready token ids)."""
    config.validate()
    ids = prompt_ids(target, prompt, chat=config.chat) if isinstance(prompt, str) else list(prompt)
    if config.strategy == "baseline":
        return stream_baseline(target, ids, config, cancel=cancel)
    if drafter is None:
        raise ValueError(f"strategy {config.strategy!r} needs a drafter")
    return stream_speculative(check_pair(target, drafter), ids, config, cancel=cancel)


def generate(target: LoadedModel, drafter: LoadedModel | None, prompt, config: GenerationConfig, **kw) -> Run:
    """Run a stream to the end and return its record."""
    run = None
    for event in stream(target, drafter, prompt, config, **kw):
        run = event.run
    if run is None or run.finish_reason is None:
        raise RuntimeError("generation ended without a final record")
    return run
