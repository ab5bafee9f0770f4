"""The Python API: load models, generate, stream. What the CLI, the app and sweeps use too.

    import uag
    target = uag.load("demo-target")
    drafter = uag.load_drafter("lookup+demo-drafter")        # or "demo-drafter", or "lookup"
    run = uag.core.engine(target, drafter, "Stolica Polski to", uag.GenerationConfig(strategy="context", k=2))
    run.text, run.acceptance_rate, run.tokens_per_second

Models load once per process (a shared `ModelStore`). Strategy "auto" decides by the pair's measured
costs on this machine: the profile `python -m uag calibrate` (or the app) saved, or on first use a quick
calibration that is saved for next time. The engine itself reads and writes no files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.core.drafters import load_drafter as _load_drafter
from uag.core.engine import generate as _generate
from uag.core.engine import stream as _stream
from uag.core.records import Event, Run
from uag.models.store import LoadedModel, ModelStore, check_pair
from uag.study.profiles import find_profile, save, target_key

Progress = Callable[[str], None]
_store: ModelStore | None = None


def store() -> ModelStore:
    """The process-wide model store that `load` and `load_drafter` use."""
    global _store
    if _store is None:
        _store = ModelStore()
    return _store


def load(name: str, *, progress: Progress | None = None) -> LoadedModel:
    """A model by hub id, local folder, or offline name (demo-target, demo-drafter, …), loaded once."""
    return store().get(name, progress=progress)


def load_drafter(name: str, *, progress: Progress | None = None) -> DrafterChoice:
    """A drafter: a model name, "lookup" (no model), or "lookup+<model>" (the hybrid)."""
    return _load_drafter(store(), name, progress=progress)


def saved_profile(target: LoadedModel, drafter: DrafterChoice | LoadedModel | None) -> CostProfile | None:
    """The pair's calibrated costs on this machine, if `python -m uag calibrate` (or the app) saved them."""
    if drafter is None:
        return None
    model = DrafterChoice.of(drafter).model
    return None if model is None else find_profile(check_pair(target, model))


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
        profile = find_profile(target_key(target))
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


def stream(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | None,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    *,
    progress: Progress | None = None,
    **kw,
) -> Iterator[Event]:
    """`uag.core.engine.stream`; strategy "auto" gets the pair's measured costs (`profile_for`) unless
    `profile=` is given. `progress` hears about a first-use calibration."""
    config = config or GenerationConfig()
    if config.strategy == "auto" and "profile" not in kw:
        kw["profile"] = profile_for(target, drafter, progress=progress)
    return _stream(target, drafter, prompt, config, **kw)


def generate(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | None,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    *,
    progress: Progress | None = None,
    **kw,
) -> Run:
    """One whole run (see `stream`)."""
    config = config or GenerationConfig()
    if config.strategy == "auto" and "profile" not in kw:
        kw["profile"] = profile_for(target, drafter, progress=progress)
    return _generate(target, drafter, prompt, config, **kw)
