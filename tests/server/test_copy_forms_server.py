"""A reply that may write JSON (a request with tools or a JSON grammar) drafts by lookup from the prompt as a JSON
string holds it too (uag.core.copy_forms); other requests do not build those views; the output stays the target's.

A Service on a tiny random target and its own worker, the requests passed to `Service.job` as the HTTP layer passes
them; the host's engine stream is wrapped to see the drafter choice each run was given.
"""

from __future__ import annotations

import pytest

from tests.support.tiny_models import build_tiny
from uag.core.config import GenerationConfig
from uag.core.engine import stream as engine_stream
from uag.core.grammar import response_format_constraint
from uag.runtime.host import Host
from uag.runtime.jobs import JobRunner
from uag.runtime.worker import MLXWorker
from uag.server.protocol import Request, ServerDefaults
from uag.server.service import Done, Service

PROMPT = 'Kot: {"imie": "Filemon",\n "wiek": 3}.\nOpis kota w JSON:'


@pytest.fixture(scope="module")
def target_dir(store):
    path = str(build_tiny("mistral", "mistral-v1", seed=5, tie_embeddings=True))
    store.get(path)
    return path


def served_with_choices(store, target: str) -> tuple[Service, list]:
    choices = []

    def stream(target_model, choice, *args, **kwargs):
        choices.append(choice)
        return engine_stream(target_model, choice, *args, **kwargs)

    defaults = ServerDefaults(model=target, drafter="lookup", drafters=("lookup",), strategy="context", k=8)
    host = Host(store, JobRunner(MLXWorker(), budget_s=120), target=target, lookup_memory=0, off_path=True)
    host.stream = stream
    served = Service(host, defaults, cache_bytes=0)
    served.costs.close()  # no measuring in the background
    return served, choices


def ask(served: Service, config: GenerationConfig, drafter: str | None = "lookup") -> Done:
    request = Request("completion", model=served.target_name, config=config, drafter=drafter, prompt=PROMPT)
    items = list(served.runner.run(served.job, request, None, label="an API request"))
    return next(item for item in items if isinstance(item, Done))


def test_a_json_reply_drafts_from_the_copy_forms_and_a_plain_one_does_not(store, target_dir):
    served, choices = served_with_choices(store, target_dir)
    json_reply = GenerationConfig(k=8, max_tokens=24, constraint=response_format_constraint({"type": "json_object"}))
    alone = ask(served, GenerationConfig("baseline", max_tokens=24, constraint=json_reply.constraint), drafter=None)
    drafted = ask(served, json_reply)
    plain = ask(served, GenerationConfig(k=8, max_tokens=24))
    assert [None if c is None else c.copy_forms for c in choices] == [None, True, False]
    assert drafted.text == alone.text  # lossless under the grammar, with the views
    assert drafted.report["speculative"]["drafter"] == "lookup" and plain.text
