"""Speculation over a target sharded across two local processes (CPU ring backend), the drafter on rank 0.

The harness starts the ranks itself (MLX_RANK, MLX_HOSTFILE with free ports on 127.0.0.1, one core each:
the ring's spinning threads make unpinned ranks many times slower on two cores) and checks every exit
code — mlx.launch exits 0 when a rank fails. Every launch is bounded and the bound is asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.tiny_models import build_tiny

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_LIMIT_S = 150  # a hang guard for one launch (two ranks, imports, loading, a few runs): ~30 s on idle cores
PROMPT = "Ala ma kota, a kot ma Alę. Ala ma kota, a kot"


@dataclass
class Rank:
    rc: int | None
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start_ranks(tmp: Path, args: list[str], *, ranks=(0, 1), size: int = 2) -> list[subprocess.Popen]:
    """Start `ranks` of a `size`-rank group on 127.0.0.1, each pinned to its own core where there are two."""
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(size)]))
    pin = shutil.which("taskset") and (os.cpu_count() or 1) >= size
    procs = []
    for r in ranks:
        env = {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}
        cmd = [sys.executable, "-m", "tests.support.sharded_rank", "--out", str(tmp), "--prompt", PROMPT, *args]
        if pin:
            cmd = ["taskset", "-c", str(r), *cmd]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def finish(procs: list[subprocess.Popen], deadline: float) -> list[Rank]:
    """Wait for every rank until `deadline` (time.monotonic); kill what is left and fail the test."""
    out, late = [], []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            late.append(p.args)
        out.append(Rank(p.returncode, stdout, stderr))
    assert not late, f"ranks still running at the deadline (a hang): {late}\n{[r.stderr[-2000:] for r in out]}"
    return out


def launch(tmp: Path, args: list[str]) -> list[list[dict]]:
    """Both ranks to the end: every exit code 0, each rank's results."""
    start = time.monotonic()
    ranks = finish(start_ranks(tmp, args), start + LAUNCH_LIMIT_S)
    for r, rank in enumerate(ranks):
        assert rank.rc == 0, f"rank {r} exited {rank.rc}: {rank.stderr[-3000:]}"
    assert time.monotonic() - start < LAUNCH_LIMIT_S
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def models():
    """A tied target (echoes: drafts are accepted), an untied one (varied text), a drafter of another vocabulary."""
    return {
        "tied": str(build_tiny("qwen2", "qwen2.5")),
        "varied": str(build_tiny("qwen2", "qwen2.5", seed=2, tie_embeddings=False)),
        "drafter": str(build_tiny("llama", "llama-3.2", seed=1)),
    }


def unsharded_greedy(target: str, max_tokens: int) -> list[int]:
    from uag.core.config import GenerationConfig
    from uag.core.engine import generate
    from uag.models.store import ModelStore

    model = ModelStore().get(target)
    ids = model.tokenizer.encode(PROMPT)
    return generate(model, None, ids, GenerationConfig(translation="baseline", max_tokens=max_tokens)).token_ids


def check_run(results: list[dict], reference: list[int]) -> None:
    """Both ranks produced the unsharded greedy output and kept their caches exact."""
    for result in results:
        assert result["token_ids"] == reference, (result["rank"], result["token_ids"], reference)
        assert result["bad_offsets"] == [], result["bad_offsets"]
        assert result["final_offset"] == result["committed"] - 1
        assert result["finish_reason"] == "length"
    assert results[0]["cycles_k"] == results[1]["cycles_k"]


@pytest.mark.parametrize("shard", ["pipeline", "tensor"])
def test_speculation_over_a_sharded_target_is_lossless_and_saves_passes(tmp_path, models, shard):
    runs = ["baseline:", "context:" + models["drafter"], "context:lookup"]  # a baseline first: its extra queued step
    rank0, rank1 = launch(
        tmp_path, ["--target", models["tied"], "--shard", shard, "-k", "4", *sum((["--run", r] for r in runs), [])]
    )
    reference = unsharded_greedy(models["tied"], 40)
    for name, result0, result1 in zip(runs, rank0, rank1):
        check_run([result0, result1], reference)
        if not name.startswith("baseline"):
            assert result0["passes"] < len(reference) / 2, (name, result0["passes"])  # 40 tokens, k = 4


@pytest.mark.parametrize("shard", ["pipeline", "tensor"])
def test_varied_text_parked_stretches_and_the_agreement_check(tmp_path, models, shard):
    runs = ["context:" + models["drafter"], "context:lookup", "auto:lookup+" + models["drafter"]]
    args = ["--target", models["varied"], "--shard", shard, "-k", "3", "--max-tokens", "24", "--check-every", "1"]
    rank0, rank1 = launch(tmp_path, [*args, *sum((["--run", r] for r in runs), [])])
    reference = unsharded_greedy(models["varied"], 24)
    assert len(set(reference)) > 10  # varied: a cache or relay slip would change it
    for result0, result1 in zip(rank0, rank1):
        check_run([result0, result1], reference)
    assert rank0[2]["k_policy"] == "adaptive" and 0 in rank0[2]["cycles_k"]  # auto parked somewhere


def test_a_rank_killed_mid_run_makes_the_other_fail_fast_naming_it(tmp_path, models):
    args = [
        "--target",
        models["tied"],
        "--shard",
        "tensor",
        "--max-tokens",
        "400",
        "--slow-ms",
        "50",
        "--run",
        "context:lookup",
        "--timeout",
        "20",
    ]
    start = time.monotonic()
    procs = start_ranks(tmp_path, args)
    progress = tmp_path / "progress1"
    while not (progress.exists() and progress.read_text().strip() and int(progress.read_text()) >= 5):
        assert time.monotonic() - start < LAUNCH_LIMIT_S, "rank 1 never got going"
        assert procs[0].poll() is None and procs[1].poll() is None, [p.communicate() for p in procs]
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    rank0, _ = finish(procs, killed + 30)
    assert rank0.rc not in (0, None)
    assert time.monotonic() - killed < 30
    # MLX's ring mostly raises in the collective that lost its peer; now and then it blocks instead, and the
    # watchdog ends the wait: either way one line naming rank 1, within the bound.
    named = ("rank 0: lost rank 1", "rank 0: no progress for 20 s while generating: rank 1 stopped answering")
    assert any(n in rank0.last_line for n in named) and rank0.last_line.startswith("error:"), rank0.stderr[-2000:]


def test_a_rank_that_never_connects_is_named_within_the_bound(tmp_path, models):
    args = ["--target", models["tied"], "--shard", "tensor", "--run", "context:lookup", "--connect-timeout", "8"]
    start = time.monotonic()
    (rank0,) = finish(start_ranks(tmp_path, args, ranks=(0,)), start + 60)
    assert rank0.rc not in (0, None)
    assert time.monotonic() - start < 60
    assert "rank 0:" in rank0.last_line and "did not all connect within 8 s" in rank0.last_line, rank0.stderr


def test_the_agreement_check_names_a_rank_that_diverged(tmp_path, models):
    args = [
        "--target",
        models["varied"],
        "--shard",
        "tensor",
        "-k",
        "3",
        "--max-tokens",
        "24",
        "--run",
        "context:" + models["drafter"],
        "--check-every",
        "1",
        "--tamper-at",
        "3",
    ]
    start = time.monotonic()
    ranks = finish(start_ranks(tmp_path, args), start + LAUNCH_LIMIT_S)
    for r, rank in enumerate(ranks):
        assert rank.rc == 2, (r, rank.rc, rank.stderr[-2000:])
        assert f"error: rank {r}: rank 1 holds different committed tokens from rank 0" in rank.last_line


@pytest.mark.parametrize(
    ("arch", "shard", "message"),
    [
        ("llama", "pipeline", "cannot be sharded by pipeline: mlx-lm shards this architecture only by tensor"),
        ("gemma3_text", "tensor", "neither by pipeline nor by tensor"),
    ],
)
def test_an_architecture_that_cannot_be_sharded_that_way_is_one_clear_line(arch, shard, message):
    from tests.support.tiny_models import ARCH_CONFIGS
    from uag.distributed.sharded import check_shardable
    from uag.errors import ModelError

    config = {**ARCH_CONFIGS[arch], "vocab_size": 64}
    with pytest.raises(ModelError, match=message) as err:
        check_shardable("m", config, shard, 2)
    assert "\n" not in str(err.value)


def test_qwen2_shards_both_ways():
    from tests.support.tiny_models import ARCH_CONFIGS
    from uag.distributed.sharded import check_shardable

    for shard in ("pipeline", "tensor"):
        check_shardable("m", {**ARCH_CONFIGS["qwen2"], "vocab_size": 64}, shard, 2)


def test_the_link_term_favours_speculation_more_the_slower_the_link():
    from uag.core.costmodel import CostProfile, collectives_per_pass, link_ms, over_link, sharded_speedup

    assert collectives_per_pass("tensor", 80, 2) == 160 and collectives_per_pass("pipeline", 80, 2) == 2
    assert link_ms(10, 4, 0.5) == 20.0
    profile = CostProfile({1: 10.0, 5: 11.0}, drafter_ms=1.0, translate_ms=0.5)
    alpha_star = [over_link(profile, 160, latency).break_even(4) for latency in (0.0, 0.3, 1.0)]
    assert alpha_star[0] == profile.break_even(4) and alpha_star[0] > alpha_star[1] > alpha_star[2]
    # 48 tokens: the baseline pays 47 passes, speculation 12 passes and 12 exchanges.
    speedups = [sharded_speedup(470.0, 47, 400.0, 12, 12, 4, latency) for latency in (0.0, 0.3, 1.0)]
    assert speedups[0] == 470.0 / 400.0 and speedups[0] < speedups[1] < speedups[2]
