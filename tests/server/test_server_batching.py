"""Continuous batching through `uag serve`'s HTTP API (issue #37, item 4): greedy, float32 (the offline models as
stored), each request sent concurrently gets the reply it gets sent alone to the same server — its text, finish
reason and token count — 2, 4 and 8 at once of different lengths, drafters, strategies and routes; one arriving
mid-run; one cancelled mid-run; one cut by a stop string; one forced to call a tool (a tiny Qwen2.5, whose template
takes tools); a conversation's second turn after its cache was evicted. Every reply's `speculative.batch` says how
many requests its passes served.

One demo-pair server for the module (`--max-batch 8`, conversation caches off unless a test turns them on, no cost
measuring in the background). A concurrent group starts together: a job of the test's holds the worker until
every request is queued, then they all join the batch at once.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from tests.support.server import held, until

pytestmark = pytest.mark.slow

DRAFTERS = "lookup,demo-drafter,lookup+demo-drafter"
LIST = "1. Warszawa\n2. Kraków\n3. Łódź\n4. Wrocław\n5."
CODE = "def fib(n):\n    if n < 2:\n        return n\n    return"
LONG = "Ala ma kota, a kot ma Alę. " * 24 + "Ala ma"  # read in chunks (more than READ_CHUNK tokens)


@dataclass(frozen=True)
class Ask:
    """One request: its route, prompt (a user message for chat), max_tokens and `speculative` (None: the server's
    default, lookup+demo-drafter with auto)."""

    name: str
    route: str  # chat or completions
    prompt: str | list
    max_tokens: int
    speculative: Any = None
    stop: str | None = None
    extra: tuple = ()  # more fields, as (key, value) pairs

    def body(self, **more) -> tuple[str, dict]:
        body = {"model": "demo-target", "max_tokens": self.max_tokens, "temperature": 0, **dict(self.extra), **more}
        if self.route == "chat":
            messages = self.prompt if isinstance(self.prompt, list) else [{"role": "user", "content": self.prompt}]
            body["messages"] = messages
        else:
            body["prompt"] = self.prompt
        if self.speculative is not None:
            body["speculative"] = self.speculative
        if self.stop is not None:
            body["stop"] = [self.stop]
        return f"/v1/{'chat/completions' if self.route == 'chat' else 'completions'}", body


@dataclass(frozen=True)
class Reply:
    text: str  # content; a tool call's name and arguments after it
    finish: str
    tokens: int
    batch: dict | None = None
    cached: int = 0

    @property
    def same(self) -> tuple[str, str, int]:
        """What must not change with the company a request keeps."""
        return self.text, self.finish, self.tokens


ASKS = [  # first 2, first 4, all 8 at once; the first two make a target pass every round from the first on
    Ask("list", "completions", LIST, 16, {"drafter": "lookup", "strategy": "context", "k": 4}),
    Ask("fox", "completions", "The quick brown fox", 8, False),
    Ask("capital", "chat", "Stolica Polski to", 10),
    Ask("long", "completions", LONG, 32, {"drafter": "lookup+demo-drafter", "strategy": "context", "k": 3}),
    Ask("story", "chat", "Opowiedz krótką bajkę o kocie.", 20, {"drafter": "demo-drafter"}),
    Ask("code", "completions", CODE, 24, {"drafter": "demo-drafter", "strategy": "naive", "k": 2}),
    Ask("count", "chat", "Policz od 1 do 20: 1, 2, 3,", 12, {"drafter": "lookup", "strategy": "auto"}),
    Ask("days", "chat", "Dni tygodnia: poniedziałek, wtorek,", 20, {"drafter": "demo-drafter", "strategy": "context"}),
]


def parsed(data: dict, route: str) -> Reply:
    choice = data["choices"][0]
    text = (choice["message"]["content"] or "") if route == "chat" else choice["text"]
    for call in (choice.get("message") or {}).get("tool_calls") or []:
        text += f"\n{call['function']['name']}({call['function']['arguments']})"
    usage = data["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Reply(text, choice["finish_reason"], usage["completion_tokens"], data["speculative"].get("batch"), cached)


def ask(url: str, request: Ask) -> Reply:
    path, body = request.body()
    response = httpx.post(url + path, json=body, timeout=600)
    assert response.status_code == 200, (request.name, response.text)
    return parsed(response.json(), request.route)


def streamed(url: str, request: Ask, *, started: threading.Event | None = None, leave_after: int = 0):
    """A streamed request's Reply; with `leave_after`, the text of that many content chunks, then the client
    closes the stream. `started` is set at the first content chunk."""
    path, body = request.body(stream=True, stream_options={"include_usage": True})
    pieces, finish, last = [], None, None
    with httpx.stream("POST", url + path, json=body, timeout=600) as response:
        assert response.status_code == 200, request.name
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") if request.route == "chat" else choice["text"]
                if piece:
                    pieces.append(piece)
                    if started is not None:
                        started.set()
                finish = choice["finish_reason"] or finish
            if leave_after and len(pieces) >= leave_after:
                return "".join(pieces)
            last = chunk
    return Reply("".join(pieces), finish, last["usage"]["completion_tokens"], last["speculative"].get("batch"))


def together(served, requests: list[Ask], *, call=ask) -> list:
    """The requests sent at once, each from its own thread, all queued before any starts."""
    url, service = served
    worker = service.runner.worker
    with ThreadPoolExecutor(len(requests)) as pool, held(service):
        futures = [pool.submit(call, url, request) for request in requests]
        until(lambda: worker.backlog >= len(requests) or any(f.done() for f in futures))
    return [f.result() for f in futures]


def unshare(service) -> None:
    """The session's models as they were before this server shared them (other modules use the same store)."""
    from tests.support.tiny_models import unshare as unshare_models

    pair = service.host.loaded("lookup+demo-drafter")
    if pair is not None:
        unshare_models(pair[0], pair[1].model)


@pytest.fixture(scope="module")
def served(store):
    from tests.support.server import serve_args, serving
    from uag.server.main import build

    settings = serve_args(
        "--max-batch",
        "8",
        "--per-client",
        "16",
        "--max-queue",
        "32",
        "--no-ui",
        "--cache-gb",
        "0",
        "--drafters",
        DRAFTERS,
        "--max-tokens",
        "40",
    )
    app, service = build(settings, store=store)
    service.costs.close()  # auto learns its costs as it runs; nothing else takes the worker between the tests' jobs
    assert service.batched and service.runner.worker.max_batch == 8
    try:
        with serving(app) as url:
            yield url, service
    finally:
        unshare(service)


@pytest.fixture(scope="module")
def alone(served):
    """Each request's reply sent alone (once per module, by name)."""
    replies: dict[str, Reply] = {}

    def reply(request: Ask) -> Reply:
        if request.name not in replies:
            replies[request.name] = ask(served[0], request)
            assert replies[request.name].batch == {"mean": 1.0, "largest": 1}, request.name
        return replies[request.name]

    return reply


@pytest.mark.parametrize("n", [2, 4, 8])
def test_requests_sent_together_get_the_replies_they_get_alone(served, alone, n):
    requests = ASKS[:n]
    replies = together(served, requests)
    assert [r.same for r in replies] == [alone(request).same for request in requests]
    for request, reply in zip(requests, replies):
        assert 1 <= reply.batch["mean"] <= reply.batch["largest"] <= n, (request.name, reply.batch)
    assert all(reply.batch["largest"] > 1 for reply in replies[:2])  # their first passes were one (the others' vary)
    realised = [reply.batch["realised"] for reply in replies if "realised" in reply.batch]
    if n == 8:  # auto's runs (its evidence is the pair's): what their batched cycles came to against their prices
        assert realised and all(set(r) <= {"plain", "model", "lookup"} and min(r.values()) > 0 for r in realised)


def test_a_request_arriving_mid_run_joins_and_loses_nothing(served, alone):
    url, _ = served
    first = [replace(ASKS[1], name="fox-32", max_tokens=32), replace(ASKS[4], name="story-32", max_tokens=32)]
    late = ASKS[2]  # its target passes come while the target alone still writes one token a round
    started = [threading.Event() for _ in first]
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(streamed, url, request, started=event) for request, event in zip(first, started)]
        until(lambda: all(event.is_set() for event in started) or any(f.done() for f in running))
        assert not any(f.done() for f in running)  # both are still generating when the late one comes
        joined = pool.submit(ask, url, late).result()
        replies = [f.result() for f in running]
    assert [r.same for r in replies] == [alone(request).same for request in first]
    assert joined.same == alone(late).same and joined.batch["largest"] > 1


def test_a_request_cancelled_mid_run_leaves_the_others_as_they_were(served, alone):
    url, service = served
    leaving = replace(ASKS[1], name="fox-40", max_tokens=40)  # cancelled after 2 chunks
    staying = [ASKS[0], ASKS[6]]
    expected = [alone(request) for request in (leaving, *staying)]  # first: the last run of the target alone is ours

    def call(url, request):
        return streamed(url, request, leave_after=2) if request is leaving else ask(url, request)

    seen, *replies = together(served, [leaving, *staying], call=call)
    assert expected[0].text.startswith(seen) and seen
    assert [r.same for r in replies] == [e.same for e in expected[1:]]
    until(lambda: service.runner.worker.running == 0)
    cancelled = next(s for s in reversed(service.snapshot()[0]) if s.prompt_tokens and s.strategy == "baseline")
    assert 2 <= cancelled.completion_tokens < 40
    assert ask(url, ASKS[1]).same == alone(ASKS[1]).same  # the server answers the next request


def test_a_request_cut_by_a_stop_string_beside_others(served, alone):
    whole = alone(ASKS[7])
    word = whole.text.split()[2]
    cut = replace(ASKS[7], name="days-stop", stop=word)
    expected = alone(cut)
    assert expected.finish == "stop" and expected.text == whole.text[: whole.text.index(word)]
    replies = together(served, [cut, ASKS[0], ASKS[2]])
    assert [r.same for r in replies] == [expected.same, alone(ASKS[0]).same, alone(ASKS[2]).same]


def test_a_batched_request_s_prompt_is_translated_once(served, alone, monkeypatch):
    """Checking the drafter's room translates the prompt for the demo drafter (its own tokenizer); the run takes that
    translator rather than translate the prompt again on the batch's worker, whose time every member waits on (a
    worker's profile on an H200 spent 4.6 % of it translating prompts, twice each: docs/results.md, do)."""
    from uag.core.translate import TextTranslator

    requests = [ASKS[4], replace(ASKS[4], name="story-2", prompt="Opowiedz krótką bajkę o psie.")]
    expected = [alone(request).same for request in requests]
    start, prompts = TextTranslator.start, []
    monkeypatch.setattr(TextTranslator, "start", lambda self, ids: prompts.append(len(ids)) or start(self, ids))
    assert [r.same for r in together(served, requests)] == expected
    assert len(prompts) == 2  # one each


def test_a_second_turn_after_its_conversation_cache_was_evicted(served, alone):
    """Conversation caches on, with room for one: two first turns together leave one cache (the other evicted); the
    two second turns together, one warm and one cold, give the replies each gets alone and cold."""
    url, service = served
    caches = service.caches
    lists = ("1. Warszawa\n2. Kraków\n3. Łódź\n4.", "1. Wisła\n2. Odra\n3. Warta\n4.")  # a turn 2 reuses a cache
    firsts = [Ask(f"turn1-{i}", "chat", [{"role": "user", "content": text}], 8) for i, text in enumerate(lists)]

    def second(first: Ask, reply: Reply) -> Ask:  # that holds at least half of what it shares (MIN_SHARED)
        more = [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Dodaj Gdańsk."}]
        return Ask(first.name.replace("1", "2"), "chat", [*first.prompt, *more], 8)

    try:
        caches.max_bytes = 1e12
        one = alone(firsts[0])
        size = caches.nbytes
        assert len(caches) == 1 and size > 0
        caches.clear()
        caches.max_bytes, evictions = 1.5 * size, caches.evictions
        turn1 = together(served, firsts)
        assert len(caches) == 1 and caches.evictions == evictions + 1
        assert turn1[0].same == one.same
        seconds = [second(first, reply) for first, reply in zip(firsts, turn1)]
        turn2 = together(served, seconds)
        assert sorted(reply.cached > 0 for reply in turn2) == [False, True]
        caches.max_bytes = 0  # the references: alone, cold
        caches.clear()
        assert [r.same for r in turn2] == [alone(request).same for request in seconds]
        assert turn1[1].same == alone(firsts[1]).same
    finally:
        caches.max_bytes = 0
        caches.clear()


# --- a forced tool call: a tiny random Qwen2.5 carries a template with tools ------------------------------------------
CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Paris"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather now.", "parameters": CITY},
}


@pytest.fixture(scope="module")
def tiny_served():
    from tests.support.server import serve_args, serving
    from tests.support.tiny_models import build_tiny
    from uag.server.main import build

    folder = str(build_tiny("qwen2", "qwen2.5"))
    settings = serve_args(
        "--target",
        folder,
        "--drafter",
        "off",
        "--drafters",
        "lookup",
        "--no-ui",
        "--cache-gb",
        "0",
        "--max-batch",
        "4",
        "--per-client",
        "8",
        "--max-tokens",
        "24",
    )
    app, service = build(settings)
    service.costs.close()
    with serving(app) as url:
        yield url, service, folder


def test_a_forced_tool_call_beside_others(tiny_served):
    url, service, folder = tiny_served
    weather = [{"role": "user", "content": "What is the weather in Oslo?"}]
    requests = [
        Ask("tool", "chat", weather, 24, extra=(("tools", [WEATHER]), ("tool_choice", "required"))),
        Ask("chat", "chat", "Say hello.", 16, {"drafter": "lookup", "strategy": "context", "k": 4}),
        Ask("plain", "completions", "Hello, world. Hello,", 12, False),
    ]
    requests = [replace(r, extra=(*r.extra, ("model", folder))) for r in requests]
    alone = [ask(url, request) for request in requests]
    assert "get_weather(" in alone[0].text
    replies = together((url, service), requests)
    assert [r.same for r in replies] == [r.same for r in alone]
    assert all(r.batch["largest"] > 1 for r in replies)
