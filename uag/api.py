"""The Python API: load models, generate, stream. What `uag generate` runs through too.

    import uag
    target = uag.load("demo-target")
    drafter = uag.load_drafter("lookup+demo-drafter")        # or "demo-drafter", or "lookup"
    run = uag.generate(target, drafter, "Stolica Polski to", uag.GenerationConfig(translation="context", k=2))
    run.text, run.acceptance_rate, run.tokens_per_second

Models load once per process (a shared `ModelStore`), through `uag.models.loading`: a broken model folder is a
`uag.UserError` saying what is wrong with it, as on the command line and in the app. Adaptive k ("auto":
`GenerationConfig(k_policy="adaptive")`) decides by the pair's measured costs on this machine (uag.costs.pair):
the profile `python -m uag calibrate` (or the app) saved, or on first use a quick calibration that is saved for
next time (a run that finds them off, or whose verify curve stops short of a copy's pass, keeps them and says so
in one warning line: `uag calibrate` measures them again); it opens from what earlier runs of the pair accepted
here, and saves what this run taught (`uag calibrate --reset` forgets both). The engine itself reads and writes
no files; the sweeps (uag.study.bench) call it with the pair's profile and no saved evidence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice, load_drafter_choice
from uag.core.engine import last_run
from uag.core.engine import stream as _stream
from uag.core.records import Event, Run
from uag.costs.pair import open_auto, profile_for, saved_profile
from uag.models.loading import load_model
from uag.models.store import LoadedModel, ModelStore

__all__ = ["generate", "load", "load_drafter", "profile_for", "saved_profile", "store", "stream"]

Progress = Callable[[str], None]
_store: ModelStore | None = None


def store() -> ModelStore:
    """The process-wide model store that `load` and `load_drafter` use."""
    global _store
    if _store is None:
        _store = ModelStore()
    return _store


def load(name: str, *, progress: Progress | None = None) -> LoadedModel:
    """A model by hub id, local folder, or offline name (demo-target, demo-drafter, …), loaded once;
    `uag.errors.ModelError` (a `UserError`) saying what is wrong when it cannot be loaded."""
    return load_model(store(), name, role="model", progress=progress)


def load_drafter(name: str, *, progress: Progress | None = None) -> DrafterChoice:
    """A drafter: a model name, "lookup" (no model), or "lookup+<model>" (the hybrid); `ModelError` as `load`."""
    return load_drafter_choice(store(), name, progress=progress)


def stream(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | None,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    *,
    progress: Progress | None = None,
    **kw,
) -> Iterator[Event]:
    """`uag.core.engine.stream`; adaptive k ("auto") gets the pair's measured costs (`profile_for`) unless
    `profile=` is given, and what earlier runs of the pair accepted unless `evidence=` is given (then saved
    again when the run ends). `progress` hears about a first-use calibration. Saved costs that the run finds off
    are kept, with one warning line (uag.costs.pair.open_auto)."""
    config = config or GenerationConfig()
    if config.k_policy != "adaptive":
        return _stream(target, drafter, prompt, config, **kw)
    auto = open_auto(target, drafter, kw, progress=progress)
    return _closing(_stream(target, drafter, prompt, config, **{**kw, **auto.engine_kwargs()}), auto.finish)


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
    return last_run(stream(target, drafter, prompt, config, progress=progress, **kw))


def _closing(events: Iterator[Event], finish: Callable[[], None]) -> Iterator[Event]:
    """`events`, then `finish()` once the run has ended (also when its consumer stopped it early)."""
    try:
        yield from events
    finally:
        events.close()
        finish()
