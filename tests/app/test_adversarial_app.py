"""The running app under bad input, as a careless or hostile user would send it (issue 14, app and API).

Every case goes through the served app: gradio_client, or raw HTTP for what a client library would never
send (wrong JSON types, lone surrogates, a forwarded address that makes the caller remote). For each: the
answer is one line, with no traceback, no Python type name, no server path; and the next good request
succeeds. Good requests are 2 tokens long, so the module stays quick on a CPU.
"""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest

pytestmark = pytest.mark.slow

REMOTE = {"X-Forwarded-For": "203.0.113.9"}  # through a proxy: the app treats the caller as remote
PYTHON_NAMES = re.compile(r"Traceback|\b\w*(Error|Exception)\b|NoneType|<class|\b(str|int|float|dict|bool)\b")
SERVER_PATHS = re.compile(r"/tmp/|/root|/home/|/work/|site-packages|\.cache")
GOOD = {"max_tokens": 2}

# (case, data after the prompt as raw /compare parameters, headers, what the message must say)
DEFAULTS = ["demo-target", "demo-drafter", "context", 2, 10, 64, 0.0, None, False]


def _with(**changes):
    names = ["target", "drafter", "strategy", "k", "window", "max_tokens", "temperature", "seed", "chat"]
    return [changes.get(name, value) for name, value in zip(names, DEFAULTS)]


CASES = [
    ("empty prompt", ["", *_with()], {}, "the prompt is empty"),
    ("blank prompt", [" \n\t ", *_with()], {}, "the prompt is empty"),
    ("no prompt at all", [None, *_with()], {}, "the prompt is empty"),
    ("prompt too long", ["x" * 20_001, *_with()], {}, "at most 20000"),
    ("prompt a number", [42, *_with()], {}, "the prompt must be text"),
    ("prompt a list", [["a"], *_with()], {}, "the prompt must be text"),
    ("lone surrogate", ["Ala \ud83d ma", *_with()], {}, "not valid text at position 5"),
    ("NUL in prompt", ["a\x00b", *_with()], {}, "NUL character"),
    ("k zero", ["Hej", *_with(k=0)], {}, "k (draft length) must be a whole number from 1 to 32"),
    ("k huge", ["Hej", *_with(k=10**9)], {}, "k (draft length) must be a whole number from 1 to 32"),
    ("k fraction", ["Hej", *_with(k=2.5)], {}, "k (draft length) must be a whole number"),
    ("k text", ["Hej", *_with(k="two")], {}, "k (draft length) must be a whole number"),
    ("k boolean", ["Hej", *_with(k=True)], {}, "k (draft length) must be a whole number"),
    ("window negative", ["Hej", *_with(window=-1)], {}, "context window W must be a whole number from 0 to 64"),
    ("window huge", ["Hej", *_with(window=10**9)], {}, "context window W must be a whole number from 0 to 64"),
    ("max tokens zero", ["Hej", *_with(max_tokens=0)], {}, "max tokens must be a whole number from 1"),
    ("max tokens huge", ["Hej", *_with(max_tokens=10**9)], {}, "max tokens must be a whole number from 1"),
    ("temperature negative", ["Hej", *_with(temperature=-1)], {}, "temperature must be a number from 0 to 2"),
    ("temperature infinite", ["Hej", *_with(temperature="inf")], {}, "temperature must be a number from 0 to 2"),
    ("temperature words", ["Hej", *_with(temperature="hot")], {}, "temperature must be a number from 0 to 2"),
    ("seed negative", ["Hej", *_with(seed=-1)], {}, "seed must be a whole number from 0"),
    ("seed huge", ["Hej", *_with(seed=2**40)], {}, "seed must be a whole number from 0"),
    ("chat 'no'", ["Hej", *_with(chat="no")], {}, "chat template must be true or false"),
    ("chat a number", ["Hej", *_with(chat=7)], {}, "chat template must be true or false"),
    ("strategy baseline", ["Hej", *_with(strategy="baseline")], {}, "strategy must be one of none, naive"),
    ("strategy unknown", ["Hej", *_with(strategy="warp")], {}, "strategy must be one of none, naive"),
    ("target empty", ["Hej", *_with(target="")], {}, "choose a target"),
    ("target not a name", ["Hej", *_with(target=5)], {}, "the target must be a name"),
    ("drafter empty", ["Hej", *_with(drafter="")], {}, "no drafter given"),
    ("drafter lookup+", ["Hej", *_with(drafter="lookup+")], {}, "after lookup+ name a drafter model"),
    ("missing folder", ["Hej", *_with(target="./no-such-model")], {}, "no model directory at"),
    ("remote: /etc", ["Hej", *_with(target="/etc")], REMOTE, "model folders on the server can be chosen only"),
    ("remote: ../x", ["Hej", *_with(drafter="../x")], REMOTE, "model folders on the server can be chosen only"),
    ("remote: ~", ["Hej", *_with(drafter="lookup+~/models")], REMOTE, "model folders on the server can be chosen"),
    (
        "remote: big preset",
        ["Hej", *_with(target="speakleash/Bielik-11B-v3.0-Instruct-MLX-8bit")],
        REMOTE,
        "not available to remote users",
    ),
    ("remote: any hub id", ["Hej", *_with(target="org/anything")], REMOTE, "not available to remote users"),
]


def _raw(app_url: str, data: list, headers: dict) -> tuple[str, str]:
    """(SSE event, its data) of a raw /compare call."""
    import httpx

    with httpx.Client(base_url=app_url, timeout=300, headers=headers) as http:
        body = json.dumps({"data": data}).encode()  # json escapes a lone surrogate as \ud83d, as a browser would
        event_id = http.post("gradio_api/call/compare", content=body, headers={"content-type": "application/json"})
        lines = http.get(f"gradio_api/call/compare/{event_id.json()['event_id']}").text.splitlines()
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    last = next(i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("event: "))
    data = json.loads(lines[last + 1].removeprefix("data: "))
    return events[-1], data["error"] if events[-1] == "error" and isinstance(data, dict) else data


def assert_user_message(message: str, expected: str, sent: str = "") -> None:
    assert expected in message, message
    assert "\n" not in message.strip(), f"more than one line: {message!r}"
    assert not PYTHON_NAMES.search(message), f"Python internals in: {message!r}"
    assert not SERVER_PATHS.search(message.replace(sent, "")), f"a server path in: {message!r}"


def good_request_succeeds(app_url: str) -> None:
    from gradio_client import Client

    baseline, speculative, _, stats = Client(app_url, verbose=False).predict(
        "Stolica Polski to", **GOOD, api_name="/compare"
    )
    assert stats["identical"] is True and baseline == speculative


@pytest.mark.parametrize("case, data, headers, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_through_raw_http(app_url, case, data, headers, expected):
    event, message = _raw(app_url, data, headers)
    assert event == "error" and isinstance(message, str), (event, message)
    sent = next((str(v) for v in data if isinstance(v, str) and v.startswith(("./", "/", "~", "lookup+"))), "")
    assert_user_message(message, expected, sent)
    good_request_succeeds(app_url)


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"k": 99}, "k (draft length) must be a whole number from 1 to 32 (got 99)"),
        ({"temperature": 5.0, "max_tokens": 0}, "temperature must be a number from 0 to 2"),
        ({"chat": "maybe"}, "chat template must be true or false"),
        ({"drafter": "lookup+lookup"}, "after lookup+ name a drafter model"),
    ],
)
def test_bad_input_through_gradio_client(app_url, options, expected):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError) as err:
        Client(app_url, verbose=False).predict("Hej", **options, api_name="/compare")
    assert_user_message(str(err.value), expected)
    good_request_succeeds(app_url)


def _damaged_folders(tmp_path):
    from tests.support.tiny_models import build_tiny

    source = build_tiny("mistral", "mistral-v1")
    no_type, truncated = tmp_path / "no-type", tmp_path / "truncated"
    for folder in (no_type, truncated):
        shutil.copytree(source, folder)
    config = json.loads((no_type / "config.json").read_text())
    del config["model_type"]
    (no_type / "config.json").write_text(json.dumps(config))
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    return {no_type: "config.json names no model_type", truncated: "model.safetensors is incomplete or damaged"}


def test_damaged_model_folders_get_user_messages(app_url, tmp_path):  # finding 5
    for folder, expected in _damaged_folders(tmp_path).items():
        event, message = _raw(app_url, ["Hej", *_with(target=str(folder))], {})
        assert event == "error"
        assert_user_message(message, expected, str(folder))
    good_request_succeeds(app_url)


def test_remote_users_never_see_or_use_a_folder_a_local_user_loaded(app_url, app_session):  # finding 2
    from tests.support.tiny_models import tiny_pair

    drafter, target = map(str, tiny_pair())
    event, _ = _raw(app_url, ["Hej", *_with(target=target, drafter=drafter, max_tokens=2)], {})  # the local user
    assert event == "complete" and target in app_session.store.loaded
    for data in (_with(target=target), _with(target="org/other")):
        event, message = _raw(app_url, ["Hej", *data], REMOTE)
        assert event == "error" and target not in message.replace(data[0], "") and "/" + "tmp" not in message
    assert_user_message(message, "not available to remote users")
    assert target not in app_session.loaded_names(app_session.access("203.0.113.9"))


def test_one_client_cannot_fill_the_queue(app_url, app_session):  # finding 1: per-client limit
    import httpx

    data = ["Napisz opowiadanie", *_with(max_tokens=4000)]
    with httpx.Client(base_url=app_url, timeout=60, headers=REMOTE) as http:
        ids = [http.post("gradio_api/call/compare", json={"data": data}).json()["event_id"] for _ in range(3)]
        streams = [http.stream("GET", f"gradio_api/call/compare/{i}") for i in ids]
        responses = [s.__enter__() for s in streams]
        try:
            refused = None
            for response in responses:  # the third is refused at once; the first two run or wait
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("event: error"):
                        refused = json.loads(next(lines).removeprefix("data: "))["error"]
                        break
                    if line.startswith("data:"):
                        break
            assert refused is not None
            assert_user_message(refused, "you already have 2 requests queued or running")
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)  # the client leaves: both its jobs are cancelled
    client = app_session.client("127.0.0.1", REMOTE)  # the connecting address: no proxy is trusted
    for _ in range(600):  # each job is cancelled at the server's next heartbeat; bounded, not timed
        if app_session.runner.queued(client) == 0:
            break
        time.sleep(0.1)
    assert client == "127.0.0.1" and app_session.runner.queued(client) == 0
    good_request_succeeds(app_url)


def test_an_upload_over_the_limit_is_refused(app_url):  # finding 3
    import httpx

    from uag.app.files import MAX_UPLOAD_MB

    big = b"\0" * (MAX_UPLOAD_MB * 2**20 + 4096)
    with httpx.Client(base_url=app_url, timeout=120) as http:
        answer = http.post("gradio_api/upload", files={"files": ("sweep.db", big)})
    assert answer.status_code == 413, answer.text[:200]
