"""What a conversation's next turn costs the batch's worker at its start and end (issue 52, item 4).

Every member of `uag serve`'s batch runs on one worker thread, so what a request does there at its start and end
(rendering its prompt, translating it for a drafter model, indexing it for prompt lookup, adding prompt and reply to
the shared index) holds up every other member's round. On an H200 these were ~15 % of the worker's time over edit
conversations (docs/results.md, do). Three of them, as they were and as they are, on the bundled `edit`
conversations' second turns (turn 1's file copied back as the reply, as a whole-file edit does), side by side:

- translation: the drafter's check translated the prompt and the run translated it again; now the run takes the
  checked translator (`Translator.begin`);
- lookup's index: rebuilt over the whole prompt every run; now the conversation's last run's index, kept with its
  caches (`PromptCaches.lookup`), goes on from where that run ended;
- the shared index: noted every n-gram of prompt and reply; now a turn that goes on from the newest document notes
  only the n-grams of its new tokens (`SharedIndex.add`); after another request's, still all of them.

Medians of `--repeats` timings per conversation, pooled; no model is run (the tokenizers only).

The target needs a chat template (the demo target has none): the coder target's, after `make models-coder`.

    python benchmarks/request_start.py [--target coder-target] [--drafter demo-drafter] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from datetime import datetime

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)
from uag.core.lookup import NgramIndex, SharedIndex
from uag.core.translate import DEFAULT_WINDOW, make_translator
from uag.models.store import ModelStore
from uag.models.vocab import same_vocabulary
from uag.server.chat import render
from uag.study.datasets import load_conversations

FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def timed(setup: Callable[[], object], work: Callable[[object], object], repeats: int) -> float:
    """Median milliseconds of `work(setup())`, the setup not timed."""
    out = []
    for _ in range(repeats):
        state = setup()
        tic = time.perf_counter()
        work(state)
        out.append((time.perf_counter() - tic) * 1000)
    return statistics.median(out)


def turn_two(tokenizer, conversation) -> tuple[list[int], list[int]] | None:
    """(what turn 1's run left committed: its prompt and reply, the reply's end token included; turn 2's prompt), the
    reply being turn 1's file copied back; None where the template does not re-send that reply as it was written."""
    block = FENCE.search(conversation.turns[0])
    if block is None:
        return None
    reply = f"```python\n{block.group(1)}```"
    first = render(tokenizer, conversation.messages([]))
    second = render(tokenizer, conversation.messages([reply]))
    written = list(tokenizer.encode(reply, add_special_tokens=False))
    end = len(first) + len(written)
    if second[: len(first)] != first or second[len(first) : end] != written:
        return None
    return second[: end + 1], second  # + the end-of-turn token the run committed last


def measure(held: list[int], prompt: list[int], translator: Callable, repeats: int) -> dict[str, tuple[float, float]]:
    """(before, now) in ms for one turn: `held` is what the conversation's last run committed, `prompt` this turn's."""

    def started():
        t = translator()
        t.start(prompt)
        return t

    def kept():
        index = NgramIndex()
        index.extend(held)
        return index

    def holding(*documents):
        def setup():
            index = SharedIndex(1_000_000)
            for document in documents:
                index.add(document)
            return index

        return setup

    one = timed(translator, lambda t: t.start(prompt), repeats)
    again = timed(started, lambda t: t.begin(prompt), repeats)
    cold = timed(NgramIndex, lambda i: i.extend(prompt), repeats)
    warm = timed(kept, lambda i: i.extend(prompt[len(i.ids) :]), repeats)
    ended = [*prompt, *held[-64:]]  # its prompt and a reply of 64 tokens: what the run adds when it ends
    other = list(reversed(held))  # another request's document, added after the conversation's last
    whole = timed(holding(held, other), lambda i: i.add(ended), repeats)  # every n-gram noted, as always before
    newest = timed(holding(other, held), lambda i: i.add(ended), repeats)
    return {"translation": (2 * one, one + again), "lookup's index": (cold, warm), "shared index": (whole, newest)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="coder-target", help="a model with a chat template")
    parser.add_argument("--drafter", default="demo-drafter", help="a drafter model (its tokenizer is all it needs)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    store = ModelStore()
    target, drafter = store.get(args.target), store.get(args.drafter)
    shared = same_vocabulary(target.vocab, drafter.vocab)
    turns = [t for c in load_conversations("edit", args.conversations) if (t := turn_two(target.tokenizer, c))]
    if not turns:
        print(f"{args.target}'s chat template re-sends no conversation's reply as written: nothing to time")
        return 1
    print(
        f"# {args.target} ← {args.drafter}, {len(turns)} edit conversations' turn 2 "
        f"({min(len(p) for _, p in turns)}–{max(len(p) for _, p in turns)} prompt tokens), medians of "
        f"{args.repeats}, {platform.processor() or platform.machine()}, {datetime.now():%Y-%m-%dT%H:%M}, "
        f"load {os.getloadavg()[0]:.2f}"
    )

    def translator():
        return make_translator("context", target.vocab, drafter.vocab, window=DEFAULT_WINDOW, shared=shared)

    rows: dict[str, list[tuple[float, float]]] = {"translation": [], "lookup's index": [], "shared index": []}
    for held, prompt in turns:
        for name, pair in measure(held, prompt, translator, args.repeats).items():
            rows[name].append(pair)

    print(f"{'':16}{'before ms':>10}{'now ms':>10}{'now / before':>14}   (per turn: median over conversations)")
    total = [0.0, 0.0]
    for name, pairs in rows.items():
        before, now = (statistics.median(p[i] for p in pairs) for i in (0, 1))
        total[0], total[1] = total[0] + before, total[1] + now
        print(f"{name:16}{before:10.2f}{now:10.2f}{now / before:14.3f}")
    print(f"{'together':16}{total[0]:10.2f}{total[1]:10.2f}{total[1] / total[0]:14.3f}")
    print(
        "translation: the check's start and the run's (before), the check's and `begin` (now); lookup's index: a "
        "fresh index over the prompt, or the kept one going on; shared index: the turn's prompt and reply added "
        "where the conversation's last document is not (before: always so) or is the newest"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
