"""The server's index shared across requests (issue #39, item 2): a later request drafts an earlier one's reply by
prompt lookup, within its API key only, losslessly; `--lookup-memory` sets the bound (0: off; refused with --shard).

A Service on a tiny random target (untied: varied text, which its own prompt never predicts) and its own worker,
the requests passed to `Service.job` as the HTTP layer passes them, with the key each presented.
"""

from __future__ import annotations

import hashlib

import pytest

from tests.support.server import serve_args
from tests.support.tiny_models import build_tiny
from uag.core.config import GenerationConfig
from uag.errors import InputError
from uag.runtime.host import Host
from uag.runtime.jobs import JobRunner
from uag.runtime.worker import MLXWorker
from uag.server.keys import digest_of
from uag.server.main import DEFAULT_LOOKUP_MEMORY
from uag.server.protocol import Request, ServerDefaults
from uag.server.service import Delta, Done, Service

PROMPT = "Ala ma kota, a kot ma Alę."


@pytest.fixture(scope="module")
def target_dir(store):
    path = str(build_tiny("mistral", "mistral-v1", seed=5, tie_embeddings=False))
    store.get(path)  # loaded once for the module
    return path


def service(store, target: str, lookup_memory: int) -> Service:
    defaults = ServerDefaults(model=target, drafter="lookup", drafters=("lookup",), strategy="context", k=8)
    runner = JobRunner(MLXWorker(), budget_s=120)
    host = Host(store, runner, target=target, lookup_memory=lookup_memory, off_path=True)
    served = Service(host, defaults, cache_bytes=0)
    served.costs.close()  # no measuring in the background
    return served


def ask(served: Service, key: str | None, drafter: str | None = "lookup", prompt: str = PROMPT) -> Done:
    config = GenerationConfig(k=8, max_tokens=24) if drafter else GenerationConfig("baseline", max_tokens=24)
    request = Request("completion", model=served.target_name, config=config, drafter=drafter, prompt=prompt)
    items = list(served.runner.run(served.job, request, key, label="an API request"))
    return next(item for item in items if isinstance(item, Done))


def test_a_later_request_drafts_an_earlier_reply_within_its_key_only(store, target_dir):
    served = service(store, target_dir, 10_000)
    alone = ask(served, "key-a", drafter=None)  # the target alone: also an earlier request of key a
    assert alone.report["speculative"]["shared_lookup_cycles"] == 0
    again = ask(served, "key-a")
    spec = again.report["speculative"]
    assert again.text == alone.text  # lossless
    assert spec["shared_lookup_cycles"] >= 1 and spec["accepted_tokens"] >= 16  # the earlier reply, copied
    assert spec["lookup"]["cycles"] >= spec["shared_lookup_cycles"] and spec["lookup"]["kept_per_cycle"] > 1
    other = ask(served, "key-b")  # another key never drafts from key a's requests
    assert other.text == alone.text and other.report["speculative"]["shared_lookup_cycles"] == 0
    keyless = ask(served, None)
    assert keyless.text == alone.text and keyless.report["speculative"]["shared_lookup_cycles"] == 0
    # kept by the key's digest, never the key
    held = served.host.memory.get((hashlib.sha256(b"key-a").hexdigest(), served.target_name))
    assert held is not None and len(held.documents) == 1  # the retried request replaced the same text
    assert served.host.memory.get(("key-a", served.target_name)) is None


def test_lookup_memory_off_drafts_from_each_request_alone(store, target_dir):
    served = service(store, target_dir, 0)
    ask(served, None, drafter=None)
    assert served.host.memory is None and ask(served, None).report["speculative"]["shared_lookup_cycles"] == 0


def test_the_lookup_memory_option():
    assert serve_args().lookup_memory == DEFAULT_LOOKUP_MEMORY
    assert serve_args("--lookup-memory", "0").lookup_memory == 0
    with pytest.raises(InputError, match="--lookup-memory must be at least 0"):
        serve_args("--lookup-memory", "-1")
    with pytest.raises(InputError, match="--lookup-memory: a sharded server"):
        serve_args("--shard", "tensor", "--lookup-memory", "1000")


def test_over_http_the_key_a_request_presented_is_the_one_it_drafts_within(store, target_dir):
    from fastapi.testclient import TestClient

    from uag.server.routes import create_app

    served = service(store, target_dir, 10_000)
    http = TestClient(create_app(served, api_key="key-a"), base_url="http://127.0.0.1")
    body = {"model": served.target_name, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    auth = {"Authorization": "Bearer key-a"}
    first = http.post("/v1/completions", json={**body, "speculative": False}, headers=auth)
    assert first.status_code == 200, first.text
    second = http.post("/v1/completions", json=body, headers=auth)
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert second.json()["speculative"]["shared_lookup_cycles"] >= 1
    held = hashlib.sha256(digest_of("key-a").encode()).hexdigest()  # the routes pass the key on as its digest
    assert served.host.memory.get((held, served.target_name)) is not None


def test_the_lookup_summary_counts_proposed_and_kept_tokens_per_lookup_cycle():
    from types import SimpleNamespace

    from uag.server.responses import lookup_summary

    cycle = lambda source, proposed, kept: SimpleNamespace(source=source, proposed_ids=[0] * proposed, accepted=kept)  # noqa: E731
    summary = lookup_summary([cycle("lookup", 16, 16), cycle("model", 4, 1), cycle("lookup", 40, 31)])
    assert summary == {
        "cycles": 2,
        "proposed_tokens": 56,
        "accepted_tokens": 47,
        "proposed_per_cycle": 28.0,
        "kept_per_cycle": 23.5,
    }
    assert lookup_summary([cycle("model", 4, 1)])["kept_per_cycle"] is None


def test_text_the_detokenizer_holds_back_to_the_end_reaches_the_reply(store, target_dir):
    """The engine's detokenizer may hold the last characters (a trailing space) until the run ends, when it adds
    them to the run's last token: the reply, streamed or whole, ends with them too."""
    from dataclasses import replace as replaced

    from uag.core.engine import stream as engine_stream

    def stream(*args, **kwargs):  # the engine's stream, its final flush made visible: " !" held back to the end
        events = engine_stream(*args, **kwargs)
        last = None
        try:
            for event in events:
                last = event.run
                yield event
        finally:
            events.close()
            if last is not None and last.tokens:
                last.tokens[-1] = replaced(last.tokens[-1], text=last.tokens[-1].text + " !")

    defaults = ServerDefaults(model=target_dir, drafter="lookup", drafters=("lookup",), strategy="context", k=8)
    host = Host(store, JobRunner(MLXWorker(), budget_s=120), target=target_dir, stream=stream, off_path=True)
    served = Service(host, defaults, cache_bytes=0)
    served.costs.close()
    request = Request(
        "completion",
        model=served.target_name,
        config=GenerationConfig(k=8, max_tokens=8),
        drafter="lookup",
        prompt=PROMPT,
    )
    items = list(served.runner.run(served.job, request, None, label="an API request"))
    done = next(item for item in items if isinstance(item, Done))
    streamed = "".join(item.text for item in items if isinstance(item, Delta)) + done.tail
    assert streamed.endswith(" !") and done.text.endswith(" !") and done.text == streamed
