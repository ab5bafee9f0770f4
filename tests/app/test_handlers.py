"""The page's handlers without a browser: a stand-in request, plain values in and out; the Plot tab's uploads."""

from __future__ import annotations

import shutil
import sqlite3

import pandas as pd
import pytest

from tests.support.app_fakes import NoWorker, request
from uag.app.compare_view import Update
from uag.app.files import load_results
from uag.app.handlers import DECODING, KEEP, Handlers, Shown, show
from uag.app.session import Session
from uag.core.config import FIELDS
from uag.core.records import Cycle
from uag.study.plots import cycle_ribbon, position_acceptance


@pytest.fixture
def handlers():
    return Handlers(Session(worker=NoWorker()))


def test_the_decoding_controls_follow_the_one_field_list():
    assert DECODING == tuple(f.name for f in FIELDS)


def test_bad_settings_become_one_error_update_and_keep_what_is_shown(handlers):
    decoding = {
        "strategy": "context",
        "k": 99,
        "window": 10,
        "max_tokens": 8,
        "temperature": 0,
        "seed": None,
        "chat": "no",
    }
    (outputs,) = handlers.run("Hej", "demo-target", "demo-drafter", decoding, [], request())
    status, warning, baseline, *_, history = outputs
    assert status.startswith("**Cannot run:**") and "k (draft length)" in status and "chat template" in status
    assert warning is KEEP and baseline is KEEP and history is KEEP


def test_remote_requests_follow_the_remote_rules(handlers):
    remote = request(headers={"X-Forwarded-For": "203.0.113.9"})
    assert handlers.load(remote) == Shown(handlers.session.access_note(handlers.session.access(None)), True)
    assert handlers.load(request()) == Shown("", False)
    (outputs,) = handlers.run("Hej", "/etc", "demo-drafter", {}, [], remote)
    assert "model folders on the server" in outputs[0]


def test_stop_without_a_run_keeps_the_status(handlers):
    assert handlers.stop(request()) is KEEP


def test_presets_fill_both_names(handlers):
    target, drafter, note = handlers.preset("Offline demo: Gemma-3-270M ← SmolLM2-135M")
    assert (target, drafter) == ("demo-target", "demo-drafter") and note
    assert handlers.preset("no such preset") == (KEEP, KEEP, "")


def test_the_app_opens_on_a_lookup_pair_with_auto_and_a_structured_example():  # issue 12
    from uag.app.ui import example_prompts
    from uag.core.config import DrafterSpec
    from uag.runtime.presets import DEFAULT, PRESETS
    from uag.study.datasets import load_bundled

    defaults = Session(worker=NoWorker()).defaults
    assert DEFAULT is PRESETS[0] and (defaults.target, defaults.drafter) == (DEFAULT.target, DEFAULT.drafter)
    assert DrafterSpec.parse(DEFAULT.drafter).lookup and DEFAULT.offline
    assert defaults.generation.strategy == "auto" and defaults.generation.k <= 8
    texts, sets = example_prompts()
    assert sets[0] == "structured" and texts[0] == load_bundled("structured")[0].text


def test_a_finished_update_adds_its_history_row():
    row = {"prompt": "p"}
    outputs = show(Update("Done", state="done", baseline_text="a", spans=[("a", "target")], row=row), [{"prompt": "o"}])
    assert outputs[2] == "a" and outputs[-1] == [{"prompt": "o"}, row] and outputs[5] is KEEP


# --- the Plot tab's uploads (finding 3) ---------------------------------------------------------------------


@pytest.fixture
def upload_dir(tmp_path):
    """Where a web server keeps an upload: a temporary folder the user must never see."""
    folder = tmp_path / "gradio" / "0f3c9a"
    folder.mkdir(parents=True)
    return folder


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not a database at all", "x.db is not a results file"),
        (b"", "x.db is not a results file"),
    ],
)
def test_an_upload_that_is_not_a_results_file_is_named_by_its_base_name(upload_dir, content, message):
    path = upload_dir / "x.db"
    path.write_bytes(content)
    frame, text = load_results(str(path))
    assert frame is None and text.startswith(message) and str(upload_dir) not in text and "/" not in text


def test_an_sqlite_file_of_another_program_says_so(upload_dir):
    path = upload_dir / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER, body TEXT)")
    frame, text = load_results(str(path))
    assert frame is None and text == (
        "Could not read other.db: other.db is a foreign database: SQLite, but not a uag results file (tables: notes)"
    )
    assert str(upload_dir) not in text and "SELECT" not in text and "Error" not in text


def test_a_results_file_with_no_speculative_runs_says_what_is_missing(upload_dir):
    from uag.study.results import ResultsDB

    path = upload_dir / "empty.db"
    ResultsDB(path).close()
    frame, text = load_results(str(path))
    assert frame is None and "empty.db" in text and "no speculative runs" in text and str(upload_dir) not in text


def test_an_upload_over_the_limit_is_refused_and_not_kept(upload_dir):
    path = upload_dir / "big.db"
    path.write_bytes(b"SQLite format 3\x00" + b"\0" * 3 * 2**20)
    frame, text = load_results(str(path), max_mb=2)
    assert frame is None and text == "big.db is 3 MB; this app takes results files of at most 2 MB."
    assert not path.exists()


# --- the cycle ribbon and per-position acceptance ------------------------------------------------------------


def test_the_ribbon_marks_lookup_cycles_where_the_engine_names_the_source():
    cycles = [Cycle(0, 2, [1, 2], [1, 2], 2, 3), Cycle(1, 2, [1, 2], [1, 2], 1, 2), Cycle.plain(2, 1.0)]
    for cycle, source in zip(cycles, ("lookup", "model", "")):
        cycle.source = source
    fig = cycle_ribbon(cycles)
    accepted = fig.data[0]
    assert list(accepted.marker.pattern.shape) == ["/", "", ""]
    assert list(accepted.hovertext) == ["cycle 1 · lookup", "cycle 2 · model", "cycle 3 · plain step"]
    assert "prompt lookup" in fig.layout.annotations[0].text
    plain = cycle_ribbon([Cycle(0, 2, [1, 2], [1, 2], 2, 3)])  # no source recorded: no pattern, no note
    assert plain.data[0].marker.pattern.shape is None and not plain.layout.annotations


def test_position_acceptance_marks_untried_positions():
    fig = position_acceptance([0.8, 0.5, None])
    bar = fig.data[0]
    assert list(bar.x) == [1, 2, 3] and list(bar.y) == [0.8, 0.5, 0.0] and list(bar.text) == ["80%", "50%", "untried"]


def test_history_table_survives_odd_prompts():
    from uag.app.handlers import table

    frame = table([{"prompt": 12345, "alpha": 0.5}])
    assert isinstance(frame, pd.DataFrame) and frame["prompt"].iloc[0] == "12345"


def test_a_damaged_model_folder_never_reaches_mlx(tmp_path):
    from tests.support.tiny_models import build_tiny
    from uag.errors import ModelError
    from uag.models.store import ModelStore

    folder = tmp_path / "copy"
    shutil.copytree(build_tiny("mistral", "mistral-v1"), folder)
    (folder / "config.json").write_text("[]")
    with pytest.raises(ModelError, match="names no model_type"):
        ModelStore().get(str(folder))
