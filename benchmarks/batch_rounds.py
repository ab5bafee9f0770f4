"""B requests decoding plainly at once, in one process: uag's `Batch` against mlx-lm's `BatchGenerator`.

What `uag serve --drafter off` does with concurrent requests, without HTTP, tokenizers or streams: each request is a
job running uag's engine (the target alone, mlx-lm's `generate_step`) in one `uag.runtime.batching.Batch`, whose
rounds run one pass for all members on the caches it keeps merged; against it, mlx-lm's `BatchGenerator` (what
`mlx_lm.server` batches with) on the same model, prompts and lengths. Both read their prompts first (the Batch one
prompts arriving together in passes they share, BatchGenerator in one batched prefill); neither stops at an EOS, so both
generate exactly `--max-tokens` per request. Conditions run interleaved, `--repeats` times; medians and spreads.

- `uag`: a pass of one token a row queued (`mx.async_eval`), each member streaming its previous token while the
  device computes it (`Batch.pipelined`, the default on a GPU);
- `uag-wait`: every pass waited for before any member runs on (the default on a CPU; on a GPU before 2026-12-03);
- `mlx_lm`: `BatchGenerator.insert` all prompts, `next()` until every request is done;
- `uag-auto` (with `--auto [DRAFTER]`): each request runs `auto` over prompt lookup (and a drafter model), from the
  costs `uag serve` measures at start; on random prompts lookup finds little, so this is what parked speculation
  costs a batch against plain decoding (`uag`). With `--prompts edit` each request is instead the first turn of a
  bundled `edit` conversation (a file and a change to make, as `uag serve` reads them), where lookup copies: what
  speculating costs a batch, as in an editing agent's turns (the demo target, a base model, rewrites little of the
  file in a first turn, so auto mostly parks there too). With `--prompts copy` each request is such a turn followed
  by its own first half: the model writes it out again, lookup's proposals hold, and every member verifies long
  drafts round after round (docs/results.md, cz).

`--breakdown` says where each uag condition's rounds spend their milliseconds (the batch's own `RoundTimes`, as
`uag serve`'s /metrics reports them: wall clock and the worker's CPU); `--profile N` prints the N functions each
condition spends most time in (cProfile).

On a GPU (or a Mac) a pass over a few rows takes milliseconds, so what each member does in Python between passes is
a large share of a round: this is where it shows. On a CPU the pass runs on the cores the Python runs on: queued
passes ran no faster there (a tiny test model, 2 cores: 0.90-0.99x waited-for ones).

    python benchmarks/batch_rounds.py --target demo-target --batch 4 8 --max-tokens 64 --repeats 5 [--breakdown]
        [--auto demo-drafter] [--prompts edit|copy] [--profile 30]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import io
import json
import platform
import pstats
import random
import statistics
import time
from datetime import datetime

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from uag.core.config import GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice
from uag.core.engine import generate
from uag.costs.pair import measure_costs
from uag.models.store import LoadedModel, ModelStore
from uag.runtime.batching import Batch, RoundTimes, share, sharing_now
from uag.runtime.worker import Job
from uag.server.chat import render
from uag.study.datasets import Conversation, load_conversations


@dataclasses.dataclass
class Endless(LoadedModel):
    """The loaded model, never stopping at an EOS: every request generates exactly its max tokens."""

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset()


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def copy_prompts(target: LoadedModel, batch: int) -> list[list[int]]:
    """A bundled `edit` conversation's first turn (a file and a change to make), then the same tokens again up to
    their middle, one a request: the model goes on writing the text out again, as a model writing a file back
    copies it, so that prompt lookup's proposals hold and every member verifies long drafts round after round.
    What speculating costs a batch where it pays most."""
    turns = [target.tokenizer.encode(conversation.turns[0]) for conversation in edit_conversations(batch)]
    return [ids + ids[: len(ids) // 2] for ids in turns]


def edit_prompts(target: LoadedModel, batch: int) -> list[list[int]]:
    """The first turns of the bundled `edit` conversations (a file and a change to make to it), read as `uag serve`
    reads them (`uag.server.chat.render`: the target's chat template, or the messages' text without one), one a
    request (past the last, from the first again): where lookup copies, as in an editing agent's turns. Prompts
    differ in length."""
    return [render(target.tokenizer, conversation.messages([])) for conversation in edit_conversations(batch)]


def edit_conversations(batch: int) -> list[Conversation]:
    """The bundled `edit` conversations, one a request: past the last, from the first again."""
    conversations = load_conversations("edit")
    return [conversations[i % len(conversations)] for i in range(batch)]


def batch_prompts(kind: str, target: LoadedModel, vocab: int, batch: int, length: int) -> list[list[int]]:
    """`batch` requests' prompts of a kind (`--prompts`): random tokens of `length`, edit turns, or copies."""
    if kind == "random":
        return prompts(vocab, batch, length, seed=batch)
    return copy_prompts(target, batch) if kind == "copy" else edit_prompts(target, batch)


def breakdown_line(times: RoundTimes) -> str:
    """Milliseconds per round in each part the batch times (`uag.runtime.batching.RoundTimes`, what `uag serve`'s
    GET /metrics reports): wall clock / the worker thread's CPU (wall above CPU: it waited, for the device or GIL)."""
    per = {
        clock: {p: 1000 * v / max(times.rounds, 1) for p, v in getattr(times, clock).items()}
        for clock in ("wall", "cpu")
    }
    return (
        ", ".join(f"{p} {per['wall'][p]:.2f} / {per['cpu'][p]:.2f}" for p in times.PARTS) + " ms a round (wall / CPU)"
    )


def run_uag(
    target: LoadedModel,
    ids: list[list[int]],
    max_tokens: int,
    pipelined: bool,
    drafter: DrafterChoice | None = None,
    profile: CostProfile | None = None,
    times: RoundTimes | None = None,
    packing: bool | None = None,
) -> tuple[float, list]:
    """Seconds for every request's tokens, run as a `uag serve` worker runs shared jobs; and the tokens. With a
    `drafter`, each request runs `auto` over it from the pair's measured costs (`profile`), as `uag serve` runs a
    request (its `Sharing` passed on). `times`: where the batch's rounds spend their time, added up there.
    `packing`: whether ragged passes run packed (None: the batch's default, on a CPU only)."""
    out: dict[int, list[int]] = {}
    config = GenerationConfig("baseline", max_tokens=max_tokens)
    if drafter is not None:
        config = GenerationConfig("context", k=16, k_policy="adaptive", max_tokens=max_tokens)

    def request(job, i):
        out[i] = generate(target, drafter, ids[i], config, profile=profile, sharing=sharing_now()).token_ids
        yield i

    batch = Batch(max_size=len(ids), times=times)
    batch.pipelined = pipelined
    batch.packing = batch.packing if packing is None else packing
    jobs = [Job(request, (i,), str(i), shared=True) for i in range(len(ids))]
    tic = time.perf_counter()
    batch.run_all(jobs)  # as under load: every member waits for its rounds
    seconds = time.perf_counter() - tic
    for job in jobs:
        list(job)  # raises what the job raised
    return seconds, [out[i] for i in range(len(ids))]


def run_mlx_lm(target: LoadedModel, ids: list[list[int]], max_tokens: int) -> tuple[float, list]:
    """Seconds for every request's tokens through mlx-lm's BatchGenerator; and the tokens."""
    generator = BatchGenerator(target.model, max_tokens=max_tokens, stop_tokens=[], prefill_batch_size=len(ids))
    tokens: dict[int, list[int]] = {}
    tic = time.perf_counter()
    uids = generator.insert(ids, [max_tokens] * len(ids))
    done = 0
    while done < len(ids):
        for response in generator.next_generated():
            tokens.setdefault(response.uid, []).append(response.token)
            done += response.finish_reason is not None
    seconds = time.perf_counter() - tic
    generator.close()
    return seconds, [tokens[u] for u in uids]


def profiled(run, ids: list[list[int]], top: int) -> str:
    """The `top` functions a run spent most time in, by their own time (cProfile's tottime; under greenlets a
    member's time is its own functions', so cumulative times mislead)."""
    profile = cProfile.Profile()
    profile.runcall(run, ids)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip() and "Ordered by" not in line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target", help="an offline name, a folder or a hub id")
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 8], help="requests at once (each a condition)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request (random prompts)")
    parser.add_argument(
        "--prompts",
        choices=("random", "edit", "copy"),
        default="random",
        help="random tokens (lookup finds little), the bundled edit conversations' first turns as uag serve "
        "reads them (a file to change: lookup copies from it, as in an editing agent's turns), or such a turn "
        "followed by its own first half (the model copies it on: lookup's proposals hold, every member verifies "
        "long drafts)",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--only", nargs="+", help="run only these conditions, e.g. uag-auto uag-auto-padded")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON line per measurement as well")
    parser.add_argument(
        "--auto",
        nargs="?",
        const="lookup",
        metavar="DRAFTER",
        help="also uag-auto: each request running auto over prompt lookup (and this drafter model, if named), as "
        "uag serve runs it; the prompts are random tokens, so lookup finds little and auto mostly parks",
    )
    parser.add_argument("--breakdown", action="store_true", help="also where uag's rounds spend their time")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="also the N functions each condition spends most time in"
    )
    args = parser.parse_args(argv)

    loaded = ModelStore().get(args.target)
    share(loaded, "target")
    target = Endless(**{f.name: getattr(loaded, f.name) for f in dataclasses.fields(loaded)})
    vocab = int(target.model.args.vocab_size) if hasattr(target.model, "args") else 32000
    choice, profile = None, None
    if args.auto:
        model = None
        if args.auto != "lookup":
            model = ModelStore().get(args.auto)
            share(model, "drafter")
        choice = DrafterChoice(lookup=True, model=model)
        profile = measure_costs(target, choice).profile  # what uag serve measures at start (its quick calibration)
    # each condition: run_uag's options for uag's, None for mlx-lm's BatchGenerator
    conditions: dict[str, dict | None] = {"uag": {"pipelined": True}, "uag-wait": {"pipelined": False}, "mlx_lm": None}
    if choice is not None:
        conditions["uag-auto"] = {"pipelined": True, "drafter": choice, "profile": profile}
        if mx.default_device() == mx.cpu:  # ragged passes padded to their widest, as before packing (and on a GPU)
            conditions["uag-auto-padded"] = {**conditions["uag-auto"], "packing": False}
    if args.only:
        conditions = {name: conditions[name] for name in args.only if name in conditions}
    runs = {
        name: functools.partial(run_mlx_lm, target, max_tokens=args.max_tokens)
        if options is None
        else functools.partial(run_uag, target, max_tokens=args.max_tokens, **options)
        for name, options in conditions.items()
    }
    print(
        f"# {args.target} ({target.dtype}), {mx.default_device()}, {platform.machine()}, "
        f"{args.prompts} prompts ({args.prompt} tokens where random), {args.max_tokens} generated each, "
        f"{args.repeats} repeats, "
        f"{datetime.now().isoformat(timespec='minutes')}"
    )
    if profile is not None:  # the curve auto prices a batch's passes by (a pass over n tokens: one of its rows)
        curve = ", ".join(f"{w}: {ms:.2f}" for w, ms in sorted(profile.target_ms.items()))
        print(
            f"# auto's calibration: target ms per pass over w tokens {{{curve}}}, "
            f"drafter step {profile.drafter_ms:.2f} ms"
        )
    for b in args.batch:
        ids = batch_prompts(args.prompts, target, vocab, b, args.prompt)
        for run in runs.values():  # warm-up: compiled kernels, allocations
            run(ids)
        tps: dict[str, list[float]] = {name: [] for name in runs}
        texts: dict[str, list] = {}
        for repeat in range(args.repeats):
            order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
            for name in order:
                seconds, tokens = runs[name](ids)
                tps[name].append(b * args.max_tokens / seconds)
                texts.setdefault(name, tokens)
                if args.json:
                    print(json.dumps({"batch": b, "condition": name, "repeat": repeat, "seconds": seconds}))
        medians = {name: statistics.median(v) for name, v in tps.items()}
        for name, values in tps.items():
            peer = f"; {medians[name] / medians['mlx_lm']:.2f}x mlx_lm" if "mlx_lm" in medians else ""
            print(f"B = {b}  {name:<9} {medians[name]:8.1f} tok/s  (runs {min(values):.1f}-{max(values):.1f}{peer})")
        if args.breakdown:
            for name, options in [(n, o) for n, o in conditions.items() if o is not None]:
                times = RoundTimes()
                run_uag(target, ids, args.max_tokens, times=times, **options)
                print(f"B = {b}  {name:<9} {breakdown_line(times)} ({times.rounds} rounds)")
        for name, run in runs.items() if args.profile else ():
            print(f"B = {b}  {name}: the {args.profile} functions it spent most time in (cProfile, tottime)")
            print(profiled(run, ids, args.profile))
        if {"uag", "uag-wait", "mlx_lm"} <= set(medians):
            same = sum(a == c for a, c in zip(texts["uag"], texts["mlx_lm"]))
            print(
                f"B = {b}  uag / uag-wait {medians['uag'] / medians['uag-wait']:.2f}x; "
                f"tokens equal to mlx_lm's: {same}/{b}"
            )
        if {"uag-auto", "uag-auto-padded"} <= set(medians):
            same = sum(a == c for a, c in zip(texts["uag-auto"], texts["uag-auto-padded"]))
            print(
                f"B = {b}  uag-auto packed / padded {medians['uag-auto'] / medians['uag-auto-padded']:.2f}x; "
                f"tokens equal: {same}/{b}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
