"""Who drafts: a model through translation, prompt lookup, or both (the hybrid).

`DrafterChoice` is what a user picked, loaded once (a model in memory, or no model at all for lookup);
each run turns it into a stateful `Drafter` that proposes target tokens every cycle:

- `ModelDrafter`: k passes of a drafter model, then translation into target tokens (uag.core.translate).
- `LookupDrafter`: the continuation of the latest earlier occurrence of the last n tokens (uag.core.lookup).
- `HybridDrafter`: lookup where the context offers a match, the model elsewhere; the policy picks the
  source each cycle (uag.core.policy).

`load_drafter_choice` loads what a user named; `check_drafter_fits` refuses a prompt that leaves it no room.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from uag.core import anatomy
from uag.core.anatomy import Loss
from uag.core.config import LOOKUP, DrafterSpec, GenerationConfig
from uag.core.copy_forms import copy_forms
from uag.core.lookup import LOOKUP_REACH, NGRAMS, NgramIndex, SharedIndex, own_match, proposal, recall
from uag.core.passes import PREFILL_STEP, PromptCaches, prefill, reuse, settle_allocator, trim_to
from uag.core.policy import StopRule
from uag.core.prompt_input import check_context
from uag.core.records import Cycle, Offer, Rehearsal
from uag.core.translate import IntersectionTranslator, Proposal, Resync, TextTranslator, Translator, make_translator
from uag.core.verify import IdMap, draft_distribution
from uag.models.loading import user_facing_load_errors
from uag.models.store import LoadedModel
from uag.models.vocab import Vocab, same_vocabulary

REHEARSAL_SPAN = 64  # positions per pass of a rehearsal (its logits are kept: one row per position)


@dataclass(frozen=True)
class DrafterChoice:
    """A loaded drafter choice: prompt lookup (also from `shared_index`, earlier requests' text, and with
    `copy_forms` from the prompt in the forms a JSON reply copies it in), a model, or both."""

    lookup: bool = False
    model: LoadedModel | None = None
    shared_index: SharedIndex | None = field(default=None, compare=False, repr=False)
    copy_forms: bool = field(default=False, compare=False)  # a reply that may write JSON: a tool call, a schema

    def __post_init__(self):
        if not self.lookup and self.model is None:
            raise ValueError("a drafter choice needs lookup, a model, or both")

    @property
    def name(self) -> str:
        return str(DrafterSpec(self.lookup, None if self.model is None else self.model.name))

    @property
    def kind(self) -> str:
        return DrafterSpec(self.lookup, None if self.model is None else self.model.name).kind

    @classmethod
    def of(cls, drafter: DrafterChoice | LoadedModel) -> DrafterChoice:
        return drafter if isinstance(drafter, DrafterChoice) else cls(model=drafter)


# --- drafters of one run ---------------------------------------------------------------------------


@dataclass
class Draft:
    """One cycle's proposal and what making it cost."""

    source: str  # "model" or "lookup"
    proposed: list[int]  # target ids put up for verification
    draft_ids: list[int] = field(default_factory=list)  # what the drafter drafted (its own vocabulary)
    usable: list[int] = field(default_factory=list)  # drafts worth translating (up to a control token)
    q: object | None = None  # the drafter's distributions (TLI sampling), for rejection sampling
    id_map: IdMap | None = None  # how q's drafter ids map to target ids
    draft_ms: float = 0.0  # drafter passes (model) or the lookup itself
    translate_ms: float = 0.0
    sync_ms: float = 0.0  # catching up with tokens committed since the drafter last drafted
    passes: int = 0  # drafter forward passes
    read: int = 0  # tokens those passes read
    absorbed: bool = False
    fallback: bool = False
    empty: bool = False
    resync_absorbed: bool = False
    proposal: Proposal | None = None  # the translator's proposal (model drafts), for the loss anatomy
    match: int = 0  # a lookup proposal: how many tokens its match ran back (uag.core.lookup)
    branches: list[list[int]] = field(default_factory=list)  # lookup's other continuations (a tree pass: engine)
    nodes: int = 0  # the tree pass's nodes, once verified as one (engine); 0: verified alone
    shared_index: bool = False  # a lookup proposal from earlier requests' text (LookupDrafter.shared)
    confidence: list[float] = field(default_factory=list)  # the drafter's probability of each draft it made
    #                                                        (a stop rule's run; draft_ids are those proposed)

    def length(self, asked: int) -> int:
        """The draft length a record gives: the drafts made where a stop rule ended them, else the k asked."""
        return self.passes if self.confidence else asked

    def cycle(
        self,
        k: int,
        accepted: int,
        emitted: int,
        *,
        verify_ms: float,
        resync_ms: float,
        resync_absorbed: bool,
        loss: Loss,
    ) -> Cycle:
        """The record of the cycle this draft went into, asked for k drafts (its length: `length`), once verified
        (`accepted` of it, `emitted` tokens committed) and committed (`resync_ms`, `resync_absorbed`: the
        drafter's re-sync after the commit, to which its catch-up before drafting adds)."""
        return Cycle(
            index=0,
            k=self.length(k),
            draft_ids=self.draft_ids,
            proposed_ids=self.proposed,
            accepted=accepted,
            emitted=emitted,
            draft_ms=self.draft_ms,
            translate_ms=self.translate_ms,
            verify_ms=verify_ms,
            resync_ms=resync_ms + self.sync_ms,
            drafter_passes=self.passes,
            drafter_read=self.read,
            absorbed=self.absorbed,
            fallback=self.fallback,
            empty=self.empty,
            resync_absorbed=resync_absorbed or self.resync_absorbed,
            source=self.source,
            loss={name: n for name, n in loss.as_dict().items() if n},
            match=self.match,
            branches=1 + len(self.branches),
            nodes=self.nodes,
            confidence=self.confidence,
            shared_index=self.shared_index,
        )


class Drafter(Protocol):
    """What the speculative cycle needs from whatever drafts. Proposals are in target ids."""

    name: str  # what drafts, as a user names it: a model, "lookup", "lookup+<model>"
    translation: str  # how its drafts become target ids: a translator's name, or "lookup" (none needed)

    def start(self, prompt: Sequence[int]) -> int:
        """Begin a run on the target's prompt ids; return the tokens a first draft must read first (fewer
        where a conversation's cache already holds the start of them)."""

    def offer(self, k_max: int) -> Offer:
        """The sources that can draft now and how many tokens each could propose at most (and how far
        lookup's match runs back)."""

    def propose(self, source: str, k: int, budget: int, stop: StopRule | None = None) -> Draft:
        """Up to k drafts from `source`, translated, never more than `budget` target tokens; a model's
        drafts as many as `stop` says, where there is one."""

    def loss(self, draft: Draft, accepted: int, written: Sequence[int]) -> Loss:
        """Where the draft's lost positions went (uag.core.anatomy), before `commit` hears of `written`."""

    def commit(self, draft: Draft | None, new: Sequence[int]) -> bool:
        """The target committed `new` (after a draft, or plain steps); return whether re-sync absorbed."""

    def rehearse(self) -> Rehearsal | None:
        """Read what was committed while parked and say where drafts would have held (None: cannot)."""

    def restore(self) -> None:
        """Leave any cache holding exactly what was committed, and say so in the run's `PromptCaches`."""


def lookup_offer(index: NgramIndex, k_max: int) -> Offer:
    """What prompt lookup can draft now: up to LOOKUP_REACH tokens (k_max where more; a fixed k takes k of them,
    auto as many as its verify curve pays for) and how far its match runs back, or nothing without a match."""
    if index.match is None:
        return Offer()
    return Offer({LOOKUP: max(k_max, LOOKUP_REACH)}, match=index.match_length(), branched=index.branching())


def copy_views(vocab: Vocab, prompt: Sequence[int]) -> SharedIndex | None:
    """The prompt in the forms a JSON reply copies it in (uag.core.copy_forms), as target ids indexed for lookup;
    None where no form differs from the prompt's text."""
    forms = [vocab.encode(form)[0] for form in copy_forms(vocab.decode(prompt))]
    if not forms:
        return None
    views = SharedIndex(max(1, sum(len(ids) for ids in forms)), NGRAMS)
    for ids in forms:
        views.add(ids)
    return views


class LookupDrafter:
    """Prompt lookup over everything committed (and `shared`, earlier requests' text; with `copy_forms`, also the
    prompt as a tool call's JSON string or a copy out of a numbered listing writes it): no model, no translation."""

    name = translation = LOOKUP

    def __init__(
        self,
        vocab: Vocab,
        ngrams: Sequence[int] = NGRAMS,
        shared: SharedIndex | None = None,
        copy_forms: bool = False,
        caches: PromptCaches | None = None,
    ):
        self.vocab = vocab  # the target's: lookup's proposals are target tokens
        self.index = NgramIndex(ngrams)
        self.shared = shared
        self.copy_forms = copy_forms
        self.caches = caches  # the conversation's: its last run's index, which this run goes on with (`start`)
        self.views: SharedIndex | None = None  # the prompt's copy forms, built by `start`

    def start(self, prompt: Sequence[int]) -> int:
        """Index the prompt: where the conversation's last run indexed the start of it (its prompt and reply, which
        a next turn re-sends), only the rest; indexing costs ~3 ms a thousand tokens on a CPU core."""
        held = None if self.caches is None else self.caches.lookup
        if held is not None and held.ngrams == self.index.ngrams and list(prompt[: len(held)]) == held.ids:
            self.index = held
            self.index.extend(prompt[len(held.ids) :])
        else:
            self.index = NgramIndex(self.index.ngrams)
            self.index.extend(prompt)
        if self.caches is not None:
            self.caches.lookup = self.index  # extended in place by every token the run commits
        self.views = copy_views(self.vocab, prompt) if self.copy_forms else None  # a decode, an escape, an encode
        return 0

    def offer(self, k_max: int) -> Offer:
        reach = max(k_max, LOOKUP_REACH)
        written, mine, viewed = own_match(self.index, self.views, reach)
        match, recalled = recall(self.shared, self.index, reach, mine)
        if recalled:  # the request's own continuation, where it has a match, may go beside it (lookup.proposal)
            return Offer({LOOKUP: len(recalled)}, match=match, branched=self.index.match is not None)
        if viewed:
            return Offer({LOOKUP: len(written)}, match=mine)
        return lookup_offer(self.index, k_max)

    def propose(self, source: str, k: int, budget: int, stop: StopRule | None = None) -> Draft:
        tic = time.perf_counter()  # the source that matches further back; the other's continuation a branch
        ids, match, branches, recalled = proposal(self.index, self.shared, min(k, budget), self.views)
        ms = (time.perf_counter() - tic) * 1000
        return Draft(
            LOOKUP, ids, list(ids), list(ids), draft_ms=ms, match=match, branches=branches, shared_index=recalled
        )

    def loss(self, draft: Draft, accepted: int, written: Sequence[int]) -> Loss:
        if accepted >= len(draft.proposed):
            return Loss()
        return anatomy.of_ids(self.vocab, self.index.ids[-anatomy.CONTEXT :], draft.proposed, accepted, written)

    def commit(self, draft: Draft | None, new: Sequence[int]) -> bool:
        self.index.extend(new)
        return False

    def rehearse(self) -> Rehearsal | None:
        return None  # a lookup costs nothing: it is simply tried

    def restore(self) -> None:
        pass


class ModelDrafter:
    """A drafter model through a translator. Its cache has read translator.drafter_ids[:seen]; the rest
    (the prompt, the target's corrections, tokens committed while parked) is fed with its next draft, or
    read earlier by a rehearsal, so a fully accepted draft costs no extra drafter pass and a run that never
    drafts or rehearses never pays. A conversation's later run starts from the cache its `PromptCaches`
    keeps, trimmed to the longest common prefix of the drafter ids it holds and this run's drafter prompt."""

    def __init__(
        self, model: LoadedModel, translator: Translator, config: GenerationConfig, caches: PromptCaches | None = None
    ):
        self.model, self.translator, self.config = model, translator, config
        self.caches = PromptCaches() if caches is None else caches
        self.cache: list | None = None  # the run's cache, from `caches` or fresh (`start`)
        self.seen = 0
        self.unsynced: list[int] = []  # committed target tokens the translator has not been given yet
        self.tli = isinstance(translator, IntersectionTranslator)
        self.id_map: IdMap | None = None  # built on the first drafter pass, which tells its logits' size
        self.name, self.translation = model.name, translator.name
        self.prompt_length = 0

    def start(self, prompt: Sequence[int]) -> int:
        ids = self.translator.begin(prompt)
        check_context(len(ids), self.model.context_length, "drafter", self.model.name)
        self.prompt_length = len(ids)
        held = self.caches.drafter_cache if self.caches.drafter_model in (None, self.model.name) else None
        self.cache, self.seen = reuse(held, self.caches.drafter_ids, ids, self.model.make_cache)
        return len(ids) - self.seen

    def offer(self, k_max: int) -> Offer:
        return Offer({"model": k_max})

    def _sync(self, drafts: Sequence[int] = ()) -> Resync:
        """Give the translator the tokens committed since it last heard, keep what the cache saw."""
        resync = self.translator.commit(drafts, self.unsynced)
        self.unsynced = []
        self.seen = min(self.seen, resync.cut, len(self.translator.drafter_ids) - 1)
        trim_to(self.cache, self.seen)
        return resync

    def propose(self, source: str, k: int, budget: int, stop: StopRule | None = None) -> Draft:
        t0 = time.perf_counter()
        catch_up = self._sync() if self.unsynced else None
        t1 = time.perf_counter()
        drafts, q, read, confidence = self._draft(k) if stop is None else self._draft_until(k, stop)
        passes = len(confidence) or k
        t2 = time.perf_counter()
        usable = self.translator.usable(drafts)
        proposal = self.translator.propose(usable)
        t3 = time.perf_counter()
        return Draft(
            "model",
            proposal.ids[:budget],
            draft_ids=drafts,
            usable=usable,
            q=q,
            id_map=self.id_map,
            draft_ms=(t2 - t1) * 1000,
            translate_ms=(t3 - t2) * 1000,
            sync_ms=(t1 - t0) * 1000,
            passes=passes,
            read=read,
            absorbed=proposal.absorbed,
            fallback=proposal.fallback,
            empty=proposal.empty,
            resync_absorbed=bool(catch_up and catch_up.absorbed),
            proposal=proposal,
            confidence=confidence,
        )

    def _restrict(self, logits: mx.array) -> mx.array:
        """Under TLI, the drafter's logits restricted to the shared vocabulary (the map is built on first use,
        when the logits tell the drafter's vocabulary size); otherwise unchanged."""
        if not self.tli:
            return logits
        if self.id_map is None:
            self.id_map = IdMap(self.translator.to_target, logits.shape[-1])
        return logits + self.id_map.drafter_mask

    def _unread(self) -> mx.array:
        """What the first drafter pass must feed: everything the cache has not seen (a long stretch, the
        prompt say, read first in chunks, as a prompt is)."""
        ids = self.translator.drafter_ids
        if len(ids) - self.seen > PREFILL_STEP:
            prefill(self.model.model, self.cache, ids[self.seen : len(ids) - 1])
            self.seen = len(ids) - 1
        return mx.array(ids[self.seen :])

    def _draft(self, k: int) -> tuple[list[int], mx.array | None, int, list[float]]:
        """k drafter passes, pipelined; the first also feeds what the drafter has not seen. Greedy, except TLI
        at temperature > 0, which samples and keeps each distribution q for rejection sampling."""
        base, seen = len(self.translator.drafter_ids), self.seen
        y, sample = self._unread(), self.tli and self.config.temperature > 0
        guesses, qs = [], []
        for _ in range(k):
            logits = self._restrict(self.model.model(y[None], cache=self.cache)[:, -1, :])
            if sample:
                q = draft_distribution(logits, self.config.temperature)
                y = mx.random.categorical(mx.log(q))
                qs.append(q)
            else:
                y = mx.argmax(logits, axis=-1)
            mx.async_eval(y)
            guesses.append(y)
        drafts = mx.concatenate(guesses).tolist()
        self.seen = base + k - 1  # every draft but the last has been fed back
        settle_allocator()
        return drafts, (mx.concatenate(qs) if qs else None), base - seen + k - 1, []

    def _draft_until(self, k: int, stop: StopRule) -> tuple[list[int], mx.array | None, int, list[float]]:
        """Drafts one pass at a time (greedy, or sampled as in `_draft`), until `stop`, told the drafter's
        probability of each draft so far, says how many to propose, or k are drafted; the drafts past that many
        are dropped (the cache trims them with the next re-sync)."""
        base, seen = len(self.translator.drafter_ids), self.seen
        y, sample = self._unread(), self.tli and self.config.temperature > 0
        drafts, qs, confidence, keep = [], [], [], None
        while keep is None and len(drafts) < k:
            logits = self._restrict(self.model.model(y[None], cache=self.cache)[:, -1, :])
            q = draft_distribution(logits, self.config.temperature if sample else 1.0)
            y = mx.random.categorical(mx.log(q)) if sample else mx.argmax(logits, axis=-1)
            chance = q[0, y]  # the drafter's probability of what it drafted
            mx.eval(y, chance)
            drafts.append(y.item())
            confidence.append(chance.item())
            if sample:
                qs.append(q)
            keep = stop(confidence)
        self.seen = base + len(drafts) - 1
        settle_allocator()
        keep = len(drafts) if keep is None else min(keep, len(drafts))
        q = mx.concatenate(qs[:keep]) if sample and keep else None
        return drafts[:keep], q, base - seen + len(drafts) - 1, confidence

    def loss(self, draft: Draft, accepted: int, written: Sequence[int]) -> Loss:
        proposal = draft.proposal
        if proposal is None or (accepted >= len(draft.proposed) and not proposal.dropped):
            return Loss()
        if isinstance(self.translator, TextTranslator):
            return anatomy.of_cycle(self.translator, proposal, draft.proposed, accepted, written)
        context = self.translator.target_ids[-anatomy.CONTEXT :]  # identity: drafts are target tokens
        return anatomy.of_ids(self.translator.target, context, draft.proposed, accepted, written)

    def commit(self, draft: Draft | None, new: Sequence[int]) -> bool:
        self.unsynced += new
        if draft is None or draft.source != "model":
            return False  # plain steps or another source's draft: caught up lazily, with the next draft
        return self._sync(draft.usable).absorbed

    def rehearse(self) -> Rehearsal | None:
        """Catch up now on what was committed while parked (the reading the next draft would do anyway),
        keeping the drafter's guess at every generated position: a draft starting at a position holds for
        as many positions as the guesses there and after it are right, so one pass replays every draft the
        stretch could have had. Greedy guesses (restricted to the shared vocabulary under TLI); the
        prompt is read without them, and the newest token stays pending for the next draft, as after one."""
        if not self.unsynced:
            return None
        tic = time.perf_counter()
        target_tokens = len(self.unsynced)
        self._sync()
        ids = self.translator.drafter_ids
        start, end = self.seen, len(ids) - 1
        first = min(max(start, self.prompt_length - 1), end)
        if first > start:
            prefill(self.model.model, self.cache, ids[start:first])
        hits, confidence = [], []
        for lo in range(first, end, REHEARSAL_SPAN):
            hi = min(lo + REHEARSAL_SPAN, end)
            logits = self._restrict(self.model.model(mx.array(ids[lo:hi])[None], cache=self.cache)[0])
            guesses, chances = mx.argmax(logits, axis=-1), mx.max(mx.softmax(logits, axis=-1), axis=-1)
            hits += [g == t for g, t in zip(guesses.tolist(), ids[lo + 1 : hi + 1])]
            confidence += chances.tolist()
        self.seen = end
        settle_allocator()
        if not hits:
            return None
        ms = (time.perf_counter() - tic) * 1000
        return Rehearsal(hits, end - start, ms, target_tokens, confidence[: len(hits)])

    def restore(self) -> None:
        if self.cache is None:
            return  # never started
        if self.unsynced and self.translator.target_ids:
            self._sync()
        self.seen = max(0, min(self.seen, len(self.translator.drafter_ids) - 1))
        trim_to(self.cache, self.seen)
        held = self.caches
        held.drafter_cache, held.drafter_ids = self.cache, self.translator.drafter_ids[: self.seen]
        held.drafter_model = self.model.name


class HybridDrafter:
    """Lookup where the context offers a match, the model elsewhere; both kept in step with the target."""

    def __init__(self, lookup: LookupDrafter, model: ModelDrafter):
        self.lookup, self.model, self.translation = lookup, model, model.translation
        self.name = str(DrafterSpec(True, model.name))

    def start(self, prompt: Sequence[int]) -> int:
        self.lookup.start(prompt)
        return self.model.start(prompt)

    def offer(self, k_max: int) -> Offer:
        lookup = self.lookup.offer(k_max)
        return Offer({**lookup, **self.model.offer(k_max)}, match=lookup.match, branched=lookup.branched)

    def propose(self, source: str, k: int, budget: int, stop: StopRule | None = None) -> Draft:
        return (self.lookup if source == LOOKUP else self.model).propose(source, k, budget, stop)

    def loss(self, draft: Draft, accepted: int, written: Sequence[int]) -> Loss:
        return (self.lookup if draft.source == LOOKUP else self.model).loss(draft, accepted, written)

    def commit(self, draft: Draft | None, new: Sequence[int]) -> bool:
        self.lookup.commit(draft, new)
        return self.model.commit(draft, new)

    def rehearse(self) -> Rehearsal | None:
        return self.model.rehearse()

    def restore(self) -> None:
        self.model.restore()


def make_drafter(
    choice: DrafterChoice,
    target: LoadedModel,
    config: GenerationConfig,
    *,
    translator: Translator | None = None,
    caches: PromptCaches | None = None,
    shared: bool = False,
) -> Drafter:
    """The stateful drafter of one run for a loaded choice (the translation strategy applies to the model;
    `caches` is the conversation's, whose drafter side the model reads from and leaves ready, and whose lookup index
    prompt lookup goes on with)."""
    lookup = (
        LookupDrafter(target.vocab, shared=choice.shared_index, copy_forms=choice.copy_forms, caches=caches)
        if choice.lookup
        else None
    )
    if choice.model is None:
        return lookup
    translator = translator or make_translator(
        config.translation, target.vocab, choice.model.vocab, window=config.window, shared=shared
    )
    model = ModelDrafter(choice.model, translator, config, caches)
    return model if lookup is None else HybridDrafter(lookup, model)


def load_drafter_choice(
    store, spec: str | DrafterSpec, *, progress: Callable[[str], None] | None = None, dtype: str | None = None
) -> DrafterChoice:
    """The `DrafterChoice` that `spec` names ("demo-drafter", "lookup", "lookup+demo-drafter"), its model loaded
    once through `store` in `dtype` (None: as stored), load failures said as ModelError; lookup loads nothing."""
    spec = spec if isinstance(spec, DrafterSpec) else DrafterSpec.parse(spec)
    with user_facing_load_errors("drafter", spec.model or str(spec)):
        model = None if spec.model is None else store.get(spec.model, dtype=dtype, progress=progress)
        return DrafterChoice(lookup=spec.lookup, model=model)


def check_drafter_fits(target, drafter, ids: Sequence[int], config: GenerationConfig) -> Translator | None:
    """InputError when the prompt `ids` (the target's) leaves the drafter model no room to generate in its
    context; nothing to check for the baseline or prompt lookup alone (`drafter`: a `DrafterChoice`, a loaded
    model or None). The length checked is the translator's own drafter-side prompt, so exactly what the run
    will feed the drafter (the target's own check is uag.core.engine.prompt_ids). Returns that translator, started
    on `ids`, which the run may take (`Seams.translator`) rather than translate the prompt again; None where
    nothing was checked."""
    if drafter is None or not config.speculative:
        return None
    model = DrafterChoice.of(drafter).model
    if model is None or model.context_length is None:
        return None
    shared = same_vocabulary(target.vocab, model.vocab)
    translator = make_translator(config.translation, target.vocab, model.vocab, window=config.window, shared=shared)
    check_context(len(translator.start(ids)), model.context_length, "drafter", model.name)
    return translator
