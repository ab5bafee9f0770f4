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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from uag.core.kept_caches import KeptCaches
from uag.core.passes import batched_pass, prefill, trim_to


def random_model(config_path: str, dtype: str):
    """An mlx-lm model of the config's shapes with random weights, in `dtype`."""
    from mlx_lm.utils import _get_classes

    config = json.loads(open(config_path).read())
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="an offline name, a folder or a hub id")
    source.add_argument("--shapes", metavar="CONFIG.json", help="random weights of this config's shapes")
    parser.add_argument("--dtype", default="float32", help="with --shapes: float32, bfloat16, float16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=512, help="tokens each sequence's cache holds")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.target:
        from uag.models.store import ModelStore

        loaded = ModelStore().get(args.target)
        model, make_cache, name = loaded.model, loaded.make_cache, args.target
    else:
        model, name = random_model(args.shapes, args.dtype), f"random weights of {args.shapes} ({args.dtype})"
        make_cache = partial(make_prompt_cache, model)
    print(f"{name} on {mx.default_device()}, MLX {mx.__version__}; context {args.context}, median of {args.repeats}")
    table = costs(
        model, make_cache, sorted(set(args.batches) | {1}), sorted(set(args.widths) | {1}), args.context, args.repeats
    )
    print(report(table, sorted(set(args.batches) | {1}), sorted(set(args.widths) | {1})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
