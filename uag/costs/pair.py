"""A pair's measured costs on this machine, which strategy `auto` decides by: the profile that
`python -m uag calibrate` (or the app) saved, or on a pair's first use a quick calibration, saved for next time.
The API (`uag.saved_profile`, `uag.api.profile_for`), the app and the sweeps all read them here. Also what
earlier runs of the pair accepted (`saved_evidence`, `keep_evidence`): auto's opening starts from it.

A run that finds the saved costs off (`uag.costs.profiles.why_measure_again`) never removes them: the CLI and
the API say so in one warning line, and a server (`open_auto(…, schedule=…)`) measures them again off the
request's path (uag.runtime.keeper.CostKeeper), saving the new ones only if they were not measured busier.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.core.evidence import Evidence
from uag.costs import calibrate as measuring  # looked up at each call: tests replace its functions
from uag.costs.profiles import (
    COPY_WIDTH,
    JUDGED_TOKENS,
    LONGER,
    Calibration,
    find_calibration,
    find_evidence,
    machine_load,
    pair_name,
    profile_key,
    replaces,
    save,
    save_evidence,
    short_of_copies,
    target_key,
    why_measure_again,
)
from uag.models.store import LoadedModel, Pair, check_pair

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
Schedule = Callable[[dict, str], None]  # (the pair's profile key, why its costs should be measured)
MEASURING = "measuring this pair's costs once (auto decides by them; saved for next time)"
_said_short: set[str] = set()  # pairs whose short verify curve this process has warned of (once each)


def saved_profile(target: LoadedModel, drafter: DrafterChoice | LoadedModel | None) -> CostProfile | None:
    """The pair's calibrated costs on this machine, if `python -m uag calibrate` (or the app) saved them; None
    without a drafter model, or when the saved file is damaged (auto then learns the costs as it runs)."""
    if drafter is None:
        return None
    model = DrafterChoice.of(drafter).model
    if model is None:
        return None
    calibration = read_calibration(check_pair(target, model))
    return None if calibration is None else calibration.profile


def read_calibration(key: dict | Pair) -> Calibration | None:
    """`find_calibration(key)`, with a damaged or foreign file in the cache logged and read as none."""
    try:
        return find_calibration(key)
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
    key = evidence_key(target, drafter)
    return None if key is None else saved_or_measured(key, target, drafter, progress=progress).profile


def saved_or_measured(
    key: dict, target: LoadedModel, drafter: DrafterChoice | LoadedModel, *, progress: Progress | None = None
) -> Calibration:
    """The pair's saved calibration (`key`: its `evidence_key`), or a quick one measured now and kept."""
    calibration = read_calibration(key)
    if calibration is None:
        (progress or (lambda _: None))(MEASURING)
        calibration = measure_costs(target, drafter, progress=progress)
        keep_measured(calibration, target)
    return calibration


def measure_costs(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel,
    *,
    progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
) -> Calibration:
    """One quick calibration (`QUICK`) of the pair, or of the target alone for prompt lookup; `cancel`, asked
    between passes, stops it (uag.costs.calibrate.MeasurementStopped). Not saved: `keep_measured` decides."""
    model = DrafterChoice.of(drafter).model
    if model is None:
        return measuring.calibrate_target(target, progress=progress, cancel=cancel, **measuring.QUICK)
    return measuring.calibrate(check_pair(target, model), progress=progress, cancel=cancel, **measuring.QUICK)


def keep_measured(calibration: Calibration, target: LoadedModel) -> tuple[bool, str]:
    """Save `calibration` unless the saved one was measured quieter (`uag.costs.profiles.replaces`); a pair's
    calibration also gives prompt lookup its target-only profile where none is saved. (saved, what to say)."""
    saved = read_calibration(calibration.key)
    name, load = pair_name(calibration.key), calibration.load or "an unknown load"
    if not replaces(calibration.load, saved):
        was = saved.load or "an unknown load"
        return False, (
            f"kept the saved costs of {name} (measured at {was}): the new measurement ran at {load}, "
            "and a busy machine's costs are not saved over a quieter one's"
        )
    path = save(calibration)
    lookup = target_key(target)
    if calibration.key != lookup and read_calibration(lookup) is None:
        save(measuring.target_part(calibration, target))
    curve = calibration.profile.target_ms
    step, widest = curve.get(1), max(curve)
    before = "" if saved is None or 1 not in saved.profile.target_ms else f" (was {saved.profile.target_ms[1]:.1f})"
    wide = f", a pass over {widest} tokens {curve[widest]:.1f} ms" if widest > 1 else ""
    return True, f"saved the costs of {name} measured at {load}: target step {step:.1f} ms{before}{wide}; {path}"


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


def why_short(calibration: Calibration | None, drafter: DrafterChoice | LoadedModel | None) -> str | None:
    """Why `calibration` cannot price what `drafter` proposes (`short_of_copies`): only a drafter with prompt
    lookup copies past a model's k; None where it reaches, or where nothing is saved."""
    if calibration is None or drafter is None or not DrafterChoice.of(drafter).lookup:
        return None
    return short_of_copies(calibration.profile)


def say_short(key: dict, why: str) -> None:
    """Where nothing measures costs off the run's path (the CLI, the API, the app): one warning line per pair and
    process that its saved verify curve stops short of a copy's pass (`why_short`), naming the command that mends
    it."""
    name = json.dumps(key, sort_keys=True)
    if name in _said_short:
        return
    _said_short.add(name)
    log.warning(
        "auto's saved costs for %s: %s, so auto prices long copies by extrapolation (measure them again with "
        "`uag calibrate --target %s --drafter %s`, which times widths to %d)",
        pair_name(key),
        why,
        key["target"],
        key["drafter"],
        COPY_WIDTH,
    )


def judge_profile(
    calibration: Calibration, evidence: Evidence, context: int | None = None, generated: int | None = None
) -> str | None:
    """After an auto run on `calibration`'s profile: why its costs should be measured again, by the run's own
    target passes (`Evidence.scale`) and the machine's load now against the measurement's; None when they hold.
    A run whose passes read a cache of `context` tokens, over `LONGER` times the one the profile was timed at, is
    not taken for a sign of slower costs: its passes cost more for the cache alone, and measuring again at the
    profile's context would find the same times, and every long request would set off a measurement beside the next
    one. Nor is a run that `generated` fewer than `JUDGED_TOKENS` tokens: a client's short probe times a pass or two,
    too few to tell the machine's speed, and the measurement it set off would hold up the request after it.

    Example: a profile calibrated while a test suite ran (target 495 ms a step) and a quiet run (147 ms):
    scale 0.3 -> "this run's target passes took 0.3× the saved times";  scale 2.3 at context 2,800 on a profile
    timed at 256 -> None
    """
    if generated is not None and generated < JUDGED_TOKENS:
        return None
    if context is not None and evidence.scale > 1 and context > LONGER * calibration.context:
        return None
    return why_measure_again(evidence.scale, calibration.load, machine_load)


@dataclass(frozen=True)
class AutoInputs:
    """What an `auto` run of a pair opens from — its costs (`profile`) and what earlier runs accepted
    (`evidence`) — and `finish`, to call once the run has ended (also when it was stopped early)."""

    profile: CostProfile | None
    evidence: Evidence | None
    # to call once the run has ended, with the cache its passes read at the end where known (`judge_profile`);
    # nothing to save where the evidence is the caller's
    finish: Callable[..., None] = field(default=lambda context=None, generated=None: None)

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's keyword arguments (uag.core.engine.stream's `profile=` and `evidence=`)."""
        return {"profile": self.profile, "evidence": self.evidence}


def open_auto(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | None,
    given: Mapping[str, Any] = MappingProxyType({}),
    *,
    progress: Progress | None = None,
    held: dict[str, Evidence] | None = None,
    schedule: Schedule | None = None,
    keep: bool = True,
    save: Callable[[dict | None, Evidence], None] | None = None,
) -> AutoInputs:
    """What an `auto` run of the pair opens from, where the caller's engine arguments `given` hold none: the
    pair's `profile`, and as `evidence` what earlier runs of the pair accepted on this machine
    (`saved_evidence`), or the one a long-lived caller keeps in `held` across its runs (the server and the
    app, per pair; read from the saved evidence on the pair's first run there). Its `finish` saves the evidence
    for the pair's next run and judges the profile by the run (`judge_profile`); it does nothing where the
    caller's own evidence leaves nothing to save.

    Without `schedule` (the CLI, the API, the app) a pair with no saved profile is measured here, and a profile
    the run found off, or one whose verify curve stops short of a lookup copy's pass (`why_short`), is said in
    one warning line (`uag calibrate` measures it again). With it (a server) nothing is measured here: the run
    goes on the saved profile or none (auto then learns the costs as it runs), and `schedule(key, why)` hears
    of a missing or short profile now and of one the run found off at the end.
    `keep=False` (an ablated auto, `uag serve --auto-off`): the evidence opens from the pair's saved evidence and
    stays in `held`; nothing is saved and the profile is not judged. `save(key, evidence)`: how `finish` keeps it
    (default `keep_evidence`, at once; a host batching requests defers the write while others run:
    uag.runtime.host.Host.keep_evidence).
    """
    key = evidence_key(target, drafter)
    calibration, profile = None, given.get("profile")
    if "profile" not in given and key is not None:
        if schedule is None:
            calibration = saved_or_measured(key, target, drafter, progress=progress)
        elif (calibration := read_calibration(key)) is None:
            schedule(key, "no costs are saved for it yet")
        if (short := why_short(calibration, drafter)) is not None:
            (schedule or say_short)(key, short)
        profile = None if calibration is None else calibration.profile
    if "evidence" in given:
        return AutoInputs(profile, given["evidence"])  # the caller's evidence stays the caller's
    if held is None:
        evidence = saved_evidence(key)
    else:
        name = json.dumps(key, sort_keys=True)
        if name not in held:
            held[name] = saved_evidence(key)
        evidence = held[name]

    if not keep:
        return AutoInputs(profile, evidence)

    def finish(context: int | None = None, generated: int | None = None) -> None:
        (save or keep_evidence)(key, evidence)
        why = None if calibration is None else judge_profile(calibration, evidence, context, generated)
        if why is None:
            return
        if schedule is not None:
            schedule(key, why)
        else:
            log.warning(
                "auto's saved costs for %s look off: %s; auto rescales them as it runs (measure them again with "
                "`uag calibrate --target %s --drafter %s` on a quiet machine)",
                pair_name(key),
                why,
                key["target"],
                key["drafter"],
            )

    return AutoInputs(profile, evidence, finish)
