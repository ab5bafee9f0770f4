"""A stand-in for the engine's stream that replies with scripted text, for server tests that need a model to
say something exact (a tool call) on a tiny random model. It keeps the prompt ids each request rendered."""

from __future__ import annotations

import time
from collections.abc import Iterator

from uag.core.records import Event, Run, Token


class Scripted:
    """`stream(target, drafter, ids, config, …)` with the engine's signature; each call takes the next reply.
    A reply that is an exception is raised after the first piece of text (a failure mid-stream)."""

    def __init__(self):
        self.replies: list[str | BaseException] = []
        self.prompts: list[list[int]] = []

    def __call__(self, target, drafter, ids, config, *, cancel=None, caches=None, **_) -> Iterator[Event]:
        self.prompts.append(list(ids))
        reply = self.replies.pop(0)
        run = Run("baseline", target.name, prompt_ids=list(ids), max_tokens=config.max_tokens)
        return self._events(run, reply)

    @staticmethod
    def _events(run: Run, reply: str | BaseException) -> Iterator[Event]:
        text = reply if isinstance(reply, str) else "Hm"
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
        for i, piece in enumerate(pieces):
            token = Token(i, piece, False)
            run.tokens.append(token)
            run.last_token_s = time.perf_counter()
            run.first_token_s = run.first_token_s or run.last_token_s
            if isinstance(reply, BaseException):
                raise reply
            if i == len(pieces) - 1:
                run.finish_reason = "eos"
            yield Event((token,), None, run)
