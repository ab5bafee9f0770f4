"""What the app shows of a pair's measured costs on this machine: a figure and a caption, and the progress of
a calibration. No mlx, no gradio."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from uag.costs.profiles import Calibration
from uag.runtime.jobs import Status, Waiting
from uag.study.plots import verify_cost

if TYPE_CHECKING:
    from uag.models.store import Pair

BREAK_EVEN_KS = (1, 2, 4, 8)  # draft lengths the cost caption gives α* for


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


@dataclass(frozen=True)
class Calibrated:
    """What a calibration job hands back once it saved its measurement."""

    calibration: Calibration
    path: Path
    pair: Pair


def cost_view(calibration: Calibration, pair: Pair) -> CostView:
    """A calibration of `pair` as the Costs panel shows it: the verify-cost figure and its caption."""
    title = f"Costs on this machine: {pair.target.name} ← {pair.drafter.name}"
    return CostView(
        verify_cost(calibration.profile, title=title), cost_caption(calibration, r_bytes=pair.r), calibration
    )


class CalibrationView:
    """What a calibration shows while it runs, fed the job's items on the consumer's thread
    (`uag.app.session.Session` feeds it): progress lines, then the new costs, or why it ended without them."""

    def __init__(self, target: str, drafter: str, *, remote: bool):
        self.pair_name = f"{target} ← {drafter}"
        self.remote = remote
        self.done: Calibrated | None = None

    def take(self, item: Any) -> CalibrationUpdate | None:
        """The refresh an item from the job calls for, or None."""
        if isinstance(item, Waiting):
            return CalibrationUpdate(item.text)
        if isinstance(item, Status):
            return CalibrationUpdate(f"Calibrating {self.pair_name}: {item.text}")
        if isinstance(item, Calibrated):
            self.done = item
        return None

    def finished(self) -> CalibrationUpdate:
        if self.done is None:
            return CalibrationUpdate("Stopped: nothing was saved.", state="stopped")
        where = "on the server" if self.remote else f"to `{self.done.path}`"  # no paths for remote users
        return CalibrationUpdate(
            f"Calibrated {self.pair_name}; saved {where}.",
            state="done",
            view=cost_view(self.done.calibration, self.done.pair),
        )

    @staticmethod
    def failed(message: str) -> CalibrationUpdate:
        return CalibrationUpdate(message, state="error")


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
