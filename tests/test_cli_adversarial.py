"""The command line against hostile and careless input: every bad input is one `error:` line and exit 2.

Each case runs the real command in a subprocess (real argv bytes, real stdin), and checks that stderr holds
exactly one line besides the `[uag]`/`[bench]` progress lines, that it starts with ``error:``, names what
is wrong, shows no traceback and no Python type name, and that the exit status is 2.
"""
# ruff: noqa: E501  (the table of cases reads best one case per line)

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROGRESS = ("[uag] ", "[bench] ")
TYPE_NAME = re.compile(
    r"\b\w*(Error|Exception)\b|\bNoneType\b|\b(int|float|str|bool)\(|invalid (int|float) value|<class "
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Model folders: good tiny ones, broken copies, and a drafter whose context is 16 tokens."""
    from tests.support.tiny_models import build_tiny

    root = tmp_path_factory.mktemp("models")
    good = build_tiny("llama", "llama-3.2")
    no_type = shutil.copytree(good, root / "no-model-type")
    config = json.loads((no_type / "config.json").read_text())
    del config["model_type"]
    (no_type / "config.json").write_text(json.dumps(config))
    truncated = shutil.copytree(good, root / "truncated")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (root / "bad.txt").write_bytes("Zażółć gęślą ".encode() + b"\xff\xfe jaz")  # Latin-1 bytes inside UTF-8
    (root / "prompts").mkdir()
    (root / "schema.json").write_text('{"type": "object", "properties": {"n": {"type": "strin"}}}')
    return {
        "good": str(good),
        "short_drafter": str(build_tiny("llama", "llama-3.2", seed=3, max_position_embeddings=16)),
        "no_type": str(no_type),
        "truncated": str(truncated),
        "bad_file": str(root / "bad.txt"),
        "folder": str(root / "prompts"),
        "missing": str(root / "nothing-here"),
        "root": str(root),
        "schema": str(root / "schema.json"),
    }


GENERATE = ["-m", "uag", "generate", "--strategy", "baseline"]
# (id, argv after the interpreter with {placeholders} from `folders`, stdin bytes, what the message must say)
CASES = [
    (
        "negative-seed",
        [*GENERATE, "--seed", "-1", "--temp", "0.5", "Ala"],
        None,
        "--seed: seed must be a whole number from 0 to 2147483647 (got -1)",
    ),
    (
        "infinite-temperature",
        [*GENERATE, "--temp", "inf", "Ala"],
        None,
        "--temp: temperature must be a number from 0 to 2 (got inf)",
    ),
    ("nan-temperature", [*GENERATE, "--temp", "nan", "Ala"], None, "--temp: temperature must be a number from 0 to 2"),
    (
        "huge-window",
        [*GENERATE, "--window", "1000000000", "Ala"],
        None,
        "--window: context window W must be a whole number from 0 to 64",
    ),
    (
        "huge-max-tokens",
        [*GENERATE, "--max-tokens", "1000000000", "Ala"],
        None,
        "--max-tokens: max tokens must be a whole number from 1 to 4096",
    ),
    ("expression-max-tokens", [*GENERATE, "--max-tokens", "10**9", "Ala"], None, "(got '10**9')"),
    (
        "fractional-k",
        [*GENERATE, "-k", "2.5", "Ala"],
        None,
        "-k: k (draft length) must be a whole number from 1 to 32 (got 2.5)",
    ),
    ("word-seed", [*GENERATE, "--seed", "abc", "Ala"], None, "--seed: seed must be a whole number"),
    (
        "unknown-strategy",
        [*GENERATE[:-2], "--strategy", "exact", "Ala"],
        None,
        "--strategy: strategy must be one of baseline",
    ),
    (
        "unknown-k-policy",
        [*GENERATE, "--k-policy", "sometimes", "Ala"],
        None,
        "--k-policy: k policy must be one of fixed, adaptive (got 'sometimes')",
    ),
    (
        "auto-with-fixed-k",
        [*GENERATE[:-2], "--strategy", "auto", "--k-policy", "fixed", "Ala"],
        None,
        "--strategy, --k-policy: strategy 'auto' means k policy adaptive, not 'fixed'",
    ),
    (
        "baseline-with-adaptive-k",
        [*GENERATE, "--k-policy", "adaptive", "Ala"],
        None,
        "--strategy, --k-policy: k policy adaptive needs a drafter",
    ),
    ("unknown-flag", [*GENERATE, "--temperature", "0.5", "Ala"], None, "unrecognized arguments: --temperature"),
    (
        "invalid-utf8-argv",
        [*GENERATE, b"Zaz\xf3\xb3\xe6 \xff"],
        None,
        "the prompt is not valid UTF-8: byte 0xf3 at character 4",
    ),
    (
        "invalid-utf8-stdin",
        [*GENERATE, "-"],
        b"Ala \xff\xfe ma kota",
        "the prompt on stdin is not valid UTF-8: byte 0xff at byte 5",
    ),
    (
        "invalid-utf8-file",
        [*GENERATE, "--prompt-file", "{bad_file}"],
        None,
        "bad.txt' is not valid UTF-8: byte 0xff at byte 21",
    ),
    ("missing-prompt-file", [*GENERATE, "--prompt-file", "{missing}"], None, "nothing-here': no such file"),
    ("prompt-file-is-a-folder", [*GENERATE, "--prompt-file", "{folder}"], None, "is a folder; give a text file"),
    ("two-prompts", [*GENERATE, "--prompt-file", "{bad_file}", "Ala"], None, "give the prompt once"),
    ("no-prompt", GENERATE, None, "no prompt given: pass it as an argument, as - to read stdin, or with --prompt-file"),
    ("blank-prompt", [*GENERATE, "  \n\t "], None, "the prompt is empty"),
    ("model-folder-missing", [*GENERATE, "--target", "{missing}", "Ala"], None, "no model directory at"),
    ("config-without-model-type", [*GENERATE, "--target", "{no_type}", "Ala"], None, "model_type"),
    ("truncated-weights", [*GENERATE, "--target", "{truncated}", "Ala"], None, "incomplete or"),
    (
        "json-schema-not-json",
        [*GENERATE, "--json-schema", "{bad_file}", "Ala"],
        None,
        "--json-schema: cannot read a JSON Schema from",
    ),
    ("json-schema-bad-type", [*GENERATE, "--json-schema", "{schema}", "Ala"], None, "--json-schema: schema: "),
    (
        "json-schema-and-object",
        [*GENERATE, "--json-schema", "{schema}", "--json-object", "Ala"],
        None,
        "not allowed with argument --json-schema",
    ),
    (
        "empty-lookup-drafter",
        ["-m", "uag", "generate", "--drafter", "lookup+", "Ala"],
        None,
        "after lookup+ name a drafter model",
    ),
    (
        "prompt-beyond-drafter-context",
        [
            "-m",
            "uag",
            "generate",
            "--target",
            "{good}",
            "--drafter",
            "{short_drafter}",
            "Ala ma kota, a kot ma Alę. " * 4,
        ],
        None,
        "whose context is 16 tokens: shorten the prompt, pick a drafter with a longer context",
    ),
    (
        "analyze-word-for-r",
        ["-m", "uag", "analyze", "--model-only", "--r", "abc"],
        None,
        "argument --r: must be a finite number (got 'abc')",
    ),
    ("analyze-missing-file", ["-m", "uag", "analyze", "{missing}"], None, "no results file at"),
    (
        "bench-word-for-n",
        ["-m", "uag", "bench", "--target", "t", "--drafters", "d", "--n", "few", "--out", "{root}/r.db"],
        None,
        "argument --n: must be a whole number",
    ),
    (
        "bench-out-is-a-folder",
        ["-m", "uag", "bench", "--target", "t", "--drafters", "d", "--n", "1", "--out", "{folder}"],
        None,
        "is a directory, not a results file",
    ),
    (
        "calibrate-word-for-repeats",
        ["-m", "uag", "calibrate", "--repeats", "many"],
        None,
        "argument --repeats: must be a whole number",
    ),
    (
        "unknown-command",
        ["-m", "uag", "generat", "Ala"],
        None,
        "unknown command 'generat': choose one of generate, serve, app",
    ),
    (
        "app-word-for-port",
        ["-m", "uag", "app", "--port", "abc"],
        None,
        "argument --port: must be a whole number (got 'abc')",
    ),
    (
        "bench-through-uag-word-for-n",
        ["-m", "uag", "bench", "--target", "t", "--drafters", "d", "--n", "few", "--out", "{root}/r.db"],
        None,
        "argument --n: must be a whole number",
    ),
]


def _argv(template: list, folders: dict) -> list:
    return [part.format(**folders) if isinstance(part, str) else part for part in template]


@pytest.mark.parametrize(("argv", "stdin", "message"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_error_line_with_exit_2(folders, tmp_path, argv, stdin, message):
    env = {**os.environ, "PYTHONPATH": str(REPO), "UAG_CACHE_DIR": os.environ.get("UAG_CACHE_DIR", "")}
    env = {k: v for k, v in env.items() if v}
    done = subprocess.run(
        [sys.executable, *_argv(argv, folders)],
        cwd=tmp_path,
        env=env,
        input=stdin or b"",
        capture_output=True,
        timeout=300,
    )
    err = done.stderr.decode("utf-8", "replace")
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(PROGRESS)]
    assert done.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in err and not TYPE_NAME.search(lines[0]), lines[0]
    assert done.stdout == b""


def test_json_schema_makes_the_reply_fit_the_schema(folders, tmp_path):
    """The flag reaches the engine: a tiny random model (Llama-3.2's real tokenizer) writes what the schema
    allows, with speculation as without, the schema given bare or as response_format's json_schema object."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    bare, wrapped = tmp_path / "bare.json", tmp_path / "wrapped.json"
    bare.write_text(json.dumps(schema))
    wrapped.write_text(json.dumps({"name": "answer", "schema": schema, "strict": True}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    replies = []
    for path, strategy in ((bare, "baseline"), (wrapped, "auto")):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "uag",
                "generate",
                "--target",
                folders["good"],
                "--drafter",
                "lookup",
                "--strategy",
                strategy,
                "--json-schema",
                str(path),
                "--max-tokens",
                "12",
                "--json",
                "Ala",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr.decode()
        replies.append(json.loads(done.stdout)["text"])
    assert replies[0] == replies[1] and replies[0].startswith('{"ok": ')


@pytest.mark.parametrize(
    ("flags", "translation", "k_policy"),
    [
        (["--strategy", "tli", "--k-policy", "adaptive"], "tli", "adaptive"),
        (["--strategy", "tli+auto"], "tli", "adaptive"),
        (["--strategy", "auto"], "context", "adaptive"),
        (["--strategy", "auto", "--k-policy", "adaptive"], "context", "adaptive"),
        (["--k-policy", "adaptive"], "context", "adaptive"),  # --strategy's default, context
        (["--strategy", "tli"], "tli", "fixed"),
        ([], "context", "fixed"),
    ],
)
def test_k_policy_and_strategy_flags_set_the_translation_and_the_k_policy(monkeypatch, flags, translation, k_policy):
    """What `uag generate` runs for its flags: the config it reads the prompt with (caught there: no model loads)."""
    from types import SimpleNamespace

    from uag import cli
    from uag.errors import InputError
    from uag.runtime import pair

    asked = []

    def caught(loaded, prompt, config):
        asked.append(config)
        raise InputError("caught")

    monkeypatch.setattr(pair, "open_pair", lambda *a, **kw: SimpleNamespace(target=object(), choice=None))
    monkeypatch.setattr(pair, "prompt_ids_for", caught)
    assert cli.main(["generate", *flags, "-k", "6", "Ala"]) == 2
    assert (asked[0].translation, asked[0].k_policy, asked[0].k) == (translation, k_policy, 6)


def test_there_are_at_least_15_distinct_bad_inputs():
    assert len({case[0] for case in CASES}) == len(CASES) >= 15


def test_an_internal_error_is_not_blamed_on_the_user(tmp_path, monkeypatch, capsys):
    """A bug (here: the engine raising TypeError) is 'internal error', exit 1, its traceback in the log only."""
    from types import SimpleNamespace

    from uag import api, cli
    from uag.runtime import pair

    monkeypatch.setenv("UAG_CACHE_DIR", str(tmp_path))

    def broken(*args, **kwargs):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(api, "generate", broken)
    monkeypatch.setattr(pair, "open_pair", lambda *a, **kw: SimpleNamespace(target=object(), choice=None))
    monkeypatch.setattr(pair, "prompt_ids_for", lambda loaded, prompt, config: [1, 2, 3])
    assert cli.main(["generate", "--strategy", "baseline", "--json", "Ala"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("internal error: python -m uag generate failed"), err
    assert "error:" not in err[0].split("internal error:")[0] and "Please report it" in err[0]
    log = (tmp_path / "logs" / "errors.log").read_text()
    assert "Traceback" in log and "TypeError: unsupported operand" in log


# --- the one `uag` command ---------------------------------------------------------------------------------

COMMANDS = ("generate", "serve", "app", "calibrate", "bench", "analyze", "models")


def _python(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_help_lists_every_command_and_a_bare_uag_shows_it_as_an_error():
    from uag.cli import COMMANDS as dispatched

    assert tuple(dispatched) == COMMANDS
    shown = _python("-m", "uag", "--help")
    assert shown.returncode == 0 and shown.stderr == ""
    listed = [line.split()[0] for line in shown.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    bare = _python("-m", "uag")
    assert bare.returncode == 2 and bare.stdout == "" and bare.stderr.strip() == shown.stdout.strip()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_help(command):
    import importlib.util

    done = _python("-m", "uag", command, "--help")
    if command == "serve" and importlib.util.find_spec("uag.server") is None:  # until the server lands
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert (
            done.stderr.strip() == "error: `uag serve` is not part of this installation of uag (no module uag.server)"
        )
        return
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m uag {command} ")


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["app.py", "--help"], "usage: python -m uag app "),
    ],
)
def test_app_py_is_the_app(argv, usage):
    done = _python(*argv)
    assert done.returncode == 0 and done.stdout.startswith(usage), done.stderr


def test_a_command_whose_package_is_missing_says_which(monkeypatch, capsys):
    """A command module that cannot be imported is one line, not a traceback: missing from this installation,
    or needing a package that is not installed."""
    from uag import cli

    monkeypatch.setitem(cli.COMMANDS, "serve", ("uag.no_such_server", "main", "a server"))
    assert cli.main(["serve", "--port", "8000"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: `uag serve` is not part of this installation of uag (no module uag.no_such_server)"
    )

    def needs_a_package(name):
        raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")

    monkeypatch.setattr("importlib.import_module", needs_a_package)
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: `uag serve` needs the Python package 'fastapi'") and "\n" not in err


def test_every_command_says_progress_and_logs_on_stderr_one_way(capsys):
    """`uag.command.progress` and `log_to_stderr` are the one way a command writes to stderr: `[uag] …` lines,
    stdout left to the result, a logger's records not passed up to the root logger (no line twice)."""
    import logging

    from uag.command import log_to_stderr, progress

    progress("loading the target\nfrom the cache")
    out, err = capsys.readouterr()
    assert out == "" and err == "[uag] loading the target from the cache\n"
    logger = logging.getLogger("uag.test_progress")
    handler = log_to_stderr(levels={"uag.test_progress": logging.INFO})
    try:
        logger.info("measured %s", "costs")
        assert capsys.readouterr().err == "[uag] measured costs\n" and not logger.propagate
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
