"""Tiny random mlx-lm models that carry real tokenizers, so tests exercise real loading and generation offline.

``build_tiny(arch, tokenizer)`` writes config.json + model.safetensors + the tokenizer files of
``real_tokenizers.build(tokenizer)`` into a directory that ``mlx_lm.load`` accepts, cached under the test cache
and keyed by every argument. Weights are random: use these models for correctness (caches, sync, streaming),
never for acceptance rates. Tests choose the regime: tied embeddings make greedy decoding repeat the last token,
so two different models agree ~100% (accept paths); untied models produce varied text and agree ~0% (rejects).

Example: model, tokenizer = mlx_lm.load(str(build_tiny("qwen2", "qwen2.5")))
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from . import real_tokenizers

RECIPE = "2"  # bump when configs or initialisation below change
EMBED_STD_TIED = 1.0  # tied: token embeddings dominate the residual stream (the model echoes its last token)
LOGIT_STD = 4.0  # untied: spread of the logits (mlx's default init gives ~0.6, a near-uniform softmax)
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}

# Shapes and defaults per arch; vocab_size, tie_word_embeddings and eos_token_id are filled in by build_tiny.
ARCH_CONFIGS = {
    "llama": {"model_type": "llama", **TINY, "intermediate_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
    "mistral": {"model_type": "mistral", **TINY, "intermediate_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e4},
    "qwen2": {"model_type": "qwen2", **TINY, "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6},
    # Every other layer slides over the last 8 tokens, so windowing shows up within a few dozen tokens.
    "gemma3_text": {
        "model_type": "gemma3_text",
        **TINY,
        "intermediate_size": 128,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
    },
    # State-space model: its cache (ArraysCache) cannot be trimmed, so mlx-lm's speculative decoding refuses it.
    "mamba": {
        "model_type": "mamba",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "state_size": 16,
        "conv_kernel": 4,
        "time_step_rank": 4,
        "use_bias": False,
        "use_conv_bias": True,
    },
}
ARCHS = tuple(ARCH_CONFIGS)
NON_TRIMMABLE_ARCH = "mamba"
# transformers 5 loads any model_type="qwen2" tokenizer as Qwen2Tokenizer, which rebuilds Qwen's own
# pre-tokenizer around the vocabulary: only Qwen's tokenizer survives that.
ALLOWED_TOKENIZERS = {"qwen2": ("qwen2.5",)}
# The paper's roles: a Mistral-architecture target (Bielik) and drafters of other families.
NATIVE_ARCH = {"mistral-v1": "mistral", "qwen2.5": "qwen2", "llama-3.2": "llama"}


def build_tiny(arch: str, tokenizer: str, *, seed: int = 0, tie_embeddings: bool = True, **overrides) -> Path:
    """Directory of a tiny random `arch` model carrying the real `tokenizer`; `overrides` patch config.json.

    Building (not reusing) seeds mlx's global RNG with `seed`: tests that sample must seed it themselves.
    """
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if tokenizer not in real_tokenizers.NAMES:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; expected one of {real_tokenizers.NAMES}")
    if tokenizer not in ALLOWED_TOKENIZERS.get(arch, (tokenizer,)):
        raise ValueError(f"arch {arch!r} can only carry {ALLOWED_TOKENIZERS[arch]} (got {tokenizer!r})")
    key = {"arch": arch, "tokenizer": tokenizer, "seed": seed, "tie": tie_embeddings, "overrides": overrides}
    stamp = json.dumps({**key, "recipe": RECIPE, "tokenizer_recipe": real_tokenizers.RECIPE}, sort_keys=True)
    name = f"{arch}-{tokenizer}-s{seed}-{'tied' if tie_embeddings else 'untied'}-{_digest(stamp)}"
    dest = real_tokenizers.cache_root() / "models" / name
    return real_tokenizers.cached_dir(dest, stamp, lambda tmp: _write(tmp, **key))


def tiny_pair(drafter: str = "qwen2.5", target: str = "mistral-v1", *, seed: int = 0, **kwargs) -> tuple[Path, Path]:
    """(target, drafter) directories in the paper's roles, each on its tokenizer's native arch, different seeds."""
    return (
        build_tiny(NATIVE_ARCH[target], target, seed=seed, **kwargs),
        build_tiny(NATIVE_ARCH[drafter], drafter, seed=seed + 1, **kwargs),
    )


def _write(path: Path, *, arch: str, tokenizer: str, seed: int, tie: bool, overrides: dict) -> None:
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    tokenizer_dir = real_tokenizers.build(tokenizer)
    vocab_size = real_tokenizers.VOCAB_SIZES[tokenizer]
    eos = real_tokenizers.EOS_TOKEN_IDS[tokenizer]
    config = {**ARCH_CONFIGS[arch], "vocab_size": vocab_size, "tie_word_embeddings": tie, "eos_token_id": eos}
    config.update(overrides)

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    if tie:
        weights.pop("lm_head.weight", None)  # gemma3_text always builds an lm_head and ties when it is missing
    _rescale(weights, config["hidden_size"], tie)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in tokenizer_dir.iterdir():
        if file.name != real_tokenizers.STAMP:
            shutil.copy(file, path / file.name)

    # Refuse to publish a directory mlx-lm cannot load and run.
    loaded, wrapper = mlx_lm.load(str(path))
    logits = loaded(mx.array([wrapper.encode("Ala ma kota")]))
    assert logits.shape[-1] == vocab_size and bool(mx.isfinite(logits).all()), (arch, tokenizer, logits.shape)


def _rescale(weights: dict, hidden_size: int, tie: bool) -> None:
    """Make next-token distributions peaked instead of near-uniform (mlx's default init gives logit std ~0.6).

    Tied: unit-variance embeddings dominate the residual stream, so greedy decoding repeats the last token and
    two different models agree ~100%. Untied: the default embeddings keep the context in play and the head is
    scaled to logit std LOGIT_STD, so greedy text is varied and two models agree ~0%.
    """
    import mlx.core as mx

    (embed,) = [k for k in weights if k.endswith(("embed_tokens.weight", "embeddings.weight"))]
    if tie:
        weights[embed] = mx.random.normal(weights[embed].shape) * EMBED_STD_TIED
    else:
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = mx.random.normal(head.shape) * (LOGIT_STD / hidden_size**0.5)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def unshare(*models) -> None:
    """The store's `LoadedModel`s as other test modules get them: the batch's `SharedModel` wrapper, which a batched
    pass puts on a model it shares (uag.runtime.batching.share), taken off again (a module-scoped fixture's end)."""
    from uag.runtime.batching import SharedModel

    for loaded in models:
        if isinstance(loaded.model, SharedModel):
            loaded.model = loaded.model.inner
