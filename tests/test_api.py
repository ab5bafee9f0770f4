"""The /compare endpoint through gradio_client, against the app served in-process on the demo pair."""

from __future__ import annotations

import threading

import pytest

from uag.highlight import DRAFT, TARGET

PROMPTS = ("Stolica Polski to", "Ile nóg ma pająk?")
MAX_TOKENS = 8  # the endpoint's default is 48; kept short so that the tests stay quick on a CPU


def predict(url: str, prompt: str, **options):
    from gradio_client import Client

    return Client(url, verbose=False).predict(prompt, api_name="/compare", **options)


@pytest.fixture(scope="module")
def sequential(app_url):
    """Each prompt's answer from a call on its own."""
    return {prompt: predict(app_url, prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS}


def test_endpoint_defaults_are_the_demo_pair(app_url):
    from gradio_client import Client

    info = Client(app_url, verbose=False).view_api(return_format="dict", print_info=False)
    params = info["named_endpoints"]["/compare"]["parameters"]
    defaults = {p["parameter_name"]: p["parameter_default"] for p in params if p["parameter_has_default"]}
    assert [p["parameter_name"] for p in params][0] == "prompt" and not params[0]["parameter_has_default"]
    assert defaults == {
        "target": "demo-target",
        "drafter": "demo-drafter",
        "strategy": "context",
        "k": 2,
        "window": 10,
        "max_tokens": 48,
        "temperature": 0.0,
        "seed": 0,
        "chat": False,
    }
    assert len(info["named_endpoints"]["/compare"]["returns"]) == 4


@pytest.mark.slow
def test_compare_returns_both_texts_spans_and_stats(sequential):
    baseline, speculative, spans, stats = sequential[PROMPTS[0]]
    assert baseline and baseline == speculative  # greedy: lossless
    assert "".join(text for text, _ in spans) == speculative
    assert {label for _, label in spans} <= {DRAFT, TARGET}
    assert stats["identical"] is True and stats["speedup"] > 0 and stats["strategy"] == "context"
    assert stats["baseline"]["generated_tokens"] == stats["speculative"]["generated_tokens"] <= MAX_TOKENS
    assert set(stats["time_split_ms"]) == {"draft", "translate", "verify", "resync"}
    assert stats["verdict"].startswith("**Speculation")


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
        ("Hej", {"temperature": -1.0, "max_tokens": 0}, "temperature must be from 0 to 2.0"),
        ("Hej", {"strategy": "baseline"}, "strategy must be one of none, naive, context"),  # and any newer ones
    ],
)
def test_bad_input_is_a_clear_error(app_url, prompt, options, message):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="Cannot run") as err:
        predict(app_url, prompt, **options)
    assert message in str(err.value)


def test_share_without_a_login_is_refused(capsys):
    from uag.ui import main

    assert main(["--share"]) == 2
    assert "--share --auth USER:PASS" in capsys.readouterr().err
    assert main(["--auth", "no-colon"]) == 2
    assert "--auth takes USER:PASS" in capsys.readouterr().err
