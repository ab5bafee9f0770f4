"""The Python API: load models, generate, stream. What the CLI, the app and sweeps use too.

    import uag
    target = uag.load("demo-target")
    drafter = uag.load_drafter("lookup+demo-drafter")        # or "demo-drafter", or "lookup"
    run = uag.engine(target, drafter, "Stolica Polski to", uag.GenerationConfig(strategy="context", k=2))
    run.text, run.acceptance_rate, run.tokens_per_second

Models load once per process (a shared `ModelStore`). Strategy "auto" decides by the pair's measured
costs on this machine: the profile `python -m uag.calibrate` (or the app) saved, or on first use a quick
calibration that is saved for next time. The engine itself reads and writes no files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from uag.config import GenerationConfig
from uag.costmodel import CostProfile
from uag.drafters import DrafterChoice
from uag.drafters import load_drafter as _load_drafter
from uag.engine import generate as _generate
from uag.engine import stream as _stream
from uag.models import LoadedModel, ModelStore, check_pair
from uag.profiles import find_profile
from uag.records import Event, Run

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
    """The pair's calibrated costs on this machine, if `python -m uag.calibrate` (or the app) saved them."""
    if drafter is None:
        return None
    model = DrafterChoice.of(drafter).model
    return None if model is None else find_profile(check_pair(target, model))


def profile_for(
    target: LoadedModel, drafter: DrafterChoice | LoadedModel | None, *, progress: Progress | None = None
) -> CostProfile | None:
    """The saved profile, or on a pair's first use a quick calibration (seconds), saved for next time.

    auto decides by measured costs: a drafter's cost relative to the target by time, not by bytes (on a
    GPU a tiny model can cost more than a bigger one; on a CPU bf16 is slower than float32). Lookup alone
    has no drafter model to time: auto learns the target's costs from the run itself.
    """
    if drafter is None or DrafterChoice.of(drafter).model is None:
        return None
    profile = saved_profile(target, drafter)
    if profile is None:
        from uag.calibrate import QUICK, calibrate
        from uag.profiles import save

        say = progress or (lambda _: None)
        say("measuring this pair's costs once (auto decides by them; saved for next time)")
        calibration = calibrate(check_pair(target, DrafterChoice.of(drafter).model), progress=say, **QUICK)
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
    """`uag.engine.stream`; strategy "auto" gets the pair's measured costs (`profile_for`) unless
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
