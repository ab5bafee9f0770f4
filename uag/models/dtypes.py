"""The dtypes a model can be loaded in, as the user names them, and what each means for speculation. No mlx.

    float32, bfloat16, float16      every floating parameter cast to that type
    q8, q4                          mlx-lm's own affine quantisation (its default group size, 64) of every
                                    layer it quantises, over bfloat16 for the rest: what mlx-community's
                                    -8bit / -4bit models are

`precision(LoadedModel.dtype)` reads back what a loaded model is in the same words, so a hub model loaded as
stored ("4-bit (bfloat16)") and the demo target loaded with ``--target-dtype q4`` are the same precision.
"""

from __future__ import annotations

from uag.errors import InputError

AS_STORED = "as stored"  # what the app's dropdowns call None
FLOATS = ("float32", "bfloat16", "float16")
QUANTIZED = {"q8": 8, "q4": 4}  # name -> bits
DTYPES = (*FLOATS, *QUANTIZED)
# mlx-lm quantises the layers of a bfloat16 checkpoint for its -Nbit models; we quantise over the same type
QUANTIZED_OVER = "bfloat16"
# The only dtype whose k-token verification pass costs less than k one-token steps on a CPU (MLX's
# bfloat16 / float16 / quantized CPU kernels do not amortise: docs/results.md#which-dtype-benchmarksdtype_costpy).
AMORTISES_ON_CPU = frozenset({"float32"})


def parse_dtype(value: str | None, *, flag: str = "dtype") -> str | None:
    """A dtype as the user typed it, checked; None (or "", "auto") means: as the model is stored.

    Example: parse_dtype("BF16") -> "bfloat16";  parse_dtype("4-bit") -> "q4";  parse_dtype("as stored") -> None;
             parse_dtype("int3") -> InputError
    """
    text = "".join((value or "").lower().split()).replace("-", "").replace("_", "")
    if text in ("", "auto", "asstored", "none"):
        return None
    aliases = {
        "fp32": "float32",
        "f32": "float32",
        "bf16": "bfloat16",
        "fp16": "float16",
        "f16": "float16",
        "8bit": "q8",
        "int8": "q8",
        "4bit": "q4",
        "int4": "q4",
    }
    text = aliases.get(text, text)
    if text not in DTYPES:
        raise InputError(f"{flag}: unknown dtype {value!r}: choose one of {', '.join(DTYPES)}")
    return text


def bits(dtype: str) -> int:
    """Bits per weight of a dtype's quantised or cast layers. Example: bits("q4") -> 4; bits("bfloat16") -> 16"""
    if dtype in QUANTIZED:
        return QUANTIZED[dtype]
    return {"float32": 32, "bfloat16": 16, "float16": 16}[dtype]


def precision(described: str) -> str:
    """The dtype name for a loaded model's description (`LoadedModel.dtype`), the one divergence thresholds use.

    Example: "float32" -> "float32";  "4-bit (bfloat16)" -> "q4";  "8-bit (float16)" -> "q8";
             "bfloat16/float32" -> "bfloat16" (mixed: the coarsest float);  "3-bit (bfloat16)" -> "q3"
    """
    text = (described or "").strip()
    if "-bit" in text:
        return f"q{text.split('-bit', 1)[0].strip()}"
    floats = [part for part in text.split("/") if part in FLOATS]
    for name in ("bfloat16", "float16", "float32"):  # coarsest first
        if name in floats:
            return name
    return text or "?"


def amortises(dtype: str, backend: str) -> bool:
    """Whether a k-token verification pass in `dtype` costs less than k single steps on `backend` (measured).

    Example: amortises("q4", "cpu") -> False;  amortises("float32", "cpu") -> True;  amortises("q4", "metal") -> True
    """
    return backend != "cpu" or precision(dtype) in AMORTISES_ON_CPU


def slow_dtype_note(target_dtype: str, backend: str) -> str | None:
    """What to tell the user before a run whose target cannot amortise verification here; None where it can."""
    if amortises(target_dtype, backend):
        return None
    return (
        f"the target runs in {precision(target_dtype)} on the CPU, where only float32 lets a k-token verification "
        "pass cost less than k one-token steps (MLX's bfloat16, float16 and quantized CPU kernels do not amortise): "
        "expect speculation to run slower than the target alone here; load the target in float32 to measure speedups"
    )


def add_dtype_options(parser) -> None:
    """--target-dtype / --drafter-dtype on an argparse parser (`uag generate`, `uag bench`), read by `parse_dtype`."""
    for role in ("target", "drafter"):
        parser.add_argument(
            f"--{role}-dtype",
            default=None,
            metavar="DTYPE",
            help=f"load the {role} in {', '.join(DTYPES)} (q8/q4: mlx-lm's quantisation, converted once into the "
            "user cache); default: as stored, the offline models in float32",
        )
