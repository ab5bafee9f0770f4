"""Results file: one SQLite database per study, one row per generation run, one row per cycle. No mlx.

Baseline and speculative runs share the ``runs`` table; each run's verification cycles are in ``cycles``.
A run and its cycles are written in one transaction, so a killed sweep never leaves half a run, and each
run has a unique ``run_key`` (a hash of what identifies it: uag.study.runspec), so a sweep that is run again
skips what is there. The file is in WAL mode: the app can read it while a sweep writes it.

    with ResultsDB("results.db") as db:
        if not db.has(spec.key):
            db.add(run, spec=spec, prompt=text, machine=machine)
    frame = load_runs("results.db")  # one row per speculative run, its baseline joined: alpha, tps, speedup …
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from uag.core.config import short_name
from uag.core.records import Run
from uag.errors import InputError
from uag.study.runspec import BASELINE, Machine, RunSpec

FORMAT = "uag-results"
SCHEMA_VERSION = 1

# The columns of `runs` after `id`, in order. Numbers are Run.stats(); the machine block is `Machine`.
RUN_COLUMNS = {
    "run_key": "TEXT NOT NULL UNIQUE",
    "sweep": "TEXT",
    "created_at": "TEXT NOT NULL",  # UTC, ISO 8601 with microseconds
    # what was asked (RunSpec)
    "target": "TEXT NOT NULL",
    "drafter": "TEXT",  # NULL for baselines
    "strategy": "TEXT NOT NULL",  # "baseline" or as requested: none / naive / context / tli / auto / tli+auto …
    "k": "INTEGER NOT NULL",
    "window": "INTEGER NOT NULL",
    "max_tokens": "INTEGER NOT NULL",
    "temperature": "REAL NOT NULL",
    "seed": "INTEGER",
    "chat": "INTEGER NOT NULL",
    "dataset": "TEXT NOT NULL",
    "prompt_id": "TEXT NOT NULL",
    "prompt": "TEXT NOT NULL",
    # what happened (Run.stats)
    "translation": "TEXT NOT NULL",  # Run.translation: baseline / identity / none / naive / context / tli
    # Run.k_policy: how k was chosen, "fixed" or "adaptive" (k is then the maximum). Read back as `k_policy`
    # (`_as_read`); the column keeps its name, and files written before the rename hold "auto" for "adaptive".
    "policy": "TEXT",
    "prompt_tokens": "INTEGER",
    "generated_tokens": "INTEGER",
    "finish_reason": "TEXT",
    "cycles": "INTEGER",
    "proposed": "INTEGER",
    "accepted": "INTEGER",
    "acceptance_rate": "REAL",
    "mean_accepted": "REAL",
    "draft_fraction": "REAL",
    "tokens_per_second": "REAL",
    "prompt_tps": "REAL",
    "prompt_ms": "REAL",
    "generation_s": "REAL",
    "drafter_passes": "INTEGER",
    "stalls": "INTEGER",
    "absorptions": "INTEGER",
    "resync_absorptions": "INTEGER",
    "fallbacks": "INTEGER",
    "empty_translations": "INTEGER",
    "draft_ms": "REAL",
    "translate_ms": "REAL",
    "verify_ms": "REAL",
    "resync_ms": "REAL",
    "text": "TEXT",
    "token_ids": "TEXT",  # JSON list
    "notes": "TEXT",  # JSON list
    # greedy output against the baseline's (uag.runtime.divergence): identical, diverged_near_tie, diverged; NULL
    # for baselines, sampled runs and files written before the column existed
    "divergence": "TEXT",
    # where it ran (Machine)
    "platform": "TEXT",
    "python": "TEXT",
    "uag_version": "TEXT",
    "mlx_version": "TEXT",
    "device": "TEXT",
    "backend": "TEXT",
    "blas": "TEXT",
    "target_bytes": "INTEGER",
    "target_dtype": "TEXT",
    "drafter_bytes": "INTEGER",
    "drafter_dtype": "TEXT",
}
CYCLE_COLUMNS = {  # after run_id and cycle_index, the names of Cycle's fields
    "run_id": "INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE",
    "cycle_index": "INTEGER NOT NULL",
    "k": "INTEGER NOT NULL",
    "proposed": "INTEGER NOT NULL",
    "accepted": "INTEGER NOT NULL",
    "emitted": "INTEGER NOT NULL",
    "draft_ms": "REAL",
    "translate_ms": "REAL",
    "verify_ms": "REAL",
    "resync_ms": "REAL",
    "drafter_passes": "INTEGER",
    "drafter_read": "INTEGER",
    "absorbed": "INTEGER",
    "fallback": "INTEGER",
    "empty": "INTEGER",
    "resync_absorbed": "INTEGER",
}
# Runs a sweep is computing now, so that a second sweep on the same file skips them (not part of the results:
# readers ignore it; files written before it existed get it when opened for writing).
CLAIMS = """CREATE TABLE IF NOT EXISTS claims (run_key TEXT PRIMARY KEY, owner TEXT NOT NULL, host TEXT NOT NULL,
                                     pid INTEGER NOT NULL, claimed_at TEXT NOT NULL);"""
CLAIM_TTL_S = 12 * 3600  # a claim from another host counts this long (its process cannot be checked from here)
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, {", ".join(f'"{c}" {t}' for c, t in RUN_COLUMNS.items())});
CREATE TABLE IF NOT EXISTS cycles ({", ".join(f'"{c}" {t}' for c, t in CYCLE_COLUMNS.items())},
                                   PRIMARY KEY (run_id, cycle_index));
CREATE INDEX IF NOT EXISTS runs_by_prompt ON runs (target, dataset, prompt_id);
{CLAIMS}
INSERT OR IGNORE INTO meta VALUES ('format', '{FORMAT}'), ('schema_version', '{SCHEMA_VERSION}');
"""
# Run.stats() numbers stored as they are (phase_ms is split into the four *_ms columns).
STATS = (
    "prompt_tokens",
    "generated_tokens",
    "finish_reason",
    "cycles",
    "proposed",
    "accepted",
    "acceptance_rate",
    "mean_accepted",
    "draft_fraction",
    "tokens_per_second",
    "prompt_tps",
    "prompt_ms",
    "generation_s",
    "drafter_passes",
    "stalls",
    "absorptions",
    "resync_absorptions",
    "fallbacks",
    "empty_translations",
)
# A speculative run's baseline: the target alone on the same prompt with the same decoding settings.
SAME_PROMPT = ("target", "target_dtype", "dataset", "prompt_id", "max_tokens", "temperature", "seed", "chat")


def _check_matches(run: Run, spec: RunSpec) -> None:
    asked = {name: getattr(spec, name) for name in ("target", "drafter", "k", "window")}
    asked["max_tokens"], asked["seed"] = spec.config.max_tokens, spec.config.seed
    got = {name: getattr(run, name) for name in asked}
    asked["temperature"], got["temperature"] = float(spec.config.temperature), float(run.temperature)
    asked["baseline"], got["baseline"] = spec.strategy == BASELINE, run.translation == BASELINE
    wrong = {name: (got[name], asked[name]) for name in asked if got[name] != asked[name]}
    if wrong:
        detail = ", ".join(f"{name} {g!r} (spec: {a!r})" for name, (g, a) in wrong.items())
        raise ValueError(f"the run does not match its spec: {detail}")


def _run_row(
    run: Run, spec: RunSpec, *, prompt: str, machine: Machine, sweep: str | None, divergence: str | None = None
) -> dict:
    stats = run.stats()
    row = {
        "run_key": spec.key,
        "sweep": sweep,
        "created_at": _now(),
        **spec.columns(),
        "prompt": prompt,
        "translation": run.translation,
        "policy": stats["k_policy"],
        **{name: stats[name] for name in STATS},
        **{f"{phase}_ms": ms for phase, ms in stats["phase_ms"].items()},
        "text": run.text,
        "token_ids": json.dumps(run.token_ids),
        "notes": json.dumps(run.notes, ensure_ascii=False),
        "divergence": divergence,
        **asdict(machine),
    }
    assert set(row) == set(RUN_COLUMNS), set(row) ^ set(RUN_COLUMNS)
    return row


def _connect(path: Path, *, write: bool) -> sqlite3.Connection:
    """Open a results file; InputError (with what the file is instead) if it is not one.

    Reading never creates a file; writing creates the schema in a new or empty file.
    """
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a results file")
    if not write and not path.exists():
        raise InputError(f"no results file at {path}")
    if write and not path.parent.is_dir():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InputError(f"cannot create the folder {path.parent} for {path.name}: {err.strerror or err}") from None
    uri = f"file:{quote(str(path.resolve()))}?mode={'rwc' if write else 'ro'}"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30)
    except sqlite3.OperationalError as err:
        raise InputError(f"cannot open {path}: {err}") from None
    try:
        _check_format(conn, path, write=write)
    except BaseException:
        conn.close()
        raise
    return conn


def _check_format(conn: sqlite3.Connection, path: Path, *, write: bool) -> None:
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as err:  # "file is not a database"
        raise InputError(f"{path} is not a SQLite database ({err}), so not a uag results file") from None
    if not tables:
        if not write:
            raise InputError(f"{path} is empty: it holds no runs yet (write one with python -m uag bench)")
        # IF NOT EXISTS / OR IGNORE: a concurrent creator may have done the same meanwhile.
        conn.executescript(f"BEGIN IMMEDIATE; {SCHEMA} COMMIT;")
        tables = {"meta"}
    meta = dict(conn.execute("SELECT key, value FROM meta")) if "meta" in tables else {}
    if meta.get("format") != FORMAT:
        raise InputError(
            f"{path} is a foreign database: SQLite, but not a uag results file (tables: {', '.join(sorted(tables))})"
        )
    version = int(meta.get("schema_version", 0))
    if version != SCHEMA_VERSION:
        raise InputError(f"{path} has results schema {version}; this uag reads schema {SCHEMA_VERSION}")
    if write:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(CLAIMS)
        _add_missing_columns(conn)


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    """Columns added to `runs` since a file was written (all nullable): an older file gets them when opened for
    writing, so a sweep can resume into it."""
    have = {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    for column in [c for c in RUN_COLUMNS if c not in have]:
        try:
            conn.execute(f'ALTER TABLE runs ADD COLUMN "{column}" {RUN_COLUMNS[column]}')
        except sqlite3.OperationalError:  # a concurrent writer added it meanwhile
            pass


def _insert(table: str, columns: dict) -> str:
    """Example: _insert("t", {"a": ..., "b": ...}) -> 'INSERT INTO t ("a", "b") VALUES (:a, :b)'"""
    names = ", ".join(f'"{c}"' for c in columns)
    return f"INSERT INTO {table} ({names}) VALUES ({', '.join(f':{c}' for c in columns)})"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _claim_is_live(host: str, pid: int, claimed_at: str) -> bool:
    """Whether a claim's process may still be computing its run: alive on this host, or recent elsewhere."""
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, someone else's
            return True
        return True
    age = datetime.now(timezone.utc) - datetime.fromisoformat(claimed_at)
    return age.total_seconds() < CLAIM_TTL_S


class ResultsDB:
    """A results file opened for writing (created if missing, with its folder). Use as a context manager,
    or `close()`. Several processes may write one file: `claim` a run before computing it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = _connect(self.path, write=True)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> ResultsDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release this writer's claims (runs it did not finish) and close the file (once; again is a no-op)."""
        if self._conn is None:
            return
        try:
            self._conn.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))
        finally:
            self._conn.close()
            self._conn = None

    def has(self, run_key: str) -> bool:
        return self._conn.execute("SELECT 1 FROM runs WHERE run_key = ?", (run_key,)).fetchone() is not None

    def claim(self, run_key: str) -> bool:
        """Reserve a run for this writer; False when it is stored already or another live writer holds it.

        A claim whose process died (a sweep killed with SIGKILL) is taken over, so a resumed sweep redoes it.
        """
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            if self.has(run_key):
                return False
            held = self._conn.execute(
                "SELECT owner, host, pid, claimed_at FROM claims WHERE run_key = ?", (run_key,)
            ).fetchone()
            if held is not None and held[0] != self.owner and _claim_is_live(*held[1:]):
                return False
            host, pid, _ = self.owner.split(":")
            self._conn.execute(
                "INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?)", (run_key, self.owner, host, int(pid), _now())
            )
            return True
        finally:
            self._conn.execute("COMMIT")

    def add(
        self,
        run: Run,
        *,
        spec: RunSpec,
        prompt: str,
        machine: Machine,
        sweep: str | None = None,
        divergence: str | None = None,
    ) -> int | None:
        """Store a finished run and its cycles in one transaction and release its claim; return the run's id,
        or None (writing nothing) when a run with the same key is stored already, e.g. by another sweep.
        `divergence`: how its greedy output compares with the baseline's (uag.runtime.divergence's kind).

        ValueError if the run is unfinished or does not match `spec` (a bug in the caller).
        """
        if run.finish_reason is None:
            raise ValueError("the run is not finished (no finish_reason)")
        _check_matches(run, spec)
        row = _run_row(run, spec, prompt=prompt, machine=machine, sweep=sweep, divergence=divergence)
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            self._conn.execute("DELETE FROM claims WHERE run_key = ?", (spec.key,))
            cursor = self._conn.execute(_insert("runs", RUN_COLUMNS) + " ON CONFLICT (run_key) DO NOTHING", row)
            if cursor.rowcount == 0:
                self._conn.execute("COMMIT")
                return None
            run_id = cursor.lastrowid
            cycle_fields = list(CYCLE_COLUMNS)[2:]
            self._conn.executemany(
                _insert("cycles", CYCLE_COLUMNS),
                [
                    {"run_id": run_id, "cycle_index": c.index, **{name: getattr(c, name) for name in cycle_fields}}
                    for c in run.cycles
                ],
            )
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        return run_id

    def tokens(self, run_key: str) -> tuple[list[int], str] | None:
        """A stored run's token ids and finish reason (a baseline to compare a resumed sweep's runs with)."""
        row = self._conn.execute("SELECT token_ids, finish_reason FROM runs WHERE run_key = ?", (run_key,)).fetchone()
        return None if row is None else (json.loads(row[0]), row[1])

    def runs(self) -> pd.DataFrame:
        """Every stored run, baseline and speculative, in the order written (token_ids and notes as JSON)."""
        return _as_read(pd.read_sql_query("SELECT * FROM runs ORDER BY id", self._conn))

    def cycles(self) -> pd.DataFrame:
        """Every stored cycle, by run and cycle index."""
        return pd.read_sql_query("SELECT * FROM cycles ORDER BY run_id, cycle_index", self._conn)


def _as_read(frame: pd.DataFrame) -> pd.DataFrame:
    """Runs as Run names them: the `policy` column as `k_policy`, in GenerationConfig's words ("auto", which
    files written before Run.k_policy hold, read as "adaptive").

    Example: policy ["fixed", "auto", "adaptive", None] -> k_policy ["fixed", "adaptive", "adaptive", None]
    """
    frame = frame.rename(columns={"policy": "k_policy"})
    if "k_policy" in frame:
        frame["k_policy"] = frame["k_policy"].replace({"auto": "adaptive"})
    return frame


def load_runs(path: str | Path) -> pd.DataFrame:
    """One row per speculative run, with its baseline's tokens/s joined (same target, prompt and settings).

    Adds ``alpha`` (acceptance rate, 0–1), ``tps``, ``tps_base``, ``speedup`` = tps / tps_base (NaN when the
    prompt has no baseline yet), ``baseline_id`` and ``group`` ("<drafter> · <strategy>"); keeps every
    column of ``runs``. InputError for a missing, empty, foreign or non-SQLite file, or one without
    speculative runs. Opens the file read-only.
    """
    path = Path(path)
    conn = _connect(path, write=False)
    same = " AND ".join(f"b.{c} IS s.{c}" for c in SAME_PROMPT)
    try:
        frame = pd.read_sql_query(
            f"""SELECT s.*, b.tokens_per_second AS tps_base, b.id AS baseline_id FROM runs s
                LEFT JOIN runs b ON b.strategy = '{BASELINE}' AND {same}
                WHERE s.strategy != '{BASELINE}' ORDER BY s.id""",
            conn,
        )
        baselines = conn.execute(f"SELECT count(*) FROM runs WHERE strategy = '{BASELINE}'").fetchone()[0]
    finally:
        conn.close()
    if frame.empty:
        raise InputError(f"{path} holds no speculative runs yet ({baselines} baseline runs); run a sweep first")
    if "divergence" not in frame:  # a file written before the column existed
        frame["divergence"] = None
    frame = _as_read(frame)
    frame["alpha"] = frame["acceptance_rate"].astype(float)
    frame["tps"] = frame["tokens_per_second"].astype(float)
    frame["tps_base"] = frame["tps_base"].astype(float)
    frame["speedup"] = frame["tps"] / frame["tps_base"]
    frame["group"] = [f"{short_name(d)} · {s}" for d, s in zip(frame["drafter"], frame["strategy"])]
    return frame
