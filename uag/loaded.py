"""A target and a drafter choice as the app holds them once loaded, and what the engine is given of them.

The engine grows with the drafter kinds (lookup, hybrid) and with the cost profile passed in by its caller;
the flags below read its signature, so the app works with either form of `uag.generate.stream`.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import uag.generate
from uag.costmodel import CostProfile
from uag.drafters import DrafterChoice
from uag.errors import InputError
from uag.models import LoadedModel, Pair
from uag.profiles import find_calibration

log = logging.getLogger(__name__)

# Whether the engine takes a DrafterChoice (lookup, hybrid) as its drafter yet; until then a model only.
ENGINE_TAKES_CHOICE = "DrafterChoice" in str(inspect.signature(uag.generate.stream).parameters["drafter"].annotation)
# Whether the engine takes the pair's cost profile from its caller (else it looks the profile up itself).
ENGINE_TAKES_PROFILE = "profile" in inspect.signature(uag.generate.stream).parameters


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
        if self.choice.lookup:
            if not ENGINE_TAKES_CHOICE:
                raise InputError(
                    "drafting by prompt lookup is not available in this version yet: choose a drafter model"
                )
            return self.choice
        return self.choice.model

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
