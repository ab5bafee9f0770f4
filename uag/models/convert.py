"""GGUF file -> mlx-lm model folder (``config.json``, ``model.safetensors``, tokenizer), in float32.

The weights are dequantized with the ``gguf`` package, a slice of rows at a time, and streamed into the
safetensors file, so converting a 1.5B model needs about as much memory as its largest slice, not its
7 GB of float32 weights. llama.cpp's storage conventions are undone on the way: llama's Q/K rows are
un-permuted, Gemma's RMSNorm weights lose llama.cpp's +1, qwen2's q/k/v biases are kept. A GGUF that
carries its own ``output.weight`` gets it as an untied ``lm_head`` (that is the matrix llama.cpp computes
logits with). The tokenizer is built from the GGUF metadata the way transformers builds it, torch-free.

Example: ``convert(Path("m.gguf"), Path("out"), architecture="qwen2", model_type="qwen2",
         eos_token_ids=(151645, 151643))``
then ``mlx_lm.load("out")`` -> (model, tokenizer).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Progress = Callable[[str], None]

# Rows dequantized at once are capped at this many float32 values (64 MiB), so the embedding matrix of a
# 152K vocabulary never exists twice in memory.
SLICE_VALUES = 1 << 24

# GGUF per-layer tensor names -> mlx-lm's (the HF names), per architecture.
_LAYER_NAMES = {
    "llama": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    },
    "qwen2": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    },
    "gemma3": {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
}
_SHARED_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BIASED = {"qwen2": frozenset({"attn_q", "attn_k", "attn_v"})}  # GGUF keys whose .bias tensors mlx-lm has
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)$")


def mlx_name(gguf_name: str, architecture: str) -> str:
    """mlx-lm's parameter name for a GGUF tensor.

    Example: ("blk.3.ffn_norm.weight", "gemma3") -> "model.layers.3.pre_feedforward_layernorm.weight"
             ("blk.0.attn_q.bias", "qwen2") -> "model.layers.0.self_attn.q_proj.bias"
    """
    match = _TENSOR_NAME.match(gguf_name)
    layer, key, kind = match.groups() if match else (None, None, None)
    if kind == "bias" and key not in _BIASED.get(architecture, ()):
        key = None
    if layer is not None and key is not None:
        leaf = _LAYER_NAMES[architecture].get(key) or _SHARED_LAYER_NAMES.get(key)
        if leaf:
            return f"model.layers.{layer}.{leaf}.{kind}"
    elif key in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[key]}.{kind}"
    raise ValueError(f"no mlx-lm name for GGUF tensor {gguf_name!r} ({architecture})")


def unpermute_rope_rows(weight, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves for its rope).

    llama.cpp writes ``w.reshape(n_heads, 2, d/2, ...).swapaxes(1, 2)``; this is the inverse, as in
    transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    Example: one head of 4 rows [a0, b0, a1, b1] (stored) -> [a0, a1, b0, b1] (HF / mlx-lm layout)
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def convert(
    gguf_path: Path,
    out: Path,
    *,
    architecture: str,
    model_type: str,
    eos_token_ids: tuple[int, ...],
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write ``out/model.safetensors``, ``out/config.json`` and the tokenizer files; return the config.

    ``architecture`` is the GGUF's (``general.architecture``), checked; ``model_type`` the mlx-lm module.
    """
    from gguf import GGUFReader

    say = progress or (lambda message: None)
    reader = GGUFReader(gguf_path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    if metadata["general.architecture"] != architecture or architecture not in _LAYER_NAMES:
        raise ValueError(f"{gguf_path} is {metadata['general.architecture']!r}, expected {architecture!r}")
    shapes = {mlx_name(t.name, architecture): _shape(t) for t in reader.tensors}
    config = _config(architecture, model_type, eos_token_ids, metadata, shapes)
    _check_against_mlx_lm(config, shapes)
    write_safetensors(out / "model.safetensors", shapes, _float32_tensors(reader, metadata, say))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    say("building the tokenizer from the GGUF metadata")
    _tokenizer(metadata).save_pretrained(str(out))
    return config


def _shape(tensor) -> tuple[int, ...]:
    # ggml lists dimensions fastest-first; numpy wants them the other way round
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _float32_tensors(reader, metadata: dict[str, Any], say: Progress) -> Iterator[tuple[str, Any]]:
    """(mlx-lm name, float32 slice of rows) in file order, llama.cpp's conventions undone; a tensor
    arrives in one or more consecutive slices of whole rows."""
    import numpy as np
    from gguf.quants import dequantize

    architecture = metadata["general.architecture"]
    heads = metadata[f"{architecture}.attention.head_count"]
    kv_heads = metadata.get(f"{architecture}.attention.head_count_kv", heads)
    layers = metadata[f"{architecture}.block_count"]
    announced = set()
    for tensor in reader.tensors:
        layer, key, _ = _TENSOR_NAME.match(tensor.name).groups()
        step = f"layer {int(layer) + 1}/{layers}" if layer is not None else "embeddings and output"
        if step not in announced:
            announced.add(step)
            say(f"converting {step}")
        shape = _shape(tensor)
        name = mlx_name(tensor.name, architecture)
        permuted = architecture == "llama" and key in ("attn_q", "attn_k")
        rows = shape[0] if len(shape) > 1 and not permuted else 1  # a permuted or 1-D tensor goes whole
        step_rows = max(1, SLICE_VALUES // max(1, int(np.prod(shape[1:])))) if rows > 1 else 1
        for start in range(0, rows, step_rows):
            data = tensor.data[start : start + step_rows] if rows > 1 else tensor.data
            part_shape = (min(step_rows, rows - start), *shape[1:]) if rows > 1 else shape
            weight = np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32).reshape(part_shape)
            if permuted:
                weight = unpermute_rope_rows(weight, heads if key == "attn_q" else kv_heads)
            if architecture == "gemma3" and key.endswith("norm"):
                weight = weight - 1.0  # llama.cpp stores Gemma's RMSNorm weights as 1 + w; mlx-lm adds the 1
            yield name, np.ascontiguousarray(weight)


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], slices: Iterator[tuple[str, Any]]) -> None:
    """Stream float32 tensors into a safetensors file whose header is written first, from ``shapes``.

    ``slices`` yields (name, array) in ``shapes``' order, each tensor as consecutive slices of whole rows.
    Example: shapes {"a": (2, 3)}, slices ("a", 1x3), ("a", 1x3) -> one tensor "a" of 2x3 float32.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * _count(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    order, written = iter(shapes), {}
    current = None
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, array in slices:
            if name != current:
                assert current is None or written[current] == _count(shapes[current]), f"{current} incomplete"
                current = next(order)
                assert name == current, f"tensor {name!r} arrived where {current!r} was due"
                written[name] = 0
            assert array.dtype.name == "float32" and tuple(array.shape[1:]) == tuple(shapes[name][1:]), name
            handle.write(array.tobytes())
            written[name] += array.size
        assert current is None or written[current] == _count(shapes[current]), f"{current} incomplete"
        assert next(order, None) is None, "some tensors never arrived"
        assert handle.tell() == 8 + len(encoded) + offset


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _f32(value: float) -> float:
    """A GGUF float32 as the decimal it was written from. Example: 9.999999747378752e-06 -> 1e-05"""
    import numpy as np

    return float(str(np.float32(value)))


def _config(
    arch: str, model_type: str, eos_token_ids: tuple[int, ...], metadata: dict[str, Any], shapes: dict[str, tuple]
) -> dict[str, Any]:
    """config.json in mlx-lm's ModelArgs field names (which are the HF ones)."""
    vocab_size, hidden_size = shapes["model.embed_tokens.weight"]
    config = {
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": metadata[f"{arch}.block_count"],
        "intermediate_size": metadata[f"{arch}.feed_forward_length"],
        "num_attention_heads": metadata[f"{arch}.attention.head_count"],
        "num_key_value_heads": metadata[f"{arch}.attention.head_count_kv"],
        "rms_norm_eps": _f32(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "vocab_size": vocab_size,
        "max_position_embeddings": metadata[f"{arch}.context_length"],
        "rope_theta": _f32(metadata[f"{arch}.rope.freq_base"]),
        "rope_scaling": None,
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "bos_token_id": metadata["tokenizer.ggml.bos_token_id"],
        "eos_token_id": list(eos_token_ids),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "llama":
        config["head_dim"] = metadata.get(f"{arch}.rope.dimension_count", hidden_size // config["num_attention_heads"])
        config["rope_traditional"] = False  # HF layout once the Q/K rows are un-permuted
    elif arch == "qwen2":
        config["rope_traditional"] = False  # llama.cpp runs qwen2 with NEOX rope and stores Q/K in HF order
    elif arch == "gemma3":
        head_dim = metadata[f"{arch}.attention.key_length"]
        config.update(
            head_dim=head_dim,
            # llama.cpp scales queries by 1/sqrt(head_dim) for every Gemma-3 but the 27B: same as HF's 270M config
            query_pre_attn_scalar=head_dim,
            sliding_window=metadata[f"{arch}.attention.sliding_window"],
            # not in the GGUF; llama.cpp hard-codes both for gemma3 (5 local layers, then 1 global)
            sliding_window_pattern=6,
            rope_local_base_freq=10_000.0,
        )
    return config


def _check_against_mlx_lm(config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Fail before writing anything, not at load, if a name or shape does not fit mlx-lm's model.

    mlx builds the model's parameters lazily, so this allocates nothing.
    """
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    expected = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    if config["tie_word_embeddings"]:
        expected.pop("lm_head.weight", None)
    got = {k: tuple(v) for k, v in shapes.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(f"converted weights do not fit mlx-lm: missing {missing}, extra {extra}, shape {wrong}")


def _tokenizer(metadata: dict[str, Any]):
    """A Hugging Face fast tokenizer from GGUF metadata, built the way transformers' GGUF loader builds it.

    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` would do the same, but in transformers 5 its GGUF
    reader imports torch; so read the metadata with ``gguf`` and call the torch-free builder it calls.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    # (mirrors transformers.integrations.gguf.gguf_tokenizer_mapping.get_gguf_tokenizer)
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)  # llama.cpp's default for SentencePiece vocabularies
    tokens = tokenizer_dict["tokens"]
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        tokenizer_config[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config)


def to_dtype(source: Path | str, out: Path, dtype: str, *, progress: Progress | None = None) -> dict[str, Any]:
    """Write the mlx-lm model at ``source`` (a folder or a hub id mlx-lm can load) into ``out`` in ``dtype``
    (uag.models.dtypes: float32, bfloat16, float16, q8, q4); return its config.

    The steps are mlx-lm's own (``mlx_lm.convert``): a quantized source is dequantized first, floating
    parameters are cast (to bfloat16 under a quantisation, as mlx-community's -Nbit models are), then
    ``quantize_model`` packs what mlx-lm quantises, at its default group size; ``mlx_lm.utils.save`` writes
    weights, config and tokenizer.
    Example: ``to_dtype(Path("demo-target-1"), Path("out"), "q4")`` -> config with quantization {"bits": 4, ...}
    """
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import dequantize_model, load, quantize_model, save

    from uag.models.dtypes import FLOATS, QUANTIZED, QUANTIZED_OVER

    if dtype not in (*FLOATS, *QUANTIZED):
        raise ValueError(f"unknown dtype {dtype!r}")
    say = progress or (lambda message: None)
    model, tokenizer, config = load(str(source), return_config=True, lazy=True)
    if config.get("quantization") or config.get("quantization_config"):
        say("dequantizing")
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    cast_to = getattr(mx, QUANTIZED_OVER if dtype in QUANTIZED else dtype)
    keep = getattr(model, "cast_predicate", lambda _: True)  # some architectures keep a few parameters as they are
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(cast_to) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    config["torch_dtype"] = QUANTIZED_OVER if dtype in QUANTIZED else dtype
    if dtype in QUANTIZED:
        say(f"quantizing to {QUANTIZED[dtype]} bits")
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its bits per weight: not on our stdout (--json)
            model, config = quantize_model(model, config, group_size=None, bits=QUANTIZED[dtype])
    save(out, source, model, tokenizer, config)
    return config
