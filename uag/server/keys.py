"""The server's API keys: one (`--api-key`, named "default") or a file of named keys (`--api-key-file`), held only as
their SHA-256 digests and read again when the file changes, so that adding or revoking a key needs no restart.

    # keys.txt: one `name: key` a line; `sha256:<hex>` in place of a key keeps the key itself out of the file
    alice: 4f1c0e2b9d7a4c3e8b5a6d9f0e1c2b3a
    ci:    sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b

    keys = ApiKeys.read("keys.txt");  keys.match("4f1c0e2b9d7a4c3e8b5a6d9f0e1c2b3a") -> Key(name "alice")

A request's key is known downstream by its `Key`, a str holding the key's digest (never the key): what is kept per
key (prompt lookup's shared index, conversation caches, stored responses) is kept per digest. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from uag.errors import InputError

log = logging.getLogger(__name__)

DEFAULT_NAME = "default"  # the name of --api-key's (or $UAG_API_KEY's) key
HASHED = "sha256:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
DIGEST = re.compile(r"[0-9a-f]{64}")


def digest_of(key: str) -> str:
    """The SHA-256 hex digest a key is held as.

    Example: digest_of("test") -> "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    """
    return hashlib.sha256(key.encode()).hexdigest()


class Key(str):
    """A key the server holds: as a str its digest (what every per-key store is keyed by), and its `name` (the
    client it counts as, its metrics label)."""

    name: str

    def __new__(cls, digest: str, name: str) -> Key:
        made = super().__new__(cls, digest)
        made.name = name
        return made

    def __repr__(self) -> str:
        return f"Key({self.name!r})"


def parse_keys(text: str, where: str = "the key file") -> dict[str, str]:
    """name -> digest from a key file's text: `name: key` or `name: sha256:<64 hex>` a line, `#` comments and
    blank lines ignored; InputError naming every bad line (a line's key is never repeated in it).

    Example: parse_keys("alice: s3cret\\n# a comment\\n") -> {"alice": digest_of("s3cret")}
    """
    keys: dict[str, str] = {}
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, key = (part.strip() for part in line.partition(":"))
        at = f"{where}, line {number}"
        if not colon or not key:
            problems.append(f"{at}: write `name: key` (or `name: sha256:<hex>`)")
        elif not NAME.fullmatch(name):
            problems.append(f"{at}: the name {name[:70]!r} is not 1-64 letters, digits, '_', '.', '@' or '-'")
        elif name in keys:
            problems.append(f"{at}: the name {name!r} is given twice")
        elif any(c.isspace() for c in key):
            problems.append(f"{at}: the key holds a space")
        elif key.lower().startswith(HASHED) and not DIGEST.fullmatch(key[len(HASHED) :].lower()):
            problems.append(f"{at}: {HASHED} takes the key's SHA-256 as 64 hex digits")
        else:
            hashed = key.lower().startswith(HASHED)
            digest = key[len(HASHED) :].lower() if hashed else digest_of(key)
            if digest in keys.values():
                problems.append(f"{at}: the key of {name!r} is also another name's")
            keys[name] = digest
    if problems:
        raise InputError("; ".join(problems))
    return keys


@dataclass(frozen=True)
class _Stamp:
    mtime_ns: int
    size: int
    inode: int


class ApiKeys:
    """The keys a request may present: `fixed` (name -> digest: --api-key's) and those of `path` (a key file), read
    again whenever the file's modification time, size or inode changes (checked on each `match`). A file that
    becomes unreadable or wrong keeps the keys read last, with an error in the log: a typo mid-edit locks nobody
    out, and a revoked key stops working as soon as the file saying so is saved."""

    def __init__(self, fixed: dict[str, str] | None = None, path: str | Path | None = None):
        self.fixed = dict(fixed or {})
        self.path = None if path is None else Path(path).expanduser()
        self._keys: dict[str, str] = dict(self.fixed)
        self._stamp: _Stamp | None = None
        self._lock = threading.Lock()
        if self.path is not None:
            self._keys = self._read()  # InputError at start: a server never starts on a bad key file

    @classmethod
    def one(cls, key: str) -> ApiKeys:
        """--api-key's key, named "default"."""
        return cls({DEFAULT_NAME: digest_of(key)})

    @property
    def from_file(self) -> bool:
        """Whether the keys come from a file (each key is then its own client: uag.server.routes)."""
        return self.path is not None

    def match(self, given: str) -> Key | None:
        """The held key `given` is, compared by digest with `hmac.compare_digest` against every key (no early
        exit), or None."""
        self._refresh()
        digest = digest_of(given)
        with self._lock:
            held = list(self._keys.items())
        found = None
        for name, known in held:
            if hmac.compare_digest(digest, known):
                found = Key(known, name)
        return found

    def _refresh(self) -> None:
        """Read the file again if it changed since it was last judged (each version is judged once)."""
        if self.path is None:
            return
        try:
            stat = self.path.stat()
            stamp: _Stamp | None = _Stamp(stat.st_mtime_ns, stat.st_size, stat.st_ino)
        except OSError:
            stamp = None
        with self._lock:
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                keys = self._read()
            except InputError as err:
                log.error("%s; the keys read last stay in force", err)
                return
            added, dropped = set(keys) - set(self._keys), set(self._keys) - set(keys)
            self._keys = keys
        if added or dropped:
            log.info(
                "API keys read again from %s: %d keys%s%s",
                self.path,
                len(keys),
                f", added {', '.join(sorted(added))}" if added else "",
                f", revoked {', '.join(sorted(dropped))}" if dropped else "",
            )

    def _read(self) -> dict[str, str]:
        """The file's keys with the fixed ones; InputError when it cannot be read or is wrong."""
        assert self.path is not None
        try:
            if self._stamp is None:
                stat = self.path.stat()
                self._stamp = _Stamp(stat.st_mtime_ns, stat.st_size, stat.st_ino)
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"--api-key-file {self.path}: cannot read it ({err})") from None
        keys = parse_keys(text, f"--api-key-file {self.path}")
        for name, digest in self.fixed.items():
            if name in keys:
                raise InputError(f"--api-key-file {self.path}: the name {name!r} is --api-key's (or $UAG_API_KEY's)")
            if digest in keys.values():
                raise InputError(f"--api-key-file {self.path}: --api-key's key is also in the file")
            keys[name] = digest
        if not keys:
            raise InputError(f"--api-key-file {self.path} holds no keys: write `name: key` lines")
        return keys


def hash_line(key: str) -> str:
    """What `python -m uag serve --hash-key` prints for a key: the form a key file holds it in.

    Example: hash_line("test") -> "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    """
    key = key.strip()
    if not key or any(c.isspace() for c in key):
        raise InputError("--hash-key reads one key, without spaces, from standard input")
    return HASHED + digest_of(key)
