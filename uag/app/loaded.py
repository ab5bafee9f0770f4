"""A target and a drafter choice as the app holds them once loaded, and what the engine is given of them:
the drafter (a model, or a `DrafterChoice` for lookup and the hybrid) and, for `auto`, the pair's costs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from uag.api import profile_for as api_profile_for
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.models.store import LoadedModel, Pair
from uag.study.profiles import find_calibration

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """A target and a drafter choice, loaded and checked; `pair` when the drafter has a model."""

    target: LoadedModel
    choice: DrafterChoice
    pair: Pair | None

    @property
    def r(self) -> float | None:
        return self.pair.r if self.pair is not None else None

    @property
    def drafter(self) -> DrafterChoice | LoadedModel:
        """What the engine takes as its drafter."""
        return self.choice if self.choice.lookup else self.choice.model

    def uses(self, model: LoadedModel) -> bool:
        return model is self.target or model is self.choice.model


def saved_profile(loaded: Loaded) -> CostProfile | None:
    """The pair's saved cost profile on this machine, for `auto` (None without one, or a damaged one)."""
    if loaded.pair is None:
        return None
    try:
        calibration = find_calibration(loaded.pair)
    except Exception:  # a damaged or foreign file in the cache: auto learns the costs during the run instead
        log.warning("reading the cost profile of %s failed", loaded.pair.target.name, exc_info=True)
        return None
    return calibration.profile if calibration is not None else None


def profile_for(loaded: Loaded, progress: Callable[[str], None] | None = None) -> CostProfile | None:
    """The saved profile, or on the pair's first `auto` run a quick calibration, saved (uag.api.profile_for);
    for prompt lookup alone, the target's own verify curve."""
    profile = saved_profile(loaded)
    return profile if profile is not None else api_profile_for(loaded.target, loaded.choice, progress=progress)
