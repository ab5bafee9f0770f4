"""What auto knows about a pair on this machine, saved as JSON in the user cache, keyed by device, backend,
models and dtypes:

- profiles/: what a speculative cycle costs (uag.costs.calibrate measures it), timed the way runs spend it
  (`METHOD`: a profile timed another way is not found, so the next auto run measures it again), and how busy
  the machine was meanwhile (`MachineLoad`): `replaces` and `why_measure_again` decide by it;
- evidence/: what earlier runs of the pair accepted (uag.core.evidence.Evidence), the prior of the next
  run's opening decision. `forget` (`uag calibrate --reset`) removes both; deleting the files does too.

The engine never reads this store by itself: callers look a profile and evidence up here and pass them in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from uag.core.config import LOOKUP
from uag.core.costmodel import CostProfile
from uag.core.evidence import Evidence
from uag.core.lookup import LOOKUP_REACH
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


STALE = 2.0  # a run whose target passes take under 1/STALE or over STALE times the profile's: it is off
JUDGED_TOKENS = 16  # a run that wrote fewer timed too few passes to call a profile off (pair.judge_profile)
LONGER = 2  # a run whose passes read a cache over this many times the profile's: slower for that (pair.judge_profile)
BUSY = 0.75  # others' load per core above which a measurement is a busy machine's
QUIETER = 0.25  # a moment this much quieter per core than the profile's measurement ...
DISAGREES = 1.25  # ... whose run's passes are this many times faster than the profile's: measure again
LOAD_TAU_S = 60.0  # the time constant of the 1-minute load average (os.getloadavg()[0])
COPY_WIDTH = LOOKUP_REACH + 1  # the widest pass auto verifies: a lookup copy and the target's own token


@dataclass(frozen=True)
class MachineLoad:
    """How busy other processes kept the machine while a profile was measured (`others_load`, in cores) before
    the measurement and during it, and the machine's cores."""

    start: float
    end: float
    cpus: int

    @property
    def per_core(self) -> float:
        """The busier end's load per core. Example: start 0.4, end 1.8, 2 cores -> 0.9"""
        return max(self.start, self.end) / max(1, self.cpus)

    @property
    def busy(self) -> bool:
        return self.per_core > BUSY

    def __str__(self) -> str:
        return f"load {max(self.start, self.end):.2f} on {self.cpus} core{'s' * (self.cpus != 1)}"

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "cpus": self.cpus}

    @classmethod
    def from_dict(cls, data: dict) -> MachineLoad:
        return cls(float(data["start"]), float(data["end"]), int(data["cpus"]))


def decayed(share: float, rate: float, seconds: float, tau_s: float = LOAD_TAU_S) -> float:
    """A process's share of the 1-minute load average after `seconds` spent at `rate` CPU seconds per second,
    from `share` before: the average's own exponential decay.

    Example: share 0, one core busy for 60 s -> 1 − e⁻¹ ≈ 0.63;  share 1, idle for 60 s -> 0.37
    """
    weight = math.exp(-max(0.0, seconds) / tau_s)
    return share * weight + rate * (1 - weight)


class _OwnShare:
    """This process's share of the load average, followed from its CPU time (all threads) at each reading."""

    def __init__(self):
        self._lock = threading.Lock()
        self._at, self._cpu, self._share = time.monotonic(), _cpu_s(), 0.0

    def now(self) -> float:
        with self._lock:
            at, cpu = time.monotonic(), _cpu_s()
            if at > self._at:
                self._share = decayed(self._share, (cpu - self._cpu) / (at - self._at), at - self._at)
                self._at, self._cpu = at, cpu
            return self._share


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot, all cores (Linux's /proc/stat); None elsewhere.

    Example: "cpu  4705 150 1120 16250 520 0 20 0 0 0" at 100 ticks a second -> (4705+150+1120+0+20+0) / 100 = 59.95
    """
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class OthersBusy:
    """The cores other processes kept busy since the previous reading: the machine's busy CPU time less this
    process's own, per second (Linux's /proc/stat). Unlike the load average it counts CPU time, not runnable
    threads (a measurement's BLAS and MLX threads outnumber the cores without using more than them), and it
    follows at once. A reading less than `MIN_WINDOW_S` after the previous one repeats the previous value (the
    very first waits that long for a window).

    Example: the machine busy 3.0 CPU-s and this process 1.0 over 2 s -> 1.0 (others kept one core busy)
    """

    MIN_WINDOW_S = 0.5

    def __init__(self, busy=None, own=None, clock=time.monotonic, sleep=time.sleep):
        self.busy_s, self.own_s = busy or _busy_s, own or _cpu_s
        self.clock, self.sleep = clock, sleep
        self._lock = threading.Lock()
        self._at: float | None = None
        self._busy = self._own = 0.0
        self._value: float | None = None

    def now(self) -> float | None:
        with self._lock:
            if self._at is None:
                self._mark(self.busy_s(), self.own_s())
                self.sleep(self.MIN_WINDOW_S)
            elapsed = self.clock() - self._at
            if elapsed < self.MIN_WINDOW_S and self._value is not None:
                return self._value
            busy, own = self.busy_s(), self.own_s()
            if busy is None or elapsed <= 0:
                return None
            self._value = max(0.0, (busy - self._busy) - (own - self._own)) / elapsed
            self._mark(busy, own)
            return self._value

    def _mark(self, busy: float | None, own: float) -> None:
        self._at, self._busy, self._own = self.clock(), busy or 0.0, own


_own = _OwnShare()
_others = OthersBusy()


def others_load() -> float | None:
    """How busy other processes keep the machine, in cores: on Linux the cores they kept busy since the previous
    reading (`OthersBusy`: read it at a measurement's start and end, and a server every few seconds, so that a
    reading covers what just happened); elsewhere the 1-minute load average less this process's own share
    (`_OwnShare`). None where the system tells neither."""
    if _busy_s() is not None:
        return _others.now()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return max(0.0, load - _own.now())


def machine_load(start: float | None = None) -> MachineLoad | None:
    """The machine's load now (`others_load`), with `start` read at a measurement's start; None without one."""
    end = others_load()
    if end is None:
        return None
    return MachineLoad(round(end if start is None else start, 3), round(end, 3), os.cpu_count() or 1)


def replaces(new: MachineLoad | None, saved: Calibration | None) -> bool:
    """Whether a measurement made under `new` load is saved over the `saved` calibration (None: nothing saved).

    A busy machine only ever adds time: the least of several rounds keeps a burst out, but not a load that lasts
    the whole measurement. So a measurement counts as busy when others' load per core passed `BUSY` before it
    or during it (`others_load`: this process's own work is not counted, since that is the measurement itself),
    and a busy one never replaces one measured quieter, nor one of unknown load (files saved before loads were
    recorded). A quiet one, or one where the system reports no
    load, always does: it is the newer truth.

    A saved verify curve short of a copy's pass (`short_of_copies`) is always replaced: a busier measurement
    prices every width a little high, which auto rescales by its own passes, but a curve that stops short prices
    a copy by extrapolation, and no rescaling mends a wrong shape.

    Example: new load 1.6 on 2 cores, saved at 0.3 on 2 -> False;  new 0.4 on 2 -> True;  nothing saved -> True
    """
    if saved is None or new is None or not new.busy or short_of_copies(saved.profile):
        return True
    return saved.load is not None and saved.load.per_core >= new.per_core


def short_of_copies(profile: CostProfile) -> str | None:
    """Why a verify curve cannot price a lookup copy, or None where it can. A copy proposes up to
    `LOOKUP_REACH` tokens, a pass `COPY_WIDTH` wide; past its widest width a curve is extrapolated from its last
    two, and on a CPU those two can cross a BLAS kernel's boundary (a 1.5B target's curve timed to width 9 went
    on at 124 ms a token where a step took 925 ms: a 64-token copy looked 9 steps dear, and until a run timed a
    wide pass of its own, auto proposed short copies). Profiles saved before calibration timed copies' widths,
    and `uag calibrate --max-width` below 65, stop short.

    Example: widths 1..9 -> "its verify curve stops at width 9, short of a copy's 65";  1..16 and 65 -> None
    """
    widest = max(profile.target_ms)
    if widest >= COPY_WIDTH:
        return None
    return f"its verify curve stops at width {widest}, short of a copy's {COPY_WIDTH}"


def why_measure_again(scale: float, measured: MachineLoad | None, now: Callable[[], MachineLoad | None]) -> str | None:
    """Why a run's target passes, at `scale` times the profile's (`Evidence.scale`), say that the profile should
    be measured again; None when they do not. Off by more than `STALE` either way; or, at a moment well quieter
    than the profile's measurement (`QUIETER` per core less, and not busy), faster by `DISAGREES` or more. `now`
    reads the machine's load (`machine_load`), only where the verdict depends on it.

    Example: scale 0.3 -> "this run's target passes took 0.3× the saved times";  scale 0.7, measured at 1.6 on
    2 cores, now 0.2 on 2 -> a reason;  scale 0.7, both quiet -> None
    """
    if not 1 / STALE <= scale <= STALE:
        return f"this run's target passes took {scale:.2g}× the saved times"
    if measured is None or scale >= 1 / DISAGREES:
        return None
    load = now()
    if load is not None and not load.busy and load.per_core <= measured.per_core - QUIETER:
        return (
            f"this run's target passes took {scale:.2g}× the saved times, measured at {measured} (now {load.end:.2f})"
        )
    return None


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
    """A measured profile with what it is valid for, when it was measured and how busy the machine was then
    (None in files saved before that was recorded, or where the machine has no load average)."""

    key: dict
    profile: CostProfile
    measured_at: str
    context: int
    load: MachineLoad | None = None

    def to_dict(self) -> dict:
        load = {} if self.load is None else {"machine_load": self.load.to_dict()}
        return {
            "key": self.key,
            "measured_at": self.measured_at,
            "context": self.context,
            **load,
            **self.profile.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        load = data.get("machine_load")
        return cls(
            data["key"],
            CostProfile.from_dict(data),
            data["measured_at"],
            int(data["context"]),
            None if load is None else MachineLoad.from_dict(load),
        )


def pair_name(key: dict) -> str:
    """The pair a profile key is for, as messages name it. Example: "org/target ← lookup" """
    return f"{key['target']} ← {key['drafter']}"


def find_calibration(pair: _Pair | dict) -> Calibration | None:
    """The saved calibration for this pair (or profile key) on this machine, if there is one (a damaged
    file raises)."""
    path = profile_path(pair if isinstance(pair, dict) else profile_key(pair))
    if not path.exists():
        return None
    return Calibration.from_dict(json.loads(path.read_text()))


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
