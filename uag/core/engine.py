"""Generation on mlx-lm models: the target alone, or speculative cycles with any drafter.

Layers, as in mlx-lm's generate.py: step generators yield `Step` records (`baseline_steps`, mlx-lm's own
`generate_step`; `speculative_steps`, `Speculation.cycle` — draft, verify, commit — and, where the policy parks,
`Speculation.plain_steps`); `stream()` owns the run (the `Run` record, text, timing, EOS, the budget, cancel, and
the `finally` that leaves both caches holding exactly the committed tokens) and yields `Event`s; `generate()`
drains it. A conversation's caches (`PromptCaches`) are trimmed to what each prompt shares and read past it; the
first cycle rides on the prompt pass. Why each part is as it is: docs/how-it-works.md, "The engine".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.generate import generate_step

from uag.core.config import GRAMMAR, LOOKUP, GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.detokenize import Pieces
from uag.core.drafters import Draft, Drafter, DrafterChoice, make_drafter
from uag.core.passes import (
    PromptCaches,
    prefill,
    reuse,
    settle_allocator,
    tree_ready,
    trim_to,
    verify_pass,
    verify_tree,
)
from uag.core.policy import AutoSettings, Evidence, Policy, StopRule, make_policy, within
from uag.core.records import Cycle, Event, Run, Sharing
from uag.core.sampling import PENALTY_CONTEXT, Sampler, TargetSampling
from uag.core.translate import Translator
from uag.core.verify import accept_greedy, accept_rejection
from uag.errors import InputError, ModelError
from uag.models.store import LoadedModel, check_pair

if TYPE_CHECKING:
    from uag.core.grammar import Matcher


@dataclass(frozen=True, slots=True)
class Seams:
    """Replacements for what a run builds itself (tests, benchmarks): the policy that picks k (or only the
    settings of the `auto` one it builds), the translator of a drafter model's tokens, the target's sampler on
    speculative runs (the config's penalties still apply)."""

    policy: Policy | None = None
    auto: AutoSettings | None = None
    translator: Translator | None = None
    sampler: Sampler | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """What one step committed: target ids, how many leading ones came from a draft, and its cycle."""

    ids: list[int]
    accepted: int = 0
    cycle: Cycle | None = None  # None for a prompt pass that verified no draft
    opening: bool = False  # the prompt pass made it (its ids are the first ones of the run)
    read_ms: float | None = None  # an opening step: the target's passes over the prompt (None: all it took)


def prompt_ids(target: LoadedModel, prompt: str, *, chat: bool = False) -> list[int]:
    """Token ids of the prompt for the target (its chat template applied once, when asked)."""
    if not prompt or not prompt.strip():
        raise InputError("the prompt is empty")
    if chat:
        if not target.tokenizer.has_chat_template:
            raise ModelError(f"{target.name!r} has no chat template: turn the chat template off")
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        ids = target.tokenizer.encode(prompt)
    return _fitting(target, ids)


def _fitting(target: LoadedModel, ids: Sequence[int]) -> list[int]:
    """The prompt's ids, where there are some and they leave the target room to write."""
    if not ids:
        raise InputError("the prompt is empty")
    limit = target.context_length
    if limit is not None and len(ids) >= limit:
        raise InputError(f"the prompt is {len(ids)} tokens; {target.name!r} has a context of {limit}")
    return list(ids)


def matcher_for(target: LoadedModel, constraint: str) -> Matcher:
    """A run's matcher for a constraint (uag.core.grammar) over the target's tokens and its logits' width."""
    from uag.core.grammar import Matcher, TokenTable  # llguidance: loaded by the first constrained run only

    width = getattr(getattr(target.model, "args", None), "vocab_size", None) or target.vocab.size
    return Matcher(TokenTable.of(target.tokenizer, width, target.eos_ids), constraint)


def token_budget(target: LoadedModel, n_prompt: int, max_tokens: int) -> int:
    """The tokens a run may write: max_tokens, or fewer where the target's context ends first."""
    limit = target.context_length
    return max_tokens if limit is None else min(max_tokens, limit - n_prompt)


# --- the target alone ----------------------------------------------------------------------------


def baseline_steps(
    target: LoadedModel,
    prompt: Sequence[int],
    config: GenerationConfig,
    cache: list,
    cached: int,
    budget: int,
    grammar: Matcher | None = None,
) -> Iterator[Step]:
    """The target alone, through mlx-lm's `generate_step`, reading the prompt after the `cached` tokens the
    cache holds; the cache is left holding every committed token but the newest. Its penalties see the whole
    committed sequence, the cached tokens included, as speculation's do; the grammar masks every step."""
    sampling = TargetSampling.of(config, grammar=grammar)
    steps = generate_step(
        mx.array(prompt[cached:]),
        target.model,
        max_tokens=budget,
        sampler=sampling.sampler,
        logits_processors=sampling.with_prefix(prompt[:cached], len(prompt) - cached) or None,
        prompt_cache=cache,
    )
    generated = 0
    try:
        tic = time.perf_counter()
        for token, _ in steps:
            now = time.perf_counter()
            generated += 1  # before the yield: a consumer may stop at it
            opening = generated == 1
            yield Step([token], 0, None if opening else Cycle.plain(0, (now - tic) * 1000), opening=opening)
            tic = time.perf_counter()
    finally:
        steps.close()
        trim_to(cache, len(prompt) + generated - 1)


# --- speculation ---------------------------------------------------------------------------------


class Speculation:
    """One speculative run's target side: its cache, the committed tokens, and the drafter that serves it.
    The target's cache has read committed[:seen]: at the start the `cached` tokens a conversation's cache
    held, after every step every committed token but the newest."""

    def __init__(
        self,
        target: LoadedModel,
        prompt: Sequence[int],
        config: GenerationConfig,
        drafter: Drafter,
        cache: list,
        cached: int = 0,
        *,
        sampler: Sampler | None = None,
        grammar: Matcher | None = None,
        batched: bool = False,
    ):
        self.target, self.config, self.drafter, self.cache = target, config, drafter, cache
        self.batched = batched  # a server runs it in a batch with other requests (uag.runtime.batching)
        self.sampling = TargetSampling.of(config, sampler, grammar)
        self.grammar = grammar  # the constraint's matcher: it has consumed every generated committed token
        self.committed = list(prompt)  # target ids: prompt, then every generated token
        self.seen, self.eos = cached, target.eos_ids

    def open(self, source: str, k: int, budget: int, stop: StopRule | None = None) -> Step:
        """The prompt pass with a first draft: the target reads the prompt but its last token, then verifies a draft
        made from the prompt alone together with that token (one pass fewer than reading the whole prompt and drafting
        after the target's first token). Its `read_ms`: that reading and the verify pass, which reads the last prompt
        token; not the drafting."""
        tic = time.perf_counter()
        prefill(self.target.model, self.cache, self.committed[self.seen : -1])
        read_ms = (time.perf_counter() - tic) * 1000
        self.seen = len(self.committed) - 1
        step = self.cycle(source, k, budget, stop)
        return replace(step, opening=True, read_ms=read_ms + step.cycle.verify_ms)

    def cycle(self, source: str, k: int, budget: int, stop: StopRule | None = None) -> Step:
        """Draft (up to k, as many as `stop` says where there is one) → verify → commit: at most `budget`
        tokens, stopping at EOS. Under a grammar, a greedy draft ends at its first token the grammar refuses
        (the target could not keep it), and source GRAMMAR proposes the tokens the grammar forces."""
        if source == GRAMMAR:
            forced = self.grammar.forced()[: min(k, budget - 1)]
            draft = Draft(GRAMMAR, forced, draft_ids=list(forced), usable=list(forced))
        else:
            draft = self.drafter.propose(source, k, budget - 1, stop)
        if self.grammar is not None and draft.q is None:
            draft.proposed = draft.proposed[: self.grammar.valid(draft.proposed)]
        t0 = time.perf_counter()
        verdict = self._verify(draft)
        new = verdict.committed(draft.proposed)
        new = new[: next((i + 1 for i, t in enumerate(new) if t in self.eos), len(new))]  # up to EOS
        accepted = min(verdict.accepted, len(new))
        t1 = time.perf_counter()
        loss = self.drafter.loss(draft, accepted, new)
        resync_absorbed = self._commit(draft, new)
        t2 = time.perf_counter()
        cycle = draft.cycle(
            k,
            accepted,
            len(new),
            verify_ms=(t1 - t0) * 1000,
            resync_ms=(t2 - t1) * 1000,
            resync_absorbed=resync_absorbed,
            loss=loss,
        )
        return Step(new, accepted, cycle)

    def _verify(self, draft: Draft):
        """One target pass over its pending token and the proposal (with lookup's other continuations, as a tree,
        where uag.core.passes.tree_ready); each position picked as the target alone would pick it there."""
        proposed, branches = draft.proposed, [draft.proposed, *draft.branches]
        model, greedy = self.target.model, self.sampling.by_argmax
        if draft.branches and tree_ready(model, self.cache, self.sampling, batched=self.batched):
            tree = verify_tree(model, self.cache, self.committed[-1], branches, self.sampling.ids, greedy=greedy)
            draft.proposed, draft.nodes, self.seen = branches[tree.branch], tree.nodes, self.seen + 1 + len(tree.path)
            return tree.verdict
        draft.branches = []  # verified alone
        inputs = mx.array([self.committed[-1], *proposed])[None]
        logits, picks = verify_pass(model, inputs, self.cache, greedy=greedy and draft.q is None)
        self.seen += 1 + len(proposed)
        logits = self.sampling.rows(self.committed, proposed, logits[0])
        if draft.q is not None:
            p = self.sampling.distribution(logits)
            verdict = accept_rejection(p, draft.q, draft.usable, proposed, draft.id_map)
        else:  # picked by its batch with the pass, where it ran in one
            verdict = accept_greedy(proposed, self.sampling.ids(logits) if picks is None else picks)
        settle_allocator()
        return verdict

    def _commit(self, draft: Draft, new: list[int]) -> bool:
        """Append committed tokens, trim the target's cache to all but the newest, tell the drafter."""
        self.committed += new
        if self.grammar is not None:
            self.grammar.consume(new)
        self.seen = min(self.seen, len(self.committed) - 1)
        trim_to(self.cache, self.seen)
        return self.drafter.commit(draft, new)

    def plain_steps(self, n: int, until: Callable[[], bool] | None = None) -> Iterator[int]:
        """Up to n plain target steps, pipelined as in mlx-lm's generate_step: each step is queued before the previous
        token is read back, so that parked, speculation costs what the target alone costs. Unlike generate_step, nothing
        is queued past the last token (generate_step computes one token more than it yields: a whole wasted step at the
        end of every parked stretch). When `until()` turns true after a token, the step already queued is taken and the
        stretch ends there. At the start of a run the stretch opens with the prompt, read as mlx-lm reads it."""
        model, cache, sampling, grammar = self.target.model, self.cache, self.sampling, self.grammar
        history = mx.array(self.committed[-PENALTY_CONTEXT - 1 : -1], dtype=mx.int32) if sampling.processors else None

        def queue(ids: mx.array) -> mx.array:
            nonlocal history
            logits = model(ids[None], cache=cache)[:, -1, :]
            if sampling.processors:  # the penalties' history grows by each input, as in generate_step
                history = mx.concatenate([history, ids.astype(mx.int32)])[-PENALTY_CONTEXT:]
            y = sampling.choose(sampling.step(history, logits))
            mx.async_eval(y)
            return y

        pending = self.committed[self.seen :]
        try:
            if len(pending) > 1:
                prefill(model, cache, pending[:-1])
            y = queue(mx.array(pending[-1:]))
            i = 0
            while y is not None:
                if grammar is not None:  # the next step's mask follows this token: no step is queued ahead
                    grammar.consume([y.item()])
                following = queue(y) if i + 1 < n else None
                token = y.item()
                self.committed.append(token)
                self.drafter.commit(None, [token])
                yield token
                if following is not None and until is not None and until():
                    n = i + 2  # take the step already queued, queue no more
                y, i = following, i + 1
        finally:
            self.seen = len(self.committed) - 1
            trim_to(self.cache, self.seen)

    def restore(self) -> None:
        """Leave both caches holding exactly the committed sequences, however the run ended."""
        self.seen = min(self.seen, len(self.committed) - 1)
        trim_to(self.cache, self.seen)
        self.drafter.restore()


def speculative_steps(
    spec: Speculation, policy: Policy, k_max: int, budget: int, sharing: Sharing | None = None
) -> Iterator[Step]:
    """Cycles where the policy drafts, pipelined plain stretches where it parks; up to `budget` tokens, each
    proposal offered up to `k_max` (the policy may ask for fewer). `sharing`: the run's place in a server's
    batch, told when the drafter rehearses."""
    generated = 0
    offer = lambda: spec.drafter.offer(k_max)  # noqa: E731
    forced = lambda: 0 if spec.grammar is None else len(spec.grammar.forced())  # noqa: E731

    def lookup_pending() -> bool:  # the batch the stretch was decided in changed, or a draft turned up: stop it
        if policy.reconsider() or forced() > 0:
            return True
        offered = offer()
        return LOOKUP in offered and policy.heeds(offered)  # not where its decision passed a match like it over

    passed = None  # the lookup proposal the last decision passed over: the next cycle's record carries it

    def choose(left: int) -> tuple[str, int]:  # what the grammar forces is proposed free, before the policy asks
        nonlocal passed
        n = forced()
        decision = within((GRAMMAR, min(n, k_max)), left) if n else policy.choose(offer(), left)
        passed = None if n else policy.passed_over()
        return decision

    stretch = None
    try:
        policy.begin(spec.drafter.start(spec.committed), budget)
        source, k = choose(budget)  # the policy keeps within the budget (uag.core.policy.within)
        if k == 0:  # parked from the start: the prompt pass opens a stretch
            stretch = spec.plain_steps(min(policy.plain_steps(), budget), lookup_pending)
            generated += 1
            tic = time.perf_counter()
            token = next(stretch)
            yield Step([token], opening=True, read_ms=(time.perf_counter() - tic) * 1000)
        else:  # the prompt pass verifies a first draft
            step = spec.open(source, k, budget, policy.stop_rule(source, k))
            policy.observe(step.cycle)
            generated += len(step.ids)
            yield step
        while generated < budget and spec.committed[-1] not in spec.eos:
            source, k = ("", 0) if stretch is not None else choose(budget - generated)
            if k == 0:  # plain target steps, as many in a row as the policy wants
                stretch = stretch or spec.plain_steps(min(policy.plain_steps(), budget - generated), lookup_pending)
                t0 = time.perf_counter()
                for token in stretch:
                    now = time.perf_counter()
                    cycle = Cycle.plain(0, (now - t0) * 1000)
                    cycle.passed, passed = passed, None
                    policy.observe(cycle)
                    generated += 1
                    if generated < budget and token not in spec.eos and policy.wants_rehearsal():
                        _rehearse(spec.drafter, policy, cycle, sharing)
                    yield Step([token], 0, cycle)
                    t0 = time.perf_counter()
                    if token in spec.eos:
                        break
                stretch.close()
                stretch = None
                continue
            step = spec.cycle(source, k, budget - generated, policy.stop_rule(source, k))
            step.cycle.passed, passed = passed, None
            policy.observe(step.cycle)
            generated += len(step.ids)
            yield step
    finally:
        if stretch is not None:
            stretch.close()
        spec.restore()


def _rehearse(drafter: Drafter, policy: Policy, cycle: Cycle, sharing: Sharing | None) -> None:
    """The drafter catches up on the parked stretch and the policy learns from its guesses there; the
    plain step's record carries what that reading cost. Batched, the batch knows its drafter passes for a
    rehearsal: it does not hold the others' target passes for them (uag.runtime.batching, `Batch.round`)."""
    if sharing is not None:
        sharing.rehearsing = True
    try:
        rehearsal = drafter.rehearse()
    finally:
        if sharing is not None:
            sharing.rehearsing = False
    if rehearsal is not None:
        cycle.draft_ms, cycle.drafter_passes, cycle.drafter_read = rehearsal.ms, 1, rehearsal.read
        policy.rehearsed(rehearsal)


# --- the stream ----------------------------------------------------------------------------------


def stream(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | Drafter | None,
    prompt: str | Sequence[int],
    config: GenerationConfig,
    *,
    profile: CostProfile | None = None,
    cancel: threading.Event | None = None,
    caches: PromptCaches | None = None,
    evidence: Evidence | None = None,
    seams: Seams | None = None,
    sharing: Sharing | None = None,
) -> Iterator[Event]:
    """Baseline or speculative generation for a text prompt (or ready token ids), one `Event` per step.

    `drafter`: a loaded model, a `DrafterChoice` (lookup, or lookup+model), a ready `Drafter` (ranks of a
    sharded target that only relay drafts: uag.distributed.sharded), or None for the baseline.
    `profile`: the pair's measured costs (uag.costs.pair.saved_profile), which seed adaptive k ("auto");
    `evidence`: what auto learned in earlier runs of this pair, carried on and updated in place.
    `caches`: the conversation's caches; the run reads only the prompt tokens they do not hold already
    (`Run.cached_tokens` counts those that they do) and leaves them ready for the next run.
    `seams`: replacements for the policy, translator or sampler (tests, benchmarks).
    `sharing`: how a server batches this run's target passes with other requests' (uag.runtime.batching): auto
    prices a draft by the batch's pass, and a tree pass runs only where the batch lets the model be the run's own.
    """
    config.validate()
    ids = prompt_ids(target, prompt, chat=config.chat) if isinstance(prompt, str) else _fitting(target, prompt)
    budget = token_budget(target, len(ids), config.max_tokens)
    caches = PromptCaches() if caches is None else caches
    seams = seams or Seams()
    grammar = None if config.constraint is None else matcher_for(target, config.constraint)
    common = dict(temperature=config.temperature, seed=config.seed, max_tokens=config.max_tokens, prompt_ids=ids)
    if config.strategy == "baseline":
        run = Run("baseline", target.name, **common)
    else:
        drafting, notes, r = _drafter(target, drafter, config, caches, seams.translator)
        policy = seams.policy or make_policy(config, profile, r, evidence, seams.auto, sharing)
        run = Run(
            drafting.translation,
            target.name,
            drafting.name,
            k=config.k,
            window=config.window,
            notes=list(notes),
            k_policy=policy.k_policy,
            **common,
        )
    # Last, once nothing can refuse the run: the target's cache trimmed to what this prompt shares with it.
    held = caches.target_cache if caches.target_model in (None, target.name) else None
    cache, run.cached_tokens = reuse(held, caches.target_ids, ids, target.make_cache)
    caches.target_cache, caches.target_ids, caches.target_model = cache, ids[: run.cached_tokens], target.name
    if config.strategy == "baseline":
        steps = baseline_steps(target, ids, config, cache, run.cached_tokens, budget, grammar)
    else:
        spec = Speculation(
            target,
            ids,
            config,
            drafting,
            cache,
            run.cached_tokens,
            sampler=seams.sampler,
            grammar=grammar,
            batched=sharing is not None,
        )
        steps = speculative_steps(spec, policy, config.k, budget, sharing)
    return _drive(
        run, steps, Pieces(target.tokenizer, target.eos_ids), target.eos_ids, config.seed, cancel, caches, grammar
    )


def _drafter(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | Drafter | None,
    config: GenerationConfig,
    caches: PromptCaches,
    translator: Translator | None,
) -> tuple[Drafter, tuple[str, ...], float]:
    """The run's drafter, the pair's notes, and r (drafter/target bytes, auto's prior for the drafter's cost)."""
    if drafter is None:
        raise InputError(f"strategy {config.strategy!r} needs a drafter")
    if not isinstance(drafter, (DrafterChoice, LoadedModel)):
        return drafter, (), 0.0  # ready made
    choice = DrafterChoice.of(drafter)
    if choice.model is None:
        return make_drafter(choice, target, config, caches=caches), (), 0.0
    pair = check_pair(target, choice.model)
    made = make_drafter(choice, target, config, translator=translator, caches=caches, shared=pair.shared_vocabulary)
    return made, pair.notes, pair.r


def _drive(
    run: Run,
    steps: Iterator[Step],
    pieces: Pieces,
    eos: frozenset[int],
    seed: int | None,
    cancel: threading.Event | None,
    caches: PromptCaches,
    grammar: Matcher | None = None,
) -> Iterator[Event]:
    """The one loop that turns steps into a run: timing, text, EOS, cancel, and the final record."""
    if seed is not None:
        mx.random.seed(seed)
    reason, failed = "length", True
    tic = time.perf_counter()
    try:
        for step in steps:
            now = time.perf_counter()
            if step.opening:  # prompt_ms: the target's reading of the prompt (uag.core.records.Run)
                read_ms = (now - tic) * 1000 if step.read_ms is None else step.read_ms
                run.first_token_s, run.prompt_ms, run.opening = now, read_ms, len(step.ids)
            if step.cycle is not None:
                step.cycle.index = len(run.cycles)
                run.cycles.append(step.cycle)
            run.last_token_s = now
            tokens = pieces(step.ids, step.accepted)
            run.tokens.extend(tokens)
            if step.ids[-1] in eos:
                reason = "eos"
            elif cancel is not None and cancel.is_set():
                reason = "stopped"
            yield Event(tokens, step.cycle, run)
            if reason == "length" and cancel is not None and cancel.is_set():  # set while the consumer held it
                reason = "stopped"
            if reason != "length":
                break
        failed = False
    except GeneratorExit:
        reason, failed = "stopped", False
        raise
    finally:
        steps.close()  # the step generator's own `finally` leaves the caches exact
        caches.keep([*run.prompt_ids, *run.token_ids], failed)
        run.finish_reason = reason
        run.grammar_ms = 0.0 if grammar is None else grammar.ms
        tail = pieces.flush()
        if tail and run.tokens:  # text held back by the detokenizer (an incomplete final character)
            run.tokens[-1] = replace(run.tokens[-1], text=run.tokens[-1].text + tail)


def generate(
    target: LoadedModel, drafter: DrafterChoice | LoadedModel | Drafter | None, prompt, config: GenerationConfig, **kw
) -> Run:
    """Run a stream to the end and return its record."""
    return last_run(stream(target, drafter, prompt, config, **kw))


def last_run(events: Iterator[Event]) -> Run:
    """Drain a stream of `Event`s and return the run's final record."""
    run = None
    for event in events:
        run = event.run
    if run is None or run.finish_reason is None:
        raise RuntimeError("generation ended without a final record")
    return run
