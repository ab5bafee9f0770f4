"""`uag serve --shard`: two ranks on 127.0.0.1 (the ring backend, started as tests/distributed/test_sharded.py starts
them), rank 0 serving the `openai` SDK, the target tensor-sharded over both.

One cluster for the module: greedy replies with lookup, a drafter model of another vocabulary and `auto` equal the
target alone's and the unsharded `uag generate --strategy baseline`; a streamed reply equals the whole one; a stop
string and a client that leaves end the run on both ranks, and the next request is served; rank 0 stopping ends
the follower. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.distributed.test_sharded import (
    LAUNCH_LIMIT_S,
    PROMPT,
    ROOT,
    finish,
    free_ports,
    models,  # noqa: F401  its tiny models, a fixture (read by name below)
)
from tests.support import real_tokenizers

openai = pytest.importorskip("openai")

KEY = "shard-key"
MAX_TOKENS = 16


@dataclass
class Cluster:
    url: str
    procs: list[subprocess.Popen]
    target: str  # the untied tiny target (varied text), its path: the served model id
    drafter: str  # a tiny drafter of another vocabulary


@contextmanager
def serving(tmp: Path, target: str, *args: str) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """(base URL, [rank 0, rank 1]) of `uag serve --shard tensor` on two ranks once rank 0 answers; what is still
    running at the end is killed."""
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    port = free_ports(1)[0]
    # The costs measured over the shards at startup are kept beside the tiny models, not in the user's cache: the
    # first run measures them (every rank taking part), later runs find them, as a server's next start does.
    env = {
        **os.environ,
        "MLX_HOSTFILE": str(hostfile),
        "UAG_API_KEY": KEY,
        "UAG_CACHE_DIR": str(real_tokenizers.cache_root() / "serve-sharded"),
    }
    pin = (
        shutil.which("taskset") and (os.cpu_count() or 1) >= 2
    )  # one core each (tests/distributed/test_sharded.py says why)
    procs = []
    for r in range(2):
        cmd = [
            sys.executable,
            "-m",
            "uag",
            "serve",
            "--shard",
            "tensor",
            "--target",
            target,
            "--port",
            str(port),
            "--shard-timeout",
            "30",
            *args,
        ]
        cmd = ["taskset", "-c", str(r), *cmd] if pin else cmd
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**env, "MLX_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + LAUNCH_LIMIT_S
    try:
        while True:
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                ranks = finish(procs, time.monotonic())  # kills what is left, and fails naming it
                pytest.fail(f"the sharded server did not start: {[(r.rc, r.stderr[-2000:]) for r in ranks]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        yield url, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """The untied tiny target, lookup by default, a drafter model of another vocabulary offered."""
    tiny = request.getfixturevalue("models")
    drafters = f"lookup,{tiny['drafter']},lookup+{tiny['drafter']}"
    args = ["--drafter", "lookup", "--drafters", drafters, "-k", "3", "--max-tokens", str(MAX_TOKENS)]
    with serving(tmp_path_factory.mktemp("serve-sharded"), tiny["varied"], *args) as (url, procs):
        yield Cluster(url, procs, tiny["varied"], tiny["drafter"])


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(client, model: str, speculative=None, **kw):
    extra = None if speculative is None else {"speculative": speculative}
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], extra_body=extra, **kw
    )


def unsharded_baseline(capsys, monkeypatch, store, target: str, *, chat: bool) -> str:
    """`uag generate --strategy baseline --json` on the whole target, in this process (the session's store)."""
    from uag.cli import main

    monkeypatch.setattr("uag.models.store.ModelStore", lambda *_, **__: store)  # the target loaded once
    capsys.readouterr()
    argv = ["generate", "--target", target, "--strategy", "baseline", "--json", "--max-tokens", str(MAX_TOKENS)]
    assert main([*argv, *(["--chat"] if chat else []), PROMPT]) == 0
    return json.loads(capsys.readouterr().out)["text"]


def test_shard_with_a_dtype_is_one_line_and_exit_2(capsys):
    from uag.server.main import main

    assert main(["--shard", "tensor", "--target-dtype", "bfloat16", "--no-ui"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --shard loads the models as stored: drop --target-dtype and --drafter-dtype", err


def test_greedy_replies_equal_the_target_alone_and_the_unsharded_target(cluster, client, capsys, monkeypatch, store):
    target = cluster.target
    alone = ask(client, target, False, max_tokens=MAX_TOKENS)
    text = alone.choices[0].message.content
    assert alone.usage.completion_tokens == MAX_TOKENS and alone.model_extra["speculative"]["strategy"] == "baseline"
    assert text == unsharded_baseline(capsys, monkeypatch, store, target, chat=True)
    for speculative in (
        {"drafter": "lookup", "strategy": "context", "k": 3},
        {"drafter": cluster.drafter, "strategy": "context", "k": 2},  # another vocabulary: translated
        {"drafter": f"lookup+{cluster.drafter}", "strategy": "auto"},
        None,  # the server's default: auto over lookup, with the costs measured over the shards at startup
    ):
        reply = ask(client, target, speculative, max_tokens=MAX_TOKENS)
        assert reply.choices[0].message.content == text, speculative
        spec = reply.model_extra["speculative"]
        assert spec["drafter"] == (speculative or {"drafter": "lookup"})["drafter"]
        assert spec["cycles"] > 0 or spec["strategy"] == "auto"  # auto may park (what earlier runs taught it)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0  # no conversation caches across shards
    completion = client.completions.create(
        model=target, prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"speculative": {"drafter": "lookup", "k": 3}}
    )
    assert completion.choices[0].text == unsharded_baseline(capsys, monkeypatch, store, target, chat=False)


def test_a_streamed_reply_equals_the_whole_one(cluster, client):
    whole = ask(client, cluster.target, {"drafter": "lookup", "k": 3}, max_tokens=MAX_TOKENS)
    chunks = list(
        ask(
            client,
            cluster.target,
            {"drafter": "lookup", "k": 3},
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    with pytest.raises(openai.BadRequestError, match="--shard"):  # a near-tie check needs the whole target
        ask(client, cluster.target, {"drafter": "lookup", "check": True}, max_tokens=MAX_TOKENS)


def test_missing_costs_are_measured_over_the_shards_while_idle_not_in_a_request(cluster, client):
    """Costs missing while serving (removed by hand, `uag calibrate --reset`): an auto request runs without them
    and the server measures them in the background, with every rank taking part, not on rank 0 alone."""
    lookup = f"{Path(cluster.target).name}@tensorx2-lookup-*.json"  # the target's costs, for prompt lookup
    profiles = real_tokenizers.cache_root() / "serve-sharded" / "profiles"
    for path in profiles.glob(lookup):
        path.unlink()
    alone = ask(client, cluster.target, False, max_tokens=MAX_TOKENS).choices[0].message.content
    assert not list(profiles.glob(lookup))  # a request never measures them
    reply = ask(client, cluster.target, {"drafter": "lookup", "strategy": "auto"}, max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content == alone
    deadline = time.monotonic() + 120
    while not list(profiles.glob(lookup)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(list(profiles.glob(lookup))) == 1  # measured once the worker was idle
    again = ask(client, cluster.target, {"drafter": "lookup", "strategy": "auto"}, max_tokens=MAX_TOKENS)
    assert again.choices[0].message.content == alone


def test_a_stop_string_and_a_client_that_leaves_end_the_run_on_every_rank(cluster, client):
    url, target = cluster.url, cluster.target
    tic = time.monotonic()
    full = ask(client, target, False, max_tokens=MAX_TOKENS).choices[0].message.content
    reply_s = time.monotonic() - tic
    stop = full[len(full) // 2 :][:3]
    for speculative in ({"drafter": "lookup", "strategy": "context", "k": 3}, False):
        cut = ask(client, target, speculative, max_tokens=MAX_TOKENS, stop=[stop])
        assert cut.choices[0].message.content == full[: full.index(stop)], speculative
        assert cut.choices[0].finish_reason == "stop"
    for speculative in ({"drafter": "lookup", "k": 3}, False):  # stopped at a decision; at a token's go-on check
        body = {
            "model": target,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4000,
            "stream": True,
            "speculative": speculative,
        }
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
        ) as response:
            lines = []
            for line in response.iter_lines():  # the first content delta, then the client goes away
                if '"content":"' in line and '"content":""' not in line:
                    break
                lines.append(line)
            else:
                pytest.fail(f"the stream ended before its first content: {response.status_code} {lines[-3:]}")
        left = time.monotonic()
        again = ask(client, target, False, max_tokens=MAX_TOKENS)
        assert again.choices[0].message.content == full
        # Not 4,000 tokens later (250 replies of 16): the run ended within a decision or a token of the client leaving.
        assert time.monotonic() - left < 10 * reply_s + 5, (time.monotonic() - left, reply_s)


def test_rank_0_stopping_ends_the_follower(cluster):
    procs = cluster.procs
    procs[0].send_signal(signal.SIGTERM)  # Ctrl-C, mlx.launch or a service manager stopping the server
    stopped = time.monotonic()
    rank0, rank1 = finish(procs, stopped + 30)
    assert rank0.rc == 0 and rank1.rc == 0, (rank0.stderr[-2000:], rank1.stderr[-2000:])
    assert "error" not in rank1.stderr and "sharded by tensor over 2 ranks" in rank0.stderr
    assert time.monotonic() - stopped < 30


def test_a_rank_lost_while_idle_stops_rank_0_with_one_line_naming_it(request, tmp_path):
    """Rank 0's heartbeat finds the lost rank within seconds, with no request to fail first."""
    tiny = request.getfixturevalue("models")
    with serving(tmp_path, tiny["tied"], "--drafter", "lookup", "--drafters", "lookup") as (_, procs):
        procs[1].kill()
        killed = time.monotonic()
        rank0, _ = finish(procs, killed + 30)
    assert rank0.rc == 2 and time.monotonic() - killed < 30, (rank0.rc, rank0.stderr[-2000:])
    assert rank0.last_line.startswith("error: rank 0: lost rank 1 while telling the other ranks"), rank0.stderr[-2000:]
