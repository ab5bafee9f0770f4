"""`python -m uag calibrate`: measure what a speculative cycle costs on this machine, and save it.

The study modelled verification as 1 + c·k² target steps. Real costs are not that smooth (on a GPU a kernel
switch can make a wider pass cheaper than a narrower one: docs/results.md, "Break-even for the study's shapes"),
so we measure instead, each the way a run spends it: the target's verification over w = 1..16 new tokens with
a filled cache, and sparsely on to 65, a lookup copy's widest pass (every row scored, as a cycle scores it), a
drafter step (pipelined, as drafting runs k of them), the drafter's one pass over n new tokens (reading a prompt
or a parked stretch: a batched pass, not n steps), and the translation's bookkeeping per cycle. The profile is
saved per (device, backend, model pair, dtype) in the user cache, with the machine's load meanwhile;
`--strategy auto` and the app use it. A `cancel` check between passes lets a server stop a measurement when a
request comes in. `--reset` forgets what was saved for a pair: its profile and what earlier auto runs of it
accepted (uag.costs.profiles).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone

import mlx.core as mx

from uag.command import CommandParser, progress, run, whole
from uag.core.config import LOOKUP, DrafterSpec
from uag.core.costmodel import CostProfile
from uag.core.passes import logprobs, settle_allocator
from uag.core.translate import DEFAULT_WINDOW, make_translator, text_after
from uag.costs.profiles import COPY_WIDTH, Calibration, forget, machine_load, others_load, profile_key, save, target_key
from uag.errors import UserError
from uag.models.loading import load_model
from uag.models.store import LoadedModel, ModelStore, Pair, check_pair

DEFAULT_CONTEXT = 256  # tokens already in the cache when timing (a short conversation)
# every width a model's draft reaches (k <= 16), and sparsely those a lookup copy reaches (lookup.LOOKUP_REACH):
# past the widest measured width auto extrapolates from the last two, which can price a wide pass far from its cost
DEFAULT_WIDTHS = (*range(1, 17), 24, 33, 49, COPY_WIDTH)
READ_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # drafter passes over n tokens (past 256: their slope)
DRAFT_STEPS = 4  # drafter steps timed in a row, pipelined as a draft runs them
FILL_CHUNK = 32  # tokens per pass while filling the cache: a measurement stops between passes (`cancel`)
# On first use of auto: verifying up to k = 8 drafts, and a copy's 16, 32 and 64; other widths are interpolated
# until a run times them.
QUICK = {"widths": (*range(1, 10), 17, 33, COPY_WIDTH), "repeats": 3}
Cancel = Callable[[], bool]  # asked between passes: True stops the measurement (`MeasurementStopped`)
CALIBRATION_TEXT = (
    "Kraków – miasto na prawach powiatu w południowej Polsce, położone nad Wisłą. W latach 1038–1596 "
    "był stolicą Polski, a do 1734 roku miejscem koronacji królów. The city lies on the Vistula river. "
)


class MeasurementStopped(Exception):
    """A measurement stopped part way by its `cancel` (a server's request came in); nothing was measured."""


def _go_on(cancel: Cancel | None) -> None:
    if cancel is not None and cancel():
        raise MeasurementStopped


def filled_cache(model: LoadedModel, context: int, cancel: Cancel | None = None) -> tuple[list, list[int]]:
    """A KV cache holding `context` tokens of calibration text, and those token ids, read `FILL_CHUNK` tokens a
    pass with `cancel` asked between them: a request that arrives while a server measures waits for one short
    pass, not for the whole context's read (a 1.5B target on a 2-core CPU reads 256 tokens in ~20 s)."""
    ids = model.tokenizer.encode(CALIBRATION_TEXT * (1 + 4 * context // len(CALIBRATION_TEXT)))[:context]
    cache = model.make_cache()
    for start in range(0, len(ids), FILL_CHUNK):
        _go_on(cancel)
        model.model(mx.array(ids[start : start + FILL_CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache, ids


def verify_pass(model: LoadedModel, cache: list, tokens: mx.array) -> None:
    """A target pass as a cycle's verification runs it (uag.core.engine): every row's logits normalised and
    its greedy choice read back."""
    mx.argmax(logprobs(model.model(tokens, cache=cache)[0]), axis=-1).tolist()
    settle_allocator()


def read_pass(model: LoadedModel, cache: list, tokens: mx.array) -> None:
    """A drafter pass as a draft's first pass runs it (uag.core.drafters): it reads every token, and its
    guess after the last is read back."""
    mx.argmax(model.model(tokens, cache=cache)[:, -1, :], axis=-1).tolist()
    settle_allocator()


def time_forward(
    model: LoadedModel, cache: list, ids: list[int], width: int, repeats: int, run_pass=verify_pass
) -> float:
    """The least milliseconds of `repeats` passes over `width` new tokens (after one warm-up pass: kernel
    selection, allocation); the cache is rewound after each. The least, not the median: on a shared
    machine other work only ever adds time, so the fastest pass is the best estimate of the pass itself."""
    return min(_time_passes(model, cache, ids, width, repeats + 1, run_pass)[1:])


def time_draft(
    model: LoadedModel,
    cache: list,
    ids: list[int],
    repeats: int,
    steps: int = DRAFT_STEPS,
    cancel: Cancel | None = None,
) -> float:
    """The least milliseconds per drafter step of `repeats` drafts of `steps` tokens, run as ModelDrafter
    drafts: each pass reads the previous guess, queued without waiting, the guesses read back at the end."""
    offset, times = cache[0].offset, []
    for _ in range(repeats + 1):  # the first warms up
        _go_on(cancel)
        y, guesses = mx.array(ids[-1:]), []
        tic = time.perf_counter()
        for _ in range(steps):
            y = mx.argmax(model.model(y[None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(y)
            guesses.append(y)
        mx.concatenate(guesses).tolist()
        settle_allocator()
        times.append((time.perf_counter() - tic) * 1000 / steps)
        for layer in cache:
            layer.trim(layer.offset - offset)
    return min(times[1:])


def _time_passes(
    model: LoadedModel, cache: list, ids: list[int], width: int, passes: int, run_pass, cancel: Cancel | None = None
) -> list[float]:
    tokens = mx.array(ids[-width:])[None]
    offset = cache[0].offset
    times = []
    for _ in range(passes):
        _go_on(cancel)
        tic = time.perf_counter()
        run_pass(model, cache, tokens)
        times.append((time.perf_counter() - tic) * 1000)
        for layer in cache:
            layer.trim(layer.offset - offset)
    return times


def target_curve(
    model: LoadedModel,
    cache: list,
    ids: list[int],
    widths,
    repeats: int,
    say,
    run_pass=verify_pass,
    label: str = "target",
    monotone: bool = False,
    cancel: Cancel | None = None,
) -> dict[int, float]:
    """Time per width of `run_pass` (a verification, by default), robust to a busy machine: `repeats`
    rounds over every width (so that a burst of other work lands on one round, not on one width), the
    least time per width. With `monotone`, made non-decreasing in w (cost(w) = min over w' >= w).

    Verification keeps its measured shape: the engine verifies exactly the tokens proposed, and a BLAS may
    price widths unevenly (OpenBLAS on a CPU prices some middle widths above 16); made non-decreasing, the curve
    priced a middle width at the widest pass's time and auto drafted long where short paid. On a loaded machine
    medians of a few rounds caught bursts of other work at single widths: the least of several rounds is what
    keeps such a burst out. Figures: docs/results.md#calibration-uag-calibrate.
    """
    widths = sorted(w for w in widths if w <= len(ids))
    for w in widths:  # warm-up: kernel selection and allocation for every shape
        _time_passes(model, cache, ids, w, 1, run_pass, cancel)
    times = {w: math.inf for w in widths}
    for i in range(repeats):
        for w in widths:
            times[w] = min(times[w], *_time_passes(model, cache, ids, w, 1, run_pass, cancel))
            say(f"{label}, {w} new token(s): {times[w]:.2f} ms (round {i + 1} of {repeats})")
    if not monotone:
        return times
    curve, least = {}, math.inf
    for w in reversed(widths):
        least = min(least, times[w])
        curve[w] = least
    return dict(sorted(curve.items()))


def time_translation(pair: Pair, window: int = DEFAULT_WINDOW, cycles: int = 24, k: int = 2) -> float:
    """Median milliseconds of one cycle's translation and re-sync (context strategy), on the calibration
    text with drafts that are the drafter's encoding of what the target then commits. No model passes."""
    target, drafter = pair.target.vocab, pair.drafter.vocab
    translator = make_translator("context", target, drafter, window=window, shared=pair.shared_vocabulary)
    ids = target.encode(CALIBRATION_TEXT * 2)[0]
    start = min(32, len(ids) // 2)
    translator.start(ids[:start])
    times = []
    for i in range(start, min(len(ids) - k, start + k * cycles), k):
        drafts = drafter.encode(text_after(target, ids[:i], ids[i : i + k]))[0][:k]
        tic = time.perf_counter()
        usable = translator.usable(drafts)
        translator.propose(usable)
        translator.commit(usable, ids[i : i + k])
        times.append((time.perf_counter() - tic) * 1000)
    return statistics.median(times) if times else 0.0


def calibrate(
    pair: Pair,
    *,
    context: int = DEFAULT_CONTEXT,
    widths=DEFAULT_WIDTHS,
    repeats: int = 5,
    progress=None,
    cancel: Cancel | None = None,
) -> Calibration:
    """Measure the pair's costs on this machine (a few seconds to a minute; `QUICK` settings: seconds), and the
    machine's load meanwhile; `cancel`, asked between passes, stops it (`MeasurementStopped`)."""
    say = progress or (lambda _: None)
    start = others_load()
    _go_on(cancel)
    cache, ids = filled_cache(pair.target, context, cancel)
    target_ms = target_curve(pair.target, cache, ids, widths, repeats, say, cancel=cancel)
    _go_on(cancel)
    d_cache, d_ids = filled_cache(pair.drafter, context, cancel)
    drafter_ms = time_draft(pair.drafter, d_cache, d_ids, repeats, cancel=cancel)
    say(f"drafter step: {drafter_ms:.2f} ms")
    # a prompt or a parked stretch: reading more never costs less
    read_ms = target_curve(
        pair.drafter,
        d_cache,
        d_ids,
        READ_WIDTHS,
        repeats,
        say,
        read_pass,
        "drafter reading",
        monotone=True,
        cancel=cancel,
    )
    translate_ms = time_translation(pair)
    say(f"translation and re-sync: {translate_ms:.3f} ms per cycle")
    profile = CostProfile(target_ms, drafter_ms, translate_ms, form="study", read_ms=read_ms)
    return Calibration(profile_key(pair), profile, _now(), context, machine_load(start))


def calibrate_target(
    target: LoadedModel,
    *,
    context: int = DEFAULT_CONTEXT,
    widths=DEFAULT_WIDTHS,
    repeats: int = 5,
    progress=None,
    cancel: Cancel | None = None,
) -> Calibration:
    """The target's costs alone, for prompt lookup (no drafter model to time; a lookup costs microseconds,
    which the policy measures per cycle): the same verify curve as `calibrate`, drafter and translation 0."""
    start = others_load()
    _go_on(cancel)
    cache, ids = filled_cache(target, context, cancel)
    target_ms = target_curve(target, cache, ids, widths, repeats, progress or (lambda _: None), cancel=cancel)
    profile = CostProfile(target_ms=target_ms, drafter_ms=0.0, translate_ms=0.0, form="study")
    return Calibration(target_key(target), profile, _now(), context, machine_load(start))


def target_part(calibration: Calibration, target: LoadedModel) -> Calibration:
    """What a pair's calibration says of its target alone: prompt lookup's profile (`calibrate_target` times
    exactly the same passes), so that measuring a pair also measures lookup's costs."""
    profile = CostProfile(target_ms=calibration.profile.target_ms, drafter_ms=0.0, translate_ms=0.0, form="study")
    return replace(calibration, key=target_key(target), profile=profile)


def widths_to(widest: int) -> list[int]:
    """The widths `uag calibrate --max-width` times: `DEFAULT_WIDTHS` up to `widest`, and `widest` itself.

    Example: widths_to(65) == list(DEFAULT_WIDTHS);  widths_to(40) -> 1..16, 24, 33, 40;  widths_to(3) -> 1, 2, 3
    >>> widths_to(40)[-4:], widths_to(3)
    ([16, 24, 33, 40], [1, 2, 3])
    """
    return sorted({w for w in DEFAULT_WIDTHS if w <= widest} | {widest})


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def summary(calibration: Calibration, ks=(1, 2, 4, 8)) -> str:
    p = calibration.profile
    lines = [
        f"{calibration.key['target']} ← {calibration.key['drafter']} on {calibration.key['device']} "
        f"({calibration.key['backend']}), cache of {calibration.context} tokens"
    ]
    lines.append("w  " + " ".join(f"{w:>6}" for w in p.target_ms))
    lines.append("ms " + " ".join(f"{ms:6.1f}" for ms in p.target_ms.values()))
    lines.append(
        f"drafter step {p.drafter_ms:.2f} ms (r = {p.drafter_ms / p.target_ms[1]:.3f} target steps); "
        f"translation {p.translate_ms:.3f} ms/cycle"
    )
    if p.read_ms:
        lines.append("drafter pass over n tokens: " + ", ".join(f"{n}: {ms:.1f} ms" for n, ms in p.read_ms.items()))
    for k in ks:
        alpha = p.break_even(k)
        lines.append(f"k={k}: break-even α* = {'unreachable' if alpha is None else f'{alpha:.0%}'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m uag calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target", help="hub id, local directory or demo-target")
    parser.add_argument(
        "--drafter",
        default="demo-drafter",
        help="hub id, local directory, demo-drafter, lookup (the target's verify curve alone) or lookup+<model> "
        "(the model's pair: lookup itself costs microseconds)",
    )
    parser.add_argument("--context", type=whole, default=DEFAULT_CONTEXT, help="tokens in the cache while timing")
    parser.add_argument(
        "--max-width",
        type=whole,
        default=COPY_WIDTH,
        help=f"largest verification width w to time, 1..{COPY_WIDTH} (every width to 16, then sparsely: "
        f"{COPY_WIDTH} is a lookup copy's widest pass, and auto extrapolates past the widest timed)",
    )
    parser.add_argument("--repeats", type=whole, default=5, help="timed rounds over all widths (least kept)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--reset", action="store_true", help="forget the pair's saved costs and what earlier auto runs accepted"
    )
    return parser


def _calibrate(args: argparse.Namespace) -> int:
    spec = DrafterSpec.parse(args.drafter)
    if args.reset:  # no models to load: the saved files name them (a hybrid's are its model's pair)
        removed = forget(args.target, spec.model or LOOKUP)
        lines = [f"removed {path}" for path in removed] or [f"nothing saved for {args.target} ← {args.drafter} here"]
        print(json.dumps({"removed": [str(path) for path in removed]}) if args.json else "\n".join(lines))
        return 0

    problems = [
        f"{flag} must be {bound} (got {value})"
        for flag, value, ok, bound in (
            ("--max-width", args.max_width, 1 <= args.max_width <= COPY_WIDTH, f"from 1 to {COPY_WIDTH}"),
            ("--context", args.context, args.context >= 16, "at least 16"),
            ("--repeats", args.repeats, args.repeats >= 1, "at least 1"),
        )
        if not ok
    ]
    if problems:
        raise UserError("; ".join(problems))
    store = ModelStore()
    say = None if args.json else progress
    target = load_model(store, args.target, role="target", progress=say)
    settings = {"context": args.context, "widths": widths_to(args.max_width), "repeats": args.repeats}
    if spec.model is None:  # prompt lookup alone: what auto prices its proposals by is the target's verify curve
        calibration = calibrate_target(target, progress=say, **settings)
    else:
        pair = check_pair(target, load_model(store, spec.model, role="drafter", progress=say))
        calibration = calibrate(pair, progress=say, **settings)
    path = save(calibration)  # asked for here: saved whatever the load (a server keeps a quieter one)
    if args.json:
        print(json.dumps({**calibration.to_dict(), "path": str(path)}, indent=2))
    else:
        print(summary(calibration))
        print(f"saved {path}")
    if calibration.load is not None and calibration.load.busy:
        print(
            f"[uag] note: measured while other work kept the machine busy ({calibration.load}): auto rescales "
            "these costs by each run's own passes, but measure again when it is quiet",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run("python -m uag calibrate", lambda: _calibrate(args))
