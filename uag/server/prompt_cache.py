"""Recent conversations' KV caches, kept for their next turn: an LRU keyed by token prefix, within a byte budget.

A chat client sends the whole conversation with every request, so turn n + 1's prompt starts with turn n's
prompt and reply. The engine, given the `PromptCaches` of turn n (uag.core.engine), trims them to the common
prefix and reads only what is new, for the target and the drafter model alike. This module decides which held
caches a new prompt reuses and which to drop. It never looks inside a cache (no mlx): it needs only the target
ids an entry holds, its size and a copy of its first tokens (`target_ids`, `nbytes()`, `prefix(n)`). Standard
library only.

    lru = ConversationCaches(max_bytes=2e9)
    caches = lru.take(pair, prompt) or PromptCaches.empty()     # a conversation's caches leave the LRU …
    run = engine.generate(…, caches=caches)
    lru.put(pair, caches)                                       # … and come back holding the new turn

Entries are taken out while a run uses them, so no two runs ever share a cache. A pair is whatever identifies
the models behind the caches (the server uses the target and the drafter model's names).

A client that re-sends the same long head but rewrites what follows it every turn (aider puts the file, as it now
is, after the history) shares too little with its last turn's entry to take it; the entry's head is then copied
(`prefix`) and the entry stays, so the head is read once however the rest changes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from uag.core.translate import longest_common_prefix

DEFAULT_CACHE_GB = 2.0
# An entry is reused when the new prompt keeps at least this share of what it holds, or when it holds all of the
# new prompt: a new conversation that only shares a system prompt with a held one
# starts cold instead of taking (and cutting down) the other's cache, while a retried turn reuses its own.
MIN_SHARED = 0.5
# A shared prefix of at least this many tokens, from an entry the prompt may not take, is copied out of it instead,
# such as a chat template's system prompt, which mlx_lm.server reuses from any cached prompt: copying a head costs
# milliseconds, reading it a pass, which on a CPU delayed new chats' first tokens (docs/results.md, bz)
MIN_FORK = 16


class Held(Protocol):
    target_ids: list[int]

    def nbytes(self) -> int: ...

    def prefix(self, n: int) -> Held | None: ...  # a copy holding the first n tokens (None: this one cannot)


@dataclass
class _Entry:
    pair: Hashable
    caches: Held
    nbytes: int


class ConversationCaches:
    """An LRU of `PromptCaches` per pair, at most `max_bytes` in all (thread-safe)."""

    def __init__(self, max_bytes: float):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be at least 0 (got {max_bytes})")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.forks = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def take(self, pair: Hashable, prompt: Sequence[int]) -> Held | None:
        """Remove and return the held caches of `pair` that share the longest prefix with `prompt`, if that
        prefix is at least `MIN_SHARED` of what they hold, or all of `prompt`. Else a copy of the longest shared
        prefix of at least `MIN_FORK` tokens (the entry stays); else None (read cold).

        Example: held [1, 2, 3] and [1, 9]; prompt [1, 2, 3, 4] -> the first (3 of 3 shared)
                 held [1, 2, 3, 4, 5, 6]; prompt [1, 2, 7] -> None (2 of 6 shared: another conversation)
                 held [1, 2, 3, 4, 5, 6]; prompt [1, 2, 3] -> it (a retried turn: the prompt is held)
                 held 30 head tokens + 400 others; prompt the head + 500 others -> a copy of the head
        """
        with self._lock:
            best, best_shared, fork, fork_shared = None, 0, None, MIN_FORK - 1
            for key, entry in self._entries.items():
                if entry.pair != pair:
                    continue
                shared = longest_common_prefix(entry.caches.target_ids, prompt)
                enough = shared >= MIN_SHARED * len(entry.caches.target_ids) or shared == len(prompt)
                if shared > best_shared and enough:
                    best, best_shared = key, shared
                elif shared > fork_shared and not enough:
                    fork, fork_shared = key, shared
            if best is not None:
                self.hits += 1
                return self._entries.pop(best).caches
            copy = None if fork is None else self._entries[fork].caches.prefix(fork_shared)
            if copy is None:
                self.misses += 1
                return None
            self._entries.move_to_end(fork)  # its head is in use
            self.forks += 1
            return copy

    def put(self, pair: Hashable, caches: Held) -> None:
        """Hold `caches` (after a run) as the most recent entry; drop the least recent beyond the budget."""
        if not caches.target_ids:
            return
        size = caches.nbytes()
        with self._lock:
            self._entries[id(caches)] = _Entry(pair, caches, size)
            total = sum(e.nbytes for e in self._entries.values())
            while self._entries and total > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                total -= dropped.nbytes
                self.evictions += 1

    def forget(self, model_name: str) -> None:
        """Drop every entry whose pair names `model_name` (the model store unloaded it)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if _names(e.pair, model_name)]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _names(pair: Hashable, name: str) -> bool:
    return pair == name or (isinstance(pair, tuple) and name in pair)
