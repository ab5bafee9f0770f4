"""`uag serve` end to end on the demo pair: the real `openai` SDK and raw HTTP against a running server.

One server for the whole module (uvicorn in a thread, the app mounted at /ui) on the session's loaded models. Every
model run costs a few seconds on a busy CPU, so the runs are few and short: small max_tokens, the lossless checks
share their turns, the CLI's baseline reuses the loaded models, and a bad request is followed by a generation only
where it reached the model worker (test_bad_requests_… says why).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

KEY = "test-key"
MODEL = "demo-target"
PROMPT = "Stolica Polski to"
DRAFTERS = "lookup,demo-drafter,lookup+demo-drafter"


@pytest.fixture(scope="module")
def served(store):
    """(base URL, Service) of `uag serve --api-key … --max-tokens 8` on the demo pair."""
    from tests.support.server import serve_args, serving
    from uag.server.main import build

    settings = serve_args("--api-key", KEY, "--max-tokens", "8", "--drafters", DRAFTERS, "--per-client", "4")
    app, service = build(settings, store=store)
    try:
        with serving(app) as url:
            yield url, service
    finally:
        service.costs.close()  # no measuring in the background during later tests


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0)


def say(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_models_health_and_the_ui(served, client):
    url, _ = served
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok", "ready": True}  # nothing preloaded here
    assert httpx.get(url + "/", follow_redirects=False).headers["location"] == "/ui/"
    assert httpx.get(url + "/ui/").status_code == 200  # the app (its login page: the key is its password)


def test_chat_reports_usage_speculation_and_timings(client):
    reply = say(client, PROMPT, max_tokens=6)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6
    spec, timings = reply.model_extra["speculative"], reply.model_extra["timings"]
    assert spec["drafter"] == "lookup+demo-drafter" and spec["strategy"] == "auto" and spec["k"] == 16
    assert spec["drafted_tokens"] == timings["draft_n"] and spec["accepted_tokens"] == timings["draft_n_accepted"]
    assert sum(spec["sources"].values()) >= 1
    if spec["estimated_speedup"] is not None:
        assert "estimate" in spec["speedup_basis"]
    assert timings["predicted_n"] == 6 and timings["prompt_n"] + timings["cache_n"] == usage.prompt_tokens


def test_streaming_with_usage_matches_the_whole_reply(client):
    whole = say(client, PROMPT, max_tokens=6, extra_body={"speculative": False})
    chunks = list(
        say(
            client,
            PROMPT,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative": False},
        )
    )
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].model_extra["speculative"]["strategy"] == "baseline"


def test_completions_and_stop(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"speculative": False})
    text = full.choices[0].text
    word = text.split()[2]
    cut = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, stop=[word, "never appears"], extra_body={"speculative": False}
    )
    assert cut.choices[0].text == text[: text.index(word)] and cut.choices[0].finish_reason == "stop"


def test_a_seed_repeats_a_sampled_reply(client):
    a, b = (
        say(client, PROMPT, max_tokens=6, temperature=1.0, seed=7, extra_body={"speculative": False}) for _ in range(2)
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def _events(body: bytes) -> list[str]:
    assert body.endswith(b"\n\n")
    events = body.decode("utf-8").split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    return [e.removeprefix("data: ") for e in events]


def test_sse_framing_byte_for_byte_and_characters_never_split(served):
    url, service = served
    target = service.store.get(MODEL)
    prompt = "𝔘𝔞𝔤 𝔘𝔞𝔤 𝔘𝔞𝔤 𝔘𝔞𝔤 𝔘𝔞𝔤 𝔘𝔞𝔤"
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": False,
    }
    response = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.content)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    deltas = [c["choices"][0]["text"] for c in chunks[:-1]]
    text = "".join(deltas)
    # The reply holds characters the target writes as several byte tokens: the test means something.
    assert any(len(target.tokenizer.encode(ch, add_special_tokens=False)) > 1 for ch in text if ord(ch) > 0xFFFF)
    assert all("\ufffd" not in d for d in deltas)
    assert all(not (0xDC80 <= ord(ch) <= 0xDCFF) for ch in text)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 3,
        "stream": True,
        "speculative": False,
    }
    response = httpx.post(url + "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {KEY}"})
    events = _events(response.content)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and len({(c["id"], c["created"]) for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert chunks[-1]["choices"][0]["delta"] == {} and all(c["usage"] is None for c in chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def _cli_baseline(capsys, monkeypatch, store, prompt: str, max_tokens: int) -> str:
    """`uag generate --strategy baseline --json` in this process, on the session's loaded models."""
    from uag.cli import main

    monkeypatch.setattr("uag.models.store.ModelStore", lambda *_, **__: store)  # not a second copy of the pair
    capsys.readouterr()
    assert main(["generate", "--strategy", "baseline", "--json", "--max-tokens", str(max_tokens), prompt]) == 0
    return json.loads(capsys.readouterr().out)["text"]


SPECULATIONS = [
    {"drafter": "demo-drafter", "strategy": "context", "k": 2},
    {"drafter": "lookup", "strategy": "context", "k": 4},
    {"drafter": "lookup+demo-drafter", "strategy": "context", "k": 3},
    {"drafter": "lookup+demo-drafter", "strategy": "auto"},
]


def test_lossless_on_a_first_turn_a_second_turn_and_after_an_eviction(served, client, capsys, monkeypatch, store):
    """Greedy text through the server: every speculation equals the target alone and `uag generate --strategy
    baseline` on a one-message request; on the second turn, replies that reuse the conversation's cache (with the
    speculation that filled it, and with another), a cold one, and one after the cache was evicted agree."""
    _, service = served
    prompt = "1. Warszawa\n2. Kraków\n3. Łódź\n4."
    turn1 = [{"role": "user", "content": prompt}]

    def ask(messages, speculative=None):
        extra = None if speculative is None else {"speculative": speculative}
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_body=extra)

    alone = ask(turn1, False).choices[0].message.content
    assert alone == _cli_baseline(capsys, monkeypatch, store, prompt, 8)
    for speculative in SPECULATIONS:
        reply = ask(turn1, speculative)
        assert reply.choices[0].message.content == alone, speculative
        assert reply.model_extra["speculative"]["drafter"] == speculative["drafter"]

    turn2 = [*turn1, {"role": "assistant", "content": alone}, {"role": "user", "content": "Dodaj Gdańsk."}]
    warm = ask(turn2)  # the server's default speculation, on the cache the first turn left
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    budget, service.caches.max_bytes = service.caches.max_bytes, 0  # every cache is evicted as it comes back
    try:
        service.caches.clear()
        evictions = service.caches.evictions
        cold = ask(turn2, False)
        assert service.caches.evictions > evictions and len(service.caches) == 0
    finally:
        service.caches.max_bytes = budget
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    evicted = ask(turn2, {"drafter": "lookup+demo-drafter", "strategy": "context", "k": 3})
    assert evicted.usage.prompt_tokens_details.cached_tokens == 0
    again = ask(turn2, False)  # the target alone on the caches a speculative run left
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    texts = [reply.choices[0].message.content for reply in (warm, cold, evicted, again)]
    assert texts == [cold.choices[0].message.content] * 4  # (warm, cold, evicted, again)


def test_a_client_that_disconnects_frees_the_worker(served, client):
    url, service = served
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 3000,
        "stream": True,
        "speculative": False,
    }
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    ) as response:
        for line in response.iter_lines():  # the first content delta, then the client goes away
            if '"content":"' in line and '"content":""' not in line:
                break
        else:
            pytest.fail("the stream ended before its first content")
    deadline = time.monotonic() + 120  # a bound on the wait, not a claim about speed
    while service.runner.worker.current is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert service.runner.worker.current is None
    last = service.snapshot()[0][-1]
    assert 0 < last.completion_tokens < 3000
    assert say(client, PROMPT, max_tokens=2).choices[0].message.content


def test_a_checked_request_is_compared_with_the_target_alone(client):
    """`"check": true` runs the target alone too: in float32 the greedy outputs agree token for token."""
    reply = say(
        client, PROMPT, max_tokens=6, extra_body={"speculative": {"drafter": "lookup+demo-drafter", "check": True}}
    )
    check = reply.model_extra["speculative"]["check"]
    assert check["kind"] == "identical" and check["position"] is None and check["message"] == ""
    assert check["baseline_tokens_per_second"] > 0 and check["measured_speedup"] > 0


def _perturbed_baseline(stream):
    """The engine's stream, but the target alone's last token replaced (a mismatch the check must find)."""

    def perturbed(target, choice, ids, config, **kw):
        run = None
        for event in stream(target, choice, ids, config, **kw):
            run = event.run
            yield event
        if choice is None and run is not None and run.tokens:  # the record is complete once the stream ends
            last = run.tokens[-1]
            run.tokens[-1] = type(last)(last.id + 1, last.text, last.from_draft)

    return perturbed


@pytest.mark.parametrize("threshold, kind", [(None, "diverged"), (1e9, "diverged_near_tie")])
def test_a_check_tells_a_near_tie_from_a_bug(served, client, monkeypatch, threshold, kind):
    """An injected mismatch: at the target's real (clear) margin it is a bug, loud in the reply and on the Server
    tab; where the dtype's rounding could reach that margin (an injected threshold) it is a near-tie."""
    from uag.runtime import divergence
    from uag.server.dashboard import server_view

    service = served[1]
    monkeypatch.setattr(service.host, "stream", _perturbed_baseline(service.host.stream))
    if threshold is not None:
        monkeypatch.setitem(divergence.NEAR_TIE_MARGIN, "float32", threshold)
    reply = say(client, PROMPT, max_tokens=4, extra_body={"speculative": {"drafter": "lookup", "check": True}})
    check = reply.model_extra["speculative"]["check"]
    assert check["kind"] == kind and check["position"] == 3
    assert check["step_margin"] is not None and check["pass_margin"] is not None
    assert ("not a bug" in check["message"]) == (kind == "diverged_near_tie")
    caption, frame, _ = server_view(service)
    label = "near-tie (rounding)" if kind == "diverged_near_tie" else "MISMATCH (bug)"
    assert frame["check"].iloc[0] == label and label in caption


def test_the_server_tab_shows_what_was_served(served):
    from uag.server.dashboard import server_view

    caption, frame, figure = server_view(served[1])
    assert len(frame) >= 5 and "requests" in caption and "estimate" in caption
    assert {"α", "speedup", "prompt (cached)"} <= set(frame.columns) and figure is not None


# --- bad requests ------------------------------------------------------------------------------------------------
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
BAD = [  # (name, path, body (dict or raw bytes), headers, status)
    ("malformed JSON", CHAT, b'{"model": ', None, 400),
    ("not an object", CHAT, b"[1, 2]", None, 400),
    ("no body", CHAT, b"", None, 400),
    ("not UTF-8", CHAT, b'{"model": "\xff"}', None, 400),
    ("no key", CHAT, GOOD, {"Authorization": ""}, 401),
    ("wrong key", CHAT, GOOD, {"Authorization": "Bearer nope"}, 401),
    ("oversized body", CHAT, {**GOOD, "pad": "x" * (5 * 2**20)}, None, 413),
    ("unknown route", "/v1/embeddings", GOOD, None, 404),
    ("unknown model", CHAT, {**GOOD, "model": "gpt-4o"}, None, 404),
    ("no model", CHAT, {"messages": GOOD["messages"]}, None, 400),
    ("unknown field", CHAT, {**GOOD, "temprature": 0.5}, None, 400),
    ("n > 1", CHAT, {**GOOD, "n": 3}, None, 400),
    ("empty messages", CHAT, {**GOOD, "messages": []}, None, 400),
    ("messages not a list", CHAT, {**GOOD, "messages": "hi"}, None, 400),
    ("unknown role", CHAT, {**GOOD, "messages": [{"role": "robot", "content": "x"}]}, None, 400),
    ("content a number", CHAT, {**GOOD, "messages": [{"role": "user", "content": 5}]}, None, 400),
    ("image part", CHAT, {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400),
    (
        "lone surrogate",
        CHAT,
        b'{"model": "demo-target", "messages": [{"role": "user", "content": "\\ud800"}]}',
        None,
        400,
    ),
    ("max_tokens a string", CHAT, {**GOOD, "max_tokens": "10"}, None, 400),
    ("max_tokens 0", CHAT, {**GOOD, "max_completion_tokens": 0}, None, 400),
    ("temperature too high", CHAT, {**GOOD, "temperature": 5}, None, 400),
    ("top_p 0", CHAT, {**GOOD, "top_p": 0}, None, 400),
    ("seed negative", CHAT, {**GOOD, "seed": -5}, None, 400),
    ("stop a number", CHAT, {**GOOD, "stop": 7}, None, 400),
    ("seventeen stops", CHAT, {**GOOD, "stop": [chr(97 + i) for i in range(17)]}, None, 400),
    ("stream_options without stream", CHAT, {**GOOD, "stream_options": {"include_usage": True}}, None, 400),
    ("logprobs", CHAT, {**GOOD, "logprobs": True}, None, 400),
    ("drafter not served", CHAT, {**GOOD, "speculative": {"drafter": "coder-drafter"}}, None, 400),
    ("k above the server's", CHAT, {**GOOD, "speculative": {"k": 20}}, None, 400),
    ("speculative a string", CHAT, {**GOOD, "speculative": "yes"}, None, 400),
    ("check not a bool", CHAT, {**GOOD, "speculative": {"check": "yes"}}, None, 400),
    ("check a sampled reply", CHAT, {**GOOD, "temperature": 0.7, "speculative": {"check": True}}, None, 400),
    (
        "tools with no template support",
        CHAT,
        {**GOOD, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
        None,
        400,
    ),
    ("too long for the target", COMPLETIONS, {"model": MODEL, "prompt": "ja " * 33000}, None, 400),
    (
        "too long for the drafter",
        COMPLETIONS,
        {"model": MODEL, "prompt": "ja " * 9000, "speculative": {"drafter": "demo-drafter"}},
        None,
        400,
    ),
    ("completions without prompt", COMPLETIONS, {"model": MODEL}, None, 400),
    ("echo", COMPLETIONS, {"model": MODEL, "prompt": "x", "echo": True}, None, 400),
    ("GET on a POST route", CHAT, None, None, 405),
]


def _reaches_the_worker(path: str, body, headers, service) -> bool:
    """Whether a request passes the key, the body limit and the field checks, and so is queued for the model
    worker (where the prompt's own checks refuse it)."""
    from uag.server.errors import APIError
    from uag.server.protocol import parse_chat, parse_completion
    from uag.server.routes import DEFAULT_MAX_BODY

    if headers or not isinstance(body, dict) or path not in (CHAT, COMPLETIONS):
        return False
    if len(json.dumps(body).encode()) > DEFAULT_MAX_BODY:  # the fixture's server keeps the default limit
        return False
    try:
        (parse_chat if path == CHAT else parse_completion)(body, service.defaults)
    except APIError:
        return False
    return True


def test_bad_requests_get_one_clear_openai_error_and_the_server_keeps_serving(served):
    """Each bad request: its status and one clear OpenAI error; then a good request succeeds. A request refused
    before it is queued (key, body, fields) never touches the model worker, so the good request after it is
    /v1/models through the same app; after one that reached the worker, and after the whole batch, it is a
    generation (one token, the target alone)."""
    url, service = served
    auth = {"Authorization": f"Bearer {KEY}"}
    good = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "speculative": False}
    messages, queued = set(), 0

    def generates(name: str) -> None:
        after = httpx.post(url + COMPLETIONS, json=good, headers=auth, timeout=120)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 1, name

    for name, path, body, headers, status in BAD:
        merged = {**auth, **(headers or {})}
        if body is None:
            response = httpx.get(url + path, headers=merged)
        elif isinstance(body, bytes):
            response = httpx.post(url + path, content=body, headers={**merged, "Content-Type": "application/json"})
        else:
            response = httpx.post(url + path, json=body, headers=merged, timeout=120)
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        message = error["message"]
        assert message and "\n" not in message and len(message) < 400, name
        for leak in ("Traceback", 'File "', "/work/", "site-packages", "NoneType", "KeyError", "ValueError"):
            assert leak not in message, (name, message)
        messages.add(message)
        if _reaches_the_worker(path, body, headers, service):
            queued += 1
            generates(name)
        else:
            models = httpx.get(url + "/v1/models", headers=auth)
            assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL, name
    generates("after the batch")
    assert service.runner.worker.current is None
    assert len(BAD) >= 30 and len(messages) >= 30  # distinct cases, distinct messages
    assert queued >= 3  # the prompt's checks on the worker (too long for either model, tools) are among them


def test_a_stream_that_cannot_start_is_an_http_error(served):
    url, _ = served
    body = {"model": MODEL, "prompt": "ja " * 33000, "stream": True}
    response = httpx.post(url + COMPLETIONS, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_sdk_errors_are_typed(client):
    with pytest.raises(openai.BadRequestError):
        say(client, PROMPT, n=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()


# --- the documented examples ---------------------------------------------------------------------------------------
def test_the_documented_examples_run_verbatim(served):
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    url, _ = served
    port = url.rsplit(":", 1)[1]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    blocks = re.findall(r"```(sh|python) server-example\n(.*?)```", doc, re.S)
    assert [kind for kind, _ in blocks] == ["sh", "python", "python"]
    env = {**os.environ, "UAG_API_KEY": KEY}
    for kind, code in blocks:
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        command = ["bash", "-c", code] if kind == "sh" else [sys.executable, "-c", code]
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        if kind == "sh":
            reply = json.loads(out.stdout)
            assert reply["choices"][0]["message"]["content"] and reply["speculative"]["drafter"] == "lookup"
        elif "check" in code:  # float32: the same tokens as the target alone
            assert out.stdout.startswith("identical "), out.stdout
        else:
            assert "acceptance_rate" in out.stdout
