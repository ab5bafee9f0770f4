"""Records of a generation run: per token, per cycle, per run. Standard library only.

One family for baseline and speculative runs, so that every consumer (CLI, app, sweeps, analysis) reads
the same numbers. Definitions (also in docs/how-it-works.md#metrics):

- proposed: target tokens put up for verification (after translation), summed over cycles.
- accepted: proposed tokens the target agreed with (the longest matching prefix of each proposal).
- acceptance rate α = accepted / proposed (target-token space; None when nothing was proposed).
- mean accepted length = accepted / cycles (draft tokens kept per verification pass, bonus excluded).
- draft fraction = accepted / generated tokens (share of the output that came from the drafter).
- generation tokens/s = (generated − opening) / (t_last − t_first): tokens after those of the prompt pass,
  over the time from the prompt pass's tokens to the last token, so prompt processing is excluded. The
  prompt pass commits one token, or, where it verified a first draft, that draft's accepted tokens and
  the target's next one (`opening`). None when nothing came after the prompt pass.
- prompt time (`prompt_ms`) = the target's passes that read the prompt tokens its cache did not hold: its
  prefill of them and the pass that reads the last one, which yields the first token (the target alone, or
  parked from the start) or also verifies the first draft (a run that drafts from the start: that pass's
  verify time). Not in it: the first draft's drafting and translation, and the drafter reading its side of
  the prompt, which it does with that draft (in the first cycle's `draft_ms` and `drafter_read`).
- prompt tokens/s = prompt tokens read / prompt time. Tokens a conversation's cache already held
  (`cached_tokens`, uag.core.passes.PromptCaches) are not read again and not counted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

LOSS_CAUSES = ("disagree", "split", "held", "absorbed", "short")  # uag.core.anatomy.Loss's fields


@dataclass(frozen=True, slots=True)
class Token:
    """One committed target token and its piece of the output text."""

    id: int
    text: str  # streaming-detokenized piece; "" while a multi-byte character is incomplete
    from_draft: bool


@dataclass(slots=True)
class Cycle:
    """One draft → translate → verify → re-sync cycle. k == 0 is a plain target step; one that ended a
    parked stretch with a rehearsal (uag.core.policy) carries the drafter's reading in draft_ms, drafter_passes
    and drafter_read."""

    index: int
    k: int  # draft length asked of the drafter
    draft_ids: list[int]  # drafter tokens it proposed (drafter vocabulary)
    proposed_ids: list[int]  # target tokens put up for verification
    accepted: int  # leading proposed tokens the target agreed with
    emitted: int  # tokens committed by this cycle (accepted + 1, fewer at EOS or max_tokens)
    draft_ms: float = 0.0
    translate_ms: float = 0.0
    verify_ms: float = 0.0
    resync_ms: float = 0.0
    drafter_passes: int = 0  # drafter forward passes spent in this cycle
    drafter_read: int = 0  # tokens those passes read: the drafts but the last, plus any catch-up (the prompt,
    #                        the target's corrections, tokens committed while parked)
    absorbed: bool = False  # re-encoding merged across the committed boundary; recovered
    fallback: bool = False  # no usable in-context encoding; contextless (anchored) encoding used
    empty: bool = False  # drafts were made but translated to no target token
    resync_absorbed: bool = False  # re-sync re-encoded drafter tokens because of a boundary merge
    source: str = ""  # what drafted: "model", "lookup"; "" for a plain target step
    loss: dict[str, int] = field(default_factory=dict)  # lost positions by cause (uag.core.anatomy); {} if none
    match: int = 0  # a lookup draft: how many tokens its match ran back (uag.core.lookup.match_length); else 0
    shared_index: bool = False  # a lookup draft from earlier requests' text (uag.core.lookup.SharedIndex)
    branches: int = 1  # proposals its pass verified: more where lookup's continuations went as a tree (proposed_ids:
    #                    the one whose tokens were kept)
    nodes: int = 0  # a tree pass: the tokens of all its proposals it read (shared prefixes once); 0: proposed_ids
    confidence: list[float] = field(default_factory=list)  # auto's model drafts: the drafter's probability of
    #   each draft it made, those it dropped after draft_ids included (k counts them all); [] where unmeasured
    passed: Passed | None = None  # the lookup proposal the decision that opened this cycle (or stretch) passed over

    @classmethod
    def plain(cls, index: int, verify_ms: float) -> Cycle:
        """A plain target step: no drafts, one token."""
        return cls(index=index, k=0, draft_ids=[], proposed_ids=[], accepted=0, emitted=1, verify_ms=verify_ms)

    @property
    def proposed(self) -> int:
        return len(self.proposed_ids)

    @property
    def ms(self) -> float:
        return self.draft_ms + self.translate_ms + self.verify_ms + self.resync_ms


class Offer(dict[str, int]):
    """What can draft now, as a drafter tells its policy: source -> the most tokens it could propose; and
    `match`, where prompt lookup has a match, how many tokens that match runs back (uag.core.lookup: the
    longer, the likelier its proposal holds), else 0; `branched`, whether lookup's proposal would bring other
    continuations into its pass (a tree: up to `lookup.branch_room(k)` more rows to pay for).

    Example: Offer({"lookup": 8, "model": 8}, match=23)
    """

    def __init__(self, sources: dict[str, int] | None = None, match: int = 0, branched: bool = False):
        super().__init__(sources or {})
        self.match, self.branched = match, branched


@dataclass(frozen=True, slots=True)
class Passed:
    """A lookup proposal a decision passed over, as auto priced it: the match it came from, the k that priced best,
    the tokens it expected of it and its rate against the rate of what was chosen (tokens per ms: batched, the whole
    batch's), in a batch of `batch` members (1 alone); what its cycle was to cost (the lookup and the pass, batched
    the batch's round of passes with it) against a plain step (`plain_ms`), and the tokens the others commit in a
    round. `alike`: the rate was capped at what it would gain were every member to propose alike
    (`AdaptiveK.alike`). A server's reply says the last one (docs/server.md).

    Example: Passed(match=12, k=16, expected=6.2, gain=0.81, batch=8, cycle_ms=31.0, plain_ms=12.0, others=7.0,
             alike=True): the copy was worth 0.81x a plain round, by what it would cost were every member to copy
    """

    match: int  # tokens its match ran back (0: unknown)
    k: int
    expected: float  # tokens the proposal was expected to commit (its own, not the others')
    gain: float  # its rate ÷ the rate of what was chosen instead
    batch: int
    cycle_ms: float = 0.0
    plain_ms: float = 0.0
    others: float = 0.0
    alike: bool = False


@dataclass(frozen=True, slots=True)
class Rehearsal:
    """What a parked stretch would have given the drafter: at each of its drafter positions, whether the
    drafter's greedy guess there was the token that came next; the policy reads only how sure each guess was
    (`Evidence.saw_guesses`)."""

    hits: list[bool]
    read: int  # tokens the drafter's pass read (the stretch, and on a first read what it had not of its prompt)
    ms: float
    target_tokens: int  # target tokens the stretch committed (the hits are over their drafter tokens)
    confidence: list[float] = field(default_factory=list)  # the drafter's probability of each guess (as hits)


@dataclass(slots=True)
class Run:
    """A whole generation: what was asked, what came out, and what it cost. `prompt_ms` is the target reading
    the prompt tokens its cache lacked, never the first cycle's drafting (the module's definitions)."""

    translation: str  # translation used: "baseline", "identity", "none", "naive", "context", "tli", "lookup"
    target: str
    drafter: str | None = None
    k: int = 0
    window: int = 0
    temperature: float = 0.0
    seed: int | None = None
    max_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # leading prompt tokens the target's cache already held (0: the whole prompt was read)
    prompt_ms: float = 0.0  # the target reading the uncached prompt tokens (its prefill and the pass of the last)
    opening: int = 1  # tokens the prompt pass committed (more than 1 where it verified a first draft)
    grammar_ms: float = 0.0  # the constraint's grammar (uag.core.grammar): masks, checks and forced tokens
    tokens: list[Token] = field(default_factory=list)
    cycles: list[Cycle] = field(default_factory=list)
    first_token_s: float | None = None  # perf_counter() when the first token was committed
    last_token_s: float | None = None
    finish_reason: str | None = None  # "eos", "length", "stopped" (consumer/cancel)
    notes: list[str] = field(default_factory=list)
    k_policy: str = "fixed"  # how k was chosen: "fixed", or "adaptive" (auto: re-decided every cycle, k ≤ self.k)

    # --- derived numbers -----------------------------------------------------------------------
    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    @property
    def from_draft(self) -> list[bool]:
        return [t.from_draft for t in self.tokens]

    @property
    def generated(self) -> int:
        return len(self.tokens)

    @property
    def proposed(self) -> int:
        return sum(len(c.proposed_ids) for c in self.cycles)

    @property
    def accepted(self) -> int:
        return sum(c.accepted for c in self.cycles)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted(self) -> float | None:
        return self.accepted / len(self.cycles) if self.cycles else None

    @property
    def draft_fraction(self) -> float:
        return self.accepted / self.generated if self.generated else 0.0

    @property
    def stalls(self) -> int:
        return sum(1 for c in self.cycles if c.emitted == 0)

    @property
    def generation_s(self) -> float | None:
        if self.first_token_s is None or self.last_token_s is None:
            return None
        return self.last_token_s - self.first_token_s

    @property
    def tokens_per_second(self) -> float | None:
        seconds = self.generation_s
        if self.generated <= self.opening or not seconds:
            return None
        return (self.generated - self.opening) / seconds

    @property
    def prompt_tps(self) -> float | None:
        read = len(self.prompt_ids) - self.cached_tokens
        return read / (self.prompt_ms / 1000) if self.prompt_ms else None

    @property
    def drafter_passes(self) -> int:
        return sum(c.drafter_passes for c in self.cycles)

    def position_acceptance(self) -> list[float | None]:
        """P(proposed position i is accepted | positions before it were), for i = 1..the longest proposal.

        Example: proposals of 2 with 2, 1 and 0 accepted -> position 1: 2/3, position 2: 1/2
        """
        longest = max((len(c.proposed_ids) for c in self.cycles), default=0)
        out: list[float | None] = []
        for i in range(longest):
            reached = [c for c in self.cycles if len(c.proposed_ids) > i and c.accepted >= i]
            out.append(sum(c.accepted > i for c in reached) / len(reached) if reached else None)
        return out

    def loss(self) -> dict[str, int]:
        """Proposed (or withheld) positions lost, by cause, over the run (uag.core.anatomy): the models disagreed
        (`disagree`), translation split agreed text differently (`split`), tokens were withheld (`held`),
        absorption or fallback (`absorbed`), or the draft ended before the target's split was decided
        (`short`); `translation` = split + held + absorbed."""
        total = {name: 0 for name in LOSS_CAUSES}
        for c in self.cycles:
            for name, n in c.loss.items():
                total[name] = total.get(name, 0) + n
        total["translation"] = total["split"] + total["held"] + total["absorbed"]
        return total

    def sources(self) -> dict[str, int]:
        """Cycles per source: "model", "lookup", and "plain" for plain target steps."""
        out: dict[str, int] = {}
        for c in self.cycles:
            out[c.source or "plain"] = out.get(c.source or "plain", 0) + 1
        return out

    def phase_ms(self) -> dict[str, float]:
        """Milliseconds spent per phase over all cycles."""
        return {
            phase: sum(getattr(c, f"{phase}_ms") for c in self.cycles)
            for phase in ("draft", "translate", "verify", "resync")
        }

    def stats(self) -> dict[str, Any]:
        """The run's summary numbers (the CLI's and the app's stats)."""
        return {
            "translation": self.translation,
            "k_policy": self.k_policy,
            "target": self.target,
            "drafter": self.drafter,
            "k": self.k,
            "window": self.window,
            "temperature": self.temperature,
            "seed": self.seed,
            "prompt_tokens": len(self.prompt_ids),
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated,
            "finish_reason": self.finish_reason,
            "cycles": len(self.cycles),
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted": self.mean_accepted,
            "draft_fraction": self.draft_fraction,
            "tokens_per_second": self.tokens_per_second,
            "prompt_tps": self.prompt_tps,
            "prompt_ms": self.prompt_ms,
            "prompt_pass_tokens": self.opening,
            "grammar_ms": self.grammar_ms,
            "generation_s": self.generation_s,
            "drafter_passes": self.drafter_passes,
            "stalls": self.stalls,
            "absorptions": sum(c.absorbed for c in self.cycles),
            "resync_absorptions": sum(c.resync_absorbed for c in self.cycles),
            "fallbacks": sum(c.fallback for c in self.cycles),
            "empty_translations": sum(c.empty for c in self.cycles),
            "phase_ms": self.phase_ms(),
            "position_acceptance": self.position_acceptance(),
            "loss": self.loss(),
            "sources": self.sources(),
            "rehearsals": sum(1 for c in self.cycles if not c.k and c.drafter_read),
            "notes": list(self.notes),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: text, ids, provenance, stats and per-cycle records."""
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "from_draft": self.from_draft,
            "pieces": [t.text for t in self.tokens],
            "prompt_ids": list(self.prompt_ids),
            "stats": self.stats(),
            "cycles": [asdict(c) for c in self.cycles],
        }


@dataclass(frozen=True, slots=True)
class Event:
    """What the streaming layer yields: the tokens a step committed and the run so far.

    ``cycle`` is None for the token produced by a prompt pass that verified no draft. ``run`` is the live
    record of the run; it is complete once the stream is exhausted (``run.finish_reason`` is then set).
    """

    tokens: tuple[Token, ...]
    cycle: Cycle | None
    run: Run

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


# --- which parts of the output came from the drafter: spans the app and the terminal colour (uag.cli) --------

DRAFT = "accepted draft"
TARGET = "target"


def spans(tokens: Iterable[Token]) -> list[tuple[str, str | None]]:
    """Runs of text with the same origin, as `gr.HighlightedText` takes them.

    Tokens produced by the target itself get no label (None); accepted draft tokens get `DRAFT`.
    Example: [('Ala', draft), (' ma', draft), (' kota', target)] -> [('Ala ma', DRAFT), (' kota', None)]
    """
    out: list[tuple[str, str | None]] = []
    for token in tokens:
        if not token.text:
            continue
        label = DRAFT if token.from_draft else None
        if out and out[-1][1] == label:
            out[-1] = (out[-1][0] + token.text, label)
        else:
            out.append((token.text, label))
    return out


# --- a request's passes shared with others' (continuous batching: uag.runtime.batching) --------------------------

FIXED_ROWS = 16.0  # a pass's fixed cost in padded tokens' worth, until a batch has timed passes of its own


def groups(widths: list[int], fixed_rows: float) -> list[list[int]]:
    """The passes (their indices) a batch runs together: every sequence of a pass is padded to its widest, so a
    pass over [17, 1, 1, 1] computes 68 tokens for 20. Sorted by width, the passes are cut where the padded tokens
    plus `fixed_rows` per pass (what a pass costs beside its tokens) sum least.

    Example: [17, 1, 1, 1], 16 -> [[0], [1, 2, 3]] (16 + 17 + 16 + 3 = 52 < 16 + 68 = 84)
             [9, 8, 9, 1], 16 -> [[0, 1, 2, 3]]   (16 + 36 = 52 < 16 + 27 + 16 + 1 = 60)
    """
    return [list(g) for g in _groups(tuple(widths), fixed_rows)]


@functools.lru_cache(maxsize=4096)
def _groups(widths: tuple[int, ...], fixed_rows: float) -> tuple[tuple[int, ...], ...]:
    """`groups`, remembered: every member of a batch prices each draft length it might propose against the same
    few shapes of the others' proposals (`Sharing.pass_tokens`), for every decision."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):  # order[start:end] as one pass, its widest order[start]
            cost = best[start] + fixed_rows + (end - start) * widths[order[start]]
            if cost < best[end]:
                best[end], cut[end] = cost, start
    out, end = [], len(order)
    while end > 0:
        out.append(tuple(sorted(order[cut[end] : end])))  # in the order they came
        end = cut[end]
    return tuple(sorted(out))


@functools.lru_cache(maxsize=4096)
def _pass_tokens(widths: tuple[int, ...], fixed_rows: float) -> tuple[int, ...]:
    return tuple(len(g) * max(widths[i] for i in g) for g in _groups(widths, fixed_rows))


@dataclass(eq=False)
class Sharing:
    """How one request's target passes are shared with other requests' (a server batching them), for `auto`
    and for the request's report. The batch keeps `others` (the other members' `Sharing`) and `fixed_rows`
    current; each member's policy says what it proposes next (`proposing`), so that every member prices its own
    proposal against the whole batch's pass, given the others' (uag.core.evidence.Prices)."""

    size: int = 1  # sequences in the last target pass shared with this request
    widest: int = 0  # the most tokens another sequence put in it (each sequence is padded to the widest)
    pass_ms: float | None = None  # how long that pass took (all sequences together)
    passes: int = 0  # target passes this request made
    summed: int = 0  # the sizes of the batches they ran in, summed
    largest: int = 1
    others: tuple[Sharing, ...] = field(default=(), repr=False)  # the batch's other members now (the batch sets
    #   them as members join and leave)
    fixed_rows: float = FIXED_ROWS  # what the batch's pass costs beside its tokens, in tokens (its `groups`)
    packed: bool = False  # the batch packs its rows' tokens into one pass, unpadded (uag.core.kept_caches, `run`)
    prior_rows: float | None = None  # the same from this request's pair's calibration (CostProfile.fixed_tokens):
    #   what the batch cuts passes by until it has timed passes of its own
    width: int = 1  # the tokens this request puts in its next target pass (1: a plain step)
    tokens: float = 1.0  # the tokens it expects to commit per round of the batch, at that width
    rehearsing: bool = False  # its drafter is reading a parked stretch: it drafts nothing the batch could wait for
    held: int = 0  # rounds its target pass waited while other members drafted with a model (`Batch.round`)
    rounds: int = 0  # its passes (target or drafter) that ran in the batch's rounds, beside the others' work
    solo: bool = True  # its last pass ran as the model's own call, alone in the batch: its wall time is that pass's

    def shared(self, size: int, widest: int, ms: float | None) -> None:
        """A target pass ran over `size` sequences, the widest of the others `widest` tokens, in `ms`."""
        self.size, self.widest, self.pass_ms = size, widest, ms
        self.passes += 1
        self.summed += size
        self.largest = max(self.largest, size)

    def proposing(self, width: int, tokens: float) -> None:
        """This request's next target pass reads `width` tokens, and it expects `tokens` a round from it."""
        self.width, self.tokens = width, tokens

    def pass_tokens(self, w: int | None) -> list[int]:
        """Tokens each target pass of the batch's next round computes when this request puts w in it (None: it
        makes none: it drafts), the others at what they propose: every sequence of a pass padded to its widest,
        the batch cut into passes as `groups` cuts it. What a draft of this request costs is what it adds to the
        whole round: on a CPU a pass of 4 × 17 tokens costs 3 passes of 4 × 1, and all four wait for it.

        Where the batch packs (`packed`), one pass of every row's tokens, unpadded.

        Example: alone -> w = 9: [9];  three others at 1, fixed_rows 16 -> w = 1: [4];  w = 2: [8];
                 w = 17: [3, 17];  None: [3];  packed, w = 17: [20]
        """
        widths = tuple(o.width for o in self.others) + (() if w is None else (w,))
        if self.packed:
            return [sum(widths)] if widths else []
        return list(_pass_tokens(widths, self.fixed_rows))

    @property
    def others_tokens(self) -> float:
        """The tokens the other members expect to commit per round (0 alone)."""
        return sum(o.tokens for o in self.others)

    @property
    def mean_size(self) -> float:
        """The batch size this request ran at, averaged over its target passes (1 when it ran alone)."""
        return self.summed / self.passes if self.passes else 1.0
