"""Saved cost profiles: what a speculative cycle costs for one pair on one machine (uag.study.calibrate
measures them). Stored as JSON in the user cache, keyed by device, backend, models and dtypes.

The engine never reads this store by itself: callers look a profile up here and pass it in
(`GenerationConfig` runs take a `CostProfile | None`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from uag.core.config import LOOKUP
from uag.core.costmodel import CostProfile
from uag.machine import backend, cache_dir, device_name


class _Model(Protocol):
    name: str

    @property
    def dtype(self) -> str: ...


class _Pair(Protocol):
    target: _Model
    drafter: _Model


def profile_key(pair: _Pair) -> dict:
    """What a profile is valid for: this machine's device and backend, these two models, their dtypes."""
    return {
        "device": device_name(),
        "backend": backend(),
        "target": pair.target.name,
        "drafter": pair.drafter.name,
        "target_dtype": pair.target.dtype,
        "drafter_dtype": pair.drafter.dtype,
    }


def target_key(target: _Model) -> dict:
    """What a target-only profile (for prompt lookup, which has no drafter model) is valid for."""
    return {
        "device": device_name(),
        "backend": backend(),
        "target": target.name,
        "drafter": LOOKUP,
        "target_dtype": target.dtype,
        "drafter_dtype": "",
    }


def profile_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = "-".join(Path(key[role]).name for role in ("target", "drafter"))
    return cache_dir() / "profiles" / f"{slug}-{key['backend']}-{digest}.json"


@dataclass(frozen=True)
class Calibration:
    """A measured profile with what it is valid for and when it was measured."""

    key: dict
    profile: CostProfile
    measured_at: str
    context: int

    def to_dict(self) -> dict:
        return {"key": self.key, "measured_at": self.measured_at, "context": self.context, **self.profile.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        return cls(data["key"], CostProfile.from_dict(data), data["measured_at"], int(data["context"]))


def find_calibration(pair: _Pair | dict) -> Calibration | None:
    """The saved calibration for this pair (or profile key) on this machine, if there is one (a damaged
    file raises)."""
    path = profile_path(pair if isinstance(pair, dict) else profile_key(pair))
    if not path.exists():
        return None
    return Calibration.from_dict(json.loads(path.read_text()))


def find_profile(pair: _Pair | dict) -> CostProfile | None:
    """The saved profile for this pair on this machine, if it was calibrated."""
    calibration = find_calibration(pair)
    return calibration.profile if calibration else None


def save(calibration: Calibration) -> Path:
    """Write atomically (a reader never sees half a file)."""
    path = profile_path(calibration.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(calibration)}")
    tmp.write_text(json.dumps(calibration.to_dict(), indent=2))
    tmp.replace(path)
    return path
