"""What tests of saved costs share: a pair's key without loading models, and evidence with something in it."""

from __future__ import annotations

from types import SimpleNamespace

from uag.core.evidence import Counts, Evidence
from uag.models.store import Pair


def fake_pair(target: str = "org/target", drafter: str = "org/drafter", dtype: str = "float32") -> Pair:
    """What a key needs of a loaded pair, without loading models."""
    model = lambda name: SimpleNamespace(name=name, dtype=dtype, weight_bytes=1000)  # noqa: E731
    return Pair(model(target), model(drafter), shared_vocabulary=False)


def learned() -> Evidence:
    evidence = Evidence(lookup=Counts([1.0], [2.0]), expansion=0.8, drafter_ms=3.0)
    evidence.saw_copy(20, tried=8, kept=7)  # 7 tokens of a copy of 20-26 kept, the 8th (27) not: the 16-31 band
    evidence.saw_drafts([0.95, 0.5, 0.1], kept=1, proposed=3)  # the model's drafts: how sure, how they fared
    return evidence
