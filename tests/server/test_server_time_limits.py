"""How long a request may run in `uag serve`: no time budget by default (a long reply that keeps writing is never
cut), a stall guard that stops a request making no progress (no token; a prompt read counts as one pass), and an
operator's `--time-budget` that cuts with `finish_reason` "length", the reason in the reply and a log line. Fakes
throughout: a fake target, a paced engine stream, limits of a fraction of a second."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import pytest

from tests.support.server import serve_args
from uag.core.config import GenerationConfig
from uag.core.records import Event, Run, Token
from uag.models.store import ModelStore
from uag.runtime.host import Host
from uag.runtime.jobs import DEFAULT_STALL_S, JobRunner
from uag.runtime.pair import Loaded
from uag.runtime.worker import MLXWorker
from uag.server.dialects import OPENAI_CHAT, Done
from uag.server.protocol import Request, ServerDefaults
from uag.server.service import Service


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path / "cache"))  # no saved costs of this machine's are read


class Tokenizer:
    has_chat_template = False

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "ab": 1, "abcd": 2}

    def encode(self, text: str) -> list[int]:
        return list(range(1, 1 + (len(text) + 3) // 4))


class Paced:
    """The engine's stream with its signature: `tokens` tokens, one every `every_s`, after a prompt read of `read_s`;
    from token `stall_at` on it writes nothing until cancelled (a stalled run). It ends as the engine does: "eos"
    after the last token, "stopped" at the first token after a cancel."""

    def __init__(self, tokens: int, every_s: float, *, read_s: float = 0.0, stall_at: int | None = None):
        self.tokens, self.every_s, self.read_s, self.stall_at = tokens, every_s, read_s, stall_at

    def __call__(self, target, drafter, ids, config, *, cancel=None, caches=None, **_):
        run = Run("baseline", target.name, prompt_ids=list(ids), max_tokens=config.max_tokens)
        return self._events(run, cancel)

    def _events(self, run: Run, cancel):
        time.sleep(self.read_s)
        for i in range(self.tokens):
            if i == self.stall_at:
                while not cancel.is_set():
                    time.sleep(0.01)
            token = Token(i, "ab ", False)
            run.tokens.append(token)
            run.last_token_s = time.perf_counter()
            run.first_token_s = run.first_token_s or run.last_token_s
            stopping = cancel.is_set()
            if stopping or i == self.tokens - 1:
                run.finish_reason = "stopped" if stopping else "eos"
            yield Event((token,), None, run)
            if stopping:
                return
            time.sleep(self.every_s)


def service(stream, *, budget_s: float | None, stall_s: float | None) -> Service:
    """A Service on a fake target (speculation off), its runner with these limits."""
    target = SimpleNamespace(
        name="org/target", dtype="float32", tokenizer=Tokenizer(), context_length=4096, weight_bytes=1000
    )
    defaults = ServerDefaults(model="org/target", drafter=None)
    runner = JobRunner(MLXWorker(), budget_s=budget_s, stall_s=stall_s)
    served = Service(Host(ModelStore(), runner, target="org/target", stream=stream), defaults, cache_bytes=0)
    served.load = lambda job, drafter, progress=None, host=None: Loaded(target, None, None)
    return served


def ask(served: Service) -> Done:
    config = GenerationConfig("baseline", max_tokens=200)
    request = Request("completion", model="org/target", config=config, drafter=None, prompt="Stolica Polski to")
    items = list(served.runner.run(served.job, request, label="an API request"))
    served.costs.close()
    return items[-1]


def test_uag_serve_sets_no_time_budget_and_a_stall_guard_by_default():
    settings = serve_args("--no-ui")
    assert settings.time_budget is None
    assert JobRunner(MLXWorker()).stall_s == DEFAULT_STALL_S == 600
    assert serve_args("--time-budget", "90").time_budget == 90


def test_a_reply_that_keeps_writing_is_not_cut():
    """Longer than the stall guard in all, a token every 0.05 s: the whole reply, no reason to report."""
    done = ask(service(Paced(tokens=12, every_s=0.05), budget_s=None, stall_s=0.3))
    assert done.finish == "stop" and done.report["usage"]["completion_tokens"] == 12
    assert "uag" not in done.report and "note" not in done.report["speculative"]


def test_a_long_prompt_read_is_not_a_stall():
    """The read before the first token takes longer than the guard: one pass nothing stops midway."""
    done = ask(service(Paced(tokens=3, every_s=0.01, read_s=0.8), budget_s=None, stall_s=0.2))
    assert done.finish == "stop" and "uag" not in done.report


def test_a_set_budget_cuts_with_a_reason_the_client_reads_and_a_log_line(caplog):
    caplog.set_level(logging.WARNING, logger="uag.server.service")
    done = ask(service(Paced(tokens=200, every_s=0.02), budget_s=0.3, stall_s=None))
    assert done.finish == "length" and 0 < done.report["usage"]["completion_tokens"] < 200
    assert done.report["uag"]["stopped_by"] == "time_budget"
    assert "time budget of 0.3 s" in done.report["uag"]["message"] and "--time-budget" in done.report["uag"]["message"]
    assert done.report["speculative"]["note"].startswith("stopped by the server's time budget")
    assert any("--time-budget" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    # OpenAI's reply carries it beside finish_reason "length", whole and on the streamed finish chunk
    chat = Request("chat", model="org/target", config=GenerationConfig(), drafter=None, stream=True)
    reply = OPENAI_CHAT.reply(chat)
    whole = reply.whole(done)
    assert whole["choices"][0]["finish_reason"] == "length" and whole["uag"]["stopped_by"] == "time_budget"
    events = [json.loads(e.removeprefix(b"data: ")) for e in reply.closing(done) if e.startswith(b"data: {")]
    finish = next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])
    assert finish["choices"][0]["finish_reason"] == "length" and finish["uag"]["stopped_by"] == "time_budget"


def test_a_stalled_request_is_stopped_and_says_so(caplog):
    caplog.set_level(logging.WARNING, logger="uag.server.service")
    tic = time.monotonic()
    done = ask(service(Paced(tokens=50, every_s=0.01, stall_at=5), budget_s=None, stall_s=0.3))
    assert time.monotonic() - tic < 10
    assert done.finish == "length" and done.report["usage"]["completion_tokens"] == 6  # five, then the stopping one
    assert done.report["uag"]["stopped_by"] == "stalled"
    assert "no progress for 0.3 s" in done.report["uag"]["message"]
    assert any("no progress" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
