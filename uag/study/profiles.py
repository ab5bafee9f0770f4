"""What auto knows about a pair on this machine, saved as JSON in the user cache, keyed by device, backend,
models and dtypes:

- profiles/: what a speculative cycle costs (uag.study.calibrate measures it), timed the way runs spend it
  (`METHOD`: a profile timed another way is not found, so the next auto run measures it again);
- evidence/: what earlier runs of the pair accepted (uag.core.evidence.Evidence), the prior of the next
  run's opening decision. `forget` (`uag calibrate --reset`) removes both; deleting the files does too.

The engine never reads this store by itself: callers look a profile and evidence up here and pass them in.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from uag.core.config import LOOKUP
from uag.core.costmodel import CostProfile
from uag.core.evidence import Evidence
from uag.machine import backend, cache_dir, device_name

log = logging.getLogger(__name__)

# How a profile was timed. 2: verification scored as a cycle scores it (every row), drafter steps pipelined
# as drafting runs them, and the drafter's reading curve (one pass over n tokens).
METHOD = 2


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
        "method": METHOD,
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
        "method": METHOD,
    }


def profile_path(key: dict) -> Path:
    return _path("profiles", key)


def evidence_path(key: dict) -> Path:
    """Where the pair's evidence is kept: beside its profile, whichever way that was timed."""
    return _path("evidence", {name: value for name, value in key.items() if name != "method"})


def _path(folder: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    slug = "-".join(Path(key[role]).name for role in ("target", "drafter"))
    return cache_dir() / folder / f"{slug}-{key['backend']}-{digest}.json"


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
    return _write(profile_path(calibration.key), calibration.to_dict())


def find_evidence(pair: _Pair | dict) -> Evidence | None:
    """What earlier runs of this pair (or profile key) on this machine accepted, if any were saved. A damaged
    file is logged and ignored (auto then starts from its default guess; `forget` removes it)."""
    path = evidence_path(pair if isinstance(pair, dict) else profile_key(pair))
    if not path.exists():
        return None
    try:
        return Evidence.from_dict(json.loads(path.read_text())["evidence"])
    except (OSError, ValueError, KeyError, TypeError):
        log.warning("ignoring the damaged auto evidence in %s (uag calibrate --reset removes it)", path, exc_info=True)
        return None


def save_evidence(pair: _Pair | dict, evidence: Evidence) -> Path:
    """Keep what this pair's runs accepted for the next process (written atomically)."""
    key = pair if isinstance(pair, dict) else profile_key(pair)
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return _write(evidence_path(key), {"key": key, "updated_at": stamp, "evidence": evidence.to_dict()})


def forget(target: str, drafter: str) -> list[Path]:
    """Remove every saved profile and evidence of `target` with `drafter` (a model name or "lookup") on this
    machine, whatever their dtypes or timing method; return the files removed. Unreadable files are left."""
    removed = []
    for path in sorted([*(cache_dir() / "profiles").glob("*.json"), *(cache_dir() / "evidence").glob("*.json")]):
        try:
            key = json.loads(path.read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        here = key.get("device") == device_name() and key.get("backend") == backend()
        if here and key.get("target") == target and key.get("drafter") == drafter:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _write(path: Path, data: dict) -> Path:
    """Write JSON atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(data)}")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return path
