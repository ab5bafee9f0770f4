"""Which dtype should the demo models run in on this backend? Measured, side by side in one run.

Speculation needs two things from a dtype: a fast single-token step (the baseline) and a multi-token
forward that costs little more than one (verification amortises). For each dtype this prints the
target's forward time over n = 1 and n = 8 new tokens with a 256-token cache, and their ratio.

Usage: python benchmarks/dtype_cost.py [--models demo-target demo-drafter] [--dtypes float32 bfloat16 q4]
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx_lm

from uag.costs.calibrate import filled_cache, time_forward
from uag.machine import backend, blas, device_name
from uag.models.store import LoadedModel, ModelStore


def as_dtype(model: LoadedModel, dtype: str) -> LoadedModel:
    """A fresh copy of the model in `dtype` ("float32", "bfloat16", "float16", "q4", "q8")."""
    weights, tokenizer, config = mlx_lm.load(str(model.path), return_config=True)
    if dtype.startswith("q"):
        weights.set_dtype(mx.bfloat16)
        nn.quantize(weights, group_size=64, bits=int(dtype[1:]))
    else:
        weights.set_dtype(getattr(mx, dtype))
    mx.eval(weights.parameters())
    return LoadedModel(model.name, model.path, weights, tokenizer, config)


def measure(model, dtypes, *, context: int, repeats: int) -> list[dict]:
    rows = []
    for dtype in dtypes:
        variant = as_dtype(model, dtype)
        cache, ids = filled_cache(variant, context)
        one = time_forward(variant, cache, ids, 1, repeats)
        eight = time_forward(variant, cache, ids, 8, repeats)
        rows.append({"model": model.name, "dtype": dtype, "ms_1": one, "ms_8": eight, "ratio_8_1": eight / one})
        del variant, cache
        mx.clear_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo-target", "demo-drafter"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16", "q8", "q4"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    store = ModelStore(dtype="float32")
    rows = [
        r
        for name in args.models
        for r in measure(store.get(name), args.dtypes, context=args.context, repeats=args.repeats)
    ]
    header = (
        f"dtype cost — {date.today()}, {platform.machine()} {device_name()}, MLX {mx.__version__} "
        f"({backend()}), BLAS {blas()}, cache {args.context} tokens"
    )
    if args.json:
        print(json.dumps({"header": header, "rows": rows}, indent=2))
        return
    print(header)
    print(f"{'model':<14} {'dtype':<9} {'1 token ms':>11} {'8 tokens ms':>12} {'8 / 1':>7}")
    for r in rows:
        print(f"{r['model']:<14} {r['dtype']:<9} {r['ms_1']:>11.2f} {r['ms_8']:>12.2f} {r['ratio_8_1']:>7.2f}")


if __name__ == "__main__":
    main()
