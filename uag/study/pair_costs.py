"""A pair's measured costs on this machine, which strategy `auto` decides by: the profile that
`python -m uag calibrate` (or the app) saved, or on a pair's first use a quick calibration, saved for next time.
The API (`uag.saved_profile`, `uag.api.profile_for`), the app and the sweeps all read them here. Also what
earlier runs of the pair accepted (`saved_evidence`, `keep_evidence`): auto's opening starts from it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.core.evidence import Evidence
from uag.models.store import LoadedModel, Pair, check_pair
from uag.study.profiles import (
    find_evidence,
    find_profile,
    profile_key,
    profile_path,
    save,
    save_evidence,
    target_key,
)

log = logging.getLogger(__name__)

STALE = 2.0  # a run whose target passes are this many times faster or slower than its saved profile's

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


def evidence_key(target: LoadedModel, drafter: DrafterChoice | LoadedModel | None) -> dict | None:
    """Where the pair's evidence is kept on this machine (its profile's key); None without a drafter."""
    if drafter is None:
        return None
    model = DrafterChoice.of(drafter).model
    return target_key(target) if model is None else profile_key(check_pair(target, model))


def saved_evidence(key: dict | None) -> Evidence:
    """What earlier runs of the pair on this machine accepted (`uag calibrate --reset` forgets it), or nothing
    yet; a new `Evidence` for auto to start from and learn into."""
    found = None if key is None else find_evidence(key)
    return found if found is not None else Evidence()


def keep_evidence(key: dict | None, evidence: Evidence) -> None:
    """Save what a run taught for the pair's next run; a cache that cannot be written is logged, not raised."""
    if key is None:
        return
    try:
        save_evidence(key, evidence)
    except OSError:
        log.warning("could not save auto's evidence for the next run", exc_info=True)


def drop_stale_profile(key: dict | None, evidence: Evidence) -> bool:
    """After an auto run on the pair's saved profile: where the run's own target passes took less than 1/STALE
    or more than STALE times the profile's (`Evidence.scale`), the profile was measured on a busier (or
    quieter) machine than this one is now, and its ratios — drafter to target, wide pass to narrow — are
    suspect too: remove it, so the pair's next auto run measures its costs again. True when removed.

    Example: a profile calibrated while a test suite ran (target 495 ms a step) and a quiet run (147 ms):
    scale 0.3 -> removed
    """
    if key is None or 1 / STALE <= evidence.scale <= STALE:
        return False
    path = profile_path(key)
    try:
        path.unlink(missing_ok=True)
    except OSError:
        log.warning("could not remove the stale cost profile %s", path, exc_info=True)
        return False
    log.warning(
        "this pair's saved costs were %.1f× off what this run measured: measured again on next use", 1 / evidence.scale
    )
    return True


def open_auto(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | None,
    kw: dict,
    *,
    progress: Progress | None = None,
    held: dict[str, Evidence] | None = None,
) -> Callable[[], None] | None:
    """What an `auto` run of the pair opens from, filled into the engine's keyword arguments `kw` where the
    caller gave none: `profile` (`profile_for`) and `evidence` — what earlier runs of the pair accepted on this
    machine (`saved_evidence`), or the one a long-lived caller keeps in `held` across its runs (the server, per
    pair; read from the saved evidence on the pair's first run there). Returns what to call once the run has
    ended, also when stopped early: it saves the evidence for the pair's next run and removes a profile the
    run's own passes showed stale (`drop_stale_profile`) — or None where a caller's own evidence and profile
    leave nothing to save.
    """
    own_profile = "profile" not in kw
    if own_profile:
        kw["profile"] = profile_for(target, drafter, progress=progress)
    if "evidence" in kw:
        return None  # the caller's evidence stays the caller's
    key = evidence_key(target, drafter)
    if held is None:
        kw["evidence"] = saved_evidence(key)
    else:
        name = json.dumps(key, sort_keys=True)
        if name not in held:
            held[name] = saved_evidence(key)
        kw["evidence"] = held[name]
    evidence = kw["evidence"]

    def close() -> None:
        keep_evidence(key, evidence)
        if own_profile:
            drop_stale_profile(key, evidence)

    return close
