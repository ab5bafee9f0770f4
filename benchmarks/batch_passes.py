"""What a batched target pass costs over batch × width: how far batching and drafting can both go on a machine.

`uag serve` runs concurrent requests' passes together (uag.runtime.batching): B sequences, each proposing up to W
tokens (W = 1 for a plain step, k + 1 for a draft of k), every sequence padded to the widest, each cache holding
`--context` tokens. This times that pass for every B × W and prints it in ms and in target steps (the pass over one
token, B = 1): on caches kept merged (uag.core.kept_caches, what the batch runs plain KV caches on; every row
trimmed back after each pass, as a rejected draft), on caches merged afresh for each pass
(uag.core.passes.batched_pass: rotating and quantized caches), and on mlx-lm's `BatchKVCache` merged once (no
trims: the floor). Two derived rows, from the kept passes:
- tokens per step, plain: B / cost(B, 1) — what batching alone buys;
- the batch width that pays: for each B, the widest W whose pass costs at most twice the plain batched step
  (a draft that keeps half its tokens still pays there).

The model is a real one (an offline name, a folder) or random weights of a real model's shapes (`--shapes
CONFIG.json`: no download, any backend; the figures depend on shapes and dtype, not on the weights). Medians of
`--repeats`.

    python benchmarks/batch_passes.py --target coder-target                    # this machine's CPU
    python benchmarks/batch_passes.py --shapes config.json --dtype bfloat16     # e.g. on a GPU (MLX's CUDA backend)

`--ragged` times rounds whose rows propose different widths (one drafting, the others decoding: [17, 1, 1, 1]) on
caches kept merged three ways: padded to the widest in one pass, cut into two passes (the wide row, the rest: what
`groups` does where padding costs more than a pass), and packed into one sequence of their tokens (what the batch
does on a CPU: `KeptCaches.run(packed=True)`), with each way's tokens equal to the padded pass's:
    python benchmarks/batch_passes.py --target coder-target --ragged 17,1,1,1 33,1,1,1 5,5,5,5 --context 1024

`--margins` measures rounding instead of time: how far a batched pass moves each row's top-two logit gap (and its
logits) from the row's own pass and from one-token steps — rows of different lengths, widths 1, k + 1 and both
mixed, on caches kept merged and merged afresh — the drift the near-tie bound of uag/runtime/divergence.py must
cover where a server batches requests:
    python benchmarks/batch_passes.py --target demo-target --margins --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from uag.core.kept_caches import KeptCaches
from uag.core.passes import batched_pass, prefill, trim_to


def random_model(config_path: str, dtype: str):
    """An mlx-lm model of the config's shapes with random weights, in `dtype` (a float type, or q8 / q4: mlx-lm's
    quantisation, group size 64, over bfloat16, as uag.models.dtypes loads them)."""
    from mlx_lm.utils import _get_classes, quantize_model

    from uag.models.dtypes import QUANTIZED, QUANTIZED_OVER

    config = json.loads(open(config_path).read())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, QUANTIZED_OVER if dtype in QUANTIZED else dtype))
    if dtype in QUANTIZED:
        model, _ = quantize_model(model, config, 64, QUANTIZED[dtype])
    mx.eval(model.parameters())
    return model


ROUNDS = 8  # passes timed together on kept caches: a compaction now and then is part of their cost


def copied(cache: list) -> list:
    """Plain KV caches holding what `cache` holds, in buffers of their own."""
    copies = []
    for layer in cache:
        copy = KVCache()
        copy.keys, copy.values = (
            mx.contiguous(layer.keys[..., : layer.offset, :]),
            mx.contiguous(layer.values[..., : layer.offset, :]),
        )
        copy.offset = layer.offset
        copies.append(copy)
    mx.eval([c.state for c in copies])
    return copies


def timed(fn, repeats: int) -> float:
    """Median ms of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append((time.perf_counter() - tic) * 1000)
    return statistics.median(times)


def costs(model: nn.Module, make_cache, batches: list[int], widths: list[int], context: int, repeats: int) -> dict:
    """{(B, W): ms} of a batched pass over B sequences of W new tokens, each after `context` cached tokens in a
    cache from `make_cache` (the store's: plain KV caches where a window is masked, as the server makes them).
    Keys: (B, W) on caches kept merged (the mean of `ROUNDS` passes, so that compactions count), (B, W, "afresh")
    merged afresh for each pass, (B, W, "once") on mlx-lm's BatchKVCache merged once."""
    from uag.core.passes import _merge

    caches = []
    for b in range(max(batches)):
        cache = make_cache()
        prefill(model, cache, [(7 * b + i) % 1000 + 10 for i in range(context)])
        caches.append(cache)
    out = {}
    for size in batches:
        kept = KeptCaches()
        rows = [copied(cache) for cache in caches[:size]]
        members = [kept.adopt(cache) for cache in rows]
        for w in widths:
            tokens = [mx.array([(13 * i + j) % 1000 + 10 for j in range(w)]) for i in range(size)]

            def alone(tokens=tokens):
                mx.eval(model(tokens[0][None], cache=caches[0]))
                trim_to(caches[0], context)

            if size == 1:
                out[size, w] = timed(alone, repeats)
                continue

            def kept_rounds(kept=kept, members=members, rows=rows, tokens=tokens):
                for _ in range(ROUNDS):
                    kept.run(model, members, tokens)  # evaluated
                    for cache in rows:
                        trim_to(cache, context)  # every row trimmed back: a draft rejected, holes left

            def afresh(size=size, tokens=tokens):
                mx.eval(batched_pass(model, tokens, caches[:size]))
                for cache in caches[:size]:
                    trim_to(cache, context)

            merged = [_merge(list(layer), room=w) for layer in zip(*caches[:size])]
            batched = mx.concatenate([t[None] for t in tokens])

            def once(merged=merged, batched=batched, w=w):
                mx.eval(model(batched, cache=merged))
                for layer in merged:
                    layer.trim(w)

            out[size, w] = timed(kept_rounds, repeats) / ROUNDS
            out[size, w, "afresh"] = timed(afresh, repeats)
            out[size, w, "once"] = timed(once, repeats)
    return out


def ragged(model: nn.Module, make_cache, shapes: list[list[int]], context: int, repeats: int) -> list[str]:
    """Per round of row widths: ms of a pass padded to the widest, of two passes (the widest row; the others), and of
    one packed pass, on caches kept merged holding `context` tokens a row (trimmed back after every pass), and whether
    the packed pass's greedy tokens are the padded pass's."""
    rows = max(len(widths) for widths in shapes)
    caches = []
    for r in range(rows):
        cache = make_cache()
        prefill(model, cache, [(7 * r + i) % 1000 + 10 for i in range(context)])
        caches.append(cache)
    kept = KeptCaches()
    members = [kept.adopt(cache) for cache in caches]
    lines = []
    for widths in shapes:
        n = len(widths)
        tokens = [mx.array([(13 * i + j) % 1000 + 10 for j in range(w)]) for i, w in enumerate(widths)]

        def once(packed: bool, split: bool = False, widths=widths, tokens=tokens, n=n) -> list:
            if split:
                out = kept.run(model, members[:1], tokens[:1]) + kept.run(model, members[1:n], tokens[1:])
            else:
                out = kept.run(model, members[:n], tokens, packed=packed)
            for cache in caches[:n]:
                trim_to(cache, context)
            return [x.argmax(-1).tolist() for x in out]

        same = once(True) == once(False)
        padded, split, packed = (timed(partial(once, *how), repeats) for how in ((False,), (False, True), (True,)))
        lines.append(
            f"{widths}: padded {padded:.0f} ms, two passes {split:.0f} ms, packed {packed:.0f} ms "
            f"({padded / packed:.2f}x, {split / packed:.2f}x); packed tokens equal padded: {same}"
        )
    return lines


def report(table: dict, batches: list[int], widths: list[int]) -> str:
    step = table[1, 1]
    lines = [f"one pass, B = 1, W = 1: {step:.2f} ms", "", "ms (target steps) of a pass over B sequences x W tokens,"]
    lines.append("on caches kept merged, every row trimmed back after each pass (uag.core.kept_caches):")
    lines.append("B \\ W " + "".join(f"{w:>16}" for w in widths))
    for b in batches:
        lines.append(f"{b:<6}" + "".join(f"{table[b, w]:>9.1f} ({table[b, w] / step:4.2f})" for w in widths))
    for key, title in [
        ("afresh", "the same passes on caches merged afresh for each pass (batched_pass: rotating, quantized caches):"),
        ("once", "the same passes on mlx-lm's BatchKVCache merged once (no per-request caches, no trims):"),
    ]:
        lines.append(title)
        for b in batches[1:]:
            lines.append(
                f"{b:<6}" + "".join(f"{table[b, w, key]:>9.1f} ({table[b, w, key] / step:4.2f})" for w in widths)
            )
    lines.append("")
    lines.append(
        "tokens per target step, plain batched steps: "
        + ", ".join(f"B={b}: {b * step / table[b, 1]:.2f}" for b in batches)
    )
    pays = []
    for b in batches:
        fit = [w for w in widths if table[b, w] <= 2 * table[b, 1]]
        pays.append(f"B={b}: W<={max(fit) if fit else 1}")
    lines.append("widest W whose pass costs <= 2x the plain batched step: " + ", ".join(pays))
    return "\n".join(lines)


# --- --margins: how far a batched pass moves each row's logits -----------------------------------------------------
PATHS = ("kept", "afresh")  # caches kept merged (plain KV caches, as served); merged afresh (rotating, quantized)


def row_lengths(rows: int, context: int) -> list[int]:
    """Cached tokens per row, from `context` down to half of it: a batch's requests never hold the same number.

    Example: row_lengths(3, 512) -> [512, 384, 256];  row_lengths(1, 512) -> [512]
    """
    half = context // 2
    return [context - half * i // max(1, rows - 1) for i in range(rows)]


def shapes(size: int, widths: list[int]) -> list[tuple[str, list[int]]]:
    """(label, each row's width) of the passes measured over `size` rows: every width alike, then the narrowest
    and the widest mixed, row by row (plain steps batched with verifications, padded to the widest).

    Example: shapes(3, [1, 9]) -> [("1", [1, 1, 1]), ("9", [9, 9, 9]), ("1/9", [1, 9, 1])]
    """
    out = [(str(w), [w] * size) for w in widths]
    if len(widths) > 1:
        lo, hi = min(widths), max(widths)
        out.append((f"{lo}/{hi}", [lo if i % 2 == 0 else hi for i in range(size)]))
    return out


def spread(values: list[float]) -> tuple[float, float] | None:
    """(median, max) of per-repeat figures; None for none.  Example: [3e-6, 1e-6, 2e-6] -> (2e-06, 3e-06)"""
    return (statistics.median(values), max(values)) if values else None


def gap_changes(reference: mx.array, other: mx.array) -> tuple[float, float]:
    """The largest |change of the top-two gap| and |change of a logit| between two computations of the same
    positions' logits (W, V), over the positions; the top two are the reference's, everything in float32.

    Example: reference [[0, 3, 2]], other [[0, 2.9, 2.05]] -> (0.15, 0.1) (to float32 rounding)
    """
    ref, oth = reference.astype(mx.float32), other.astype(mx.float32)
    top = mx.argsort(ref, axis=-1)[:, -2:]  # (W, 2): the runner-up, the top choice
    a, b = mx.take_along_axis(ref, top, axis=-1), mx.take_along_axis(oth, top, axis=-1)
    gaps = mx.abs((a[:, 1] - a[:, 0]) - (b[:, 1] - b[:, 0]))
    return float(mx.max(gaps)), float(mx.max(mx.abs(ref - oth)))


def drift(
    model: nn.Module, make_cache, batches: list[int], widths: list[int], context: int, repeats: int
) -> dict[tuple[int, str, str], list[dict]]:
    """{(B, shape label, path): per repeat {"gap", "logit": the largest change against each row's own pass,
    "steps": the largest gap change against one-token steps over the same tokens}} for passes over B rows
    (`row_lengths`) of `shapes(B, widths)`; path "alone" is the rows' own pass against their steps (what
    benchmarks/dtypes.py measures). Kept caches keep their holes between passes, as served: every row is trimmed
    back after each pass (a rejected draft), and the next pass masks the holes out (compacting now and then)."""
    mx.random.seed(0)
    lengths = row_lengths(max(batches), context)
    own = []
    for n in lengths:
        cache = make_cache()
        prefill(model, cache, [int(t) for t in mx.random.randint(10, 1000, (n,))])
        own.append(cache)
    out: dict[tuple[int, str, str], list[dict]] = defaultdict(list)
    for size in batches:
        kept = KeptCaches()
        kept_rows = [copied(cache) for cache in own[:size]]
        members = [kept.adopt(cache) for cache in kept_rows]
        fresh = [copied(cache) for cache in own[:size]]
        for _ in range(repeats):
            for label, ws in shapes(size, widths):
                tokens = [mx.random.randint(10, 1000, (w,)) for w in ws]
                alone, steps = [], []
                for cache, n, t in zip(own, lengths, tokens):  # each row's own pass, then its one-token steps
                    alone.append(model(t[None], cache=cache)[0])
                    mx.eval(alone[-1])
                    trim_to(cache, n)
                    if t.shape[0] == 1:
                        steps.append(alone[-1])
                        continue
                    one = []
                    for j in range(t.shape[0]):
                        one.append(model(t[j : j + 1][None], cache=cache)[0])
                        mx.eval(one[-1])
                    steps.append(mx.concatenate(one))
                    trim_to(cache, n)
                batched = {"kept": [x[0] for x in kept.run(model, members, tokens)]}  # evaluated
                batched["afresh"] = [x[0] for x in batched_pass(model, tokens, fresh)]
                mx.eval(steps, batched["afresh"])
                for rows in (kept_rows, fresh):
                    for cache, n in zip(rows, lengths):
                        trim_to(cache, n)
                for path, logits in batched.items():
                    changes = [(gap_changes(a, b), gap_changes(s, b)[0]) for a, s, b in zip(alone, steps, logits)]
                    out[size, label, path].append(
                        {
                            "gap": max(c[0][0] for c in changes),
                            "logit": max(c[0][1] for c in changes),
                            "steps": max(c[1] for c in changes),
                        }
                    )
                if max(ws) > 1:
                    out[size, label, "alone"].append({"steps": max(gap_changes(s, a)[0] for a, s in zip(alone, steps))})
    return dict(out)


def drift_report(table: dict, dtype: str, threshold: float) -> str:
    """The drift table (median and max over repeats of each repeat's largest change) and what it means for the
    near-tie bound `threshold` of `dtype`: two runs batched differently may each sit that far from one-token steps,
    so the bound must be at least twice the largest change against them."""
    g = lambda pair: "-" if pair is None else f"{pair[0]:.2g} ({pair[1]:.2g})"  # noqa: E731
    lines = [
        "the largest change in a pass over its rows' positions, median (max) over repeats",
        f"{'B':<4}{'widths':<8}{'path':<8}{'|Δ gap| vs own pass':>22}{'|Δ logit| vs own pass':>24}"
        f"{'|Δ gap| vs 1-token steps':>27}",
    ]
    for (size, label, path), reps in table.items():
        cells = [spread([r[name] for r in reps if name in r]) for name in ("gap", "logit", "steps")]
        lines.append(f"{size:<4}{label:<8}{path:<8}{g(cells[0]):>22}{g(cells[1]):>24}{g(cells[2]):>27}")
    worst = worst_drift(table)
    covered = 2 * worst["batched_vs_steps"] <= threshold
    lines += [
        "",
        f"largest |Δ gap|: a batched pass against its rows' own pass {worst['batched_vs_own']:.2g}, against "
        f"one-token steps {worst['batched_vs_steps']:.2g}; a row's own pass against its steps "
        f"{worst['pass_vs_steps']:.2g}",
        f"near-tie bound for {dtype}: {threshold:g} — "
        + (
            f"covers two runs batched differently (2 x {worst['batched_vs_steps']:.2g})"
            if covered
            else f"does NOT cover two runs batched differently (needs >= {2 * worst['batched_vs_steps']:.2g})"
        ),
    ]
    return "\n".join(lines)


def worst_drift(table: dict) -> dict[str, float]:
    """The largest change over every pass of a `drift` table: a batched pass against its rows' own pass, and
    against one-token steps; a row's own pass against its steps.

    Example: {(2, "1", "kept"): [{"gap": 1e-6, "logit": 2e-6, "steps": 1e-6}], (2, "9", "alone"): [{"steps": 3e-6}]}
             -> {"batched_vs_own": 1e-06, "batched_vs_steps": 1e-06, "pass_vs_steps": 3e-06}
    """

    def most(paths: tuple[str, ...], name: str) -> float:
        return max((r[name] for (_, _, path), reps in table.items() if path in paths for r in reps), default=0.0)

    return {
        "batched_vs_own": most(PATHS, "gap"),
        "batched_vs_steps": most(PATHS, "steps"),
        "pass_vs_steps": most(("alone",), "steps"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="an offline name, a folder or a hub id")
    source.add_argument("--shapes", metavar="CONFIG.json", help="random weights of this config's shapes")
    parser.add_argument(
        "--dtype",
        help="float32, bfloat16, float16, q8, q4 (default: with --shapes float32, with --target as stored)",
    )
    parser.add_argument("--batches", type=int, nargs="+", help="default: 1 2 4 8 (with --margins: 2 4 8)")
    parser.add_argument("--widths", type=int, nargs="+", help="default: 1 2 4 8 16 (with --margins: 1 and k + 1 = 9)")
    parser.add_argument(
        "--context", type=int, default=512, help="tokens each sequence's cache holds (--margins: the most)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--margins",
        action="store_true",
        help="measure how far a batched pass moves each row's top-two logit gap from its own pass (no timing)",
    )
    parser.add_argument("--json", metavar="FILE", help="with --margins: every repeat's figures, as JSON")
    parser.add_argument(
        "--ragged",
        nargs="+",
        metavar="W,W,…",
        help="time rounds of these row widths padded, as two passes and packed (e.g. 17,1,1,1)",
    )
    args = parser.parse_args(argv)
    if args.target:
        from uag.models.store import ModelStore

        loaded = ModelStore().get(args.target, dtype=args.dtype)
        model, make_cache = loaded.model, loaded.make_cache
        name, dtype = f"{args.target} ({loaded.dtype})", loaded.dtype
    else:
        dtype = args.dtype or "float32"
        model, name = random_model(args.shapes, dtype), f"random weights of {args.shapes} ({dtype})"
        make_cache = partial(make_prompt_cache, model)
    if args.margins:
        return margins(args, model, make_cache, name, dtype)
    print(f"{name} on {mx.default_device()}, MLX {mx.__version__}; context {args.context}, median of {args.repeats}")
    if args.ragged:
        shapes = [[int(w) for w in spec.split(",")] for spec in args.ragged]
        print("\n".join(ragged(model, make_cache, shapes, args.context, args.repeats)))
        return 0
    args.batches, args.widths = args.batches or [1, 2, 4, 8], args.widths or [1, 2, 4, 8, 16]
    table = costs(
        model, make_cache, sorted(set(args.batches) | {1}), sorted(set(args.widths) | {1}), args.context, args.repeats
    )
    print(report(table, sorted(set(args.batches) | {1}), sorted(set(args.widths) | {1})))
    return 0


def margins(args: argparse.Namespace, model: nn.Module, make_cache, name: str, dtype: str) -> int:
    """`--margins`: the drift table, what it means for the dtype's near-tie bound, and with `--json` the figures."""
    from uag.runtime.divergence import near_tie_margin

    batches = sorted(set(args.batches or [2, 4, 8]) - {1})
    widths = sorted(set(args.widths or [1, 9]))
    if not batches or min(widths) < 1:
        raise SystemExit("--margins needs a batch of 2 or more rows and widths of 1 or more")
    lengths = row_lengths(max(batches), args.context)
    print(
        f"{name} on {mx.default_device()}, MLX {mx.__version__}; rows of {lengths[-1]}…{lengths[0]} cached tokens, "
        f"{args.repeats} repeats"
    )
    table = drift(model, make_cache, batches, widths, args.context, args.repeats)
    threshold = near_tie_margin(dtype)
    print(drift_report(table, dtype, threshold))
    if args.json:
        rows = [{"batch": b, "widths": w, "path": p, "repeats": reps} for (b, w, p), reps in table.items()]
        worst = {"dtype": dtype, "threshold": threshold, **worst_drift(table)}
        Path(args.json).write_text(json.dumps({"model": name, "worst": worst, "passes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
