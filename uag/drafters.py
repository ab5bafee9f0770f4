"""Who drafts: a model through translation, prompt lookup, or both (the hybrid).

`DrafterChoice` is what a user picked, loaded once (a model in memory, or no model at all for lookup);
each run turns it into a stateful `Drafter` (uag.drafting) that proposes target tokens every cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from uag.config import DrafterSpec
from uag.models import LoadedModel, ModelStore


@dataclass(frozen=True)
class DrafterChoice:
    """A loaded drafter choice: prompt lookup, a model, or lookup backed by a model."""

    lookup: bool = False
    model: LoadedModel | None = None

    def __post_init__(self):
        if not self.lookup and self.model is None:
            raise ValueError("a drafter choice needs lookup, a model, or both")

    @property
    def name(self) -> str:
        return str(DrafterSpec(self.lookup, None if self.model is None else self.model.name))

    @property
    def kind(self) -> str:
        return DrafterSpec(self.lookup, None if self.model is None else self.model.name).kind

    @classmethod
    def of(cls, drafter: DrafterChoice | LoadedModel) -> DrafterChoice:
        return drafter if isinstance(drafter, DrafterChoice) else cls(model=drafter)


def load_drafter(
    store: ModelStore, spec: str | DrafterSpec, *, progress: Callable[[str], None] | None = None
) -> DrafterChoice:
    """Load what `spec` names ("demo-drafter", "lookup", "lookup+demo-drafter"); lookup loads nothing."""
    spec = spec if isinstance(spec, DrafterSpec) else DrafterSpec.parse(spec)
    model = None if spec.model is None else store.get(spec.model, progress=progress)
    return DrafterChoice(lookup=spec.lookup, model=model)
