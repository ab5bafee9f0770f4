"""The app's logic without a UI: model choice, target alone vs speculative, per-user history, the plot,
the pair's measured costs on this machine.

Plain data in and out; no gradio. One `Session` serves the whole app: it owns the model store and the
MLX worker, and decides which models a user may load. What belongs to one user (their history, their
results file) is passed in and handed back, so the UI can keep it per browser tab.

    session = Session()
    for update in session.compare("Stolica Polski to", Settings(max_tokens=16)):
        print(update.status)                 # loading → target alone → speculative → done
    update.spans                             # [(" jedna z", "target"), (" największych", "accepted draft"), …]
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import math
import re
import tempfile
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from uag.calibrate import DEFAULT_CONTEXT, DEFAULT_WIDTHS, calibrate
from uag.profiles import Calibration, find_calibration
from uag.profiles import save as save_calibration
from uag.costmodel import break_even, fit_c_from_speedups
from uag.generate import DEFAULT_K, MAX_K, SPECULATIVE, GenerationConfig, generate, prompt_ids, stream
from uag.highlight import TARGET, spans
from uag.models import ModelStore, Pair, check_pair
from uag.plots import STUDY_C, STUDY_R, cycle_ribbon, speedup_vs_alpha, verify_cost
from uag.presets import DEFAULT, PRESETS, preset_models
from uag.records import Cycle, Run, Token
from uag.translate import DEFAULT_WINDOW
from uag.worker import Job, MLXWorker

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 48  # the app's default: long enough to time, short enough to wait for on a CPU
MAX_TOKENS = 512
MAX_WINDOW = 64
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**31 - 1
MAX_PROMPT_CHARS = 20_000
K_CHOICES = (1, 2, 3, 4, 6, 8)  # draft lengths the plot can draw S(α, k) for
C_FITTED = "fitted from this session's runs"
C_STUDY = f"the study's c = {STUDY_C}"
MIN_RUNS_TO_FIT = 3
BREAK_EVEN_KS = (1, 2, 4, 8)  # draft lengths the cost caption gives α* for
CALIBRATION_REPEATS = 5  # timed passes per width (after a warm-up), as `python -m uag.calibrate`
EXPORT_TTL_S = 3600
RENDER_EVERY_S = 0.25  # streaming updates at most this often: rendering competes with MLX for the CPU
WARM_UP_PROMPT = "Hello"
PHASES = {"draft": "draft", "translate": "translate", "verify": "verify", "resync": "re-sync"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
FORWARDED = ("forwarded", "x-forwarded-for", "x-real-ip")  # a proxy in front: the real client is elsewhere


class InputError(ValueError):
    """Bad input from a user, with a message meant for them."""


# --- settings and who may load what ------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """One comparison's settings. The target alone always runs first; `strategy` is the speculative run's."""

    target: str = DEFAULT.target
    drafter: str = DEFAULT.drafter
    strategy: str = "context"
    k: int = DEFAULT_K
    window: int = DEFAULT_WINDOW
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int | None = 0
    chat: bool = False

    @classmethod
    def parse(cls, **raw: Any) -> Settings:
        """Settings from loosely typed input (form fields, JSON); InputError lists every problem.

        Example: Settings.parse(k=2.0, seed=None) -> Settings(k=2, seed=None, …);
                 Settings.parse(k=40, temperature=-1) -> InputError("k (draft length) must be … (got 40); …")
        """
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise InputError(f"unknown settings: {', '.join(sorted(unknown))}")
        values = {f.name: raw.get(f.name, f.default) for f in fields(cls)}
        problems: list[str] = []

        def whole(name: str, label: str, lo: int, hi: int) -> int | None:
            value = values[name]
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = math.nan
            if isinstance(value, bool) or not number.is_integer() or not lo <= number <= hi:
                problems.append(f"{label} must be a whole number from {lo} to {hi} (got {value!r})")
                return None
            return int(number)

        for role in ("target", "drafter"):
            values[role] = str(values[role] or "").strip()
        if values["strategy"] not in SPECULATIVE:
            problems.append(f"strategy must be one of {', '.join(SPECULATIVE)} (got {values['strategy']!r})")
        values["k"] = whole("k", "k (draft length)", 1, MAX_K)
        values["window"] = whole("window", "the context window", 0, MAX_WINDOW)
        values["max_tokens"] = whole("max_tokens", "max tokens", 1, MAX_TOKENS)
        try:
            temperature = float(values["temperature"])
        except (TypeError, ValueError):
            temperature = math.nan
        if not 0 <= temperature <= MAX_TEMPERATURE:  # also catches NaN
            problems.append(f"temperature must be from 0 to {MAX_TEMPERATURE} (got {values['temperature']!r})")
        values["temperature"] = temperature
        if values["seed"] in (None, ""):
            values["seed"] = None
        else:
            values["seed"] = whole("seed", "seed", 0, MAX_SEED)
        values["chat"] = bool(values["chat"])
        if problems:
            raise InputError("; ".join(problems))
        return cls(**values)

    def config(self, strategy: str) -> GenerationConfig:
        return GenerationConfig(
            strategy=strategy,
            k=self.k,
            window=self.window,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            chat=self.chat,
        ).validate()


@dataclass(frozen=True)
class Access:
    """What a request may load. Remote users get presets and loaded models only, unless the app was
    started with --allow-any-model; even then, never a folder on this machine."""

    remote: bool = False
    allow_any_model: bool = False

    @property
    def restricted(self) -> bool:
        return self.remote and not self.allow_any_model


LOCAL = Access()


def is_remote(host: str | None, headers: Mapping[str, str] | None = None, *, share: bool = False) -> bool:
    """Whether a request comes from somewhere other than this machine.

    A shared app's users all arrive through the share tunnel, which connects from localhost, so with
    `share` everyone counts as remote; so does any request forwarded by a proxy.
    Example: is_remote("127.0.0.1") -> False;  is_remote("192.168.1.7") -> True;  is_remote(None) -> True
    """
    if share or host is None:
        return True
    if headers is not None and any(name.lower() in FORWARDED for name in headers.keys()):
        return True
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def check_model(name: str, role: str, *, access: Access, loaded: Collection[str] = ()) -> str:
    """The model name if this user may use it; InputError saying why not otherwise."""
    name = (name or "").strip()
    if not name:
        raise InputError(f"choose a {role}: a preset, a hub id (org/name) or a local model folder")
    if name in preset_models() or name in loaded:
        return name
    local = not HUB_ID.match(name) or ".." in name or Path(name).expanduser().exists()
    if access.remote and local:
        raise InputError(
            f"{role} {name!r} is not a hub id (org/name): model folders on the server can be chosen only by "
            "someone on that machine. Choose a preset or a hub id."
        )
    if access.restricted:
        raise InputError(
            f"{role} {name!r}: this app serves remote users only its presets and the models already loaded "
            f"({', '.join(sorted({*preset_models(), *loaded}))}). Whoever runs it can allow any hub model "
            "with --allow-any-model."
        )
    return name


# --- what the worker hands back during a comparison ---------------------------------------------------------


@dataclass(frozen=True)
class _Status:
    text: str


@dataclass(frozen=True)
class _Ready:
    pair: Pair


@dataclass(frozen=True)
class _Started:
    mode: str


@dataclass(frozen=True)
class _Step:
    mode: str
    tokens: tuple[Token, ...]
    cycle: Cycle | None  # complete when handed over; the worker no longer touches it


@dataclass(frozen=True)
class _Finished:
    mode: str
    run: Run  # complete: the stream that filled it is exhausted


@dataclass(frozen=True)
class _Calibrated:
    calibration: Calibration
    path: Path


class _Cancelled(Exception):
    """Raised from a calibration's progress callback when its job was cancelled."""


# --- what the UI shows ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Update:
    """One refresh of the comparison view. A field left None means: keep what is shown."""

    status: str
    state: str = "running"  # "running", "done", "stopped", "error"
    baseline_text: str | None = None
    spans: list[tuple[str, str]] | None = None  # speculative output; labels DRAFT or TARGET
    ribbon: Any = None  # plotly Figure of the speculative run's cycles
    stats: dict | None = None
    stats_md: str | None = None
    warning: str | None = None  # "" clears; non-empty: greedy outputs differ (a bug)
    row: dict | None = None  # the history row, on the final update of a completed comparison
    baseline: Run | None = None
    speculative: Run | None = None

    @property
    def speculative_text(self) -> str:
        return "".join(text for text, _ in self.spans or [])


def labelled_spans(tokens: Sequence[Token]) -> list[tuple[str, str]]:
    """`highlight.spans` with the target's own text labelled too, so the legend names both origins.

    Example: tokens "Ala"(draft) " ma"(target) -> [("Ala", "accepted draft"), (" ma", "target")]
    """
    return [(text, label or TARGET) for text, label in spans(tokens)]


def mismatch(baseline: Run, speculative: Run) -> str:
    """A loud warning when greedy speculative output differs from the target alone ("" when it may not).

    Speculative decoding is lossless: at temperature 0 both runs must produce the same token ids. Runs that
    were stopped or sampled (temperature > 0) are not compared.
    """
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


def _fmt(value: float | None, pattern: str, missing: str = "–") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else pattern.format(value)


def speedup_of(baseline: Run | None, speculative: Run | None) -> float | None:
    """Speculative tokens/s ÷ target-alone tokens/s (None when either is untimed)."""
    if baseline is None or speculative is None:
        return None
    tps, tps_base = speculative.tokens_per_second, baseline.tokens_per_second
    return tps / tps_base if tps and tps_base else None


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
    text = (
        f"**Speculation {verdict}: {speedup:.2f}×** the target alone. A cycle took {cycle_ms:.0f} ms and committed "
        f"{per_cycle:.2f} tokens; the target alone takes {base_ms:.0f} ms per token, so a cycle had to commit "
        f"{needed:.2f} to break even."
    )
    phases = speculative.phase_ms()
    total = sum(phases.values())
    if total:
        phase, ms = max(phases.items(), key=lambda kv: kv[1])
        text += f" Most of a cycle went to {PHASES[phase]} ({ms / total:.0%})."
    alpha = speculative.acceptance_rate
    if alpha is not None and r is not None and speculative.k:
        alpha_star = float(break_even(speculative.k, r, STUDY_C))
        text += (
            f" The study's cost model (r = {r:.2f} from the weights' bytes, c = {STUDY_C}) puts break-even at "
            f"α* = {alpha_star:.0%} for k = {speculative.k}; this run's α was {alpha:.0%}."
        )
    return text


def stats_of(
    settings: Settings, baseline: Run | None, speculative: Run | None, *, r: float | None = None
) -> dict[str, Any]:
    """The numbers of a comparison, JSON-ready (also what the /compare API returns)."""
    out: dict[str, Any] = {
        **asdict(settings),
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
        out["verdict"] = explain(baseline, speculative, r=r)
    notes = list(speculative.notes) if speculative else []
    if settings.temperature > 0:
        notes.append("temperature > 0: the two outputs are separate samples; only greedy runs must match")
    out["notes"] = notes
    out["baseline"] = baseline.stats() if baseline else None
    out["speculative"] = speculative.stats() if speculative else None
    return out


def stats_markdown(stats: Mapping[str, Any], baseline: Run | None, speculative: Run | None) -> str:
    """The stats as a small table and a few lines of explanation ("…" for a run not finished yet)."""
    rows = {
        "tokens/s": lambda run: _fmt(run.tokens_per_second, "{:.1f}"),
        "tokens": lambda run: str(run.generated),
        "prompt tokens/s": lambda run: _fmt(run.prompt_tps, "{:.0f}"),
        "finish": lambda run: run.finish_reason or "…",
    }
    lines = ["| | target alone | speculative |", "|---|---:|---:|"]
    for label, value in rows.items():
        cells = [value(run) if run is not None else "…" for run in (baseline, speculative)]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    if speculative is not None:
        lines += [
            "",
            f"**Speedup {_fmt(stats.get('speedup'), '{:.2f}×')}** · α {_fmt(speculative.acceptance_rate, '{:.0%}')}"
            f" · mean accepted length {_fmt(speculative.mean_accepted, '{:.2f}')} · {len(speculative.cycles)} cycles"
            f" · k = {speculative.k} · {speculative.strategy}",
        ]
        split = stats.get("time_split_ms") or {}
        total = sum(split.values())
        if total:
            parts = [f"{PHASES[phase]} {ms / total:.0%} ({ms / 1000:.2f} s)" for phase, ms in split.items()]
            lines += ["", "Time per phase: " + " · ".join(parts)]
        if stats.get("verdict"):
            lines += ["", stats["verdict"]]
    for note in stats.get("notes") or []:
        lines += ["", f"*Note: {note}.*"]
    return "\n".join(lines)


def group_of(drafter: str, strategy: str) -> str:
    """A plot series: the drafter's short name and the translation strategy (as results files name it)."""
    return f"{drafter.rstrip('/').rsplit('/', 1)[-1] or drafter} · {strategy}"


def history_row(prompt: str, settings: Settings, baseline: Run, speculative: Run, *, r: float | None) -> dict:
    """One completed comparison, as a row of the user's history (column names as in results files)."""
    return {
        "time": datetime.now().strftime("%H:%M:%S"),
        "prompt": prompt,
        **asdict(settings),
        "tokens": speculative.generated,
        "alpha": speculative.acceptance_rate,
        "mean_accepted": speculative.mean_accepted,
        "cycles": len(speculative.cycles),
        "tps": speculative.tokens_per_second,
        "tps_base": baseline.tokens_per_second,
        "speedup": speedup_of(baseline, speculative),
        "identical": baseline.token_ids == speculative.token_ids,
        "r": r,
        "group": group_of(settings.drafter, settings.strategy),
    }


HISTORY_COLUMNS = (
    "time", "prompt", "target", "drafter", "strategy", "k", "window", "max_tokens", "temperature", "seed", "chat",
    "tokens", "alpha", "mean_accepted", "cycles", "tps", "tps_base", "speedup", "identical", "r", "group",
)  # fmt: skip


class _View:
    """Accumulates what the worker hands back and renders `Update`s from it (on the consumer's thread)."""

    def __init__(self, prompt: str, settings: Settings):
        self.prompt, self.settings = prompt, settings
        self.tokens: dict[str, list[Token]] = {"baseline": [], "speculative": []}
        self.cycles: list[Cycle] = []
        self.runs: dict[str, Run] = {}
        self.pair: Pair | None = None
        self.mode: str | None = None
        self.status = "Waiting for the MLX worker…"

    def apply(self, item: Any) -> bool:
        """Take in one item; True when it ends a phase (always worth showing at once)."""
        if isinstance(item, _Status):
            self.status = item.text
            return True
        if isinstance(item, _Ready):
            self.pair = item.pair
            return False
        mode = "baseline" if getattr(item, "mode", None) == "baseline" else "speculative"
        if isinstance(item, _Started):
            self.mode = mode
            return True
        if isinstance(item, _Step):
            self.tokens[mode].extend(item.tokens)
            if mode == "speculative" and item.cycle is not None:
                self.cycles.append(item.cycle)
            return False
        if isinstance(item, _Finished):
            self.runs[mode] = item.run
            self.tokens[mode] = list(item.run.tokens)  # the detokenizer's held-back tail is in the final run
            if mode == "speculative":
                self.cycles = list(item.run.cycles)
            return True
        raise AssertionError(f"unexpected item from the worker: {item!r}")

    @property
    def r(self) -> float | None:
        return self.pair.r if self.pair else None

    def progress(self) -> str:
        if self.mode is None:
            return self.status
        n = len(self.tokens[self.mode])
        if self.mode == "baseline":
            return f"Target alone: {n} / {self.settings.max_tokens} tokens…"
        proposed = sum(c.proposed for c in self.cycles)
        alpha = sum(c.accepted for c in self.cycles) / proposed if proposed else None
        return (
            f"Speculative ({self.settings.strategy}, k = {self.settings.k}): {n} / {self.settings.max_tokens} tokens"
            f" · α {_fmt(alpha, '{:.0%}')} so far…"
        )

    def update(self, state: str = "running", status: str | None = None) -> Update:
        baseline, speculative = self.runs.get("baseline"), self.runs.get("speculative")
        stats = stats_of(self.settings, baseline, speculative, r=self.r)
        row = None
        warning = ""
        if baseline is not None and speculative is not None:
            warning = mismatch(baseline, speculative)
            if state == "done":
                row = history_row(self.prompt, self.settings, baseline, speculative, r=self.r)
        return Update(
            status=status or self.progress(),
            state=state,
            baseline_text="".join(t.text for t in self.tokens["baseline"]),
            spans=labelled_spans(self.tokens["speculative"]),
            ribbon=cycle_ribbon(self.cycles, title="Speculative run, per cycle: proposed vs accepted"),
            stats=stats,
            stats_md=stats_markdown(stats, baseline, speculative),
            warning=warning,
            row=row,
            baseline=baseline,
            speculative=speculative,
        )

    def finished(self) -> Update:
        baseline, speculative = self.runs.get("baseline"), self.runs.get("speculative")
        stopped = (
            baseline is None or speculative is None or "stopped" in (baseline.finish_reason, speculative.finish_reason)
        )
        if stopped:
            return self.update("stopped", "Stopped. Nothing was added to the history.")
        speedup = speedup_of(baseline, speculative)
        return self.update("done", f"Done: speculative decoding ran at {_fmt(speedup, '{:.2f}×')} the target alone.")


# --- the plot tab ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlotView:
    figure: Any  # plotly Figure
    caption: str
    r: float
    c: float


def history_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The history as a table, in a fixed column order (empty with those columns when there are no rows)."""
    return pd.DataFrame(list(rows), columns=list(HISTORY_COLUMNS))


@dataclass(frozen=True)
class CostView:
    """The saved cost profile of the chosen pair on this machine: a figure (None when there is none to draw)
    and a caption saying what it shows, or what to do to get one."""

    figure: Any  # plotly Figure or None
    caption: str
    calibration: Calibration | None = None


@dataclass(frozen=True)
class CalibrationUpdate:
    """One refresh while calibrating; `view` comes with the final update of a calibration that completed."""

    status: str
    state: str = "running"  # "running", "done", "stopped", "error"
    view: CostView | None = None


def _measured_at(stamp: str) -> str:
    """Example: "2025-05-01T14:03:22+00:00" -> "2025-05-01 14:03 UTC" (anything unparsable as it is)."""
    try:
        return datetime.fromisoformat(stamp).strftime("%Y-%m-%d %H:%M UTC")
    except (TypeError, ValueError):
        return str(stamp)


def cost_caption(calibration: Calibration, *, r_bytes: float | None = None, ks: Sequence[int] = BREAK_EVEN_KS) -> str:
    """What a saved calibration says: when and where it was measured, r by time next to r by bytes, and
    the break-even acceptance α*(k) that its measured costs imply.

    Example: target 10 ms/step, drafter 1 ms -> "… r = 0.100 by time (0.070 by the weights' bytes) …"
    """
    key, profile = calibration.key, calibration.profile
    step = profile.target_ms[1]
    r_time = profile.drafter_ms / step
    by_bytes = f" ({r_bytes:.3f} by the weights' bytes)" if r_bytes is not None else ""
    alphas = []
    for k in ks:
        alpha = profile.break_even(k)
        alphas.append(f"k = {k}: {'unreachable' if alpha is None else f'{alpha:.0%}'}")
    counted = "1 + k·α tokens per cycle" if profile.form == "study" else "Leviathan's E(α, k) tokens per cycle"
    return (
        f"**Measured {_measured_at(calibration.measured_at)}** on {key.get('device', '?')} "
        f"({key.get('backend', '?')}), {calibration.context} tokens in the cache; target "
        f"{key.get('target_dtype', '?')}, drafter {key.get('drafter_dtype', '?')}.\n\n"
        f"One target step {step:.2f} ms, one drafter step {profile.drafter_ms:.2f} ms: r = {r_time:.3f} by time"
        f"{by_bytes}. Translation and re-sync {profile.translate_ms:.2f} ms per cycle.\n\n"
        f"Break-even acceptance α* from these costs ({counted}): {' · '.join(alphas)}.\n\n"
        "The `auto` strategy uses this profile for what a cycle costs (refined with each run's own timings) "
        "when it chooses k."
    )


# --- the session ----------------------------------------------------------------------------------------------


class Session:
    """The app's state shared by all users: models, the MLX worker, the rules on what may be loaded."""

    def __init__(
        self,
        store: ModelStore | None = None,
        worker: MLXWorker | None = None,
        *,
        share: bool = False,
        allow_any_model: bool = False,
        target: str = DEFAULT.target,
        drafter: str = DEFAULT.drafter,
        export_dir: str | Path | None = None,
    ):
        self.store = store or ModelStore()
        self.worker = worker or MLXWorker()
        self.share = share
        self.allow_any_model = allow_any_model
        self.defaults = Settings(target=target, drafter=drafter)
        self.export_dir = Path(export_dir) if export_dir else None  # a temporary folder, made on first export
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._warm: set[tuple[str, str]] = set()  # pairs warmed up; touched on the worker thread only
        self._pairs: dict[tuple[str, str], Pair] = {}  # pairs loaded and checked here (set on the worker thread)

    # --- models ------------------------------------------------------------------------------------------
    def access(self, host: str | None, headers: Mapping[str, str] | None = None) -> Access:
        return Access(is_remote(host, headers, share=self.share), self.allow_any_model)

    def check_models(self, target: str, drafter: str, *, access: Access = LOCAL) -> tuple[str, str]:
        loaded = self.store.loaded
        return (
            check_model(target, "target", access=access, loaded=loaded),
            check_model(drafter, "drafter", access=access, loaded=loaded),
        )

    def access_note(self, access: Access) -> str:
        """What this user may choose, in a sentence ("" for the local user)."""
        if not access.remote:
            return ""
        if access.allow_any_model:
            return "You are connected remotely: choose a preset, a loaded model or a hub id (not a local folder)."
        return "You are connected remotely: choose a preset or a model that is already loaded."

    def preset_choices(self) -> list[str]:
        return [p.label for p in PRESETS]

    def preset_for(self, target: str, drafter: str) -> str | None:
        return next((p.label for p in PRESETS if (p.target, p.drafter) == (target, drafter)), None)

    def r_of(self, target: str, drafter: str) -> float | None:
        """Drafter bytes / target bytes of a pair that has run here (None before)."""
        pair = self._pairs.get((target, drafter))
        return pair.r if pair is not None else None

    def preload(self, target: str | None = None, drafter: str | None = None) -> Job:
        """Load and warm up a pair in the background (at app start), so that the first run is quick."""
        settings = replace(
            self.defaults, target=target or self.defaults.target, drafter=drafter or self.defaults.drafter
        )
        job = self.worker.submit(self._pair_job, settings, label=f"loading {settings.target} and {settings.drafter}")
        threading.Thread(target=self._drain, args=(job,), name="uag-preload", daemon=True).start()
        return job

    @staticmethod
    def _drain(job: Job) -> None:
        try:
            for item in job:
                if isinstance(item, _Status):
                    log.info("%s", item.text)
        except Exception as err:  # a bad --target/--drafter: said again when a user runs it
            log.warning("preloading failed: %s", err)

    # --- on the worker thread ----------------------------------------------------------------------------
    def _pair(self, job: Job, settings: Settings) -> Pair:
        """Load both models (reporting progress), check the pair, warm it up once."""
        for role, name in (("target", settings.target), ("drafter", settings.drafter)):
            if name not in self.store:
                job.emit(_Status(f"Loading the {role} {name}…"))
                tic = time.perf_counter()
                model = self.store.get(name, progress=lambda msg, role=role: job.emit(_Status(f"{role}: {msg}…")))
                job.emit(
                    _Status(
                        f"Loaded the {role} {name} ({model.dtype}, {model.weight_bytes / 1e6:.0f} MB) "
                        f"in {time.perf_counter() - tic:.0f} s."
                    )
                )
        pair = check_pair(self.store.get(settings.target), self.store.get(settings.drafter))
        key = (settings.target, settings.drafter)
        self._pairs[key] = pair
        if key not in self._warm:
            # The first passes through a model are slower (allocation, kernel set-up): keep them out of the timings.
            job.emit(_Status("Warming up the pair (once) so that the timings are fair…"))
            warm = GenerationConfig("context", k=2, max_tokens=4)
            generate(pair.target, None, WARM_UP_PROMPT, replace(warm, strategy="baseline"))
            generate(pair.target, pair.drafter, WARM_UP_PROMPT, warm)
            self._warm.add(key)
        return pair

    def _pair_job(self, job: Job, settings: Settings) -> Iterator[Any]:
        self._pair(job, settings)
        yield _Status("ready")

    def _calibrate_job(self, job: Job, settings: Settings, options: dict[str, Any]) -> Iterator[Any]:
        pair = self._pair(job, settings)

        def progress(message: str) -> None:
            if job.cancelled.is_set():  # calibrate() reports after each timed width: stop there
                raise _Cancelled
            job.emit(_Status(message))

        try:
            result = calibrate(pair, progress=progress, **options)
        except _Cancelled:
            return
        yield _Calibrated(result, save_calibration(result))

    def _compare_job(self, job: Job, prompt: str, settings: Settings) -> Iterator[Any]:
        pair = self._pair(job, settings)
        ids = prompt_ids(pair.target, prompt, chat=settings.chat)
        yield _Ready(pair)
        # Never concurrently: the target alone first, then with the drafter, each timed on its own.
        for mode in ("baseline", settings.strategy):
            if job.cancelled.is_set():
                return
            yield _Started(mode)
            run = None
            for event in stream(pair.target, pair.drafter, ids, settings.config(mode), cancel=job.cancelled):
                run = event.run
                yield _Step(mode, event.tokens, event.cycle)
            assert run is not None and run.finish_reason is not None, "a stream ended without a final record"
            yield _Finished(mode, run)

    # --- comparing ---------------------------------------------------------------------------------------
    def compare(
        self, prompt: str, settings: Settings, *, access: Access = LOCAL, owner: str | None = None
    ) -> Iterator[Update]:
        """Target alone, then speculative, streamed as `Update`s; the last one has state done/stopped/error.

        `owner` (e.g. a browser session id) lets `stop(owner)` cancel this comparison from another request.
        Every failure ends in an error `Update` with a message for the user, never an exception.
        """
        try:
            prompt = prompt or ""
            if not prompt.strip():  # but generate from the prompt as typed: trailing spaces change the tokens
                raise InputError("the prompt is empty: type one or pick an example")
            if len(prompt) > MAX_PROMPT_CHARS:
                raise InputError(f"the prompt is {len(prompt)} characters; the app takes at most {MAX_PROMPT_CHARS}")
            target, drafter = self.check_models(settings.target, settings.drafter, access=access)
            settings.config(settings.strategy)  # the engine's own checks, before anything is queued
        except ValueError as err:
            yield Update(f"**Cannot run:** {err}", state="error")
            return
        settings = replace(settings, target=target, drafter=drafter)
        view = _View(prompt, settings)
        job = self.worker.submit(self._compare_job, prompt, settings, label=f"a comparison on {target}")
        self._register(owner, job)
        try:
            waited = 0.0
            while not job.started.wait(1.0):  # another user's run, or the start-up preload, goes first
                waited += 1.0
                current = self.worker.current
                doing = f" ({current.label})" if current is not None else ""
                yield Update(f"Waiting for the MLX worker{doing}… {waited:.0f} s")
            last = 0.0
            for item in job:
                boundary = view.apply(item)
                now = time.monotonic()
                if boundary or now - last >= RENDER_EVERY_S:
                    last = now
                    yield view.update()
            yield view.finished()
        except ValueError as err:  # the user's to fix: a model that cannot load or speculate, a too-long prompt
            yield replace(view.update("error"), status=f"**Cannot run:** {err}")
        except Exception as err:
            log.exception("comparison failed")
            yield replace(
                view.update("error"),
                status=f"**Unexpected error:** {type(err).__name__}: {err}. The app keeps serving; see its log.",
            )
        finally:
            job.cancel()  # a no-op when it is done; stops it when the consumer left early
            self._unregister(owner, job)

    def compare_once(
        self, prompt: str, settings: Settings, *, access: Access = LOCAL, owner: str | None = None
    ) -> Update:
        """The final `Update` of a comparison; InputError if it failed or was stopped."""
        final = None
        for update in self.compare(prompt, settings, access=access, owner=owner):
            final = update
        if final is None or final.state != "done":
            raise InputError(final.status.replace("**", "") if final else "the comparison produced nothing")
        return final

    def stop(self, owner: str | None) -> bool:
        """Cancel `owner`'s running comparison within a cycle; False when there is none."""
        with self._lock:
            job = self._jobs.get(owner) if owner else None
        if job is None:
            return False
        job.cancel()
        return True

    def _register(self, owner: str | None, job: Job) -> None:
        if owner:
            with self._lock:
                self._jobs[owner] = job

    def _unregister(self, owner: str | None, job: Job) -> None:
        if owner:
            with self._lock:
                if self._jobs.get(owner) is job:
                    del self._jobs[owner]

    # --- costs on this machine ----------------------------------------------------------------------------
    def cost_view(self, target: str, drafter: str) -> CostView:
        """The saved cost profile of this pair on this machine, if the pair is loaded here (never loads it)."""
        target, drafter = (target or "").strip(), (drafter or "").strip()
        pair = self._pairs.get((target, drafter))
        command = f"`python -m uag.calibrate --target {target or 'T'} --drafter {drafter or 'D'}`"
        if pair is None:
            return CostView(
                None,
                f"{target or '(no target)'} ← {drafter or '(no drafter)'} is not loaded yet, so its saved costs "
                "cannot be looked up. Run a comparison with it, or press **Calibrate this pair** to load it and "
                "measure what its steps cost here.",
            )
        try:
            calibration = find_calibration(pair)
        except Exception as err:  # a damaged or foreign file in the cache must not take the tab down
            log.warning("reading the cost profile of %s and %s failed: %s", target, drafter, err)
            return CostView(
                None,
                f"The saved cost profile of this pair could not be read ({type(err).__name__}: {err}). Press "
                f"**Calibrate this pair** (or run {command}) to measure it again.",
            )
        if calibration is None:
            return CostView(
                None,
                f"No cost profile for {target} ← {drafter} on this machine yet. Press **Calibrate this pair** "
                f"(or run {command}) to measure what a target pass over w tokens, a drafter step and translation "
                "cost here; the `auto` strategy then starts from these costs instead of learning them during "
                "the run.",
            )
        return self._cost_view(calibration, pair)

    @staticmethod
    def _cost_view(calibration: Calibration, pair: Pair) -> CostView:
        title = f"Costs on this machine: {pair.target.name} ← {pair.drafter.name}"
        figure = verify_cost(calibration.profile, title=title)
        return CostView(figure, cost_caption(calibration, r_bytes=pair.r), calibration)

    def calibrate_pair(
        self,
        target: str,
        drafter: str,
        *,
        access: Access = LOCAL,
        owner: str | None = None,
        context: int = DEFAULT_CONTEXT,
        widths: Sequence[int] = DEFAULT_WIDTHS,
        repeats: int = CALIBRATION_REPEATS,
    ) -> Iterator[CalibrationUpdate]:
        """Load the pair if needed, measure its costs on the MLX worker and save them in the user cache.

        Streams `CalibrationUpdate`s; the last has state done (with the new `CostView`), stopped or error.
        The same rules as `compare` decide what a user may load; `stop(owner)` cancels it after the width
        being timed. Every failure ends in an error update, never an exception.
        """
        try:
            target, drafter = self.check_models(target, drafter, access=access)
        except InputError as err:
            yield CalibrationUpdate(f"**Cannot calibrate:** {err}", state="error")
            return
        settings = replace(self.defaults, target=target, drafter=drafter)
        options = {"context": context, "widths": tuple(widths), "repeats": repeats}
        job = self.worker.submit(self._calibrate_job, settings, options, label=f"calibrating {target} ← {drafter}")
        self._register(owner, job)
        try:
            waited = 0.0
            while not job.started.wait(1.0):
                waited += 1.0
                current = self.worker.current
                doing = f" ({current.label})" if current is not None else ""
                yield CalibrationUpdate(f"Waiting for the MLX worker{doing}… {waited:.0f} s")
            done = None
            for item in job:
                if isinstance(item, _Status):
                    yield CalibrationUpdate(f"Calibrating {target} ← {drafter}: {item.text}")
                elif isinstance(item, _Calibrated):
                    done = item
            if done is None:
                yield CalibrationUpdate("Stopped: nothing was saved.", state="stopped")
                return
            pair = self._pairs[(target, drafter)]
            where = "on the server" if access.remote else f"to `{done.path}`"  # no paths for remote users
            yield CalibrationUpdate(
                f"Calibrated {target} ← {drafter}; saved {where}.",
                state="done",
                view=self._cost_view(done.calibration, pair),
            )
        except ValueError as err:  # a model that cannot load or speculate
            yield CalibrationUpdate(f"**Cannot calibrate:** {err}", state="error")
        except Exception as err:
            log.exception("calibration failed")
            yield CalibrationUpdate(
                f"**Unexpected error:** {type(err).__name__}: {err}. The app keeps serving; see its log.",
                state="error",
            )
        finally:
            job.cancel()  # a no-op when it is done; stops it when the consumer left early
            self._unregister(owner, job)

    # --- history and the plot ----------------------------------------------------------------------------
    def plot(
        self,
        rows: Sequence[Mapping[str, Any]],
        results: pd.DataFrame | None = None,
        *,
        ks: Sequence[int] = (2, 4),
        c_choice: str = C_FITTED,
        pair: tuple[str, str] | None = None,
    ) -> PlotView:
        """Speedup vs α for this session's runs (and a loaded results file) with S(α, k) for each k.

        r is the drafter/target bytes of the latest run's pair (else of `pair` once it has run here, else
        of the results file's runs, else the study's); c is fitted to this session's runs of that pair when
        asked and there are enough of them, else the study's.
        """
        history = history_frame(rows)
        file_r = None
        if results is not None and {"drafter_bytes", "target_bytes"} <= set(results.columns):
            ratios = (results["drafter_bytes"] / results["target_bytes"]).dropna()
            file_r = float(ratios.median()) if len(ratios) else None
        if len(history):
            latest = history.iloc[-1]
            r, pair = float(latest["r"]), (latest["target"], latest["drafter"])
            r_from = "drafter/target bytes of the latest run's pair"
        elif pair is not None and self.r_of(*pair) is not None:
            r, r_from = self.r_of(*pair), "drafter/target bytes of the chosen pair"
        elif file_r is not None:
            r, pair, r_from = file_r, None, "the results file's drafter/target bytes (median)"
        else:
            r, pair, r_from = STUDY_R, None, "the study's (no run here yet)"
        c, c_from = STUDY_C, "the study's (M2 Pro)"
        if c_choice == C_FITTED:
            same = history[(history["target"] == pair[0]) & (history["drafter"] == pair[1])] if pair else history
            usable = same.dropna(subset=["alpha", "speedup"])
            if len(usable) >= MIN_RUNS_TO_FIT:
                try:
                    fit = fit_c_from_speedups(usable["alpha"], usable["k"], usable["speedup"], r)
                    c, c_from = fit.c, f"fitted to {fit.n} runs of this pair (RMSE {fit.rmse:.2f}×)"
                except ValueError as err:
                    c_from = f"the study's; fitting failed ({err})"
            else:
                c_from = f"the study's; fitting needs {MIN_RUNS_TO_FIT} runs of one pair ({len(usable)} so far)"
        points = history[["alpha", "speedup", "k", "group", "prompt"]]
        if results is not None and len(results):
            from_file = results.reindex(columns=["alpha", "speedup", "k", "group", "prompt"]).copy()
            from_file["group"] = from_file["group"].astype(str) + " (file)"
            points = pd.concat([points, from_file], ignore_index=True) if len(points) else from_file
        figure = speedup_vs_alpha(
            points.astype({"alpha": float, "speedup": float}), ks=sorted(ks), r=r, c=c, title="Speedup vs acceptance α"
        )
        counts = f"{len(history)} run{'s' * (len(history) != 1)} this session"
        if results is not None:
            counts += f", {len(results)} from the results file"
        if not len(points):
            counts += " — run a comparison or load a results file to add points"
        caption = f"{counts}. r = {r:.3f}: {r_from}. c = {c:.3f}: {c_from}. Break-even α* = r + c·k."
        return PlotView(figure, caption, r, c)

    def load_results(self, path: str | Path | None) -> tuple[pd.DataFrame | None, str]:
        """A benchmark results file for the plot, and a line saying what was read (or why not)."""
        if not path:
            return None, ""
        name = Path(path).name
        try:
            from uag.results import load_runs  # the benchmark side; imported only when a file is given
        except ImportError as err:
            return None, f"Cannot read results files in this installation ({err})."
        try:
            frame = load_runs(path)
        except (ValueError, OSError) as err:
            return None, f"Could not read {name}: {err}"
        except Exception as err:  # a corrupt file must not take the app down
            log.exception("reading %s failed", path)
            return None, f"Could not read {name}: {type(err).__name__}: {err}"
        missing = {"alpha", "speedup", "k", "group"} - set(frame.columns)
        if missing:
            return None, f"{name} lacks the columns {', '.join(sorted(missing))}."
        return frame, f"Loaded {len(frame)} speculative runs from {name}."

    def export_history(self, rows: Sequence[Mapping[str, Any]]) -> Path:
        """The history as a CSV file (for download)."""
        path = self._export_path("uag-history", "csv")
        history_frame(rows).to_csv(path, index=False)
        return path

    def export_figure(self, figure: Any) -> tuple[list[Path], str]:
        """The figure as self-contained HTML, and as PNG where kaleido is installed; a line on what was made."""
        html = self._export_path("uag-speedup-vs-alpha", "html")
        figure.write_html(html, include_plotlyjs=True)  # inline plotly.js: opens offline
        if importlib.util.find_spec("kaleido") is None:
            return [html], (
                "Saved HTML. PNG export needs the kaleido package (not installed); the camera icon above the "
                "plot saves a PNG from the browser."
            )
        png = html.with_suffix(".png")
        try:
            figure.write_image(png, width=1100, height=650, scale=2)
        except Exception as err:  # kaleido present but unable to run (e.g. no browser for it)
            return [html], f"Saved HTML. PNG export failed: {type(err).__name__}: {err}"
        return [html, png], "Saved HTML and PNG."

    def _export_path(self, stem: str, suffix: str) -> Path:
        if self.export_dir is None:
            self.export_dir = Path(tempfile.mkdtemp(prefix="uag-exports-"))
        self.export_dir.mkdir(parents=True, exist_ok=True)
        for old in self.export_dir.glob("uag-*"):  # the browser has them by now (HTML exports are ~5 MB)
            if time.time() - old.stat().st_mtime > EXPORT_TTL_S:
                old.unlink(missing_ok=True)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        return self.export_dir / f"{stem}-{stamp}.{suffix}"
