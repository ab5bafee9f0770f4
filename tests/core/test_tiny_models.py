"""Tiny random models load through mlx-lm with their real tokenizers and decode deterministically."""

from __future__ import annotations

import time
from functools import cache

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import RotatingKVCache, can_trim_prompt_cache, make_prompt_cache

from tests.support.tiny_models import NON_TRIMMABLE_ARCH, build_tiny, tiny_pair

CASES = [  # every arch once; gemma3_text and mamba carry tokenizers of other families
    ("llama", "llama-3.2"),
    ("mistral", "mistral-v1"),
    ("qwen2", "qwen2.5"),
    ("gemma3_text", "qwen2.5"),
    ("mamba", "mistral-v1"),
]
UNTIED_ARCHS = ("mistral", "gemma3_text", "mamba")
PROMPT = "Ala ma kota, a kot ma Alę."


def load(arch: str, tokenizer: str, tie_embeddings: bool = True, seed: int = 0):
    """(model, tokenizer) through mlx_lm.load, once per test session."""
    return _load(arch, tokenizer, tie_embeddings, seed)


@cache
def _load(arch: str, tokenizer: str, tie_embeddings: bool, seed: int):
    return mlx_lm.load(str(build_tiny(arch, tokenizer, tie_embeddings=tie_embeddings, seed=seed)))


def greedy(model, tokenizer, prompt: str = PROMPT, max_tokens: int = 8) -> list[int]:
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]


@pytest.mark.parametrize(
    "arch, tokenizer, tie_embeddings",
    # untied where the head is a separate code path: llama-family (via mistral), gemma3_text, mamba
    [(*case, True) for case in CASES] + [(arch, tok, False) for arch, tok in CASES if arch in UNTIED_ARCHS],
)
def test_loads_and_decodes_deterministically(arch, tokenizer, tie_embeddings):
    model, tok = load(arch, tokenizer, tie_embeddings)
    ids = tok.encode(PROMPT)
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), len(tok._tokenizer))
    first = greedy(model, tok)
    assert len(first) == 8 and first == greedy(model, tok)
    # mlx-lm's streaming detokenizers (BPE and SPM alike) drop the leading space of the first generated token
    assert mlx_lm.generate(model, tok, PROMPT, max_tokens=8) == tok.decode(first).removeprefix(" ")


@pytest.mark.parametrize("arch, tokenizer", CASES)
def test_cache_trimmability(arch, tokenizer):
    model, _ = load(arch, tokenizer)
    assert can_trim_prompt_cache(make_prompt_cache(model)) == (arch != NON_TRIMMABLE_ARCH)


def test_gemma3_slides_and_stops_being_trimmable_once_the_window_is_full():
    """mlx-lm's RotatingKVCache can be trimmed only while offset < window: speculative decoding then refuses it."""
    model, tok = load("gemma3_text", "qwen2.5")
    cache_ = make_prompt_cache(model)
    assert [type(c).__name__ for c in cache_] == ["RotatingKVCache", "KVCache"]
    assert isinstance(cache_[0], RotatingKVCache) and cache_[0].max_size == 8
    model(mx.array([tok.encode("Ala ma")]), cache=cache_)
    assert can_trim_prompt_cache(cache_)
    model(mx.array([tok.encode(" kota, a kot ma Alę i psa")]), cache=cache_)
    assert cache_[0].offset > 8 and not can_trim_prompt_cache(cache_)


def test_tied_models_echo_and_agree_untied_models_do_not():
    """The two regimes tests choose between: tied -> acceptance ~100%, untied -> ~0%."""
    (a, tok), (b, _) = load("mistral", "mistral-v1", True, 0), load("mistral", "mistral-v1", True, 1)
    ids = mx.array([tok.encode(PROMPT)])
    assert a(ids).argmax(-1).tolist() == b(ids).argmax(-1).tolist() == ids.tolist()
    (a, _), (b, _) = load("mistral", "mistral-v1", False, 0), load("mistral", "mistral-v1", False, 1)
    agree = (a(ids).argmax(-1) == b(ids).argmax(-1)).mean().item()
    assert agree < 0.2


def test_tiny_pair_and_argument_checks():
    target, drafter = tiny_pair("llama-3.2")
    assert target == build_tiny("mistral", "mistral-v1") and drafter == build_tiny("llama", "llama-3.2", seed=1)
    start = time.perf_counter()
    build_tiny("mistral", "mistral-v1")
    assert time.perf_counter() - start < 0.5  # cached
    assert build_tiny("mistral", "mistral-v1", num_hidden_layers=1) != target  # overrides are part of the key
    with pytest.raises(ValueError, match="can only carry"):
        build_tiny("qwen2", "mistral-v1")
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny("gpt5", "qwen2.5")
