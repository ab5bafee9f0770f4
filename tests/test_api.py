"""The /compare endpoint through gradio_client, against the app served in-process on the demo pair."""

from __future__ import annotations

import threading

import pytest

from uag.core.records import DRAFT, TARGET

PROMPTS = ("Stolica Polski to", "Ile nóg ma pająk?")
MAX_TOKENS = 8  # the endpoint's default is 64; kept short so that the tests stay quick on a CPU


def predict(url: str, prompt: str, **options):
    from gradio_client import Client

    return Client(url, verbose=False).predict(prompt, api_name="/compare", **options)


@pytest.fixture(scope="module")
def sequential(app_url):
    """Each prompt's answer from a call on its own."""
    return {prompt: predict(app_url, prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS}


def test_endpoint_defaults_are_the_apps(app_url):
    from gradio_client import Client

    from uag.app.settings import DEFAULT_GENERATION
    from uag.runtime.presets import DEFAULT

    info = Client(app_url, verbose=False).view_api(return_format="dict", print_info=False)
    params = info["named_endpoints"]["/compare"]["parameters"]
    defaults = {p["parameter_name"]: p["parameter_default"] for p in params if p["parameter_has_default"]}
    assert [p["parameter_name"] for p in params][0] == "prompt" and not params[0]["parameter_has_default"]
    assert defaults == {
        "target": DEFAULT.target,
        "drafter": DEFAULT.drafter,
        "strategy": DEFAULT_GENERATION.strategy,
        "k": DEFAULT_GENERATION.k,
        "window": 10,
        "max_tokens": 64,
        "temperature": 0.0,
        "seed": None,
        "chat": False,
        "target_dtype": None,  # as stored: float32 for the offline models
        "drafter_dtype": None,
    }
    assert len(info["named_endpoints"]["/compare"]["returns"]) == 4


@pytest.mark.slow
def test_compare_returns_both_texts_spans_and_stats(sequential):
    baseline, speculative, spans, stats = sequential[PROMPTS[0]]
    assert baseline and baseline == speculative  # greedy: lossless
    assert "".join(text for text, _ in spans) == speculative
    assert {label for _, label in spans} <= {DRAFT, TARGET}
    assert stats["identical"] is True and stats["speedup"] > 0 and stats["strategy"] == "auto"
    assert stats["baseline"]["generated_tokens"] == stats["speculative"]["generated_tokens"] <= MAX_TOKENS
    assert set(stats["time_split_ms"]) == {"draft", "translate", "verify", "resync"}
    colour = "win" if stats["speedup"] >= 1 else "loss"  # green where it paid, red where it did not
    assert stats["verdict"].startswith(f'<strong class="speedup {colour}">Speculation')


@pytest.mark.slow
def test_two_concurrent_calls_each_get_their_own_answer(app_url, sequential):
    answers, errors = {}, []

    def call(prompt):
        try:
            answers[prompt] = predict(app_url, prompt, max_tokens=MAX_TOKENS)
        except Exception as err:  # reported below, with the other thread's outcome
            errors.append(err)

    threads = [threading.Thread(target=call, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors and set(answers) == set(PROMPTS)
    for prompt in PROMPTS:
        assert answers[prompt][:3] == sequential[prompt][:3]  # same texts and spans as when called alone
        assert answers[prompt][3]["identical"] is True


@pytest.mark.parametrize(
    "prompt, options, message",
    [
        ("", {}, "the prompt is empty"),
        ("Hej", {"k": 99}, "k (draft length) must be a whole number from 1 to 32 (got 99)"),
        ("Hej", {"temperature": -1.0, "max_tokens": 0}, "temperature must be a number from 0 to 2"),
        ("Hej", {"strategy": "baseline"}, "strategy must be one of none, naive, context"),  # and any newer ones
    ],
)
def test_bad_input_is_a_clear_error(app_url, prompt, options, message):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="Cannot run") as err:
        predict(app_url, prompt, **options)
    assert message in str(err.value)


def test_share_without_a_login_is_refused(capsys, monkeypatch):
    from uag.app.launch import main

    monkeypatch.delenv("UAG_AUTH", raising=False)
    assert main(["--share"]) == 2
    assert "--share with $UAG_AUTH=USER:PASS" in capsys.readouterr().err
    assert main(["--auth", "no-colon"]) == 2
    assert "--auth takes USER:PASS" in capsys.readouterr().err


def test_the_login_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):  # finding 14: not only argv
    from uag.app.launch import _auth, parse_args

    monkeypatch.setenv("UAG_AUTH", "ala:kot")
    assert _auth(parse_args([])) == ("ala", "kot")
    secret = tmp_path / "login"
    secret.write_text("ola:pies\n")
    assert _auth(parse_args(["--auth-file", str(secret)])) == ("ola", "pies")
    monkeypatch.delenv("UAG_AUTH")
    assert _auth(parse_args([])) is None


def test_a_taken_port_says_which_option_to_use(capsys):  # finding 14
    import socket

    from uag.app.launch import main

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["--port", str(port)]) == 2
    assert f"error: port {port} is taken: use --port" in capsys.readouterr().err


@pytest.mark.slow
def test_cancelling_an_api_job_frees_the_worker_for_the_next_caller(app_url, app_session):  # finding 1
    """A long job cancelled through gradio_client stops within a cycle: the worker is idle again before the
    next caller's short job starts, and that job finishes with the worker serving nobody else."""
    import time

    from gradio_client import Client

    long = Client(app_url, verbose=False).submit(PROMPTS[1], max_tokens=4000, api_name="/compare")
    while app_session.worker.current is None or "comparison" not in app_session.worker.current.label:
        time.sleep(0.05)
    running = app_session.worker.current
    time.sleep(1.0)  # inside the target-alone run
    long.cancel()
    assert running.wait(60), "the cancelled job still holds the MLX worker"
    assert running.cancelled.is_set() and app_session.worker.backlog == 0
    baseline, speculative, _, stats = predict(app_url, PROMPTS[0], max_tokens=3)
    assert stats["identical"] is True and stats["speculative"]["generated_tokens"] == 3
    assert app_session.worker.current is None or app_session.worker.current is not running


@pytest.mark.slow
def test_a_client_that_goes_away_cancels_its_job(app_url, app_session):  # finding 1: disconnect, raw HTTP
    import json

    import httpx

    with httpx.Client(base_url=app_url, timeout=30) as http:
        event = http.post("gradio_api/call/compare", json={"data": [PROMPTS[1], None, None, "context", 2, 10, 4000]})
        event_id = event.json()["event_id"]
        with http.stream("GET", f"gradio_api/call/compare/{event_id}") as events:
            for line in events.iter_lines():  # read until the run streams, then hang up
                if line.startswith("data:") and "Target alone" in json.dumps(line):
                    break
    running = app_session.worker.current
    assert running is not None and "comparison" in running.label
    assert running.wait(60), "the job of a client that left still holds the MLX worker"
    assert running.cancelled.is_set()


def test_padding_fills_only_what_a_call_left_out():
    from uag.app.fill_defaults import padded

    assert padded(["Hej"], ["demo-target", "demo-drafter"]) == ["Hej", "demo-target", "demo-drafter"]
    assert padded(["Hej", "t", "d"], ["demo-target", "demo-drafter"]) == ["Hej", "t", "d"]
    assert padded([], ["demo-target"]) == [None, "demo-target"]
    assert padded("junk", ["demo-target"]) == "junk"


@pytest.mark.slow
def test_a_raw_rest_call_with_only_the_prompt_gets_the_defaults(app_url):  # finding 12
    import json

    import httpx

    with httpx.Client(base_url=app_url, timeout=600) as http:
        event_id = http.post("gradio_api/call/compare", json={"data": [PROMPTS[0]]}).json()["event_id"]
        lines = http.get(f"gradio_api/call/compare/{event_id}").text.splitlines()
    assert "event: complete" in lines, lines[-4:]
    baseline, speculative, _, stats = json.loads(lines[lines.index("event: complete") + 1].removeprefix("data: "))
    assert baseline == speculative and stats["max_tokens"] == 64 and stats["drafter"] == "lookup+demo-drafter"
