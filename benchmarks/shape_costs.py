"""Verification cost curves of the study's model shapes, and the break-even α* they imply.

Random weights (cost does not depend on them) in the study's shapes and quantisations: a Bielik-11B
(Mistral architecture) 8-bit target, Qwen2.5-1.5B and Llama-3.2-1B 4-bit drafters. For each: forward
time over w new tokens with a filled cache; then, per drafter, the measured CostProfile's break-even
α*(k) (the study's form: a cycle commits 1 + k·α tokens) beside the study's M2 Pro values
(r = 0.07, c = 0.185 → α* = r + c·k), and the c that the measured curve would fit.

Usage: python benchmarks/shape_costs.py [--widths 1 2 ... 16] [--context 256] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import make_prompt_cache

from uag.core.costmodel import CostProfile
from uag.core.speedup import break_even
from uag.machine import backend, blas, device_name

SHAPES = {
    # speakleash/Bielik-11B-v3.0-Instruct: Mistral architecture, 8-bit (the study's target)
    "bielik-11b-8bit": (
        llama,
        8,
        dict(
            model_type="mistral",
            hidden_size=4096,
            num_hidden_layers=50,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32128,
            rms_norm_eps=1e-5,
            rope_theta=1e6,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2.5-1.5b-4bit": (
        qwen2,
        4,
        dict(
            model_type="qwen2",
            hidden_size=1536,
            num_hidden_layers=28,
            intermediate_size=8960,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=True,
        ),
    ),
    "llama-3.2-1b-4bit": (
        llama,
        4,
        dict(
            model_type="llama",
            hidden_size=2048,
            num_hidden_layers=16,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            rms_norm_eps=1e-5,
            rope_theta=5e5,
            tie_word_embeddings=True,
        ),
    ),
}
TARGET = "bielik-11b-8bit"
STUDY_R, STUDY_C = 0.07, 0.185
KS = (1, 2, 4, 6, 8)


def build(name: str):
    """A random model of this shape. Initialisation, cast and quantisation stay lazy until each layer is
    evaluated on its own, so peak memory is one layer in float32 rather than the whole model."""
    module, bits, config = SHAPES[name]
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=bits)
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def fit_verify_c(target_ms: dict[int, float]) -> float | None:
    """Least-squares c in verify(k + 1) / verify(1) = 1 + c·k², the study's cost of verifying k drafts.

    Example: {1: 10, 2: 11, 3: 14} -> k = 1: 0.1, k = 2: 0.4 -> c = (1·0.1 + 4·0.4) / (1 + 16) = 0.1
    """
    points = [(w - 1, ms / target_ms[1] - 1) for w, ms in target_ms.items() if w > 1]
    if not points:
        return None
    return sum(k * k * y for k, y in points) / sum(k**4 for k, _ in points)


def forward_ms(model, widths, context: int, repeats: int) -> dict[int, float]:
    cache = make_prompt_cache(model)
    ids = mx.random.randint(0, 1000, (1, context + max(widths)))
    model(ids[:, :context], cache=cache)
    mx.eval([c.state for c in cache])
    out = {}
    for w in widths:
        times = []
        for _ in range(repeats + 1):
            tic = time.perf_counter()
            mx.eval(model(ids[:, context : context + w], cache=cache)[:, -1, :].argmax(axis=-1))
            times.append((time.perf_counter() - tic) * 1000)
            for layer in cache:
                layer.trim(w)
        out[w] = statistics.median(times[1:])  # the first is a warm-up
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=list(range(1, 17)))
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()

    results = {
        "date": str(date.today()),
        "device": device_name(),
        "backend": backend(),
        "mlx": mx.__version__,
        "blas": blas(),
        "context": args.context,
        "models": {},
    }
    for name in SHAPES:
        model = build(name)
        widths = args.widths if name == TARGET else [1]
        bytes_ = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        results["models"][name] = {"bytes": bytes_, "ms": forward_ms(model, widths, args.context, args.repeats)}
        del model
        mx.clear_cache()

    target = results["models"][TARGET]
    target_ms = target["ms"]
    print(
        f"shape costs — {results['date']}, {results['device']} ({results['backend']}), MLX {results['mlx']}, "
        f"cache {args.context} tokens, random weights"
    )
    print(f"{TARGET} ({target['bytes'] / 1e9:.1f} GB) forward over w new tokens:")
    print("  w  " + " ".join(f"{w:>6}" for w in target_ms))
    print("  ms " + " ".join(f"{ms:>6.1f}" for ms in target_ms.values()))
    c_measured = fit_verify_c(target_ms)
    results["c_fitted"] = c_measured
    header = f"  {'drafter':<20} {'bytes r':>7} {'time r':>7} " + " ".join(f"{'k=' + str(k):>7}" for k in KS)
    print("\nbreak-even α*(k), study form (S = 1 when a cycle's 1 + kα tokens cost what it takes):")
    print(header)
    print(
        f"  {'study, M2 Pro':<20} {STUDY_R:>7.3f} {'':>7} "
        + " ".join(f"{min(float(break_even(k, STUDY_R, STUDY_C)), 1):>7.0%}" for k in KS)
    )
    for name, info in results["models"].items():
        if name == TARGET:
            continue
        profile = CostProfile(target_ms, drafter_ms=info["ms"][1], form="study")
        alphas = {k: profile.break_even(k) for k in KS}
        info["alpha_star"] = alphas
        info["r_bytes"], info["r_time"] = info["bytes"] / target["bytes"], info["ms"][1] / target_ms[1]
        print(
            f"  {name:<20} {info['r_bytes']:>7.3f} {info['r_time']:>7.3f} "
            + " ".join(f"{'≥100%' if a is None else f'{a:.0%}':>7}" for a in alphas.values())
        )
    if c_measured is not None:
        print(
            f"\nthe measured verification curve fits the study's 1 + c·k² with c = {c_measured:.3f} (M2 Pro: {STUDY_C})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
