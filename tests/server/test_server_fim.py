"""Fill-in-the-middle through `uag serve`: `suffix` on /v1/completions (the `openai` SDK) and llama.cpp's /infill
(raw HTTP, as llama.vscode and llama.vim send it), whole and streamed, in the shapes those clients parse. A tiny
random Qwen2.5 model carries Qwen's real tokenizer and FIM tokens, its replies scripted; the demo target (Gemma-3,
no FIM tokens) refuses with each API's 400 (slow); the coder target fills a function's body, greedy, and copies a
line of the suffix by prompt lookup (where the coder pair is converted)."""

from __future__ import annotations

import ast
import json

import httpx
import pytest

from tests.support.coder import needs_coder_pair

openai = pytest.importorskip("openai")

PREFIX = "def area(width, height):\n    "
SUFFIX = "\n\n\nprint(area(2, 3))\n"


class Script:
    """The scripted replies (tests/support/server_scripted.py), ending as the engine's stream ends when its reader
    stops early (a stop sequence): "stopped"."""

    def __init__(self):
        from tests.support.server_scripted import Scripted

        self.scripted = Scripted()
        self.replies, self.prompts = self.scripted.replies, self.scripted.prompts

    def __call__(self, target, drafter, ids, config, **kw):
        run = None
        try:
            for event in self.scripted(target, drafter, ids, config, **kw):
                run = event.run
                yield event
        finally:
            if run is not None and run.finish_reason is None:
                run.finish_reason = "stopped"


@pytest.fixture(scope="module")
def tiny_server():
    from tests.support.server import serve_args, serving
    from tests.support.tiny_models import build_tiny
    from uag.server.main import build

    folder = str(build_tiny("qwen2", "qwen2.5"))
    settings = serve_args("--target", folder, "--drafter", "off", "--no-ui", "--max-tokens", "64")
    script = Script()
    app, service = build(settings, stream=script)
    try:
        with serving(app) as url:
            yield url, service, script, folder
    finally:
        service.costs.close()


def _prompt(service, script) -> str:
    return service.store.get(service.target_name).tokenizer.decode(script.prompts[-1])


def _events(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line.removeprefix("data: ")) for line in lines]


@pytest.mark.parametrize("stream", [False, True])
def test_a_suffix_on_completions_is_filled_in_the_middle(tiny_server, stream):
    url, service, script, folder = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    script.replies.append("return width * height")
    response = client.completions.create(model=folder, prompt=PREFIX, suffix=SUFFIX, max_tokens=32, stream=stream)
    text = "".join(c.choices[0].text for c in response) if stream else response.choices[0].text
    assert text == "return width * height"
    assert _prompt(service, script) == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"


def test_a_fim_reply_ends_where_the_model_writes_a_fim_token(tiny_server):
    url, service, script, folder = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    script.replies.append("return width * height<|file_sep|>other.py\nimport os")
    response = client.completions.create(model=folder, prompt=PREFIX, suffix=SUFFIX, max_tokens=32)
    assert response.choices[0].text == "return width * height" and response.choices[0].finish_reason == "stop"


def test_infill_answers_as_llama_server(tiny_server):
    """llama.vscode's request: the project's other files, the text typed after the prefix, its sampling fields
    and the ones uag ignores; the answer in llama-server's completion object."""
    url, service, script, folder = tiny_server
    script.replies.append("width * height")
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"filename": "shapes.py", "text": "def volume(w, h, d):\n    return w * h * d\n"}],
        "prompt": "return ",
        "n_predict": 32,
        "top_k": 40,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000,
        "n_indent": 4,
        "id_slot": 0,
        "model": "qwen2.5-coder",  # llama-server serves its one model whatever a client names
    }
    answer = httpx.post(url + "/infill", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["content"] == "width * height" and data["stop"] is True and data["stop_type"] == "eos"
    assert data["tokens_predicted"] == 5  # the script's tokens are 3 characters
    assert data["tokens_evaluated"] == len(script.prompts[-1]) and data["tokens_cached"] == 0
    timings = data["timings"]
    assert {"prompt_n", "prompt_ms", "prompt_per_token_ms", "predicted_n", "predicted_ms"} <= set(timings)
    assert all(isinstance(v, (int, float)) for v in timings.values())
    assert (
        data["model"] == folder
        and data["generation_settings"]["n_predict"] == 32
        and data["generation_settings"]["top_k"] == 40
    )
    assert _prompt(service, script) == (
        "<|repo_name|>myproject\n<|file_sep|>shapes.py\ndef volume(w, h, d):\n    return w * h * d\n"
        f"<|file_sep|>filename\n<|fim_prefix|>{PREFIX}return <|fim_suffix|>{SUFFIX}<|fim_middle|>"
    )


def test_infill_says_which_stop_word_ended_the_reply(tiny_server):
    url, service, script, folder = tiny_server
    script.replies.append("width * height  # area")
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "stop": ["  #"]}
    data = httpx.post(url + "/infill", json=body, timeout=60).json()
    assert (data["content"], data["stop_type"], data["stopping_word"]) == ("width * height", "word", "  #")


def test_infill_streams_content_lines_and_a_last_stop_line(tiny_server):
    url, service, script, folder = tiny_server
    script.replies.append("width * height")
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 16, "stream": True}
    with httpx.stream("POST", url + "/infill", json=body, timeout=60) as response:
        response.read()
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _events(response)
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == "width * height"  # the last one's content is ""
    assert events[-1]["content"] == "" and events[-1]["tokens_predicted"] > 0 and "timings" in events[-1]
    assert "[DONE]" not in response.text
    assert _prompt(service, script) == f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"  # a file alone


def test_infill_response_fields_pick_what_llama_vim_reads(tiny_server):
    url, service, script, folder = tiny_server
    script.replies.append("width * height")
    fields = ["content", "timings/prompt_n", "timings/predicted_ms", "truncated", "tokens_cached"]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": -1, "response_fields": fields}
    data = httpx.post(url + "/infill", json=body, timeout=60).json()
    assert set(data) == set(fields) and data["content"] == "width * height" and data["truncated"] is False


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_extra": [{"filename": "a.py", "text": 7}]}, "input_extra[0]: must be a list of"),
        ({"input_extra": "a.py"}, "input_extra: must be a list of"),
        ({"n_predict": 0}, "n_predict: must be from 1"),
        ({"temperature": "hot"}, "temperature: must be a number"),
    ],
)
def test_infill_errors_are_llama_servers_error_object(tiny_server, body, message):
    url, *_ = tiny_server
    answer = httpx.post(url + "/infill", json={"input_prefix": "a", "input_suffix": "b", **body}, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == error["code"] == 400 and error["message"].startswith(message), error
    assert error["type"] == "invalid_request_error"


# --- the demo target: no FIM tokens ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_url(store):
    from tests.support.server import serve_args, serving
    from uag.server.main import build

    settings = serve_args("--max-tokens", "8", "--no-ui")
    app, service = build(settings, store=store)
    try:
        with serving(app) as url:
            yield url
    finally:
        service.costs.close()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_the_demo_target_has_no_fim_tokens_a_clear_400_on_each_api(demo_url, stream):
    completion = {"model": "demo-target", "prompt": PREFIX, "suffix": SUFFIX, "stream": stream}
    answer = httpx.post(demo_url + "/v1/completions", json=completion, timeout=300)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["code"] == "fim_not_supported" and error["param"] == "suffix"
    assert "no fill-in-the-middle tokens" in error["message"]
    answer = httpx.post(demo_url + "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": stream})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == 400
    assert "no fill-in-the-middle tokens" in answer.json()["error"]["message"]


# --- the coder target --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def coder_url():
    from tests.support.server import serve_args, serving
    from uag.models.store import ModelStore
    from uag.server.main import build

    store = ModelStore(max_models=2)  # its own, cleared after: the 1.5B is never held twice in the session
    settings = serve_args("--target", "coder-target", "--drafter", "lookup", "--max-tokens", "64", "--no-ui")
    app, service = build(settings, store=store)
    try:
        with serving(app) as url:
            yield url
    finally:
        service.costs.close()
        store.clear()  # FastAPI keeps a stopped app's endpoints (and through them this store) alive in a cache


CODER_PREFIX = 'def mean(values):\n    """The arithmetic mean of a non-empty list of numbers."""\n    '  # the cursor
CODER_SUFFIX = "\n\n\nassert mean([1, 2, 3]) == 2\n"
TWIN_PREFIX = "def to_celsius(fahrenheit):\n"
TWIN_SUFFIX = (
    "\n\n\ndef to_celsius_rounded(fahrenheit):\n"
    '    """Convert a temperature in degrees Fahrenheit to degrees Celsius."""\n'
    "    celsius = (fahrenheit - 32) * 5 / 9\n"
    "    return round(celsius, 2)\n"
)


@pytest.mark.slow
@needs_coder_pair
def test_the_coder_target_fills_a_function_body_through_both_apis(coder_url):
    """Greedy FIM on Qwen2.5-Coder: the body it writes makes the file parse and returns the mean; /v1/completions
    (whole and streamed) and /infill (whole and streamed) write the same middle for the same file."""
    client = openai.OpenAI(base_url=coder_url + "/v1", api_key="none", max_retries=0)
    off = {"speculative": False}
    made = client.completions.create(
        model="coder-target", prompt=CODER_PREFIX, suffix=CODER_SUFFIX, max_tokens=24, extra_body=off
    )
    middle = made.choices[0].text
    assert "return" in middle and "len(values)" in middle, middle
    ast.parse(CODER_PREFIX + middle + CODER_SUFFIX)
    streamed = client.completions.create(
        model="coder-target", prompt=CODER_PREFIX, suffix=CODER_SUFFIX, max_tokens=24, stream=True, extra_body=off
    )
    assert "".join(c.choices[0].text for c in streamed) == middle
    body = {"input_prefix": CODER_PREFIX, "input_suffix": CODER_SUFFIX, "n_predict": 24, **off}
    whole = httpx.post(coder_url + "/infill", json=body, timeout=600).json()
    assert whole["content"] == middle and whole["stop"] is True and whole["tokens_cached"] > 0  # the same file again
    with httpx.stream("POST", coder_url + "/infill", json={**body, "stream": True}, timeout=600) as response:
        response.read()
    events = _events(response)
    assert events[-1]["stop"] is True and not any(e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == middle


@pytest.mark.slow
@needs_coder_pair
def test_prompt_lookup_drafts_from_the_suffix(coder_url):
    """A middle that writes the function the suffix already holds is copied: lookup cycles keep its tokens."""
    body = {
        "input_prefix": TWIN_PREFIX,
        "input_suffix": TWIN_SUFFIX,
        "n_predict": 48,
        "speculative": {"drafter": "lookup", "strategy": "context", "k": 8},
    }
    data = httpx.post(coder_url + "/infill", json=body, timeout=600).json()
    assert "(fahrenheit - 32) * 5 / 9" in data["content"], data["content"]
    lookup = data["speculative"]["lookup"]
    assert lookup["cycles"] > 0 and lookup["accepted_tokens"] >= 8, data["speculative"]
