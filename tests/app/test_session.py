"""The app's logic without a browser: settings, model rules, the worker, compare(), history and the plot."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from uag.app.compare_view import explain, labelled_spans, mismatch, stats_of
from uag.app.history import C_FITTED, C_STUDY, HISTORY_COLUMNS, history_frame, history_row
from uag.app.session import Session
from uag.app.settings import Settings, check_prompt
from uag.core.config import MAX_TOKENS, SPECULATIVE
from uag.core.records import DRAFT, TARGET, Cycle, Run, Token
from uag.errors import InputError
from uag.runtime.access import Access, check_drafter, check_model, client_of, is_remote, names_for_remote
from uag.runtime.worker import MLXWorker

REMOTE = Access(remote=True)
REMOTE_PRESETS = Access(remote=True, remote_models="presets")
REMOTE_ANY = Access(remote=True, remote_models="any")
LOCAL = Access()


# --- settings ----------------------------------------------------------------------------------------------


def test_settings_parse_coerces_form_values():
    settings = Settings.parse(target=" demo-target ", k=3.0, window="8", max_tokens=12.0, temperature="0.5", seed=None)
    g = settings.generation
    assert (settings.target, g.k, g.window, g.max_tokens) == ("demo-target", 3, 8, 12)
    assert g.temperature == 0.5 and g.seed is None
    assert Settings.parse(seed="").generation.seed is None
    assert Settings.parse() == Settings()
    assert Settings.parse(chat="false").generation.chat is False and Settings.parse(chat=True).generation.chat


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"k": 0}, "k (draft length) must be a whole number from 1 to 32 (got 0)"),
        ({"k": 33}, "from 1 to 32 (got 33)"),
        ({"k": 2.5}, "k (draft length) must be a whole number"),
        ({"k": None}, "k (draft length) must be a whole number"),
        ({"k": True}, "k (draft length) must be a whole number"),
        ({"max_tokens": 0}, f"max tokens must be a whole number from 1 to {MAX_TOKENS} (got 0)"),
        ({"max_tokens": MAX_TOKENS + 1}, "max tokens must be"),
        ({"window": -1}, "context window W must be a whole number from 0"),
        ({"temperature": -0.1}, "temperature must be a number from 0 to 2 (got -0.1)"),
        ({"temperature": float("nan")}, "temperature must be a number from 0 to 2"),
        ({"temperature": "hot"}, "temperature must be a number from 0 to 2 (got 'hot')"),
        ({"strategy": "baseline"}, f"strategy must be one of {', '.join(SPECULATIVE)} (got 'baseline')"),
        ({"seed": -1}, "seed must be a whole number from 0"),
        ({"chat": "no"}, "chat template must be true or false (got 'no')"),  # finding 9: not bool("no")
        ({"colour": "red"}, "unknown settings: colour"),
        ({"target": 7}, "the target must be a name"),
    ],
)
def test_settings_parse_says_what_is_wrong(raw, message):
    with pytest.raises(InputError) as err:
        Settings.parse(**raw)
    assert message in str(err.value)


def test_settings_parse_lists_every_problem():
    with pytest.raises(InputError) as err:
        Settings.parse(k=99, temperature=-1, max_tokens=0, strategy="baseline")
    assert str(err.value).count(";") == 3


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "the prompt is empty"),
        (None, "the prompt is empty"),
        (" \n ", "the prompt is empty"),
        ("x" * 20_001, "at most 20000"),
        ("Ala \ud83d ma kota", "not valid text at position 5 (a lone surrogate"),  # finding 5: raw JSON surrogate
        ("a\x00b", "NUL character"),
        (42, "the prompt must be text (got a number)"),
    ],
)
def test_check_prompt(prompt, message):
    with pytest.raises(InputError, match=re.escape(message)):
        check_prompt(prompt)
    assert check_prompt("Hej ") == "Hej "  # as typed: trailing spaces change the tokens


# --- who may load what -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host, headers, share, remote",
    [
        ("127.0.0.1", {}, False, False),
        ("::1", {}, False, False),
        ("localhost", {}, False, False),
        ("192.168.1.7", {}, False, True),
        ("10.0.0.2", {}, False, True),
        ("not-an-address", {}, False, True),
        (None, {}, False, True),
        ("127.0.0.1", {}, True, True),  # a share link's users arrive through a local tunnel
        ("127.0.0.1", {"X-Forwarded-For": "203.0.113.9"}, False, True),  # behind a local proxy
    ],
)
def test_is_remote(host, headers, share, remote):
    assert is_remote(host, headers, share=share) is remote


@pytest.mark.parametrize("name", ["demo-target", "demo-drafter"])
def test_demo_models_are_open_to_everyone(name):
    for access in (LOCAL, REMOTE, REMOTE_PRESETS, REMOTE_ANY):
        assert check_model(name, "target", access=access) == name


def test_local_user_may_load_anything():
    assert check_model("org/model", "target", access=LOCAL) == "org/model"
    assert check_model("/models/mine", "drafter", access=LOCAL) == "/models/mine"


def test_remote_users_load_hub_models_only_where_the_operator_allows():  # finding 8: a 12 GB preset
    big = "speakleash/Bielik-11B-v3.0-Instruct-MLX-8bit"
    with pytest.raises(InputError, match="not available to remote users") as err:
        check_model(big, "target", access=REMOTE)
    assert "--" not in str(err.value)  # finding 10: no command-line flags in the app's words
    assert check_model(big, "target", access=REMOTE_PRESETS) == big
    with pytest.raises(InputError, match="not available to remote users"):
        check_model("org/model", "target", access=REMOTE_PRESETS)
    assert check_model("org/model", "target", access=REMOTE, loaded=["org/model"]) == "org/model"
    assert check_model("org/model", "target", access=REMOTE_ANY) == "org/model"


@pytest.mark.parametrize("path", ["/etc", "/models/mine", "./mine", "~/mine", "../mine", "a/../b", "mine", "a/b/c"])
@pytest.mark.parametrize("access", [REMOTE, REMOTE_ANY])
def test_remote_user_never_loads_a_local_path(path, access):
    with pytest.raises(InputError, match="model folders on the server can be chosen only by someone on that machine"):
        check_model(path, "drafter", access=access)


def test_remote_users_never_see_or_use_a_path_a_local_user_loaded(tmp_path):  # finding 2
    folder = str(tmp_path / "demo-drafter-1")
    loaded = ["demo-target", folder, "org/model"]
    assert names_for_remote(loaded) == ["demo-target", "org/model"]
    with pytest.raises(InputError) as err:
        check_model(folder, "drafter", access=REMOTE, loaded=loaded)
    assert "not a hub id" in str(err.value)
    with pytest.raises(InputError) as err:
        check_model("org/other", "drafter", access=REMOTE, loaded=loaded)
    assert str(tmp_path) not in str(err.value) and "org/model" in str(err.value)


def test_a_hub_shaped_name_that_is_a_local_folder_is_not_loaded_for_remote_users(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # mlx-lm would load "org/model" from here rather than from the hub
    with pytest.raises(
        InputError, match="not available to remote users"
    ):  # not "a folder": tests/app/test_ui_boundary.py
        check_model("org/model", "target", access=REMOTE_ANY)


def test_empty_model_name():
    with pytest.raises(InputError, match="choose a drafter"):
        check_model("  ", "drafter", access=LOCAL)


@pytest.mark.parametrize(
    "text, access, expected",
    [
        ("lookup", REMOTE, "lookup"),
        (" lookup+demo-drafter ", REMOTE, "lookup+demo-drafter"),
        ("demo-drafter", REMOTE, "demo-drafter"),
        ("lookup+/models/mine", LOCAL, "lookup+/models/mine"),
    ],
)
def test_drafter_kinds(text, access, expected):
    assert check_drafter(text, access=access) == expected


@pytest.mark.parametrize(
    "text, message",
    [("lookup+/etc", "not a hub id"), ("lookup+", "after lookup+ name a drafter model"), ("", "no drafter given")],
)
def test_drafter_kinds_refused(text, message):
    with pytest.raises(InputError, match=re.escape(message)):
        check_drafter(text, access=REMOTE)


def test_client_of_believes_forwarded_addresses_only_from_trusted_proxies():
    forwarded = {"X-Forwarded-For": "6.6.6.6, 203.0.113.9, 10.0.0.2"}  # the client wrote 6.6.6.6 itself
    assert client_of("127.0.0.1", forwarded) == "127.0.0.1"  # no trusted proxy: anyone could send the header
    assert client_of("198.51.100.7", forwarded, trusted_proxies=["10.0.0.0/8"]) == "198.51.100.7"
    assert client_of("10.0.0.1", forwarded, trusted_proxies=["10.0.0.0/8"]) == "203.0.113.9"
    assert client_of("::ffff:10.0.0.1", {"X-Real-IP": "203.0.113.5"}, trusted_proxies=["10.0.0.1"]) == "203.0.113.5"
    assert client_of("192.168.1.7", {}) == "192.168.1.7" and client_of(None) == "unknown"


class _NoWorker:
    """Fails the test if a job is submitted (bad input must be refused before it reaches the models)."""

    current = None
    max_batch = 1  # as a worker that runs one job at a time

    def submit(self, *args, **kwargs):
        raise AssertionError("bad input reached the worker")


@pytest.mark.parametrize(
    "prompt, settings, access, message",
    [
        ("", Settings(), LOCAL, "the prompt is empty"),
        ("   \n ", Settings(), LOCAL, "the prompt is empty"),
        ("x" * 20_001, Settings(), LOCAL, "at most 20000"),
        ("Hej", Settings(target="org/unknown"), REMOTE, "not available to remote users"),
        ("Hej", Settings(drafter="/tmp/model"), REMOTE_ANY, "not a hub id"),
        ("Hej", Settings(target=""), LOCAL, "choose a target"),
    ],
)
def test_compare_refuses_bad_input_with_one_clear_update(prompt, settings, access, message):
    session = Session(worker=_NoWorker())
    (update,) = session.compare(prompt, settings, access=access)
    assert update.state == "error" and message in update.status and update.status.startswith("**Cannot run:**")
    assert update.baseline_text is None and update.spans is None  # what was shown stays


def test_a_model_that_cannot_load_is_reported(tmp_path):
    session = Session(worker=MLXWorker(name="test-worker"))
    updates = list(session.compare("Hej", Settings(target=str(tmp_path / "missing")), access=LOCAL))
    assert updates[-1].state == "error" and "no model directory at" in updates[-1].status
    session.worker.close(timeout=5)


def test_a_damaged_model_folder_is_the_users_to_fix(tmp_path):
    from tests.support.tiny_models import build_tiny

    folder = tmp_path / "corrupt-config"
    shutil.copytree(build_tiny("llama", "llama-3.2"), folder)
    (folder / "config.json").write_text("{oops")
    session = Session(worker=MLXWorker(name="test-worker"))
    final = list(session.compare("Hej", Settings(target=str(folder), drafter="lookup"), access=LOCAL))[-1]
    session.worker.close(timeout=5)
    assert final.state == "error" and final.status.startswith("**Cannot run:**")
    assert "config.json is not valid JSON" in final.status


def test_a_broken_hub_model_is_the_users_message_not_an_internal_error(tmp_path):
    """mlx-lm's KeyError('model_type') for a hub model without an architecture: the app loads through
    uag.models.loading, so the user reads what to fix, not "Internal error"."""
    from tests.support.broken_models import BROKEN_HUB_ID, broken_hub_cache

    script = (
        "import json\n"
        "from uag.app.session import Session\n"
        "from uag.app.settings import Settings\n"
        "session = Session()\n"
        f"settings = Settings(target={BROKEN_HUB_ID!r}, drafter='lookup')\n"
        "final = list(session.compare('Hej', settings))[-1]\n"
        "print(json.dumps({'state': final.state, 'status': final.status}))\n"
        "session.worker.close(timeout=5)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=broken_hub_cache(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    final = json.loads(done.stdout.strip().splitlines()[-1])
    assert final["state"] == "error" and final["status"].startswith("**Cannot run:**"), final
    assert f"cannot load the target {BROKEN_HUB_ID!r}" in final["status"] and "model_type" in final["status"]


def test_a_prompt_beyond_the_drafters_context_is_refused_before_the_target_runs():
    """The same check as the command line's and the sweeps' (uag.core.drafters.check_drafter_fits)."""
    from tests.support.tiny_models import build_tiny

    target = str(build_tiny("llama", "llama-3.2"))
    drafter = str(build_tiny("llama", "llama-3.2", seed=3, max_position_embeddings=16))
    session = Session(worker=MLXWorker(name="test-worker"))
    settings = Settings.parse(target=target, drafter=drafter, strategy="context", max_tokens=4)
    updates = list(session.compare("Ala ma kota, a kot ma Alę. " * 4, settings, access=LOCAL))
    session.worker.close(timeout=5)
    assert updates[-1].state == "error" and updates[-1].status.startswith("**Cannot run:**")
    assert "whose context is 16 tokens: shorten the prompt" in updates[-1].status
    assert not any(u.baseline_text for u in updates)  # refused before the target alone ran


def test_an_internal_error_is_logged_with_its_traceback_and_shown_as_such(caplog):
    session = Session(worker=MLXWorker(name="test-worker"))

    def broken(job, *args):
        yield from ()
        raise KeyError("a bug")

    session._compare_job = broken
    updates = list(session.compare("Hej", Settings(), access=LOCAL))
    final = updates[-1]
    assert final.state == "error" and final.status.startswith("**Internal error**") and "KeyError" not in final.status
    assert any(record.exc_info and record.exc_info[0] is KeyError for record in caplog.records)
    session.worker.close(timeout=5)


def test_access_follows_the_share_flag():
    assert Session(worker=_NoWorker()).access("127.0.0.1") == Access(remote=False)
    shared = Session(worker=_NoWorker(), share=True, remote_models="any")
    assert shared.access("127.0.0.1") == Access(remote=True, remote_models="any")
    assert "no local folders" in shared.access_note(shared.access("127.0.0.1"))


# --- the worker ---------------------------------------------------------------------------------------------


@pytest.fixture
def worker():
    w = MLXWorker(name="test-worker")
    yield w
    w.close(timeout=5)


def test_worker_runs_jobs_one_at_a_time_in_order(worker):
    log, active, overlaps = [], [0], []

    def job_fn(job, name):
        active[0] += 1
        overlaps.append(active[0])
        for i in range(3):
            time.sleep(0.01)
            log.append(name)
            yield f"{name}{i}", threading.current_thread().name
        active[0] -= 1

    jobs = [worker.submit(job_fn, name) for name in "abc"]
    results = [list(job) for job in reversed(jobs)]  # read in any order: they still ran in turn
    assert log == list("aaabbbccc") and max(overlaps) == 1
    assert [item for item, _ in results[-1]] == ["a0", "a1", "a2"]
    assert {thread for result in results for _, thread in result} == {"test-worker"}


def test_worker_passes_exceptions_to_the_consumer(worker):
    def failing(job):
        yield 1
        raise ValueError("bad model")

    job = worker.submit(failing)
    items = []
    with pytest.raises(ValueError, match="bad model"):
        for item in job:
            items.append(item)
    assert items == [1]
    with pytest.raises(TypeError, match="generator function"):
        list(worker.submit(lambda job: [2]))
    assert worker.call(lambda: threading.current_thread().name) == "test-worker"  # the worker keeps serving


def test_cancel_stops_a_running_job_at_its_next_check(worker):
    def forever(job):
        i = 0
        while not job.cancelled.is_set():
            yield i
            i += 1
            time.sleep(0.005)

    job = worker.submit(forever)
    for item in job:
        if item == 3:
            job.cancel()
    assert job.done.is_set()


def test_a_consumer_that_leaves_cancels_the_job(worker):
    gate = threading.Event()

    def slow(job):
        yield "first"
        gate.wait(5)
        yield "never read"
        while not job.cancelled.is_set():
            time.sleep(0.005)

    job = worker.submit(slow)
    for _ in job:
        break  # the iterator is closed here, as Gradio closes a handler's generator
    assert job.cancelled.is_set()
    gate.set()
    assert job.wait(5)


def test_a_cancelled_queued_job_never_runs(worker):
    release, ran = threading.Event(), []

    def blocker(job):
        release.wait(5)
        yield "done"

    def other(job):
        ran.append(True)
        yield "ran"

    first, second = worker.submit(blocker), worker.submit(other)
    second.cancel()
    release.set()
    assert list(first) == ["done"] and list(second) == [] and not ran


def test_emit_hands_items_back_from_callbacks(worker):
    def loading(job):
        for step in ("read", "convert"):
            (lambda msg: job.emit(f"progress: {msg}"))(step)
        yield "loaded"

    assert list(worker.submit(loading)) == ["progress: read", "progress: convert", "loaded"]


# --- pure builders: spans, mismatch, explanation, history, plot ---------------------------------------------


def fake_run(
    ids, *, drafted=(), strategy="context", temperature=0.0, finish="length", seconds=1.0, cycles=None, k=2
) -> Run:
    """A finished run of `ids` (text "<id>" each) spread evenly over `seconds` after the first token."""
    tokens = [Token(i, f"<{i}>", n in drafted) for n, i in enumerate(ids)]
    run = Run(strategy, "t", None if strategy == "baseline" else "d", k=k, temperature=temperature)
    run.tokens, run.finish_reason = tokens, finish
    run.first_token_s, run.last_token_s = 100.0, 100.0 + seconds
    run.cycles = cycles or []
    return run


def test_labelled_spans_name_both_origins():
    tokens = [Token(1, "Ala", True), Token(2, " ma", True), Token(3, " kota", False), Token(4, "", False)]
    assert labelled_spans(tokens) == [("Ala ma", DRAFT), (" kota", TARGET)]


def test_no_mismatch_when_greedy_outputs_agree():
    assert mismatch(fake_run([1, 2, 3], strategy="baseline"), fake_run([1, 2, 3], drafted={1})) == ""


def test_greedy_mismatch_is_loud_and_points_at_the_token():
    warning = mismatch(fake_run([1, 2, 3, 4], strategy="baseline"), fake_run([1, 2, 9, 4]))
    assert "this is a bug" in warning and "token 3" in warning
    assert "'<3>' (id 3)" in warning and "'<9>' (id 9)" in warning
    shorter = mismatch(fake_run([1, 2], strategy="baseline"), fake_run([1, 2, 5], finish="eos"))
    assert "the end of the output" in shorter and "2 vs 3 tokens" in shorter


@pytest.mark.parametrize(
    "baseline, speculative",
    [
        (fake_run([1, 2], strategy="baseline", temperature=0.7), fake_run([1, 5], temperature=0.7)),  # samples
        (fake_run([1, 2], strategy="baseline"), fake_run([1], finish="stopped")),  # stopped by the user
    ],
)
def test_no_mismatch_warning_where_outputs_may_differ(baseline, speculative):
    assert mismatch(baseline, speculative) == ""


def _cycles(n, *, proposed=2, accepted=1, emitted=2, ms=(100.0, 10.0, 200.0, 10.0)):
    draft, translate, verify, resync = ms
    return [Cycle(i, 2, [0] * 2, [0] * proposed, accepted, emitted, draft, translate, verify, resync) for i in range(n)]


def test_explain_says_why_in_measured_terms():
    # Target alone: 10 tokens after the first in 1 s = 100 ms/token. Speculative: 5 cycles of 400 ms
    # committing 2 tokens each = 0.5× — a cycle had to commit 4.
    baseline = fake_run(list(range(11)), strategy="baseline", seconds=1.0)
    speculative = fake_run(list(range(11)), seconds=2.0, cycles=_cycles(5))
    text = explain(baseline, speculative, r=0.07)
    assert "did not pay: 0.50×" in text
    assert "A cycle took 400 ms and committed 2.00 tokens" in text and "commit 4.00 to break even" in text
    assert "Most of a cycle went to verify (62%)" in text
    assert "α* = 44% for k = 2; this run's α was 50%" in text
    fast = fake_run(list(range(11)), seconds=0.5, cycles=_cycles(5))
    assert "paid off: 2.00×" in explain(baseline, fast)
    assert 'class="speedup win"' in explain(baseline, fast) and 'class="speedup loss"' in text


def test_explain_calls_an_alpha_star_above_one_unreachable_and_counts_lookup_cycles():
    baseline = fake_run(list(range(11)), strategy="baseline", seconds=1.0)
    speculative = fake_run(list(range(11)), seconds=2.0, cycles=_cycles(5))
    assert "unreachable for k = 2" in explain(baseline, speculative, r=0.9)  # α* = 0.9/1 + 0.185·2 > 1
    for cycle in speculative.cycles:
        cycle.source = "lookup"
    text = explain(baseline, speculative, r=0.9)
    assert "α*" not in text and "Prompt lookup drafted 5 of 5 cycles" in text  # no drafter model: r does not apply


def test_explain_says_how_long_auto_parked_and_how_often_it_rehearsed():
    baseline = fake_run(list(range(11)), strategy="baseline", seconds=1.0)
    parked = [Cycle.plain(i, 100.0) for i in range(6)]
    parked[-1].draft_ms, parked[-1].drafter_passes, parked[-1].drafter_read = 12.0, 1, 40
    speculative = fake_run(list(range(11)), seconds=1.0, cycles=_cycles(2) + parked)
    speculative.k_policy = "adaptive"
    text = explain(baseline, speculative)
    assert "auto parked for 6 target steps and rehearsed 1× (12 ms)" in text
    assert speculative.stats()["rehearsals"] == 1
    speculative.k_policy = "fixed"
    assert "parked" not in explain(baseline, speculative)


def test_stats_have_the_numbers_users_ask_for():
    settings = Settings()
    baseline = fake_run(list(range(11)), strategy="baseline", seconds=1.0)
    speculative = fake_run(list(range(11)), drafted={1, 3}, seconds=2.0, cycles=_cycles(5))
    stats = stats_of(settings, baseline, speculative, r=0.5)
    assert stats["tokens_per_second"] == {"baseline": 10.0, "speculative": 5.0}
    assert stats["speedup"] == 0.5 and stats["acceptance_rate"] == 0.5 and stats["mean_accepted"] == 1.0
    assert stats["cycles"] == 5 and stats["identical"] is True
    assert stats["time_split_ms"] == {"draft": 500.0, "translate": 50.0, "verify": 1000.0, "resync": 50.0}
    assert stats["baseline"]["generated_tokens"] == 11 and stats["speculative"]["cycles"] == 5
    sampled = stats_of(Settings.parse(temperature=0.8), baseline, speculative)
    assert any("separate samples" in note for note in sampled["notes"])


def _row(alpha, speedup, k=2, prompt="p", drafter="demo-drafter", r=0.5):
    settings = Settings.parse(drafter=drafter, k=k, strategy="context")  # the fake cycles have a fixed k
    baseline = fake_run(list(range(11)), strategy="baseline", seconds=1.0)
    proposed = 10
    accepted = round(alpha * proposed)
    speculative = fake_run(
        list(range(11)),
        seconds=1.0 / speedup,
        cycles=[Cycle(0, k, [], [0] * proposed, accepted, 10)],
    )
    return history_row(prompt, settings, baseline, speculative, r=r)


def test_history_rows_and_table():
    row = _row(0.6, 1.25)
    assert set(row) == set(HISTORY_COLUMNS)
    assert row["alpha"] == 0.6 and row["speedup"] == pytest.approx(1.25) and row["group"] == "demo-drafter · context"
    frame = history_frame([row, _row(0.2, 0.8)])
    assert list(frame.columns) == list(HISTORY_COLUMNS) and len(frame) == 2
    assert list(history_frame([]).columns) == list(HISTORY_COLUMNS)


def test_plot_fits_c_once_there_are_enough_runs():
    session = Session(worker=_NoWorker())
    rows = [_row(0.2, 0.7, k=2), _row(0.5, 0.9, k=2), _row(0.8, 1.1, k=4)]
    few = session.plot(rows[:2], ks=[2, 4], c_choice=C_FITTED)
    assert few.c == 0.185 and "fitting needs 3 runs" in few.caption and few.r == 0.5
    fitted = session.plot(rows, ks=[2, 4], c_choice=C_FITTED)
    assert fitted.c != 0.185 and "fitted to 3 runs" in fitted.caption
    study = session.plot(rows, ks=[2], c_choice=C_STUDY)
    assert study.c == 0.185
    names = [trace.name for trace in fitted.figure.data]
    assert "demo-drafter · context" in names and any("S(α, k=4)" in str(n) for n in names)


def test_plot_without_runs_uses_the_study_r():
    view = Session(worker=_NoWorker()).plot([], ks=[2])
    assert view.r == 0.07 and "no run here yet" in view.caption


def test_plot_adds_a_results_file(tmp_path):
    from tests.support.synthetic_runs import add_prompt
    from uag.study.results import ResultsDB

    with ResultsDB(tmp_path / "sweep.db") as db:
        add_prompt(db, "wiki-001", tps_base=10.0, runs={("org/d-1B", "context", 2): (8, 10, 12.0)})
        add_prompt(db, "wiki-002", tps_base=10.0, runs={("org/d-1B", "context", 2): (3, 10, 8.0)})
    session = Session(worker=_NoWorker())
    frame, message = session.load_results(tmp_path / "sweep.db")
    assert message == "Loaded 2 speculative runs from sweep.db." and len(frame) == 2
    view = session.plot([], frame, ks=[2])
    assert "d-1B · context (file)" in [trace.name for trace in view.figure.data]
    assert view.r == pytest.approx(0.07) and "results file's" in view.caption


def test_load_results_reports_bad_files(tmp_path):
    session = Session(worker=_NoWorker())
    assert session.load_results(None) == (None, "")
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    frame, message = session.load_results(junk)
    assert frame is None and message.startswith("junk.db is not a results file") and str(tmp_path) not in message


def test_exports(tmp_path):
    session = Session(worker=_NoWorker(), export_dir=tmp_path)
    rows = [_row(0.4, 0.9), _row(0.7, 1.2)]
    csv = session.export_history(rows)
    assert pd.read_csv(csv)["speedup"].round(2).tolist() == [0.9, 1.2]
    paths, message = session.export_figure(session.plot(rows).figure)
    assert paths[0].suffix == ".html" and "plotly" in Path(paths[0]).read_text()[:100_000].lower()
    assert ("kaleido" in message) == (len(paths) == 1)


# --- on the demo pair ---------------------------------------------------------------------------------------

PROMPT = "Stolica Polski to"


@pytest.mark.slow
def test_compare_streams_target_alone_then_speculative(app_session):
    updates = list(app_session.compare(PROMPT, Settings.parse(max_tokens=6)))
    final = updates[-1]
    assert final.state == "done", final.status
    # The target alone streams and finishes before the speculative run shows anything.
    first_speculative = next(i for i, u in enumerate(updates) if u.spans)
    assert any(u.baseline_text and u.baseline is None for u in updates[:first_speculative])
    rendered = [u for u in updates[first_speculative:] if u.spans is not None]  # the rest only refresh the status
    assert rendered and all(u.baseline is not None for u in rendered)
    # Greedy: the same token ids, the same text; the spans carry both origins.
    assert final.baseline.token_ids == final.speculative.token_ids
    assert final.baseline_text == final.speculative_text and final.warning == ""
    assert {label for _, label in final.spans} <= {DRAFT, TARGET}
    assert final.stats["identical"] is True and final.stats["speedup"] > 0
    assert set(final.row) == set(HISTORY_COLUMNS) and final.row["prompt"] == PROMPT
    assert 0 < final.row["r"] < 1 and final.ribbon is not None


@pytest.mark.slow
def test_stop_ends_a_comparison_within_a_cycle_and_the_app_keeps_serving(app_session):
    updates = app_session.compare(PROMPT, Settings.parse(max_tokens=512), owner="tab-1")
    for update in updates:
        if update.baseline_text:  # the target alone has produced its first tokens
            shown = len(update.baseline_text)
            assert app_session.stop("tab-1")
            break
    final = list(updates)[-1]
    assert final.state == "stopped" and final.row is None and final.speculative is None
    assert final.baseline.finish_reason == "stopped"
    assert shown <= len(final.baseline_text) and final.baseline.generated < 50  # of up to 512
    assert not app_session.stop("tab-1")  # nothing left running for that tab
    again = list(app_session.compare(PROMPT, Settings.parse(max_tokens=3)))[-1]
    assert again.state == "done"


@pytest.mark.slow
def test_worker_cancel_takes_effect_before_the_next_cycle(app_session):
    from uag.core.engine import stream

    target, drafter = app_session.store.get("demo-target"), app_session.store.get("demo-drafter")
    config = Settings.parse(max_tokens=100).config()

    def job_fn(job):
        run = None
        for event in stream(target, drafter, PROMPT, config, cancel=job.cancelled):
            run = event.run
            if len(run.cycles) == 3:
                job.cancel()  # as if Stop arrived during the third cycle
        yield run

    (run,) = app_session.worker.submit(job_fn)
    assert run.finish_reason == "stopped" and len(run.cycles) == 3


@pytest.mark.slow
def test_the_time_budget_stops_a_long_comparison_and_says_why(store):  # finding 1: a per-request budget
    session = Session(store=store, worker=MLXWorker(name="test-budget"), budget_s=1.0)
    final = list(session.compare(PROMPT, Settings.parse(max_tokens=4000)))[-1]
    assert final.state == "stopped" and "gives each request 1 s of generation" in final.status
    assert final.row is None and final.baseline.finish_reason == "stopped" and final.baseline.generated < 4000
    session.worker.close(timeout=30)


def test_a_shared_app_tells_its_users_apart_by_the_tunnels_forwarded_address_and_only_then():
    forwarded = {"X-Forwarded-For": "203.0.113.9"}
    worker = MLXWorker()
    shared, local = Session(worker=worker, share=True), Session(worker=worker)
    assert shared.client("127.0.0.1", forwarded) == "203.0.113.9"  # the share tunnel connects from this machine
    assert local.client("127.0.0.1", forwarded) == "127.0.0.1"  # a header anyone could write
    assert shared.client("198.51.100.7", forwarded) == "198.51.100.7"
