"""A pair's measured costs on this machine, which strategy `auto` decides by: the profile that
`python -m uag calibrate` (or the app) saved, or on a pair's first use a quick calibration, saved for next time.
The API (`uag.saved_profile`, `uag.api.profile_for`), the app and the sweeps all read them here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.models.store import LoadedModel, Pair, check_pair
from uag.study.profiles import find_profile, save, target_key

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


def saved_profile(target: LoadedModel, drafter: DrafterChoice | LoadedModel | None) -> CostProfile | None:
    """The pair's calibrated costs on this machine, if `python -m uag calibrate` (or the app) saved them; None
    without a drafter model, or when the saved file is damaged (auto then learns the costs as it runs)."""
    if drafter is None:
        return None
    model = DrafterChoice.of(drafter).model
    return None if model is None else _read_profile(check_pair(target, model))


def _read_profile(key: dict | Pair) -> CostProfile | None:
    """`find_profile(key)`, with a damaged or foreign file in the cache logged and read as none."""
    try:
        return find_profile(key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        log.warning("the saved cost profile could not be read; it is measured again", exc_info=True)
        return None


def profile_for(
    target: LoadedModel, drafter: DrafterChoice | LoadedModel | None, *, progress: Progress | None = None
) -> CostProfile | None:
    """The saved profile, or on a pair's first use a quick calibration (seconds), saved for next time.

    auto decides by measured costs: a drafter's cost relative to the target by time, not by bytes (on a
    GPU a tiny model can cost more than a bigger one; on a CPU bf16 is slower than float32). Prompt lookup
    alone has no drafter model: its profile is the target's verify curve (what a lookup of k tokens costs
    to check), so auto drafts from the first cycle with the right k instead of learning widths one by one.
    """
    from uag.study.calibrate import QUICK, calibrate, calibrate_target

    if drafter is None:
        return None
    model = DrafterChoice.of(drafter).model
    if model is None:
        profile = _read_profile(target_key(target))
        measure = lambda say: calibrate_target(target, progress=say, **QUICK)  # noqa: E731
    else:
        profile = saved_profile(target, drafter)
        measure = lambda say: calibrate(check_pair(target, model), progress=say, **QUICK)  # noqa: E731
    if profile is None:
        say = progress or (lambda _: None)
        say("measuring this pair's costs once (auto decides by them; saved for next time)")
        calibration = measure(say)
        save(calibration)
        profile = calibration.profile
    return profile
