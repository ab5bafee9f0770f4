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
from contextlib import closing
from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from uag.config import DEFAULT_K, DEFAULT_MAX_TOKENS, MAX_K, MODES, SPECULATIVE, GenerationConfig
from uag.errors import InputError, ModelError
from uag.models import LoadedModel, Pair, check_pair
from uag.policy import AdaptiveK, FixedK
from uag.records import Cycle, Event, Run, Token
from uag.sampling import IdMap, draft_distribution, rejection_verify
from uag.translate import (
    DEFAULT_WINDOW,
    STRATEGIES,
    IntersectionTranslator,
    Resync,
    Translator,
    longest_common_prefix,
    make_translator,
)

PREFILL_STEP = 512


def prompt_ids(target: LoadedModel, prompt: str, *, chat: bool = False) -> list[int]:
    """Token ids of the prompt for the target (its chat template applied once, when asked)."""
    if not prompt or not prompt.strip():
        raise InputError("the prompt is empty")
    if chat:
        if not target.tokenizer.has_chat_template:
            raise ModelError(f"{target.name!r} has no chat template; run without --chat")
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = target.tokenizer.encode(prompt)
    limit = target.context_length
    if limit is not None and len(ids) >= limit:
        raise InputError(f"the prompt is {len(ids)} tokens; {target.name!r} has a context of {limit}")
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


def _settle_allocator() -> None:
    """Charge a forward pass's memory clean-up to that pass, not to whatever allocates next.

    A forward pass frees thousands of small buffers into glibc's fastbins; the next sizeable malloc
    merges them all (1.5-2 ms after a demo-target pass on our 2-core CPU). Without this, that cost
    lands in the first tokenizer call of the translation phase. Allocating above pymalloc's 512-byte
    limit triggers the merge here instead; total time is unchanged.
    """
    bytearray(4096)


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
                cycle = Cycle.plain(len(run.cycles), (now - run.last_token_s) * 1000)
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


class _Speculation:
    """One speculative run's state: both caches, the translator, and how much of each sequence
    each cache has read. The target has read every committed token but the newest; the drafter has
    read translator.drafter_ids[:d_seen] and gets the rest in its next forward pass."""

    def __init__(
        self,
        pair: Pair,
        prompt: Sequence[int],
        config: GenerationConfig,
        translator: Translator,
        caches: tuple[list, list] | None,
        sampler: Callable[[mx.array], mx.array],
    ):
        self.target, self.drafter = pair.target, pair.drafter
        self.config, self.translator, self.sampler = config, translator, sampler
        self.t_cache, self.d_cache = (
            caches if caches is not None else (self.target.make_cache(), self.drafter.make_cache())
        )
        self.committed = list(prompt)  # target ids: prompt, then every generated token
        self.unsynced: list[int] = []  # committed target tokens the translator has not been given yet
        self.t_seen = self.d_seen = 0
        self.tli = isinstance(translator, IntersectionTranslator)
        self.id_map: IdMap | None = None  # built on the first drafter pass, which tells its logits' size
        self.drafter_read = 0  # tokens the last draft() fed the drafter

    def start(self) -> int:
        """Give the translator the prompt; return how many tokens the drafter's version of it has. The
        drafter reads them with its first draft, so a run that never drafts (auto, parked) never pays."""
        return len(self.translator.start(self.committed))

    def prefill(self) -> int:
        """The prompt pass: the target reads the prompt and chooses the first token itself."""
        first = self.sampler(_logprobs(_prefill(self.target.model, self.t_cache, self.committed))).item()
        self.t_seen = len(self.committed)
        self.committed.append(first)
        self.unsynced.append(first)
        return first

    def sync_drafter(self, drafts: Sequence[int] = ()) -> Resync:
        """Give the translator the tokens committed since it last heard, keep what the drafter saw."""
        resync = self.translator.commit(drafts, self.unsynced)
        self.unsynced = []
        self.d_seen = _drafter_resumes_at(self.d_seen, resync.cut, len(self.translator.drafter_ids))
        _rewind(self.d_cache, self.d_seen)
        return resync

    def draft(self, k: int) -> tuple[list[int], mx.array | None]:
        """k drafter passes; the first also feeds what the drafter has not seen. Greedy, except TLI
        at temperature > 0, which samples and keeps each distribution q for rejection sampling."""
        ids = self.translator.drafter_ids
        base, seen = len(ids), self.d_seen
        if base - self.d_seen > PREFILL_STEP:  # a long unread stretch (the prompt): in chunks, like a prompt
            _prefill(self.drafter.model, self.d_cache, ids[self.d_seen : base - 1])
            self.d_seen = base - 1
        y = mx.array(ids[self.d_seen :])
        sample = self.tli and self.config.temperature > 0
        guesses, qs = [], []
        for _ in range(k):
            logits = self.drafter.model(y[None], cache=self.d_cache)[:, -1, :]
            if self.tli:
                if self.id_map is None:
                    self.id_map = IdMap(self.translator.to_target, logits.shape[-1])
                logits = logits + self.id_map.drafter_mask
            if sample:
                q = draft_distribution(logits, self.config.temperature)
                y = mx.random.categorical(mx.log(q))
                qs.append(q)
            else:
                y = mx.argmax(logits, axis=-1)
            mx.async_eval(y)
            guesses.append(y)
        drafts = mx.concatenate(guesses).tolist()
        self.d_seen = base + k - 1  # every draft but the last has been fed back
        self.drafter_read = base - seen + k - 1
        _settle_allocator()
        return drafts, mx.concatenate(qs) if qs else None

    def verify(self, proposed: list[int], drafts: list[int], q: mx.array | None) -> tuple[int, list[int]]:
        """One target pass over its pending token and the proposal: (accepted, new committed tokens)."""
        logits = self.target.model(mx.array([self.committed[-1], *proposed])[None], cache=self.t_cache)[0]
        self.t_seen += 1 + len(proposed)
        if q is not None:
            accepted, token = rejection_verify(logits, q, drafts, proposed, self.id_map, self.config.temperature)
        else:
            choices = self.sampler(_logprobs(logits)).tolist()  # the target's own choice at each position
            accepted = longest_common_prefix(proposed, choices)
            token = choices[accepted]
        _settle_allocator()
        return accepted, [*proposed[:accepted], token]

    def commit(self, new: list[int]) -> None:
        """Append committed tokens; the target cache keeps all of them but the newest."""
        self.committed += new
        self.unsynced += new
        self.t_seen = len(self.committed) - 1
        _rewind(self.t_cache, self.t_seen)

    def plain_steps(self, n: int) -> Iterator[int]:
        """Up to n plain target steps, pipelined as in mlx-lm's generate_step: each step is queued
        before the previous token is read back, so that parked, speculation costs what the target
        alone costs. Unlike generate_step, nothing is queued past the n-th token (generate_step
        computes one token more than it yields: a whole wasted step at the end of every parked
        stretch). At the start of a run the stretch opens with the prompt, read like mlx-lm reads it
        (all but the last token in chunks, then the last one). Each token is committed as it comes;
        the consumer may stop early."""
        model, cache = self.target.model, self.t_cache

        def queue(ids: mx.array) -> mx.array:
            y = self.sampler(_logprobs(model(ids[None], cache=cache)[:, -1, :]))
            mx.async_eval(y)
            return y

        pending = self.committed[self.t_seen :]
        try:
            if len(pending) > 1:
                _prefill(model, cache, pending[:-1])
            y = queue(mx.array(pending[-1:]))
            for i in range(n):
                following = queue(y) if i + 1 < n else None
                token = y.item()
                self.committed.append(token)
                self.unsynced.append(token)
                yield token
                y = following
        finally:
            self.t_seen = len(self.committed) - 1
            _rewind(self.t_cache, self.t_seen)

    def restore(self) -> None:
        """Leave both caches holding exactly the committed sequences, however the run ended."""
        if self.unsynced and self.translator.target_ids:
            self.sync_drafter()
        _rewind(self.t_cache, min(self.t_seen, len(self.committed) - 1))
        if self.translator.drafter_ids:
            _rewind(self.d_cache, min(self.d_seen, len(self.translator.drafter_ids) - 1))


def stream_speculative(
    pair: Pair,
    prompt: Sequence[int],
    config: GenerationConfig,
    *,
    translator: Translator | None = None,
    policy: FixedK | AdaptiveK | None = None,
    caches: tuple[list, list] | None = None,
    cancel: threading.Event | None = None,
    sampler: Callable[[mx.array], mx.array] | None = None,
) -> Iterator[Event]:
    """Draft → translate → verify → re-sync cycles. Lossless: every token is one the target chose."""
    config.validate()
    target, drafter = pair.target, pair.drafter
    if translator is None:
        translation = "context" if config.strategy == "auto" else config.strategy
        translator = make_translator(
            translation, target.vocab, drafter.vocab, window=config.window, shared=pair.shared_vocabulary
        )
    policy = policy or make_policy(config, pair)
    spec = _Speculation(pair, prompt, config, translator, caches, sampler or _sampler(config.temperature))
    budget = _token_budget(target, len(prompt), config.max_tokens)
    run = Run(
        translator.name,
        target.name,
        drafter.name,
        k=config.k,
        window=config.window,
        temperature=config.temperature,
        seed=config.seed,
        max_tokens=config.max_tokens,
        prompt_ids=list(prompt),
        notes=list(pair.notes),
        policy="auto" if isinstance(policy, AdaptiveK) else "fixed",
    )
    pieces = _Pieces(target)
    eos = target.eos_ids
    if config.seed is not None:
        mx.random.seed(config.seed)

    def emit(new: list[int], accepted: int, cycle: Cycle | None, now: float) -> Event:
        if cycle is not None:
            run.cycles.append(cycle)
            policy.observe(cycle)
        run.last_token_s = now
        tokens = pieces(new, [i < accepted for i in range(len(new))])
        run.tokens.extend(tokens)
        return Event(tokens, cycle, run)

    reason = "length"
    stretch = None  # plain steps opened by the prompt pass, when the run starts parked
    policy.begin(spec.start())  # what the drafter must read before its first draft
    tic = time.perf_counter()
    try:
        if policy.next_k() == 0:  # parked from the start: the prompt pass opens a stretch of plain steps
            stretch = spec.plain_steps(min(policy.plain_steps(), budget))
            first = next(stretch)
        else:
            first = spec.prefill()
        run.first_token_s = now = time.perf_counter()
        run.prompt_ms = (now - tic) * 1000
        if first in eos:
            reason = "eos"
        yield emit([first], 0, None, now)

        while reason == "length" and run.generated < budget:
            if cancel is not None and cancel.is_set():
                reason = "stopped"
                break
            remaining = budget - run.generated
            k = 0 if stretch is not None else min(policy.next_k(), remaining - 1)

            if k == 0:  # plain target steps, as many in a row as the policy wants
                steps, stretch = stretch or spec.plain_steps(min(policy.plain_steps(), remaining)), None
                t0 = time.perf_counter()
                with closing(steps):  # a stretch the loop leaves early rewinds the cache before the next cycle
                    for token in steps:
                        now = time.perf_counter()
                        cycle = Cycle.plain(len(run.cycles), (now - t0) * 1000)
                        t0 = now
                        if token in eos:
                            reason = "eos"
                        yield emit([token], 0, cycle, now)
                        if reason != "length" or (cancel is not None and cancel.is_set()):
                            break
                continue

            # 1. Draft; the drafter first catches up with whatever the target committed meanwhile.
            t0 = time.perf_counter()
            catch_up = spec.sync_drafter() if spec.unsynced else None
            t_sync = time.perf_counter()
            drafts, q = spec.draft(k)
            t1 = time.perf_counter()

            # 2. Translate into target tokens (never more than the token budget can take).
            usable = translator.usable(drafts)
            proposal = translator.propose(usable)
            proposed = proposal.ids[: remaining - 1]
            t2 = time.perf_counter()

            # 3. Verify: the longest agreed prefix plus the target's own next token; stop at EOS.
            accepted, new = spec.verify(proposed, usable, q)
            stop = next((i for i, t in enumerate(new) if t in eos), None)
            if stop is not None:
                new, reason = new[: stop + 1], "eos"
            accepted = min(accepted, len(new))
            t3 = time.perf_counter()

            # 4. Commit, trim the target's cache, re-sync the drafter (lazily: fed in its next pass).
            spec.commit(new)
            resync = spec.sync_drafter(usable)
            t4 = time.perf_counter()

            cycle = Cycle(
                index=len(run.cycles),
                k=k,
                draft_ids=drafts,
                proposed_ids=proposed,
                accepted=accepted,
                emitted=len(new),
                draft_ms=(t1 - t_sync) * 1000,
                translate_ms=(t2 - t1) * 1000,
                verify_ms=(t3 - t2) * 1000,
                resync_ms=(t4 - t3 + t_sync - t0) * 1000,
                drafter_passes=k,
                drafter_read=spec.drafter_read,
                absorbed=proposal.absorbed,
                fallback=proposal.fallback,
                empty=proposal.empty,
                resync_absorbed=resync.absorbed or bool(catch_up and catch_up.absorbed),
            )
            yield emit(new, accepted, cycle, t4)
    except GeneratorExit:
        reason = "stopped"
        raise
    finally:
        if stretch is not None:
            stretch.close()
        spec.restore()
        _finish(run, pieces, reason)


def make_policy(config: GenerationConfig, pair: Pair) -> FixedK | AdaptiveK:
    """Fixed k, or for strategy "auto" the adaptive policy with k ≤ config.k, seeded by a saved
    calibration profile for this pair on this machine when there is one."""
    if config.strategy != "auto":
        return FixedK(config.k)
    from uag.profiles import find_profile

    return AdaptiveK(k_max=config.k, profile=find_profile(pair), r=pair.r)


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
        raise InputError(f"strategy {config.strategy!r} needs a drafter")
    return stream_speculative(check_pair(target, drafter), ids, config, cancel=cancel)


def generate(target: LoadedModel, drafter: LoadedModel | None, prompt, config: GenerationConfig, **kw) -> Run:
    """Run a stream to the end and return its record."""
    run = None
    for event in stream(target, drafter, prompt, config, **kw):
        run = event.run
    if run is None or run.finish_reason is None:
        raise RuntimeError("generation ended without a final record")
    return run
