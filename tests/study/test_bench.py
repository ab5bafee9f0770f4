"""The sweep: its plan, the checks that run before any model loads, and resuming after a SIGKILL (tiny models)."""

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from uag.core.config import GenerationConfig
from uag.study import bench
from uag.study.datasets import Prompt
from uag.study.results import ResultsDB

REPO = Path(__file__).resolve().parents[2]


def sweep(**change) -> bench.Sweep:
    settings = dict(
        target="t",
        drafters=("d1", "d2"),
        strategies=("none", "context"),
        ks=(1, 2),
        datasets=("wiki",),
        n=2,
        config=GenerationConfig(max_tokens=8, window=10),
    )
    return bench.Sweep(**{**settings, **change})


PROMPTS = [Prompt("wiki-001", "wiki", "Kraków to"), Prompt("wiki-002", "wiki", "Wisła to")]


def test_plan_runs_the_baseline_then_every_condition_per_prompt():
    jobs = bench.plan(sweep(), PROMPTS)
    assert len(jobs) == 2 * (1 + 2 * 2 * 2)
    first = [(j.prompt.id, j.spec.drafter, j.spec.strategy, j.spec.k) for j in jobs[:4]]
    assert all(j.spec.config.max_tokens == 8 and j.spec.config.window == 10 for j in jobs)
    assert first == [
        ("wiki-001", None, "baseline", 0),
        ("wiki-001", "d1", "none", 1),
        ("wiki-001", "d1", "none", 2),
        ("wiki-001", "d1", "context", 1),
    ]
    assert jobs[9].spec.strategy == "baseline" and jobs[9].prompt.id == "wiki-002"
    assert len({j.spec.key for j in jobs}) == len(jobs)
    assert [j.spec.key for j in bench.plan(sweep(), PROMPTS)] == [j.spec.key for j in jobs]  # stable: resumable


def test_a_prompt_that_asks_for_the_chat_template_gets_it_where_the_target_has_one():
    prompts = [
        Prompt("code-001", "code", "def f(x):", chat=False),
        Prompt("code-022", "code", "Write f", chat=True),
        Prompt("wiki-001", "wiki", "Kraków to"),
    ]
    with_template, without = bench.plan(sweep(), prompts), bench.plan(sweep(), prompts, chat_template=False)
    chats = lambda jobs: {j.prompt.id: j.spec.config.chat for j in jobs}  # noqa: E731
    assert chats(with_template) == {"code-001": False, "code-022": True, "wiki-001": False}
    assert chats(without) == {"code-001": False, "code-022": False, "wiki-001": False}  # recorded as it ran
    changed = {a.prompt.id for a, b in zip(with_template, without, strict=True) if a.spec.key != b.spec.key}
    assert changed == {"code-022"}
    forced = sweep(config=GenerationConfig(max_tokens=8, chat=True))  # --chat: the prompts that do not say
    assert chats(bench.plan(forced, prompts)) == {"code-001": False, "code-022": True, "wiki-001": True}


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(ks=(0,)), "k (draft length) must be a whole number from 1 to 32 (got 0)"),
        (dict(strategies=("exact",)), "unknown strategy 'exact'"),
        (dict(drafters=()), "give at least one drafter"),
        (dict(drafters=("lookup+",)), "after lookup+ name a drafter model"),
    ],
)
def test_bad_settings(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sweep(**change).validate()


def run_main(capsys, *argv) -> tuple[int, list[str]]:
    code = bench.main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--k", "1", "40"], "error: --k: k (draft length) must be a whole number from 1 to 32 (got 40)"),
        (["--datasets", "wikii"], "error: unknown dataset 'wikii'"),
        (["--datasets", "wiki", "--n", "500"], "error: dataset 'wiki' has 75 prompts; asked for 500"),
        (["--max-tokens", "0"], "error: --max-tokens: max tokens must be a whole number from 1 to 4096 (got 0)"),
        (["--temp", "inf"], "error: --temp: temperature must be a number from 0 to 2 (got inf)"),
        (["--seed", "-1"], "error: --seed: seed must be a whole number from 0 to 2147483647 (got -1)"),
        (["--window", "1000000000"], "error: --window: context window W must be a whole number from 0 to 64"),
    ],
)
def test_bad_input_is_one_error_line_before_any_model_or_file(tmp_path, capsys, extra, message):
    # The models do not exist: an error about them would mean they were looked at first.
    out = tmp_path / "r.db"
    code, err = run_main(
        capsys, "--target", tmp_path / "no-target", "--drafters", tmp_path / "no-d", "--out", out, *extra
    )
    assert code == 2
    assert len(err) == 1 and err[0].startswith(message), err
    assert not out.exists()


def test_foreign_results_file_is_refused_before_models_load(tmp_path, capsys):
    out = tmp_path / "shop.db"
    with sqlite3.connect(out) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER)")
    code, err = run_main(capsys, "--target", tmp_path / "no-target", "--drafters", "d", "--n", "1", "--out", out)
    assert code == 2 and len(err) == 1 and "foreign database" in err[0]


# --- with tiny random models ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from tests.support.tiny_models import tiny_pair

    return tiny_pair()  # (target dir, drafter dir): different tokenizers


def test_unknown_drafter_is_reported_before_the_sweep_starts(tiny, tmp_path, capsys):
    target, _ = tiny
    out = tmp_path / "r.db"
    code, err = run_main(
        capsys, "--target", target, "--drafters", tmp_path / "no-such-drafter", "--n", "1", "--out", out
    )
    assert code == 2
    assert err[-1] == f"error: no model directory at '{tmp_path / 'no-such-drafter'}'"
    assert not any(line.startswith("Traceback") for line in err)
    with ResultsDB(out) as db:
        assert db.runs().empty


def test_malformed_line_of_a_user_dataset_is_reported_and_the_rest_used(tiny, tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "Ala ma kota"}\n{"prompt": "broken\n{"id": "k", "prompt": "Kot ma Alę"}\n')
    target, drafter = tiny
    out = tmp_path / "r.db"
    code, err = run_main(
        capsys,
        "--target",
        target,
        "--drafters",
        drafter,
        "--datasets",
        prompts,
        "--strategies",
        "context",
        "auto",
        "--k",
        "2",
        "--max-tokens",
        "3",
        "--out",
        out,
    )
    assert code == 0
    assert any(line.startswith("warning:") and "skipped 1 bad line(s): line 2: invalid JSON" in line for line in err)
    with ResultsDB(out) as db:
        runs = db.runs()
    assert sorted(runs["prompt_id"]) == ["k"] * 3 + ["mine-001"] * 3  # baseline + two conditions each
    assert set(runs["dataset"]) == {"mine"}
    auto = runs[runs["strategy"] == "auto"]
    assert set(auto["translation"]) == {"context"} and set(auto["k_policy"]) == {"adaptive"} and set(auto["k"]) == {2}


def _rows(db: Path) -> list[tuple]:
    """(id, run_key, created_at, tokens/s) of every run; [] while the file or its schema does not exist."""
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return conn.execute("SELECT id, run_key, created_at, tokens_per_second FROM runs ORDER BY id").fetchall()
    except sqlite3.OperationalError:  # the sweep has not created the schema yet
        return []


def test_a_killed_sweep_resumes_without_losing_or_repeating_runs(tiny, tmp_path):
    target, drafter = tiny
    db = tmp_path / "r.db"
    argv = [
        sys.executable,
        "-m",
        "uag",
        "bench",
        "--target",
        str(target),
        "--drafters",
        str(drafter),
        "--strategies",
        "none",
        "context",
        "--k",
        "1",
        "2",
        "--datasets",
        "wiki",
        "--n",
        "3",
        "--max-tokens",
        "8",
        "--out",
        str(db),
    ]
    expected = 3 * (1 + 2 * 2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + 240
        while len(_rows(db)) < 3:
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "the sweep wrote no runs in time"
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
    before = _rows(db)
    assert 3 <= len(before) < expected  # killed midway

    second = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr
    assert f"{expected} runs in this sweep, {len(before)} already in" in second.stderr

    after = _rows(db)
    assert len(after) == expected
    assert len({key for _, key, _, _ in after}) == expected
    assert after[: len(before)] == before  # same ids, timestamps and numbers
    with sqlite3.connect(db) as conn:  # no run lost its cycles, none has cycles twice
        mismatched = conn.execute(
            "SELECT r.id FROM runs r LEFT JOIN cycles c ON c.run_id = r.id "
            "GROUP BY r.id HAVING count(c.run_id) != r.cycles"
        ).fetchall()
    assert mismatched == []


def _sweep_argv(target, drafter, db, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "uag",
        "bench",
        "--target",
        str(target),
        "--drafters",
        *drafter,
        "--strategies",
        "none",
        "context",
        "--k",
        "1",
        "2",
        "--datasets",
        "wiki",
        "--n",
        "3",
        "--max-tokens",
        "8",
        "--out",
        str(db),
        *extra,
    ]


def test_two_identical_sweeps_on_one_file_share_the_work(tiny, tmp_path):
    """Started together: both finish (exit 0), every run is stored exactly once, with its cycles, and what each
    stored adds up to the whole sweep."""
    target, drafter = tiny
    db = tmp_path / "results" / "r.db"  # the folder does not exist yet either
    argv = _sweep_argv(target, [str(drafter), "lookup"], db)
    expected = 3 * (1 + 2 * 2 * 2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    logs = [tmp_path / f"sweep{i}.log" for i in (1, 2)]
    handles = [open(log, "w") for log in logs]
    try:
        procs = [subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=h, stderr=h) for h in handles]
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for h in handles:
            h.close()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    rows = _rows(db)
    assert len(rows) == expected and len({key for _, key, _, _ in rows}) == expected
    stored = [int(re.search(r"stored (\d+) runs", text).group(1)) for text in texts]
    assert sum(stored) == expected, texts
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM claims").fetchone()[0] == 0  # nothing left reserved
        assert conn.execute("SELECT count(DISTINCT drafter) FROM runs WHERE drafter IS NOT NULL").fetchone()[0] == 2
