"""Memory before loading (uag.models.memory): sizes from safetensors headers, the refusal with injected sizes."""

from __future__ import annotations

import json
import struct

import pytest

from uag.errors import ModelError
from uag.models.memory import Need, check_fits, gb, model_bytes, parameters, stored_dtype

SIZES = {"F32": 4, "BF16": 2, "U32": 4}


def write_model(folder, tensors: dict[str, tuple[str, tuple[int, ...]]], quantization: dict | None = None):
    """A model folder whose safetensors file has these tensors (zeros) and a config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = SIZES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(offset))
    config = {"model_type": "llama", **({"quantization": quantization} if quantization else {})}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_bytes_in_each_dtype_from_a_float32_folder(tmp_path):
    folder = write_model(
        tmp_path / "m",
        {
            "model.embed_tokens.weight": ("F32", (1000, 128)),
            "model.norm.weight": ("F32", (128,)),
            "lm_head.weight": ("F32", (1000, 100)),
        },  # 100 columns: not in 64-value groups, so never quantised
    )
    assert stored_dtype(folder) == "float32"
    assert model_bytes(folder) == model_bytes(folder, "float32") == 4 * (128_000 + 128 + 100_000)
    assert model_bytes(folder, "bfloat16") == 2 * (128_000 + 128 + 100_000)
    # q4: the embedding packs at 4 bits with a bfloat16 scale and bias per 64 values; the rest stays bfloat16
    assert model_bytes(folder, "q4") == 128_000 // 2 + (128_000 // 64) * 4 + 2 * (128 + 100_000)
    assert model_bytes(folder, "q8") == 128_000 + (128_000 // 64) * 4 + 2 * (128 + 100_000)


def test_a_quantized_folder_counts_the_values_it_packs(tmp_path):
    # a 4-bit 256 x 512 matrix: 512 * 4 / 32 = 64 uint32 words per row, 8 groups of 64 per row
    folder = write_model(
        tmp_path / "q",
        {
            "model.up.weight": ("U32", (256, 64)),
            "model.up.scales": ("BF16", (256, 8)),
            "model.up.biases": ("BF16", (256, 8)),
            "model.norm.weight": ("BF16", (512,)),
        },
        quantization={"group_size": 64, "bits": 4},
    )
    assert stored_dtype(folder) == "q4"
    assert {t.name: t.shape for t in parameters(folder)}["model.up.weight"] == (256, 512)
    assert model_bytes(folder) == 256 * 64 * 4 + 2 * 256 * 8 * 2 + 512 * 2  # as stored: the files' bytes
    assert model_bytes(folder, "q4") == model_bytes(folder)  # re-quantised the same way: the same size
    assert model_bytes(folder, "float32") == 4 * (256 * 512 + 512)


def test_refusal_names_both_sizes_and_the_fix():
    needs = [
        Need("target", "demo-target", "q4", 170_000_000),
        Need("drafter", "coder-target", "float32", 7_100_000_000),
    ]
    with pytest.raises(ModelError) as caught:
        check_fits(needs, available=4_000_000_000)
    text = str(caught.value)
    assert "\n" not in text
    assert "demo-target (q4, 0.17 GB)" in text and "coder-target (float32, 7.1 GB)" in text and "4 GB free" in text
    assert "--drafter-dtype" in text and "smaller drafter" in text  # the biggest model is the drafter


def test_what_fits_passes_and_what_is_loaded_costs_nothing():
    target = Need("target", "t", None, 6_000_000_000, loaded=True)
    drafter = Need("drafter", "d", "q4", 500_000_000)
    check_fits([target, drafter], available=1_000_000_000)  # only the drafter is new: 0.6 GB with headroom
    with pytest.raises(ModelError, match=r"the target t \(as stored, 6 GB, loaded\)"):
        check_fits([target, drafter], available=500_000_000)
    check_fits([target, drafter], available=None)  # cannot tell: never refuse


def test_headroom_is_asked_for():
    need = [Need("target", "t", "bfloat16", 1_000_000_000)]
    check_fits(need, available=1_300_000_000)
    with pytest.raises(ModelError, match="it needs about 1.2 GB"):
        check_fits(need, available=1_100_000_000)


@pytest.mark.parametrize(("n", "text"), [(170e6, "0.17 GB"), (7.1e9, "7.1 GB"), (23.4e9, "23 GB")])
def test_gb(n, text):
    assert gb(n) == text
