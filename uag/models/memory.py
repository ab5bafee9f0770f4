"""Will a pair fit? A model's bytes in a dtype, read from its safetensors headers (nothing loaded), the memory
this machine has free for it, and the one-line refusal when a pair does not fit.

Loading a pair that does not fit does not fail cleanly: the machine swaps until everything crawls, or the
process is killed. So every interface checks first (uag.models.loading.check_memory) and says how big each
model is, how much there is, and what to change.

    >>> need = [Need("target", "demo-target", "q4", 170e6), Need("drafter", "coder-target", "float32", 7.1e9)]
    >>> check_fits(need, available=4e9)
    ModelError: cannot load the target demo-target (q4, 0.17 GB) with the drafter coder-target (float32, 7.1 GB): ...

Unified memory (Apple silicon) is one pool for the CPU and the GPU: what macOS reports free, capped by the
GPU's recommended working set (MLX slows to a crawl above it, mlx-lm warns there). A CUDA GPU holds the
weights in its own memory: what MLX reports for the device. A Linux CPU: MemAvailable, within the cgroup's limit.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from uag.errors import ModelError
from uag.models.dtypes import FLOATS, QUANTIZED, bits

# Weights are not all a run holds: activations, the KV caches, MLX's buffer cache. Ask for this much more.
HEADROOM = 1.2
QUANT_GROUP = 64  # mlx-lm's default group size (uag.models.dtypes)
_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2}
_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors' name: "F32", "BF16", "U32"…
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _BYTES.get(self.dtype, 1)


def tensors(folder: Path) -> list[Tensor]:
    """Every tensor of a model folder's safetensors files, from their headers (a few KB read per file)."""
    found = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        found += [Tensor(k, v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"]
    return found


def _quantization(folder: Path) -> dict:
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    quant = config.get("quantization") or config.get("quantization_config") or {}
    return quant if isinstance(quant, dict) and "bits" in quant else {}


def stored_dtype(folder: Path) -> str | None:
    """What a model folder holds, in uag.models.dtypes' names: "q4", "bfloat16"…; None when it cannot tell.

    Example: an mlx-community -4bit folder -> "q4" (its config says 4 bits);  the demo target's folder -> "float32"
    """
    quant = _quantization(folder)
    if quant:
        return f"q{quant['bits']}"
    sizes: dict[str, int] = {}
    for tensor in tensors(folder):
        if tensor.dtype in _NAMES:
            sizes[_NAMES[tensor.dtype]] = sizes.get(_NAMES[tensor.dtype], 0) + tensor.nbytes
    return max(sizes, key=sizes.get) if sizes else None


def parameters(folder: Path) -> list[Tensor]:
    """The model's parameters with the shapes they have unquantized: a packed weight (uint32 words, with
    `.scales` and `.biases` beside it) is counted as the values it packs; the scales and biases are dropped."""
    listed = tensors(folder)
    quant = _quantization(folder)
    by_name = {t.name: t for t in listed}
    out = []
    for t in listed:
        stem = t.name.rsplit(".", 1)[0]
        scales = by_name.get(f"{stem}.scales")
        if quant and t.name.endswith((".scales", ".biases")) and f"{stem}.weight" in by_name:
            continue
        if quant and t.dtype == "U32" and scales is not None:
            layer = quant.get(stem)  # mlx-lm's per-layer settings are keyed by the module's path
            n_bits = layer.get("bits", quant["bits"]) if isinstance(layer, dict) else quant["bits"]
            out.append(Tensor(t.name, scales.dtype, (*t.shape[:-1], t.shape[-1] * 32 // n_bits)))
        else:
            out.append(t)
    return out


def model_bytes(folder: Path, dtype: str | None = None) -> int:
    """Bytes of the model's weights in `dtype` (as stored when None), estimated from its headers the way
    uag.models.convert.to_dtype would write them: a float dtype casts every floating parameter; q8/q4 pack each
    matrix whose rows split into 64-value groups at that many bits, plus a bfloat16 scale and bias per group,
    and keep the rest in bfloat16.

    Example: one 4096 x 4096 matrix stored in float32 (64 MiB) -> "bfloat16": 32 MiB;  "q4": 8 MiB + 1 MiB of scales
    """
    if dtype is None:
        return sum(t.nbytes for t in tensors(folder))
    total = 0
    for t in parameters(folder):
        count = math.prod(t.shape)
        if t.dtype not in _NAMES:  # integer buffers are not cast
            total += t.nbytes
        elif dtype in FLOATS:
            total += count * bits(dtype) // 8
        elif len(t.shape) >= 2 and t.name.endswith(".weight") and t.shape[-1] % QUANT_GROUP == 0:
            total += count * QUANTIZED[dtype] // 8 + (count // QUANT_GROUP) * 2 * 2
        else:
            total += count * 2
    return total


# --- what this machine has ------------------------------------------------------------------------------------


def available_bytes() -> int | None:
    """Memory free for a model's weights now, in bytes (see the module doc); None when it cannot tell."""
    gpu = _accelerator_free()
    if gpu is not None and not _unified():
        return gpu
    system = _macos_available() if sys.platform == "darwin" else _linux_available()
    if gpu is not None and system is not None:
        return min(gpu, system)
    return system if system is not None else gpu


def _unified() -> bool:
    return sys.platform == "darwin"


def _accelerator_free() -> int | None:
    """What MLX says its device can still take: the recommended working set (Metal) or the device's memory
    (CUDA), less what MLX holds already; None on a CPU."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    if mx.default_device() == mx.cpu:
        return None
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    limit = info.get("max_recommended_working_set_size") or info.get("memory_size") or info.get("total_memory")
    if not isinstance(limit, int) or limit <= 0:
        return None
    return max(0, limit - int(mx.get_active_memory()))


def _linux_available() -> int | None:
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
    if "MemAvailable" not in fields:
        return None
    available = int(fields["MemAvailable"].split()[0]) * 1024
    try:  # a container's limit (cgroup v2) can be far below what the host has free
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def _macos_available() -> int | None:
    """Free, inactive, speculative and purgeable pages: what macOS hands out without swapping (`vm_stat`)."""
    try:
        text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = text.splitlines()
    try:
        page = int(lines[0].split("page size of")[1].split()[0])
    except (IndexError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
    pages = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        if value.strip().rstrip(".").isdigit():
            pages[key.strip()] = int(value.strip().rstrip("."))
    wanted = ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable")
    if "Pages free" not in pages:
        return None
    return page * sum(pages.get(key, 0) for key in wanted)


# --- the check ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """One model a run needs: its role, name, dtype (None: as stored) and bytes; `loaded` when it is in memory
    already (it needs nothing more)."""

    role: str
    name: str
    dtype: str | None
    bytes: int
    loaded: bool = False

    def describe(self) -> str:
        held = ", loaded" if self.loaded else ""
        return f"the {self.role} {self.name} ({self.dtype or 'as stored'}, {gb(self.bytes)}{held})"


def gb(n: float) -> str:
    """Example: 170e6 -> "0.17 GB";  7.1e9 -> "7.1 GB";  23.4e9 -> "23 GB" """
    value = n / 1e9
    return f"{value:.2g} GB" if value < 10 else f"{value:.0f} GB"


def check_fits(needs: Sequence[Need], available: int | None, *, headroom: float = HEADROOM) -> None:
    """ModelError, one line naming every model's size and the fix, when the models not yet loaded need more
    than `available` bytes (with `headroom` for what a run holds besides weights); nothing when it cannot tell.

    Example: [target q4 0.17 GB, drafter float32 7.1 GB], 4 GB available -> "cannot load the target demo-target
             (q4, 0.17 GB) with the drafter coder-target (float32, 7.1 GB): they need about 8.7 GB with room to
             run, and 4 GB is free: …"
    """
    if available is None or not needs:
        return
    wanted = sum(n.bytes for n in needs if not n.loaded) * headroom
    if wanted <= available:
        return
    first, *rest = needs
    together = f" with {' and '.join(n.describe() for n in rest)}" if rest else ""
    fixes = []
    biggest = max(needs, key=lambda n: n.bytes)
    if biggest.dtype not in ("q4",):
        fixes.append(f"load the {biggest.role} in a smaller dtype (q8 or q4: --{biggest.role}-dtype)")
    if any(n.role == "drafter" for n in needs):
        fixes.append("pick a smaller drafter (or prompt lookup, which loads no model)")
    fixes.append("close what else holds memory")
    raise ModelError(
        f"cannot load {first.describe()}{together}: {'they need' if rest else 'it needs'} about {gb(wanted)} "
        f"with room to run, and this machine has {gb(available)} free; {', or '.join(fixes)}"
    )
