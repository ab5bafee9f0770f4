"""What every `python -m uag…` command shares: one-line errors, exit codes, and flags read as text.

- Input the user can fix (`uag.errors.UserError`, a bad flag) -> one line ``error: …`` on stderr, exit 2.
- Anything else is a bug: its traceback goes to a log file, the user sees ``internal error: …``, exit 1.
- Ctrl-C -> exit 130.

Numeric flags are taken as text and checked by the same code as the app's inputs (GenerationConfig.parse),
so a bad number reads the same everywhere and never names a Python type.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from uag.core.config import DEFAULT_K, DEFAULT_MAX_TOKENS, FIELD, MAX_K, GenerationConfig
from uag.core.translate import DEFAULT_WINDOW
from uag.errors import InputError, UserError

USER_ERROR = 2
INTERNAL_ERROR = 1
INTERRUPTED = 130


class CommandParser(argparse.ArgumentParser):
    """argparse, with its errors as one ``error: …`` line (exit 2) instead of a usage block."""

    def error(self, message: str) -> None:  # argparse's hook for bad command lines
        say(f"error: {message} (see {self.prog} --help)")
        sys.exit(USER_ERROR)


def say(line: str) -> None:
    """One line on stderr, whatever it holds (newlines folded, unencodable characters escaped)."""
    line = " ".join(line.split())
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    print(line.encode(encoding, "backslashreplace").decode(encoding), file=sys.stderr)


def progress(line: str) -> None:
    """What a command is doing, on stderr as ``[uag] …`` (loading, converting, measuring): every command's one way
    to say it, so that stdout keeps only the result."""
    say(f"[uag] {line}")


def log_to_stderr(
    formatter: logging.Formatter | None = None, levels: Mapping[str, int] | None = None
) -> logging.Handler:
    """Every command's log on stderr: one handler (``[uag] message`` unless `formatter` says otherwise) on the
    loggers of `levels` (default: uag at INFO), which then stop passing records up to the root logger."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter or logging.Formatter("[uag] %(message)s"))
    for name, level in (levels or {"uag": logging.INFO}).items():
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
    return handler


def literal(text: str) -> int | float | str:
    """A flag's text as a number where it reads as one, else unchanged (the checks report it as given).

    Example: "3" -> 3;  "-1" -> -1;  "0.5" -> 0.5;  "inf" -> inf;  "10**9" -> "10**9";  "" -> ""
    """
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def number(text: str) -> float:
    """An argparse type for a real number that says so in words (argparse's own names Python's float).

    Example: "0.185" -> 0.185;  "abc" -> error "must be a number (got 'abc')"
    """
    value = literal(text)
    if isinstance(value, str) or value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number (got {text!r})")
    return float(value)


def whole(text: str) -> int:
    """An argparse type for a whole number. Example: "4" -> 4;  "4.5" -> error "must be a whole number" """
    value = literal(text)
    if not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"must be a whole number (got {text!r})")
    return value


def port_taken(host: str, port: int) -> bool:
    """Whether this address cannot be bound (taken, or not this machine's): `uag app` and `uag serve` say so
    in one line before starting instead of failing inside the web server. It binds as uvicorn does
    (SO_REUSEADDR on POSIX), so the connections of a server just stopped, waiting out TIME_WAIT, do not count."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        if os.name != "nt":  # on Windows SO_REUSEADDR would let it bind a port another server holds
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def log_path() -> Path:
    from uag.machine import cache_dir

    return cache_dir() / "logs" / "errors.log"


def _log_internal_error(command: str) -> Path | None:
    """Append the current exception's traceback to the error log; its path, or None if it cannot be written."""
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as log:
            stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
            log.write(f"--- {stamp} {command} (argv: {sys.argv!r})\n{traceback.format_exc()}\n")
    except OSError:
        logging.getLogger("uag").exception("internal error in %s", command)  # no log file: stderr, via logging
        return None
    return path


def run(command: str, body: Callable[[], int]) -> int:
    """Run a command's body and turn what escapes it into a message and an exit code (see the module doc)."""
    try:
        return body()
    except UserError as err:
        say(f"error: {err}")
        return USER_ERROR
    except KeyboardInterrupt:
        return INTERRUPTED
    except Exception as err:  # a bug: the user gets one line, the log gets the traceback
        path = _log_internal_error(command)
        where = f"the traceback is in {path}" if path else "the traceback is above"
        say(f"internal error: {command} failed ({type(err).__name__}: {err}); {where}. Please report it.")
        return INTERNAL_ERROR


# The flag that sets each GenerationConfig field, for messages ("--seed: seed must be …").
FLAGS = {
    "strategy": "--strategy",
    "k_policy": "--k-policy",
    "k": "-k",
    "window": "--window",
    "max_tokens": "--max-tokens",
    "temperature": "--temp",
    "seed": "--seed",
    "chat": "--chat",
}


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by commands that generate with one pair (generate, calibrate)."""
    parser.add_argument("--target", default="demo-target", help="hub id, local directory or demo-target")
    parser.add_argument(
        "--drafter",
        default="demo-drafter",
        help="hub id, local directory, demo-drafter, lookup (prompt lookup, no model) or lookup+<model>",
    )
    parser.add_argument("-k", default=str(DEFAULT_K), help=f"draft length, 1..{MAX_K} (default {DEFAULT_K})")
    parser.add_argument(
        "--k-policy",
        help="fixed: draft k every cycle; adaptive: re-decide the draft length each cycle, k the most (default: as "
        "--strategy says: adaptive for auto and tli+auto, else fixed)",
    )
    add_decoding_options(parser)


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """The decoding settings, for commands that take several drafters or draft lengths (uag.study.bench).
    Taken as text: `decoding_config` checks them all at once, as the app does."""
    limits = {name: FIELD[name] for name in ("window", "max_tokens", "temperature", "seed")}
    parser.add_argument(
        "--window",
        default=str(DEFAULT_WINDOW),
        help=f"committed tokens of context for translation, 0..{limits['window'].hi:g} (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--max-tokens",
        default=str(DEFAULT_MAX_TOKENS),
        help=f"tokens to generate at most, 1..{limits['max_tokens'].hi:g} (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--temp", default="0", help=f"sampling temperature, 0..{limits['temperature'].hi:g}; 0 = greedy"
    )
    parser.add_argument("--seed", default=None, help=f"random seed for temperature > 0, 0..{int(limits['seed'].hi)}")
    parser.add_argument("--chat", action="store_true", help="apply the target's chat template to the prompt")


def decoding_config(args: argparse.Namespace, **fields: Any) -> GenerationConfig:
    """The GenerationConfig the flags ask for (plus `fields`); InputError naming every bad flag.

    Example: --seed -1 --temp inf -> InputError("--temp: temperature must be a number from 0 to 2 (got inf);
             --seed: seed must be a whole number from 0 to 2147483647 (got -1)")
             --strategy auto --k-policy fixed -> InputError("--strategy, --k-policy: strategy 'auto' means …")
    """
    raw: dict[str, Any] = {
        "window": literal(args.window),
        "max_tokens": literal(args.max_tokens),
        "temperature": literal(args.temp),
        "seed": None if args.seed is None else literal(args.seed),
        "chat": bool(args.chat),
        **fields,
    }
    if getattr(args, "k_policy", None) is not None:  # unsaid: as the strategy says
        raw["k_policy"] = args.k_policy
    problems = []
    for name, value in raw.items():
        try:
            GenerationConfig.parse(**{name: value})
        except InputError as err:
            problems.append(f"{FLAGS.get(name, name)}: {err}")
    if problems:
        raise InputError("; ".join(problems))
    try:
        return GenerationConfig.parse(**raw)
    except InputError as err:  # every flag is fine alone: the strategy and the k policy disagree
        raise InputError(f"--strategy, --k-policy: {err}") from None
