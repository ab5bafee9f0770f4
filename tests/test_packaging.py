"""The package's version is written once (uag.__version__), and packaging reads it from there."""

from importlib.metadata import version
from pathlib import Path

import tomllib

import uag

REPO = Path(__file__).resolve().parents[1]


def test_the_version_is_written_in_one_place():
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "uag.__version__"}
    assert version("uag") == uag.__version__
