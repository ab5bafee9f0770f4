"""The results file: what a run stores, one transaction per run, run keys, the baseline join, bad files."""

import hashlib
import json
import sqlite3
import subprocess
import sys
from dataclasses import fields, replace

import pytest

from tests.support.synthetic_runs import BASELINE_MACHINE, MACHINE, TARGET, add_prompt, make_run, spec
from uag.core.config import GenerationConfig, short_name
from uag.study.results import ResultsDB, load_runs
from uag.study.runspec import RunSpec


@pytest.fixture
def db(tmp_path):
    with ResultsDB(tmp_path / "results.db") as db:
        yield db


def test_run_and_cycles_round_trip(db):
    s = spec("wiki-001", "org/drafter-1B", "context", 2)
    run = make_run(s, tps=12.5, accepted=6, proposed=10)
    run_id = db.add(run, spec=s, prompt="Kraków to", machine=MACHINE, sweep="first")

    row = db.runs().set_index("id").loc[run_id]
    stats = run.stats()
    for name in ("generated_tokens", "proposed", "accepted", "cycles", "finish_reason", "drafter_passes", "k_policy"):
        assert row[name] == stats[name], name
    for name in ("acceptance_rate", "tokens_per_second", "draft_fraction", "prompt_tps", "generation_s"):
        assert row[name] == pytest.approx(stats[name], rel=1e-12), name
    assert row["verify_ms"] == stats["phase_ms"]["verify"]
    assert (row["strategy"], row["translation"], row["drafter"], row["k"]) == ("context", "context", s.drafter, 2)
    assert (row["run_key"], row["sweep"], row["prompt"], row["text"]) == (s.key, "first", "Kraków to", run.text)
    assert json.loads(row["token_ids"]) == run.token_ids
    assert (row["target_bytes"], row["drafter_bytes"], row["blas"]) == (10**10, 7 * 10**8, "reference")

    cycles = db.cycles()
    assert cycles[["run_id", "cycle_index", "k", "proposed", "accepted", "emitted"]].values.tolist() == [
        [run_id, 0, 2, 10, 6, 32]
    ]
    assert db.has(s.key) and not db.has(spec("wiki-002", "org/drafter-1B", "context", 2).key)


def test_file_is_in_wal_mode(db):
    mode = sqlite3.connect(db.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_a_run_and_its_cycles_are_one_transaction(db):
    s = spec("wiki-001", "d", "context", 2)
    run = make_run(s, tps=10.0, accepted=1, proposed=2)
    run.cycles.append(replace(run.cycles[0]))  # a second cycle 0: its row breaks the cycles' primary key
    with pytest.raises(sqlite3.IntegrityError):
        db.add(run, spec=s, prompt="p", machine=MACHINE)
    assert db.runs().empty and db.cycles().empty
    assert not db.has(s.key)


def test_a_run_is_stored_once(db):
    s = spec("wiki-001")
    assert db.add(make_run(s, tps=10.0), spec=s, prompt="p", machine=BASELINE_MACHINE) is not None
    # A second copy (another sweep finished it first) writes nothing and says so.
    assert db.add(make_run(s, tps=11.0), spec=s, prompt="p", machine=BASELINE_MACHINE) is None
    assert db.runs()["tokens_per_second"].tolist() == [pytest.approx(10.0)] and len(db.cycles()) == 0


def test_a_claimed_run_is_skipped_by_another_writer_until_released(tmp_path):
    s = spec("wiki-001", "d", "context", 2)
    with ResultsDB(tmp_path / "r.db") as first, ResultsDB(tmp_path / "r.db") as second:
        assert first.claim(s.key) and first.claim(s.key)  # a writer may re-claim its own run
        assert not second.claim(s.key)  # the first is computing it
        first.add(make_run(s, tps=10.0, accepted=1, proposed=2), spec=s, prompt="p", machine=MACHINE)
        assert not second.claim(s.key)  # stored now
        other = spec("wiki-002", "d", "context", 2)
        assert first.claim(other.key)
        first.close()  # a sweep that stops releases what it did not finish
        assert second.claim(other.key)


def test_the_claim_of_a_killed_sweep_is_taken_over(tmp_path):
    s = spec("wiki-001")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with ResultsDB(tmp_path / "r.db") as db:
        host = db.owner.split(":")[0]
        db._conn.execute(
            "INSERT INTO claims VALUES (?, ?, ?, ?, ?)",
            (s.key, f"{host}:{dead.stdout.strip()}:x", host, int(dead.stdout), "2026-01-01T00:00:00+00:00"),
        )
        assert db.claim(s.key)


def test_a_run_must_match_its_spec(db):
    s = spec("wiki-001", "d", "context", 2)
    with pytest.raises(ValueError, match=r"k 4 \(spec: 2\)"):
        db.add(make_run(replace(s, config=s.config.replace(k=4)), tps=1.0), spec=s, prompt="p", machine=MACHINE)
    baseline = replace(s, drafter=None, config=s.config.replace(strategy="baseline"))
    with pytest.raises(ValueError, match="baseline"):
        db.add(make_run(s, tps=1.0), spec=baseline, prompt="p", machine=MACHINE)


BASE = RunSpec("t", "d", GenerationConfig("context", 2, window=16, max_tokens=32), "wiki", "wiki-001")
SPEC_CHANGES = [
    dict(target="t2"),
    dict(drafter="d2"),
    dict(drafter="lookup+d"),
    dict(dataset="alpaca"),
    dict(prompt_id="wiki-002"),
    dict(target_dtype="q8"),
    dict(drafter_dtype="q4"),
]
CONFIG_CHANGES = [
    dict(translation="naive"),
    dict(k_policy="adaptive"),
    dict(k=4),
    dict(window=8),
    dict(max_tokens=64),
    dict(temperature=0.7),
    dict(seed=1),
    dict(chat=True),
    dict(top_p=0.9),
    dict(top_k=40),
    dict(min_p=0.1),
    dict(repetition_penalty=1.2),
    dict(presence_penalty=0.5),
    dict(frequency_penalty=0.5),
    dict(constraint='{"kind":"json_object"}'),
]


@pytest.mark.parametrize("change", SPEC_CHANGES + CONFIG_CHANGES)
def test_every_field_is_part_of_the_run_key(change):
    changed = replace(BASE, **change) if set(change) <= {f.name for f in fields(RunSpec)} else None
    changed = changed or replace(BASE, config=BASE.config.replace(**change))
    assert changed.key != BASE.key


def test_every_field_is_tested():
    assert {name for change in SPEC_CHANGES for name in change} | {"config"} == {f.name for f in fields(RunSpec)}
    assert {name for change in CONFIG_CHANGES for name in change} == {f.name for f in fields(GenerationConfig)}


def test_run_key_normalises_numbers():
    assert replace(BASE, config=BASE.config.replace(temperature=0, k=2.0)).key == BASE.key


def test_run_keys_are_those_of_files_written_before_specs_held_a_config():
    """Old results files resume: the key hashes the same eleven columns as before, baselines with k = window = 0."""

    def old_key(**fields):
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]

    common = dict(
        target="t", max_tokens=32, temperature=0.0, seed=None, chat=False, dataset="wiki", prompt_id="wiki-001"
    )
    assert BASE.key == old_key(**common, drafter="d", strategy="context", k=2, window=16)
    auto = replace(BASE, config=BASE.config.replace(k_policy="adaptive"))  # stored as strategy "auto", as before
    assert auto.columns()["strategy"] == "auto"
    assert auto.key == old_key(**common, drafter="d", strategy="auto", k=2, window=16)
    baseline = RunSpec.baseline(target="t", max_tokens=32, dataset="wiki", prompt_id="wiki-001")
    assert baseline.key == old_key(**common, drafter=None, strategy="baseline", k=0, window=0)


def test_a_file_written_before_run_k_policy_reads_its_auto_as_adaptive(tmp_path):
    """The column keeps its name `policy`; files written before Run.k_policy hold "auto" there, read as "adaptive"."""
    path = tmp_path / "old.db"
    auto = spec("wiki-001", "d", "auto", 2)
    with ResultsDB(path) as db:
        add_prompt(db, "wiki-001", tps_base=10.0, runs={("d", "context", 2): (1, 2, 9.0)})
        db.add(make_run(auto, tps=9.0), spec=auto, prompt="p", machine=MACHINE)
    with sqlite3.connect(path) as conn:
        assert {row[0] for row in conn.execute("SELECT policy FROM runs")} == {"fixed", "adaptive"}
        conn.execute("UPDATE runs SET policy = 'auto' WHERE strategy = 'auto'")  # as the old records wrote it
    frame = load_runs(path)
    assert "policy" not in frame and dict(zip(frame["strategy"], frame["k_policy"])) == {
        "context": "fixed",
        "auto": "adaptive",
    }
    with ResultsDB(path) as db:
        assert sorted(db.runs()["k_policy"]) == ["adaptive", "fixed", "fixed"]


def test_a_file_written_before_claims_existed_opens_and_loads(tmp_path):
    path = tmp_path / "old.db"
    with ResultsDB(path) as db:
        add_prompt(db, "wiki-001", tps_base=10.0, runs={("d", "context", 2): (1, 2, 9.0)})
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE claims")
    assert len(load_runs(path)) == 1
    with ResultsDB(path) as db:
        assert db.claim(spec("wiki-002").key)


def test_a_missing_folder_for_a_new_results_file_is_created(tmp_path):
    with ResultsDB(tmp_path / "results" / "deeper" / "r.db") as db:
        assert db.runs().empty


def test_load_runs_joins_each_run_to_its_baseline(tmp_path):
    with ResultsDB(tmp_path / "r.db") as db:
        add_prompt(db, "wiki-001", tps_base=10.0, runs={("org/d-1B", "context", 2): (8, 10, 12.0)})
        add_prompt(db, "wiki-002", tps_base=20.0, runs={("org/d-1B", "naive", 2): (1, 10, 10.0)})
        add_prompt(db, "wiki-003", tps_base=None, runs={("org/d-1B", "none", 2): (0, 10, 9.0)})
    frame = load_runs(tmp_path / "r.db").set_index("prompt_id")
    assert len(frame) == 3
    assert frame.loc["wiki-001", ["alpha", "tps", "tps_base", "speedup"]].tolist() == pytest.approx(
        [0.8, 12.0, 10.0, 1.2]
    )
    assert frame.loc["wiki-002", "speedup"] == pytest.approx(0.5)
    assert frame.loc["wiki-003", ["tps_base", "speedup"]].isna().all()  # no baseline yet
    assert frame.loc["wiki-001", "group"] == "d-1B · context"
    assert set(frame["target"]) == {TARGET}


def test_baselines_join_on_the_decoding_settings(tmp_path):
    """A baseline at another max_tokens or seed is not the baseline of a run."""
    with ResultsDB(tmp_path / "r.db") as db:
        add_prompt(db, "wiki-001", tps_base=None, runs={("d", "context", 2): (5, 10, 12.0)})
        other = replace(spec("wiki-001"), config=spec("wiki-001").config.replace(max_tokens=64))
        run = make_run(other, tps=99.0)
        db.add(run, spec=other, prompt="p", machine=BASELINE_MACHINE)
    assert load_runs(tmp_path / "r.db")["tps_base"].isna().all()


@pytest.mark.parametrize(
    "name, expected",
    [
        ("mlx-community/Qwen2.5-1.5B-Instruct-4bit", "Qwen2.5-1.5B-Instruct-4bit"),
        ("/m/drafter/", "drafter"),
        ("demo-drafter", "demo-drafter"),
        ("lookup", "lookup"),
        ("lookup+org/d-1B", "lookup+d-1B"),
    ],
)
def test_short_name(name, expected):
    assert short_name(name) == expected


# --- files that are not results ------------------------------------------------------------------------------
def test_missing_file_is_reported_and_not_created(tmp_path):
    with pytest.raises(ValueError, match="no results file at"):
        load_runs(tmp_path / "nothing.db")
    assert not (tmp_path / "nothing.db").exists()


def test_empty_file(tmp_path):
    (tmp_path / "empty.db").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_runs(tmp_path / "empty.db")


def test_results_file_without_speculative_runs(tmp_path):
    with ResultsDB(tmp_path / "r.db") as db:
        add_prompt(db, "wiki-001", tps_base=10.0, runs={})
    with pytest.raises(ValueError, match=r"no speculative runs yet \(1 baseline"):
        load_runs(tmp_path / "r.db")


def test_foreign_sqlite_database(tmp_path):
    path = tmp_path / "shop.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)")
    for open_it in (load_runs, ResultsDB):
        with pytest.raises(ValueError, match=r"foreign database.*tables: orders"):
            open_it(path)


def test_not_a_sqlite_file(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("this is not a database\n" * 100)
    for open_it in (load_runs, ResultsDB):
        with pytest.raises(ValueError, match="not a SQLite database"):
            open_it(path)
    assert path.read_text().startswith("this is not")  # left as it was


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "r.db"
    ResultsDB(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(ValueError, match="schema 99"):
        ResultsDB(path)


def test_the_baseline_of_a_penalised_run_carries_its_samplers():
    spec = replace(BASE, config=BASE.config.replace(repetition_penalty=1.3, top_k=5))
    assert spec.baseline_spec().config.repetition_penalty == 1.3 and spec.baseline_spec().config.top_k == 5
    assert BASE.baseline_spec().sampling() == {}
