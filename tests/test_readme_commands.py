"""The README's commands work verbatim on the installed tree, as a new user would type them.

Code blocks whose info string carries the word ``runnable`` (```` ```sh runnable ````) hold commands a user
can run right after ``make app`` / ``make test``, offline. Each ``python -m uag…`` command there is run in a
fresh folder (no ``results/`` in it) with the venv's ``bin`` first on PATH (what "activate the venv" does),
in order, so the sweep → analyze pair reads what the sweep wrote. Sizes are made small (``--n 1``,
``--max-tokens 4``, a sweep's ``--k`` list cut to its first value, a short calibration); nothing else
changes. A calibration goes to a private cache, so that it never reseeds ``auto`` in the user's (or the
other tests') profile store.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```(\S*)(.*?)\n(.*?)^```", re.M | re.S)
# Small sizes: each flag's value is replaced; flags a command lacks are added after its subcommand.
SMALL = {"--n": "1", "--max-tokens": "4", "--max-width": "2", "--repeats": "1", "--context": "16"}
ADDED = {
    ("uag", "generate"): ("--max-tokens",),
    ("uag", "calibrate"): ("--max-width", "--repeats", "--context"),
}


def runnable_commands(markdown: str) -> list[str]:
    """The `python -m uag…` commands of the blocks marked runnable, continuation lines joined, in order.

    Example: "```sh runnable\\npython -m uag bench --n 4 \\\\\\n    --out r.db   # note\\n```" ->
             ["python -m uag bench --n 4 --out r.db   # note"]
    """
    commands = []
    for match in FENCE.finditer(markdown):
        if "runnable" not in match.group(2).split():
            continue
        text = re.sub(r"\s*\\\n\s*", " ", match.group(3))
        commands += [line.strip() for line in text.splitlines() if line.strip().startswith("python -m uag")]
    return commands


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
    head = 4  # after "python -m uag generate" / "python -m uag calibrate"
    for flag in ADDED.get(tuple(argv[2:head]), ()):
        if flag not in argv:
            argv[head:head] = [flag, SMALL[flag]]
    return argv


def test_runnable_commands_are_found_and_made_small():
    text = "```sh runnable\npython -m uag generate -k 2 \\\n  'Ala ma'  # note\n```\n```sh\npython -m uag x\n```\n"
    assert runnable_commands(text) == ["python -m uag generate -k 2 'Ala ma'  # note"]
    assert small(runnable_commands(text)[0]) == [
        "python", "-m", "uag", "generate", "--max-tokens", "4", "-k", "2", "Ala ma"
    ]  # fmt: skip
    assert small("python -m uag bench --k 1 2 4 --n 4 --max-tokens 48 --out r.db") == [
        "python", "-m", "uag", "bench", "--k", "1", "--n", "1", "--max-tokens", "4", "--out", "r.db"
    ]  # fmt: skip


@pytest.fixture
def user_env(tmp_path):
    """The environment of a user who activated the venv, with a private cache that shares the converted models."""
    real_cache = Path(os.environ.get("UAG_CACHE_DIR") or Path("~/.cache/uag").expanduser())
    cache = tmp_path / "cache"
    cache.mkdir()
    for shared in ("models", "wheels"):
        if (real_cache / shared).exists():
            (cache / shared).symlink_to(real_cache / shared)
    venv_bin = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv_bin.parent))
    env["UAG_CACHE_DIR"] = str(cache)
    return env


@pytest.mark.slow
def test_every_runnable_readme_command_works_verbatim(tmp_path, user_env):
    commands = runnable_commands(README.read_text(encoding="utf-8"))
    subcommands = {shlex.split(c)[3] for c in commands}
    assert {"generate", "bench", "analyze", "calibrate"} <= subcommands, (
        "README.md marks no runnable block with these commands: give their fence the info string 'sh runnable'"
    )
    work = tmp_path / "fresh-clone"
    work.mkdir()
    outputs = {}
    for command in commands:
        argv = small(command)
        done = subprocess.run(argv, cwd=work, env=user_env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
        outputs[command] = done.stdout
    # The sweep -> analyze pair: the analysis read the sweep's results file and wrote its report.
    bench = next(c for c in commands if "uag bench" in c)
    out_file = shlex.split(bench, comments=True)[shlex.split(bench, comments=True).index("--out") + 1]
    assert (work / out_file).is_file()
    analysis = next(c for c in commands if "uag analyze" in c and "--model-only" not in c)
    out_dir = shlex.split(analysis, comments=True)[shlex.split(analysis, comments=True).index("--out") + 1]
    assert (work / out_dir / "report.html").is_file()
    model_only = next((c for c in commands if "--model-only" in c and "--json" in c), None)
    if model_only:
        rows = json.loads(outputs[model_only])["table7_model"]
        assert all(v is None or v <= 1 for row in rows for k, v in row.items() if k.startswith("alpha_star_k"))
