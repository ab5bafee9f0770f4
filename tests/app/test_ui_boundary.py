"""One trust boundary for `uag serve`'s app at /ui (issue 35, item 4), without a model.

On the server the app loads what the API serves, for every user, local or remote (`ServedModels`): a name
outside it is refused with the words that name what is served, before the disk is looked at, so the answer is
the same whether a path exists or not. The standalone app keeps its rules (the local user loads anything), and
its remote users get one answer for a folder that exists and one that does not. The running server's /ui is
probed over HTTP: /compare and the Plot tab's results file answer alike for a path that exists and one that does
not, and never read the file.
"""

from __future__ import annotations

import contextlib
import json
import os
from types import SimpleNamespace

import pytest

from tests.support.app_fakes import NoWorker, request
from uag.app.handlers import KEEP, Handlers, Shown
from uag.app.session import Session
from uag.app.settings import Settings
from uag.errors import InputError
from uag.runtime.access import LOCAL, Access, ServedModels, check_model

TARGET = "demo-target"
DRAFTERS = ("lookup+demo-drafter", "lookup", "demo-drafter")  # as ServerDefaults.allowed lists them
RULE = "this server's app runs the served pair only: target 'demo-target', drafters 'lookup+demo-drafter', 'lookup'"


@pytest.fixture
def served_session():
    return Session(worker=NoWorker(), target=TARGET, drafter=DRAFTERS[0], served=ServedModels(TARGET, DRAFTERS))


@pytest.fixture
def folders(tmp_path):
    """(a model folder that exists, one that does not), named alike."""
    real = tmp_path / "model"
    real.mkdir()
    (real / "config.json").write_text("{}")
    return str(real), str(tmp_path / "modem")


@contextlib.contextmanager
def no_disk(monkeypatch):
    """Fails the test if the block looks at the disk (stat, lstat: exists, is_dir, resolve)."""

    def looked(*args, **kwargs):
        raise AssertionError(f"looked at the disk: {args[:1]}")

    with monkeypatch.context() as patch:
        patch.setattr(os, "stat", looked)
        patch.setattr(os, "lstat", looked)
        yield


def refusal(call) -> str:
    with pytest.raises(InputError) as err:
        call()
    return str(err.value)


# --- the server's rule -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["target", "drafter"])
def test_the_server_refuses_a_folder_alike_whether_it_exists(served_session, folders, role, monkeypatch):
    answers = []
    for folder in folders:
        pair = (folder, "lookup") if role == "target" else (TARGET, f"lookup+{folder}")
        with no_disk(monkeypatch):
            message = refusal(lambda pair=pair: served_session.check_models(*pair, access=LOCAL))
        answers.append(message.replace(folder, "FOLDER"))
    assert answers[0] == answers[1] and answers[0].startswith(RULE)
    assert "config.json" not in answers[0] and "no model directory" not in answers[0]


def test_compare_and_calibrate_refuse_with_the_same_line_for_every_user(served_session, folders, monkeypatch):
    compared, calibrated = set(), set()
    for folder in folders:
        for access in (LOCAL, Access(remote=True, remote_models="any")):
            with no_disk(monkeypatch):
                (update,) = served_session.compare("Hej", Settings(target=folder), access=access)
                (calibration,) = served_session.calibrate_pair(folder, "demo-drafter", access=access)
            assert update.state == calibration.state == "error"
            compared.add(update.status.replace(folder, "FOLDER"))
            calibrated.add(calibration.status.replace(folder, "FOLDER"))
    assert len(compared) == len(calibrated) == 1
    assert RULE in compared.pop() and RULE in calibrated.pop()


@pytest.mark.parametrize(
    "target, drafter",
    [
        ("org/model", "lookup"),  # a hub id not served
        (TARGET, "org/model"),
        (TARGET, "lookup+coder-drafter"),  # an offline model, but not one this server serves
        ("coder-target", "lookup"),
        (TARGET, "lookup+"),  # not even a drafter: the same line
        ("", "lookup"),
    ],
)
def test_the_server_refuses_what_it_does_not_serve(served_session, target, drafter):
    message = refusal(lambda: served_session.check_models(target, drafter))
    assert message.startswith(RULE) and "Choose one of them" in message


@pytest.mark.parametrize("drafter, normal", [*((d, d) for d in DRAFTERS), (" lookup + demo-drafter ", DRAFTERS[0])])
def test_the_server_accepts_its_target_with_each_allowed_drafter(served_session, drafter, normal):
    assert served_session.check_models(f" {TARGET} ", drafter) == (TARGET, normal)


def test_only_lookup_when_the_server_allows_only_lookup():
    session = Session(worker=NoWorker(), target=TARGET, drafter="lookup", served=ServedModels(TARGET, ("lookup",)))
    assert session.check_models(TARGET, "lookup") == (TARGET, "lookup")
    assert "drafters 'lookup'." in refusal(lambda: session.check_models(TARGET, "lookup+demo-drafter"))


def test_the_server_serves_its_dtypes_only():
    served = ServedModels(TARGET, DRAFTERS, target_dtype="bfloat16", drafter_dtype="q8")
    session = Session(worker=NoWorker(), target=TARGET, drafter="lookup", served=served)
    assert (session.defaults.target_dtype, session.defaults.drafter_dtype) == ("bfloat16", "q8")  # the app's
    assert session.check_models(TARGET, "demo-drafter", target_dtype="bfloat16", drafter_dtype="q8")
    assert session.check_models(TARGET, "lookup", target_dtype="bfloat16", drafter_dtype="q4")  # no drafter model
    message = refusal(lambda: session.check_models(TARGET, "demo-drafter", target_dtype="bfloat16"))
    assert "target 'demo-target' in bfloat16" in message and "drafter models in q8" in message
    assert "got target 'demo-target' in bfloat16, drafter 'demo-drafter' as stored" in message
    assert "in q4" in refusal(lambda: session.check_models(TARGET, "lookup", target_dtype="q4"))


def test_every_user_of_the_servers_app_counts_as_remote_and_is_told_what_is_served(served_session):
    assert served_session.access("127.0.0.1").remote  # DNS rebinding: a web page's request comes from here
    handlers = Handlers(served_session)
    note = handlers.load(request())
    assert note == Shown(served_session.served.note, True) and "'lookup+demo-drafter', 'lookup'" in note.value


def test_the_servers_app_offers_the_served_pairs(served_session):
    handlers = Handlers(served_session)
    labels = served_session.preset_choices()
    assert [handlers.preset(label)[:2] for label in labels] == [(TARGET, d) for d in DRAFTERS]
    assert served_session.preset_for(TARGET, DRAFTERS[0]) == labels[0]
    assert handlers.preset("Qwen2.5-Coder-1.5B ← SmolLM2-135M (cross-family)") == (KEEP, KEEP, "")  # not served
    other = ServedModels("org/target", ("lookup",)).presets()
    assert [(p.label, p.target, p.drafter) for p in other] == [("org/target ← lookup", "org/target", "lookup")]


def test_the_servers_app_lists_only_served_models_as_loaded(tmp_path):
    store = SimpleNamespace(loaded=[TARGET, str(tmp_path / "other"), "demo-drafter", "org/x"], on_evict=[])
    session = Session(store, NoWorker(), served=ServedModels(TARGET, ("lookup+demo-drafter",)))
    assert session.loaded_names(LOCAL) == [TARGET, "demo-drafter"]


# --- the standalone app keeps its rules ------------------------------------------------------------------------
def test_the_standalone_app_lets_its_local_user_load_a_folder(folders):
    session = Session(worker=NoWorker())
    assert session.served is None and not session.access("127.0.0.1").remote
    assert session.check_models(folders[0], f"lookup+{folders[0]}") == (folders[0], f"lookup+{folders[0]}")


@pytest.mark.parametrize("remote_models", ["demo", "presets", "any"])
def test_a_remote_user_gets_one_answer_for_a_folder_that_exists_and_one_that_does_not(folders, remote_models):
    access = Access(remote=True, remote_models=remote_models)
    answers = {refusal(lambda f=f: check_model(f, "target", access=access)).replace(f, "F") for f in folders}
    assert len(answers) == 1 and "not a hub id" in answers.pop()


@pytest.mark.parametrize("remote_models", ["demo", "presets"])
def test_a_hub_shaped_name_that_is_a_folder_here_is_refused_as_any_name_not_served(
    tmp_path, monkeypatch, remote_models
):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # "org/model" would load this folder; "org/modem" is not here
    access = Access(remote=True, remote_models=remote_models)
    names = ("org/model", "org/modem")
    answers = {refusal(lambda n=n: check_model(n, "target", access=access)).replace(n, "N") for n in names}
    assert len(answers) == 1 and "not available to remote users" in answers.pop()


# --- the running server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(URL, the /ui Session) of `uag serve --drafters lookup,demo-drafter` built by uag.server.main.build, with a
    worker that fails on any job: nothing here loads a model."""
    from tests.support.server import serve_args, serving
    from uag.server import main

    captured, mount = [], main._mount_ui

    def keep(app, session, *rest):
        captured.append(session)
        return mount(app, session, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(main, "_mount_ui", keep)
        app, _ = main.build(serve_args("--drafters", "lookup,demo-drafter"), worker=NoWorker())
    (session,) = captured
    with serving(app) as url:
        yield url, session


def test_build_gives_the_servers_app_the_served_rule(server):
    _, session = server
    assert session.served == ServedModels(TARGET, DRAFTERS)
    assert session.defaults.target == TARGET and session.defaults.drafter == DRAFTERS[0]


def _event(url: str, path: str, fn_index: int, trigger: int) -> dict:
    """The finished message of one event of the page, called as its browser would."""
    import httpx

    data = {"path": path, "meta": {"_type": "gradio.FileData"}, "orig_name": os.path.basename(path)}
    body = {"data": [data], "fn_index": fn_index, "session_hash": "probe", "trigger_id": trigger, "event_data": None}
    with httpx.Client(base_url=url + "/ui/gradio_api", timeout=60) as http:
        assert http.post("/queue/join", json=body).status_code == 200
        with http.stream("GET", "/queue/data", params={"session_hash": "probe"}) as events:
            for line in events.iter_lines():
                message = json.loads(line[5:]) if line.startswith("data:") else {}
                if message.get("msg") == "process_completed":
                    return message
    raise AssertionError("the event did not finish")


def test_the_results_file_takes_only_uploads_on_the_server(server, tmp_path):
    import httpx

    url, _ = server
    config = httpx.get(url + "/ui/config").json()
    upload = next(c["id"] for c in config["components"] if c.get("props", {}).get("file_types") == [".db", ".sqlite"])
    fn_index = next(i for i, d in enumerate(config["dependencies"]) if [upload, "change"] in map(list, d["targets"]))
    here = tmp_path / "sweep.db"
    here.write_bytes(b"SQLite format 3\x00")  # a results file on the server, not uploaded
    answers = []
    for path in (here, tmp_path / "swept.db"):
        message = _event(url, str(path), config["dependencies"][fn_index].get("id", fn_index), upload)
        assert not message["success"] and "not uploaded by a user" in message["output"]["error"]
        answers.append(message["output"]["error"].replace(str(path), "PATH"))
    assert answers[0] == answers[1]


def test_compare_on_the_server_refuses_a_folder_alike_whether_it_exists(server, folders):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    url, _ = server
    client = Client(url + "/ui/", verbose=False)
    answers = []
    for folder in folders:
        with pytest.raises(AppError) as err:
            client.predict("Hej", folder, api_name="/compare")
        answers.append(str(err.value).replace(folder, "FOLDER"))
    assert answers[0] == answers[1] and RULE in answers[0]
