"""Several models behind one `uag serve` (--serve): a request's `model` picks one on every API, each answers as a
server of its own would, the store's budget unloads the least recently used model first and never one a running
request uses, an unknown model gets the API's 404, and bad --serve values one-line messages. Three tiny random
models with Mistral's tokenizer and untied embeddings (their greedy replies differ; a load is about a second); the
demo and coder targets from one process where the coder pair is converted."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from tests.support.coder import needs_coder_pair
from tests.support.server import held, serve_args, serving, until
from uag.errors import InputError
from uag.server.main import parse_serve
from uag.server.protocol import ModelRouter, ServerDefaults

PROMPT = "Hello there"
# Speculation as fixed as the replies: lookup at a fixed k (auto's cost keeper would take the worker while idle).
FLAGS = ("--drafter", "lookup", "--strategy", "context", "-k", "4", "--no-ui", "--cache-gb", "0", "--max-tokens", "8")
TINY = {"a": ("mistral", 11), "b": ("llama", 12), "c": ("mistral", 13)}


@contextmanager
def server(*argv: str, store=None):
    """`uag serve` with these flags at a free port: (url, service); its cost keepers and worker stopped after."""
    from uag.server.main import build

    app, service = build(serve_args(*argv), store=store)
    for keeper in service.keepers.values():
        keeper.close()
    try:
        with serving(app) as url:
            yield url, service
    finally:
        service.runner.worker.close(10)


def chat(url: str, model: str, prompt: str = PROMPT, max_tokens: int | None = None) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def folders() -> dict[str, str]:
    from tests.support.tiny_models import build_tiny

    return {
        name: str(build_tiny(arch, "mistral-v1", seed=seed, tie_embeddings=False))
        for name, (arch, seed) in TINY.items()
    }


@pytest.fixture(scope="module")
def alone(folders) -> dict[str, str]:
    """Each model's greedy reply to PROMPT from a server that serves it alone (--target, as before --serve)."""
    replies = {}
    for name, folder in folders.items():
        with server("--target", folder, *FLAGS) as (url, _):
            replies[name] = chat(url, folder)
    assert len(set(replies.values())) == len(replies)  # the replies tell the models apart
    return replies


@pytest.fixture(scope="module")
def served(folders):
    """a, b and c from one server whose store keeps two models; gpt-* answered as b, claude-* as the default a."""
    argv = [arg for name, folder in folders.items() for arg in ("--serve", f"{name}={folder}")]
    limits = ("--max-models", "2", "--max-batch", "3", "--per-client", "8")
    aliases = ("--model-alias", "gpt-*=b", "--model-alias", "claude-*")
    with server(*argv, *FLAGS, *limits, *aliases) as (url, service):
        yield url, service


def held_by(service, folders) -> list[str]:
    """The served names of the models the store holds, least recently used first."""
    names = {folder: name for name, folder in folders.items()}
    return [names[loaded] for loaded in service.store.loaded]


# --- routing ------------------------------------------------------------------------------------------------------
def test_models_lists_every_served_model_and_an_alias_reads_as_its_model(served):
    url, _ = served
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["a", "b", "c"]
    assert httpx.get(url + "/v1/models/b").json()["id"] == "b"
    assert httpx.get(url + "/v1/models/gpt-4o").json()["id"] == "b"
    assert httpx.get(url + "/v1/models/claude-haiku-4-5").json()["id"] == "a"
    missing = httpx.get(url + "/v1/models/llama3")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_alternating_requests_each_get_what_their_model_alone_answers(served, folders, alone):
    from prometheus_client.parser import text_string_to_metric_families

    url, service = served
    for name in ("a", "b", "a", "b", "c", "a"):
        assert chat(url, name) == alone[name], name
        assert held_by(service, folders)[-1] == name  # the model just used is the most recently used
    assert chat(url, "gpt-4o") == alone["b"] and chat(url, "claude-3-5-haiku") == alone["a"]
    scrape = httpx.get(url + "/metrics").text
    generated = {
        s.labels["model_name"]: s.value
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
        if s.name == "uag:generation_tokens_total"
    }
    assert set(generated) == {"a", "b", "c"} and all(generated.values())  # counted per served model


BODIES = {
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 4},
    "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": PROMPT}]},
    "/v1/responses": {"input": PROMPT, "max_output_tokens": 4},
    "/infill": {"input_prefix": "def f(x):\n    ", "input_suffix": "\n", "n_predict": 4},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_every_api_is_routed_by_its_model(served, folders, path):
    """A request for the model the store does not hold loads it: routed, whatever the API (the tiny models have no
    FIM tokens: /infill's 400 comes after the load)."""
    url, service = served
    missing = next(name for name in folders if name not in held_by(service, folders))
    answer = httpx.post(url + path, json={"model": missing, **BODIES[path]}, timeout=300)
    assert answer.status_code == (400 if path == "/infill" else 200), answer.text
    assert held_by(service, folders)[-1] == missing


def test_infill_serves_an_id_it_does_not_know_with_the_default_model(served, folders):
    url, service = served
    chat(url, "b")
    chat(url, "c")  # a is not loaded now
    body = {"model": "some-editor-default", **BODIES["/infill"]}
    assert httpx.post(url + "/infill", json=body, timeout=300).status_code == 400  # no FIM tokens, but a ran
    assert held_by(service, folders)[-1] == "a"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/responses", {"input": PROMPT}),
    ],
)
def test_an_unknown_model_gets_openais_404(served, path, body):
    url, _ = served
    answer = httpx.post(url + path, json={"model": "gpt-3.5-turbo-instruct", **body}, timeout=60)  # not gpt-*: b
    assert answer.status_code == 200
    answer = httpx.post(url + path, json={"model": "llama3", **body}, timeout=60)
    error = answer.json()["error"]
    assert answer.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert 'it serves "a", "b" and "c"' in error["message"], error


def test_an_unknown_model_on_the_messages_api_gets_anthropics_404(served):
    url, _ = served
    body = {"model": "llama3", "max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        answer = httpx.post(url + path, json=body, timeout=60)
        assert answer.status_code == 404, path
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "not_found_error"


# --- the store's budget ---------------------------------------------------------------------------------------------
def test_the_least_recently_used_model_is_unloaded_first(served, folders, alone):
    url, service = served
    gone: list[str] = []
    names = {folder: name for name, folder in folders.items()}
    service.store.on_evict.append(lambda model: gone.append(names[model.name]))
    try:
        for name in ("a", "b"):
            chat(url, name)
        assert held_by(service, folders) == ["a", "b"]
        gone.clear()
        for name, held in (("a", ["b", "a"]), ("c", ["a", "c"]), ("b", ["c", "b"])):
            assert chat(url, name) == alone[name]  # a model loaded again answers as before
            assert held_by(service, folders) == held
        assert gone == ["b", "a"]
    finally:
        service.store.on_evict.pop()


def test_a_model_a_running_request_uses_is_never_unloaded(served, folders, alone):
    """Three requests for three models run together on a store that keeps two: the third's load finds the other
    two generating, so the store holds three until one ends, and only then unloads the least recently used. No
    model is unloaded while a request generates with it."""
    url, service = served
    names = {folder: name for name, folder in folders.items()}
    generating: Counter[str] = Counter()
    unloaded: list[tuple[str, bool]] = []  # (model, whether a request was generating with it then)
    most = []

    def tracked(host, stream):
        def run(target, *args, **kwargs):
            generating[names[target.name]] += 1
            most.append(len(service.store.loaded))
            try:
                yield from stream(target, *args, **kwargs)
            finally:
                generating[names[target.name]] -= 1

        return run

    hosts = service.hosts.values()
    streams = {host: host.stream for host in hosts}
    for host in hosts:
        host.stream = tracked(host, host.stream)
    service.store.on_evict.append(lambda model: unloaded.append((names[model.name], generating[names[model.name]] > 0)))
    try:
        worker = service.runner.worker
        with ThreadPoolExecutor(3) as pool, held(service):
            replies = [pool.submit(chat, url, name) for name in ("a", "b", "c")]
            until(lambda: worker.backlog >= 3)
        assert [reply.result() for reply in replies] == [alone["a"], alone["b"], alone["c"]]
    finally:
        service.store.on_evict.pop()
        for host, stream in streams.items():
            host.stream = stream
    assert max(most) == 3  # all three loaded at once: over budget rather than unload a running model
    assert unloaded and not any(running for _, running in unloaded), unloaded
    assert len(service.store.loaded) == 2 and not service.store.pinned_names  # back within budget, nothing pinned


# --- the command line -----------------------------------------------------------------------------------------------
def test_serve_adds_models_and_fills_their_fields_from_the_flags():
    settings = serve_args(
        "--serve",
        "demo=demo-target",
        "--serve",
        "coder=coder-target,drafter=lookup+coder-drafter,drafters=lookup,coder-drafter,k=4,target-dtype=bf16",
        "--model-alias",
        "claude-*=coder",
        "--model-alias",
        "gpt-*",
        "--max-gb",
        "9",
    )
    demo, coder = settings.models
    assert (demo.name, demo.target, demo.drafter) == ("demo", "demo-target", "lookup+demo-drafter")
    assert demo.drafters == ("lookup+demo-drafter", "lookup")  # --drafter's and --drafters' defaults
    assert (coder.name, coder.target, coder.drafter) == ("coder", "coder-target", "lookup+coder-drafter")
    assert coder.drafters == ("lookup+coder-drafter", "lookup", "coder-drafter")
    assert coder.config.k == 4 and coder.target_dtype == "bfloat16" and demo.target_dtype is None
    assert (demo.aliases, coder.aliases) == (("gpt-*",), ("claude-*",)) and settings.max_gb == 9
    assert settings.target == "demo-target"  # the default model's, as with one model
    assert [m.name for m in serve_args("--target", "demo-target", "--serve", "c=coder-target").models] == [
        "demo-target",
        "c",
    ]
    assert [m.name for m in serve_args().models] == ["demo-target"]  # one model, as always


def test_parse_serve_example():
    text = "coder=coder-target,drafter=lookup+coder-drafter,drafters=lookup,coder-drafter"
    assert parse_serve(text) == (
        "coder",
        "coder-target",
        {"drafter": "lookup+coder-drafter", "drafters": "lookup,coder-drafter"},
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--serve", "coder"], "--serve 'coder': give NAME=TARGET"),
        (["--serve", "x=coder-target,temperature=1"], "--serve 'x=coder-target,temperature=1': unknown field 'temp"),
        (["--serve", "x=coder-target,k=4,k=5"], "k is given twice"),
        (["--serve", "x=coder-target,lookup"], "'lookup' is not FIELD=VALUE"),
        (["--serve", "x=coder-target,k=0"], "--serve x: k: "),
        (["--serve", "x=coder-target,strategy=fast"], "--serve x: strategy: "),
        (["--serve", "x=coder-target,drafters=lookup+"], "--serve x: drafters: "),
        (["--serve", "x=coder-target,target-dtype=int3"], "--serve x: target-dtype"),
        (["--serve", "x=demo-target", "--serve", "x=coder-target"], "two models are named 'x'"),
        (["--serve", "x=demo-target", "--model-alias", "gpt-*=y"], "no served model is named 'y' (served: x)"),
        (["--max-gb", "0"], "--max-gb must be more than 0 (got 0)"),
        (["--serve", "x=demo-target", "--shard", "tensor", "--drafter", "lookup"], "a sharded server serves one"),
    ],
)
def test_bad_serve_values_get_one_line_messages(argv, message):
    with pytest.raises(InputError) as caught:
        serve_args(*argv)
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_the_router_picks_by_name_then_alias_and_falls_back_only_where_told():
    a = ServerDefaults(model="a", drafter=None, aliases=("claude-*", "b*"))
    b = ServerDefaults(model="b", drafter=None, aliases=("gpt-*",))
    router = ModelRouter((a, b))
    assert router.pick({"model": "b"}) is b  # a served name before a's alias b*
    assert router.pick({"model": "bert"}) is a and router.pick({"model": "gpt-4o"}) is b
    assert router.pick({"model": 7}) is a and router.pick([]) is a  # the dialect's parse says what is wrong
    assert router.pick({"model": "llama3"}, any_model=True) is a
    with pytest.raises(Exception, match='does not exist on this server: it serves "a" and "b"'):
        router.pick({"model": "llama3"})
    with pytest.raises(ValueError, match="its own name"):
        ModelRouter((a, a))


# --- the demo and coder targets from one process --------------------------------------------------------------------
@pytest.mark.slow
@needs_coder_pair
def test_the_demo_and_coder_targets_from_one_server_answer_as_each_alone():
    """Alternating requests to one server serving both targets (each with SmolLM2 drafting across tokenizers) get
    the greedy replies of a server serving each alone. One store for all three servers: each model loads once; a
    store of its own, cleared after the test, so that the 7 GB coder target is not held for the rest of the run
    (FastAPI keeps a stopped app's endpoints, and through them its hosts, alive in a cache)."""
    from uag.models.store import ModelStore

    store = ModelStore()
    flags = ("--drafter", "lookup+demo-drafter", "--strategy", "context", "-k", "4", "--no-ui", "--cache-gb", "0")
    flags += ("--max-tokens", "6", "--max-batch", "1")  # one at a time: the session's models stay unwrapped
    prompts = {"demo-target": "Name a colour.", "coder": "Write a Python function that adds two numbers."}
    alone = {}
    try:
        for name, target in (("demo-target", "demo-target"), ("coder", "coder-target")):
            with server("--target", target, *flags, store=store) as (url, _):
                alone[name] = chat(url, target, prompts[name])
        with server("--target", "demo-target", "--serve", "coder=coder-target", *flags, store=store) as (url, service):
            for name in ("demo-target", "coder", "demo-target", "coder"):
                assert chat(url, name, prompts[name]) == alone[name], name
            assert {"demo-target", "coder-target"} <= set(service.store.loaded)
    finally:
        store.clear()
