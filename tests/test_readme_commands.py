"""The commands of the README and of docs/ work verbatim on the installed tree, as a new user would type them.

Code blocks whose info string carries the word ``runnable`` (```` ```sh runnable ````) hold commands a user
can run right after ``make app`` / ``make test``, offline. Each ``uag …`` or ``python -m uag…`` command there
is run with the venv's ``bin`` first on PATH (what "activate the venv" does), in order, in a fresh folder per
document (no ``results/`` in it), so that a sweep → analyze pair reads what the sweep wrote. Sizes are made
small (``--n 1``, ``--max-tokens 4``, a sweep's ``--k`` list cut to its first value, a short calibration);
nothing else changes. A calibration goes to a private cache (seeded with a copy of the calibrations already
made, so that ``auto`` need not repeat them), so that it never reseeds ``auto`` in the user's (or the other
tests') profile store.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)(.*?)\n(.*?)^```", re.M | re.S)
COMMAND = re.compile(r"^(uag|python -m uag)\s")
# Small sizes: each flag's value is replaced; flags a command lacks are added after its subcommand.
SMALL = {"--n": "1", "--max-tokens": "4", "--max-width": "2", "--repeats": "1", "--context": "16"}
ADDED = {"generate": ("--max-tokens",), "calibrate": ("--max-width", "--repeats", "--context")}


def runnable_commands(markdown: str) -> list[str]:
    """The `uag …` / `python -m uag…` commands of the blocks marked runnable, continuation lines joined, in order.

    Example: "```sh runnable\\nuag bench --n 4 \\\\\\n    --out r.db   # note\\n```" ->
             ["uag bench --n 4 --out r.db   # note"]
    """
    commands = []
    for match in FENCE.finditer(markdown):
        if "runnable" not in match.group(2).split():
            continue
        text = re.sub(r"\s*\\\n\s*", " ", match.group(3))
        commands += [line.strip() for line in text.splitlines() if COMMAND.match(line.strip())]
    return commands


def subcommand_at(argv: list[str]) -> int:
    """Where the subcommand is: after `uag`, or after `python -m uag`.

    Example: ['uag', 'bench'] -> 1;  ['python', '-m', 'uag', 'bench'] -> 3
    """
    return 1 if argv[0] == "uag" else 3


def small(command: str) -> list[str]:
    """The command as argv, with SMALL sizes (see the module docstring).

    Example: 'python -m uag bench --n 4 --out r.db' -> ['python', '-m', 'uag', 'bench', '--n', '1', '--out', 'r.db']
    """
    argv = shlex.split(command, comments=True)
    for i, word in enumerate(argv[:-1]):
        if word in SMALL:
            argv[i + 1] = SMALL[word]
    if "--k" in argv:  # a sweep's list of draft lengths keeps its first
        start = argv.index("--k") + 2
        end = next((j for j in range(start, len(argv)) if argv[j].startswith("--")), len(argv))
        del argv[start:end]
    head = subcommand_at(argv) + 1
    for flag in ADDED.get(argv[head - 1], ()):
        if flag not in argv:
            argv[head:head] = [flag, SMALL[flag]]
    return argv


def flag_value(command: str, flag: str) -> str:
    argv = shlex.split(command, comments=True)
    return argv[argv.index(flag) + 1]


def test_runnable_commands_are_found_and_made_small():
    text = "```sh runnable\npython -m uag generate -k 2 \\\n  'Ala ma'  # note\n```\n```sh\npython -m uag x\n```\n"
    assert runnable_commands(text) == ["python -m uag generate -k 2 'Ala ma'  # note"]
    assert small(runnable_commands(text)[0]) == [
        "python",
        "-m",
        "uag",
        "generate",
        "--max-tokens",
        "4",
        "-k",
        "2",
        "Ala ma",
    ]
    assert small("python -m uag bench --k 1 2 4 --n 4 --max-tokens 48 --out r.db") == [
        "python",
        "-m",
        "uag",
        "bench",
        "--k",
        "1",
        "--n",
        "1",
        "--max-tokens",
        "4",
        "--out",
        "r.db",
    ]


def test_the_uag_form_is_found_and_made_small_the_same_way():
    text = "```sh runnable\nuag calibrate --target demo-target\nmake app\nuagx generate\n```\n"
    assert runnable_commands(text) == ["uag calibrate --target demo-target"]
    assert small("uag calibrate --target demo-target --repeats 5") == [
        "uag",
        "calibrate",
        "--context",
        "16",
        "--max-width",
        "2",
        "--target",
        "demo-target",
        "--repeats",
        "1",
    ]
    assert small("uag generate 'Ala ma'") == ["uag", "generate", "--max-tokens", "4", "Ala ma"]


def test_the_readme_shows_each_command_a_newcomer_runs_first():
    commands = runnable_commands(README.read_text(encoding="utf-8"))
    subcommands = {small(c)[subcommand_at(small(c))] for c in commands}
    assert {"generate", "bench", "analyze", "calibrate"} <= subcommands, (
        "README.md marks no runnable block with these commands: give their fence the info string 'sh runnable'"
    )


@pytest.fixture
def user_env(tmp_path):
    """The environment of a user who activated the venv, with a private cache that shares the converted models."""
    real_cache = Path(os.environ.get("UAG_CACHE_DIR") or Path("~/.cache/uag").expanduser())
    cache = tmp_path / "cache"
    cache.mkdir()
    for shared in ("models", "wheels"):
        if (real_cache / shared).exists():
            (cache / shared).symlink_to(real_cache / shared)
    if (real_cache / "profiles").is_dir():  # a copy: `auto` need not calibrate again, and what runs here stays here
        shutil.copytree(real_cache / "profiles", cache / "profiles")
    venv_bin = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv_bin.parent))
    env["UAG_CACHE_DIR"] = str(cache)
    return env


@pytest.mark.slow
@pytest.mark.parametrize(
    "document",
    [d for d in DOCUMENTS if runnable_commands(d.read_text(encoding="utf-8"))],
    ids=lambda d: str(d.relative_to(REPO)),
)
def test_every_runnable_command_works_verbatim(document, tmp_path, user_env):
    commands = runnable_commands(document.read_text(encoding="utf-8"))
    work = tmp_path / "fresh-clone"
    work.mkdir()
    outputs = {}
    for command in commands:
        done = subprocess.run(small(command), cwd=work, env=user_env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{document.name}: {command}\n{done.stderr[-3000:]}"
        outputs[command] = done.stdout
    # A sweep -> analyze pair: the analysis read the sweep's results file and wrote its report.
    for bench in (c for c in commands if " bench " in c):
        assert (work / flag_value(bench, "--out")).is_file(), bench
    for analysis in (c for c in commands if " analyze " in c and "--out" in c and "--model-only" not in c):
        assert (work / flag_value(analysis, "--out") / "report.html").is_file(), analysis
    for model_only in (c for c in commands if "--model-only" in c and "--json" in c):
        rows = json.loads(outputs[model_only])["table7_model"]
        assert all(v is None or v <= 1 for row in rows for k, v in row.items() if k.startswith("alpha_star_k"))
