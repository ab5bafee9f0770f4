"""A target and a drafter choice as the app holds them once loaded, and what the engine is given of them:
the drafter (a model, or a `DrafterChoice` for lookup and the hybrid) and, for `auto`, the pair's costs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.costs.pair import profile_for, saved_profile
from uag.models.store import LoadedModel, Pair


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

    def saved_profile(self) -> CostProfile | None:
        """The pair's saved costs on this machine, for `auto` (None without them, or a damaged file)."""
        return saved_profile(self.target, self.choice)

    def profile(self, progress: Callable[[str], None] | None = None) -> CostProfile | None:
        """The saved profile, or on the pair's first `auto` run a quick calibration, saved; for prompt lookup
        alone, the target's own verify curve (uag.costs.pair)."""
        return profile_for(self.target, self.choice, progress=progress)
