"""Broken models as users meet them, for the tests that check each interface says what is wrong.

``broken_hub_cache(root)`` writes a Hugging Face cache holding ``org/broken``: a tiny model whose config.json
names no architecture (a download from a repository that lacks it). A hub model never passes the model
store's folder checks, so mlx-lm's own ``KeyError('model_type')`` reaches whoever loads it: only
`uag.models.loading` turns it into a message. It returns the environment for a subprocess that loads from
that cache offline.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .tiny_models import build_tiny

BROKEN_HUB_ID = "org/broken"
REPO = Path(__file__).resolve().parents[2]


def broken_hub_cache(root: Path) -> dict[str, str]:
    cache = root / "hf-cache"
    repo = cache / f"models--{BROKEN_HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(build_tiny("llama", "llama-3.2"), snapshot)
    config = json.loads((snapshot / "config.json").read_text())
    del config["model_type"]
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return {name: value for name, value in env.items() if value}
