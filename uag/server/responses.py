"""OpenAI's response objects for uag: a whole answer, the streamed chunks, and the `usage`, `speculative` and
`timings` blocks that say what one run did. Pure: no mlx, no HTTP; requests are checked in uag.server.protocol.

    report(run, completion_tokens=41, cached_tokens=0, drafter="lookup", step=StepTime(100.0, "calibration"))
        -> {"usage": {…}, "speculative": {"drafter": "lookup", "estimated_speedup": …, …}, "timings": {…}}
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from uag.core.config import strategy_name
from uag.core.translate import STRATEGIES


# --- responses ---------------------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def chat_response(
    rid: str, created: int, model: str, text: str | None, finish: str, report: dict, tool_calls: list | None = None
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice], **report}


def completion_response(rid: str, created: int, model: str, text: str, finish: str, report: dict) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice], **report}


def chunk(kind: str, rid: str, created: int, model: str, delta: dict | str | None, finish: str | None = None) -> dict:
    """One streamed chunk: a chat delta ({"content": …}) or a completion's text, with `usage: null`."""
    if kind == "chat":
        choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": None}


def usage_chunk(kind: str, rid: str, created: int, model: str, report: dict) -> dict:
    """The last chunk with `stream_options.include_usage`: no choices, the usage (and uag's report)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], **report}


# --- what a run did ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """The target's time per plain decode step on this machine, and where that figure comes from."""

    ms: float
    basis: str  # "calibration" (uag calibrate's profile) or "served" (this server's own runs of the target alone)


def estimated_speedup(run: Any, step: StepTime | None) -> float | None:
    """What the target alone would have taken for this run's tokens ÷ what the run took (generation only).

    Example: 41 tokens after the prompt pass in 2.0 s, target step 100 ms -> 4.1 s / 2.0 s = 2.05
    """
    seconds, after = run.generation_s, run.generated - run.opening
    if step is None or not seconds or after <= 0:
        return None
    return after * step.ms / 1000 / seconds


def saved_seconds(run: Any, step: StepTime | None) -> float:
    """The seconds speculation saved on a run against the target alone (negative: lost), estimated: the
    target's step time × the tokens after the prompt pass − the run's generation time. A run that never drafted
    (auto parked throughout) ran as the target alone, so that estimate would be only the step time's error:
    what it paid for speculation is its drafter's rehearsals, measured.

    Example: 41 tokens after the prompt pass in 2.0 s, step 100 ms -> 4.1 − 2.0 = 2.1;
             never drafted, one 30 ms rehearsal -> −0.03
    """
    if not any(c.source for c in run.cycles):
        return -sum(c.draft_ms for c in run.cycles) / 1000
    after = run.generated - run.opening
    if step is None or not run.generation_s or after <= 0:  # as `estimated_speedup`: nothing to estimate
        return 0.0
    return after * step.ms / 1000 - run.generation_s


def reported_strategy(run: Any) -> str:
    """The strategy a reply names for a speculative run: the translation it used ("identity" for a shared
    vocabulary, "lookup" without a model), with adaptive k named as uag.core.config names it.

    Example: tli with adaptive k -> "tli+auto";  context or identity with adaptive k -> "auto";  naive -> "naive"
    """
    if run.k_policy != "adaptive":
        return run.translation
    return strategy_name(run.translation if run.translation in STRATEGIES else "context", "adaptive")


def lookup_summary(cycles: list) -> dict[str, Any]:
    """Prompt lookup's cycles, the tokens they proposed and kept, per cycle and in all (how long copies ran).

    Example: cycles proposing 16 and 40, keeping 16 and 31 -> {"cycles": 2, "proposed_tokens": 56, …,
             "proposed_per_cycle": 28.0, "kept_per_cycle": 23.5}
    """
    lookup = [c for c in cycles if c.source == "lookup"]
    proposed, kept = sum(len(c.proposed_ids) for c in lookup), sum(c.accepted for c in lookup)
    n = len(lookup)
    return {
        "cycles": n,
        "proposed_tokens": proposed,
        "accepted_tokens": kept,
        "proposed_per_cycle": proposed / n if n else None,
        "kept_per_cycle": kept / n if n else None,
    }


def passed_summary(cycles: list) -> dict[str, Any]:
    """The lookup proposals auto passed over (`uag.core.records.Passed`): how many decisions did, and the last one as
    it was priced (its match, k, the tokens it expected, its rate ÷ the rate of what was chosen, the batch's size,
    its cycle's cost against a plain step's, the others' tokens a round, whether the alike cap bound it)."""
    passed = [c.passed for c in cycles if c.passed is not None]
    last = passed[-1] if passed else None
    return {
        "decisions": len(passed),
        "last": None
        if last is None
        else {
            "match": last.match,
            "k": last.k,
            "expected_tokens": round(last.expected, 2),
            "gain": round(last.gain, 3),
            "batch": last.batch,
            "cycle_ms": round(last.cycle_ms, 3),
            "plain_ms": round(last.plain_ms, 3),
            "others": round(last.others, 2),
            "alike": last.alike,
        },
    }


def report(
    run: Any, *, completion_tokens: int, cached_tokens: int, drafter: str | None, step: StepTime | None
) -> dict[str, Any]:
    """`usage` as OpenAI defines it, uag's `speculative` object and llama.cpp's `timings` for one run."""
    prompt_tokens = len(run.prompt_ids)
    drafting = [c for c in run.cycles if c.k > 0]
    speedup = estimated_speedup(run, step) if drafter is not None else None
    read = max(prompt_tokens - cached_tokens, 0)
    generation_ms = (run.generation_s or 0.0) * 1000
    return {
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
        "speculative": {
            "drafter": drafter,
            "strategy": "baseline" if drafter is None else reported_strategy(run),
            "k": run.k if drafter is not None else 0,
            "cycles": len(drafting),
            "drafted_tokens": run.proposed,
            "accepted_tokens": run.accepted,
            "acceptance_rate": run.acceptance_rate,
            "mean_accepted_length": run.accepted / len(drafting) if drafting else None,
            "sources": run.sources() if drafter is not None else {},
            "shared_lookup_cycles": sum(1 for c in drafting if c.shared_index),  # drafted from earlier requests
            # the drafter model's passes, wherever they went: drafts (also those that proposed nothing, counted as
            # plain steps in `sources`) and rehearsals, the catch-ups of a parked run
            "drafter_passes": run.drafter_passes,
            "rehearsals": sum(1 for c in run.cycles if not c.k and c.drafter_read),
            "lookup": lookup_summary(drafting),
            "passed_lookup": passed_summary(run.cycles),
            "estimated_speedup": speedup,
            "speedup_basis": None
            if speedup is None
            else f"an estimate: the target's {step.ms:.1f} ms per step on this machine ({step.basis}) × "
            f"{run.generated - run.opening} tokens ÷ this run's generation time",
            # a constrained reply (response_format, a forced tool call): what its grammar took per token written
            "grammar_ms_per_token": run.grammar_ms / run.generated if run.grammar_ms and run.generated else None,
        },
        "timings": {
            "cache_n": cached_tokens,
            "prompt_n": read,
            "prompt_ms": run.prompt_ms,
            "prompt_per_second": read / (run.prompt_ms / 1000) if run.prompt_ms and read else None,
            "predicted_n": run.generated,
            "predicted_ms": generation_ms,
            "predicted_per_second": run.tokens_per_second,
            "draft_n": run.proposed,
            "draft_n_accepted": run.accepted,
        },
    }


@dataclass(frozen=True)
class Served:
    """One finished request, as the Server tab lists it."""

    time: str
    model: str
    drafter: str | None
    strategy: str
    k: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    tokens_per_second: float | None
    alpha: float | None
    sources: dict
    speedup: float | None  # estimated, against the target alone
    saved_s: float  # estimated seconds saved (negative: lost)
    r: float | None  # the drafter's drafter/target bytes (0 for prompt lookup; a hybrid's: its model's)
    check: str | None = None  # with "check": identical, diverged_near_tie, diverged (uag.runtime.divergence)
    batch: float | None = None  # the mean batch size it ran at (`speculative.batch`); None: an unbatched server
    started: float | None = None  # epoch seconds: when the target began reading its prompt
    finished: float | None = None  # epoch seconds: its last token

    @property
    def drafted(self) -> bool:
        """Whether any cycle drafted; one that never did (auto parked throughout) ran as the target alone."""
        return any(n for source, n in self.sources.items() if source != "plain")

    @property
    def drafting_r(self) -> float | None:
        """r for what actually drafted: the drafter's r weighted by the share of drafting cycles its model
        drafted, since prompt lookup drafts for free (None when nothing drafted).

        Example: a hybrid with r = 0.5, sources {"lookup": 9, "model": 3, "plain": 30} -> 0.5 · 3/12 = 0.125;
                 the same hybrid with sources {"lookup": 12, "plain": 30} -> 0.0
        """
        drafting = sum(n for source, n in self.sources.items() if source != "plain")
        if self.r is None or not drafting:
            return None
        return self.r * self.sources.get("model", 0) / drafting
