"""What the comparison view shows: the streamed texts with their origins, the stats as JSON and Markdown,
why speculation did or did not pay, and the items the worker hands over while it runs.

Plain data in and out; no mlx, no gradio. `CompareView` accumulates the worker's items on the consumer's
thread and renders an `Update` from them whenever the UI should refresh (`uag.app.session.Session` feeds it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from uag.app.history import history_row, speedup_of
from uag.app.settings import Settings
from uag.core.records import TARGET, Cycle, Run, Token, spans
from uag.core.speedup import break_even
from uag.runtime.divergence import IDENTICAL, NEAR_TIE, Divergence
from uag.runtime.jobs import OutOfTime, Status, Tick, Waiting
from uag.study.plots import STUDY_C, cycle_ribbon, position_acceptance

PHASES = {"draft": "draft", "translate": "translate", "verify": "verify", "resync": "re-sync"}
RIBBON_TITLE = "Speculative run, per cycle: proposed vs accepted"
RENDER_EVERY_S = 0.25  # full re-renders at most this often: rendering competes with MLX for the CPU


# --- what the worker hands back during a comparison (built on the worker thread, complete when handed over) ---


@dataclass(frozen=True)
class Ready:
    r: float | None  # drafter/target bytes (None for a drafter without a model: lookup)


@dataclass(frozen=True)
class Started:
    mode: str


@dataclass(frozen=True)
class Streamed:
    """The tokens one step of a run committed (`Step` in the engine), as the view takes them."""

    mode: str
    tokens: tuple[Token, ...]
    cycle: Cycle | None


@dataclass(frozen=True)
class Finished:
    mode: str
    run: Run


@dataclass(frozen=True)
class Compared:
    """How the greedy outputs compare (uag.runtime.margins.compare_runs), handed over before the speculative run's
    `Finished`, so that a difference is never shown unexplained; None when the runs cannot be compared."""

    divergence: Divergence | None


@dataclass(frozen=True)
class Update:
    """One refresh of the comparison view. A field left None means: keep what is shown."""

    status: str
    state: str = "running"  # "running", "done", "stopped", "error"
    baseline_text: str | None = None
    spans: list[tuple[str, str]] | None = None  # speculative output; labels DRAFT or TARGET
    ribbon: Any = None  # plotly Figure of the speculative run's cycles
    positions: Any = None  # plotly Figure of per-position acceptance (when the engine reports it)
    stats: dict | None = None
    stats_md: str | None = None
    warning: str | None = None  # "" clears; non-empty: greedy outputs differ (a near-tie explained, or a bug)
    row: dict | None = None  # the history row, on the final update of a completed comparison
    baseline: Run | None = None
    speculative: Run | None = None

    @property
    def speculative_text(self) -> str:
        return "".join(text for text, _ in self.spans or [])


def labelled_spans(tokens: Sequence[Token]) -> list[tuple[str, str]]:
    """`records.spans` with the target's own text labelled too, so the legend names both origins.

    Example: tokens "Ala"(draft) " ma"(target) -> [("Ala", "accepted draft"), (" ma", "target")]
    """
    return [(text, label or TARGET) for text, label in spans(tokens)]


def mismatch(baseline: Run, speculative: Run, divergence: Divergence | None = None) -> str:
    """What to say when greedy speculative output differs from the target alone ("" when it may not).

    Speculative decoding is lossless: at temperature 0 both runs must produce the same token ids, up to
    rounding at a near-tie in low precision. With `divergence` (the target's margin where they part,
    uag.runtime.divergence) a near-tie is explained and a real mismatch is a loud bug report; without it any
    difference is. Runs that were stopped or sampled (temperature > 0) are not compared.
    """
    if divergence is not None and divergence.kind != IDENTICAL:
        p = divergence.position
        piece = lambda run: run.tokens[p].text if p < len(run.tokens) else None  # noqa: E731
        text = divergence.message(piece(baseline), piece(speculative))
        if divergence.kind == NEAR_TIE:
            return f"ℹ **Outputs part at a near-tie — not a bug.** {text}"
        return f"⚠ **Outputs differ — this is a bug.** {text}"
    if (
        baseline.temperature
        or speculative.temperature
        or "stopped" in (baseline.finish_reason, speculative.finish_reason)
    ):
        return ""
    a, b = baseline.token_ids, speculative.token_ids
    if a == b:
        return ""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def at(run: Run) -> str:
        return f"{run.tokens[i].text!r} (id {run.tokens[i].id})" if i < len(run.tokens) else "the end of the output"

    return (
        f"⚠ **Outputs differ — this is a bug.** At temperature 0 speculative decoding must reproduce the target "
        f"alone token for token, but token {i + 1} is {at(baseline)} from the target alone and {at(speculative)} "
        f"with the drafter ({len(a)} vs {len(b)} tokens). Please report it with the prompt and these settings."
    )


def fmt(value: float | None, pattern: str, missing: str = "–") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else pattern.format(value)


def speedup_badge(speedup: float | None, text: str | None = None) -> str:
    """The speedup in bold, green where speculation paid and red where it did not (assets/style.css).

    Example: speedup_badge(1.43) -> '<strong class="speedup win">Speedup 1.43×</strong>'
    """
    text = text or f"Speedup {fmt(speedup, '{:.2f}×')}"
    kind = "" if speedup is None else " win" if speedup >= 1 else " loss"
    return f'<strong class="speedup{kind}">{text}</strong>'


def explain(baseline: Run, speculative: Run, *, r: float | None = None) -> str:
    """Why speculation did or did not pay, in measured terms: the cost of a cycle against what it committed.

    A cycle pays when it commits more tokens than the target alone would have produced in the same time.
    Example: cycles of 120 ms committing 1.5 tokens, target alone 60 ms per token -> needed 2.0: did not pay.
    """
    speedup = speedup_of(baseline, speculative)
    cycles = speculative.cycles
    if speedup is None or not cycles or not speculative.generation_s:
        return "Too few tokens to time: each run needs at least two."
    base_ms = 1000 / baseline.tokens_per_second
    cycle_ms = speculative.generation_s * 1000 / len(cycles)
    per_cycle = sum(c.emitted for c in cycles) / len(cycles)
    needed = cycle_ms / base_ms
    verdict = "paid off" if speedup >= 1 else "did not pay"
    badge = speedup_badge(speedup, f"Speculation {verdict}: {speedup:.2f}×")
    text = (
        f"{badge} the target alone. A cycle took {cycle_ms:.0f} ms and committed "
        f"{per_cycle:.2f} tokens; the target alone takes {base_ms:.0f} ms per token, so a cycle had to commit "
        f"{needed:.2f} to break even."
    )
    phases = speculative.phase_ms()
    total = sum(phases.values())
    if total:
        phase, ms = max(phases.items(), key=lambda kv: kv[1])
        text += f" Most of a cycle went to {PHASES.get(phase, phase)} ({ms / total:.0%})."
    alpha = speculative.acceptance_rate
    sources = speculative.sources()
    drafted = [c for c in cycles if c.k and c.source != "lookup"]  # the model's drafts, in the k each ran
    ks = sorted({c.k for c in drafted}, key=lambda k: (-sum(c.k == k for c in drafted), k))
    if speculative.k_policy == "adaptive" and ks:
        text += " auto drafted " + ", ".join(f"k = {k} in {sum(c.k == k for c in drafted)}" for k in ks) + " cycles."
    if alpha is not None and ks:  # explained in the k that ran most, at the costs this run measured
        k, proposed = ks[0], [c for c in drafted if c.k == ks[0]]
        ms = sum(c.ms for c in proposed) / len(proposed)
        tokens = sum(c.proposed for c in proposed) / len(proposed)  # target tokens a cycle put up
        alpha_star = (ms / base_ms - 1) / tokens if tokens else math.inf
        where = f"α* = {max(alpha_star, 0):.0%}" + (", unreachable" if alpha_star > 1 else "")
        text += (
            f" At the costs this run measured, a k = {k} cycle took {ms:.0f} ms ({ms / base_ms:.2f} target steps) "
            f"for {tokens:.1f} proposed tokens: break-even at {where}"
        )
        if r is not None:
            study = float(break_even(k, r, STUDY_C))
            text += (
                f". The study's cost model (r = {r:.2f} from the weights' bytes, c = {STUDY_C}) puts break-even at "
                f"α* = {study:.0%}{', unreachable' if study > 1 else ''} for k = {k}"
            )
        text += f"; this run's α was {alpha:.0%}."
    if sources.get("lookup"):
        text += f" Prompt lookup drafted {sources['lookup']} of {sum(sources.values())} cycles at no drafter cost."
    parked = [c for c in speculative.cycles if not c.k]
    rehearsals = [c for c in parked if c.drafter_read]
    if parked and speculative.k_policy == "adaptive":
        text += f" auto parked for {len(parked)} target steps"
        if rehearsals:
            ms = sum(c.draft_ms for c in rehearsals)
            text += (
                f" and rehearsed {len(rehearsals)}× ({ms:.0f} ms): the drafter caught up on the parked text"
                " and its guesses there were checked to see whether drafting would pay"
            )
        text += "."
    return text


def _k_and_strategy(run: Run) -> str:
    """How k was chosen and how drafts were translated. Example: "auto, k ≤ 8 · context" or "k = 2 · naive"."""
    k = f"auto, k ≤ {run.k}" if run.k_policy == "adaptive" else f"k = {run.k}"
    return f"{k} · {run.translation}"


def stats_of(
    settings: Settings,
    baseline: Run | None,
    speculative: Run | None,
    *,
    r: float | None = None,
    divergence: Divergence | None = None,
) -> dict[str, Any]:
    """The numbers of a comparison, JSON-ready (also what the /compare API returns)."""
    out: dict[str, Any] = {
        **settings.flat(),
        "r": r,
        "tokens_per_second": {
            "baseline": baseline.tokens_per_second if baseline else None,
            "speculative": speculative.tokens_per_second if speculative else None,
        },
        "speedup": speedup_of(baseline, speculative),
    }
    if speculative is not None:
        phases = speculative.phase_ms()
        total = sum(phases.values()) or 1.0
        out |= {
            "acceptance_rate": speculative.acceptance_rate,
            "mean_accepted": speculative.mean_accepted,
            "cycles": len(speculative.cycles),
            "time_split_ms": phases,
            "time_split": {phase: ms / total for phase, ms in phases.items()},
        }
    if baseline is not None and speculative is not None:
        out["identical"] = baseline.token_ids == speculative.token_ids
        out["divergence"] = None if divergence is None else divergence.to_dict()  # kind, position, margins, message
        out["verdict"] = explain(baseline, speculative, r=r)
    notes = list(speculative.notes) if speculative else []
    if settings.generation.temperature > 0:
        notes.append("temperature > 0: the two outputs are separate samples; only greedy runs must match")
    out["notes"] = notes
    out["baseline"] = baseline.stats() if baseline else None
    out["speculative"] = speculative.stats() if speculative else None
    return out


def stats_markdown(stats: Mapping[str, Any], baseline: Run | None, speculative: Run | None) -> str:
    """The stats as a small table and a few lines of explanation ("…" for a run not finished yet)."""
    rows = {
        "tokens/s": lambda run: fmt(run.tokens_per_second, "{:.1f}"),
        "tokens": lambda run: str(run.generated),
        "prompt tokens/s": lambda run: fmt(run.prompt_tps, "{:.0f}"),
        "finish": lambda run: run.finish_reason or "…",
    }
    lines = ["| | target alone | speculative |", "|---|---:|---:|"]
    for label, value in rows.items():
        cells = [value(run) if run is not None else "…" for run in (baseline, speculative)]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    if speculative is not None:
        lines += [
            "",
            f"{speedup_badge(stats.get('speedup'))} · α {fmt(speculative.acceptance_rate, '{:.0%}')}"
            f" · mean accepted length {fmt(speculative.mean_accepted, '{:.2f}')} · {len(speculative.cycles)} cycles"
            f" · {_k_and_strategy(speculative)}",
        ]
        split = stats.get("time_split_ms") or {}
        total = sum(split.values())
        if total:
            parts = [f"{PHASES.get(phase, phase)} {ms / total:.0%} ({ms / 1000:.2f} s)" for phase, ms in split.items()]
            lines += ["", "Time per phase: " + " · ".join(parts)]
        if line := loss_line(speculative):
            lines += ["", line]
        if stats.get("verdict"):
            lines += ["", stats["verdict"]]
    for note in stats.get("notes") or []:
        lines += ["", f"*Note: {note}.*"]
    return "\n".join(lines)


def loss_line(run: Run) -> str:
    """Where the drafts the target did not keep went (uag.core.anatomy), or "" when none was lost.

    Example: {"disagree": 12, "split": 1, "held": 0, "absorbed": 0, "short": 2}
             -> "Drafts lost: 12 the models disagreed · 1 to translation · 2 ended mid-word"
    """
    loss = run.loss()
    parts = [
        f"{loss['disagree']} the models disagreed" if loss["disagree"] else "",
        f"{loss['translation']} to translation" if loss["translation"] else "",
        f"{loss['short']} ended mid-word" if loss["short"] else "",
    ]
    parts = [p for p in parts if p]
    return "Drafts lost: " + " · ".join(parts) if parts else ""


def positions_of(run: Run | None) -> list[float | None] | None:
    """P(draft position i accepted | the earlier ones were), when the engine reports it (else None)."""
    if run is None:
        return None
    values = run.stats().get("position_acceptance")
    return list(values) if values else None


class CompareView:
    """Accumulates what the worker hands back and renders `Update`s from it (on the consumer's thread)."""

    def __init__(self, prompt: str, settings: Settings):
        self.prompt, self.settings = prompt, settings
        self.tokens: dict[str, list[Token]] = {"baseline": [], "speculative": []}
        self.cycles: list[Cycle] = []
        self.runs: dict[str, Run] = {}
        self.r: float | None = None
        self.mode: str | None = None
        self.status = "Waiting for the MLX worker…"
        self.out_of_time: float | None = None  # the time budget that stopped the job, if one did
        self.divergence: Divergence | None = None  # the verdict on the greedy outputs, once both runs are done
        self._rendered = 0.0  # time.monotonic() of the last full render

    def take(self, item: Any) -> Update | None:
        """The refresh an item from the job calls for, or None: progress lines at once, the streamed texts
        at most every RENDER_EVERY_S (and at once when a phase begins or ends)."""
        if isinstance(item, Waiting):
            return Update(item.text)
        if isinstance(item, Status):
            self.status = item.text
            return Update(item.text)
        if isinstance(item, Tick):
            return Update(self.progress())
        if isinstance(item, OutOfTime):
            self.out_of_time = item.seconds
            return None
        boundary = self.apply(item)
        now = time.monotonic()
        if boundary or now - self._rendered >= RENDER_EVERY_S:
            self._rendered = now
            return self.update()
        return None

    def apply(self, item: Any) -> bool:
        """Take in one item; True when it ends a phase (always worth showing at once)."""
        if isinstance(item, Ready):
            self.r = item.r
            return False
        mode = "baseline" if getattr(item, "mode", None) == "baseline" else "speculative"
        if isinstance(item, Started):
            self.mode = mode
            return True
        if isinstance(item, Compared):
            self.divergence = item.divergence
            return False
        if isinstance(item, Streamed):
            self.tokens[mode].extend(item.tokens)
            if mode == "speculative" and item.cycle is not None:
                self.cycles.append(item.cycle)
            return False
        if isinstance(item, Finished):
            self.runs[mode] = item.run
            self.tokens[mode] = list(item.run.tokens)  # the detokenizer's held-back tail is in the final run
            if mode == "speculative":
                self.cycles = list(item.run.cycles)
            return True
        raise AssertionError(f"unexpected item from the worker: {item!r}")

    def progress(self) -> str:
        if self.mode is None:
            return self.status
        n, most = len(self.tokens[self.mode]), self.settings.generation.max_tokens
        if self.mode == "baseline":
            return f"Target alone: {n} / {most} tokens…"
        proposed = sum(c.proposed for c in self.cycles)
        alpha = sum(c.accepted for c in self.cycles) / proposed if proposed else None
        return (
            f"Speculative ({self.settings.strategy}, k = {self.settings.generation.k}): {n} / {most} tokens"
            f" · α {fmt(alpha, '{:.0%}')} so far…"
        )

    def update(self, state: str = "running", status: str | None = None) -> Update:
        baseline, speculative = self.runs.get("baseline"), self.runs.get("speculative")
        stats = stats_of(self.settings, baseline, speculative, r=self.r, divergence=self.divergence)
        row = None
        warning = ""
        if baseline is not None and speculative is not None:
            warning = mismatch(baseline, speculative, self.divergence)
            if state == "done":
                row = history_row(self.prompt, self.settings, baseline, speculative, r=self.r)
        positions = positions_of(speculative)
        return Update(
            status=status or self.progress(),
            state=state,
            baseline_text="".join(t.text for t in self.tokens["baseline"]),
            spans=labelled_spans(self.tokens["speculative"]),
            ribbon=cycle_ribbon(self.cycles, title=RIBBON_TITLE),
            positions=position_acceptance(positions) if positions else None,
            stats=stats,
            stats_md=stats_markdown(stats, baseline, speculative),
            warning=warning,
            row=row,
            baseline=baseline,
            speculative=speculative,
        )

    def failed(self, message: str) -> Update:
        """The last update of a comparison that failed: what was shown so far, and why it ended."""
        return replace(self.update("error"), status=message)

    def finished(self) -> Update:
        """The last update: done, or stopped (by the user, or by the job's time budget)."""
        baseline, speculative = self.runs.get("baseline"), self.runs.get("speculative")
        out_of_time = self.out_of_time
        stopped = (
            baseline is None or speculative is None or "stopped" in (baseline.finish_reason, speculative.finish_reason)
        )
        if out_of_time is not None and stopped:
            return self.update(
                "stopped",
                f"Stopped: this app gives each request {out_of_time:.0f} s of generation, and this one used them "
                "up. Ask for fewer max tokens. Nothing was added to the history.",
            )
        if stopped:
            return self.update("stopped", "Stopped. Nothing was added to the history.")
        speedup = speedup_of(baseline, speculative)
        return self.update("done", f"Done: speculative decoding ran at {fmt(speedup, '{:.2f}×')} the target alone.")
