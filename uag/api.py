"""The Python API: load models, generate, stream. What the CLI, the app and sweeps use too.

    import uag
    target = uag.load("demo-target")
    drafter = uag.load_drafter("lookup+demo-drafter")        # or "demo-drafter", or "lookup"
    run = uag.generate(target, drafter, "Stolica Polski to", uag.GenerationConfig(strategy="context", k=2))
    run.text, run.acceptance_rate, run.tokens_per_second

Models load once per process (a shared `ModelStore`). Strategy "auto" is seeded with the pair's saved
cost profile on this machine (`python -m uag.calibrate`) when there is one; the engine itself reads no
files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from uag.config import GenerationConfig
from uag.costmodel import CostProfile
from uag.drafters import DrafterChoice
from uag.drafters import load_drafter as _load_drafter
from uag.generate import generate as _generate
from uag.generate import stream as _stream
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


def stream(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | None,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    **kw,
) -> Iterator[Event]:
    """`uag.generate.stream`, with strategy "auto" seeded by the saved profile unless `profile=` is given."""
    config = config or GenerationConfig()
    if config.strategy == "auto" and "profile" not in kw:
        kw["profile"] = saved_profile(target, drafter)
    return _stream(target, drafter, prompt, config, **kw)


def generate(
    target: LoadedModel,
    drafter: DrafterChoice | LoadedModel | None,
    prompt: str | Sequence[int],
    config: GenerationConfig | None = None,
    **kw,
) -> Run:
    """One whole run (see `stream`)."""
    config = config or GenerationConfig()
    if config.strategy == "auto" and "profile" not in kw:
        kw["profile"] = saved_profile(target, drafter)
    return _generate(target, drafter, prompt, config, **kw)
