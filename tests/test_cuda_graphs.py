"""Importing uag turns MLX's CUDA graphs off unless the environment says otherwise (uag/__init__.py), and the
benchmarks start their peers (mlx_lm.server) with MLX's own default, as the peers' users run them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import uag

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serving  # noqa: E402  (benchmarks/serving.py)

SAYS = "import os, uag; print(os.environ['MLX_USE_CUDA_GRAPHS'], uag.CUDA_GRAPHS_DEFAULTED)"


@pytest.mark.parametrize(("given", "expected"), [(None, "0 True"), ("1", "1 False"), ("0", "0 False")])
def test_importing_uag_turns_cuda_graphs_off_unless_the_environment_chose(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "MLX_USE_CUDA_GRAPHS"}
    if given is not None:
        env["MLX_USE_CUDA_GRAPHS"] = given
    out = subprocess.run([sys.executable, "-c", SAYS], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


@pytest.mark.parametrize("defaulted", [True, False])
def test_a_peer_server_runs_with_mlx_s_own_cuda_graphs_default(monkeypatch, tmp_path, defaulted):
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    monkeypatch.setattr(uag, "CUDA_GRAPHS_DEFAULTED", defaulted)
    peer = serving.Server(serving.Condition("mlx_lm", "mlx_lm", ("mlx_lm.server",), "default_model"), tmp_path / "a")
    ours = serving.Server(serving.Condition("uag:off", "uag", ("uag", "serve"), "demo-target"), tmp_path / "b")
    assert ours.environment()["MLX_USE_CUDA_GRAPHS"] == "0"
    assert peer.environment().get("MLX_USE_CUDA_GRAPHS") == (None if defaulted else "0")  # the user's own choice
