"""A head read from disk after a restart (`uag serve --cache-dir`) against the same head read cold.

Each round starts `uag serve --cache-dir DIR` on a fresh folder (as `serve.py` starts servers: a private copy of the
user cache's profiles, the converted models linked) and sends a conversation whose system prompt is a long head
(the README, cut to about `--head-tokens` tokens, opening with a different word every round so that nothing holds
it): the time to its first token is the cold read. The server writes the conversation's caches to DIR once the
reply is out; it is stopped and a new server started on the same folder, which gets the agent's next turn — the
same head, the first reply, a new question: the time to its first token is the read after the restart (the file
loaded, only the new tokens read). Each server answers a short unrelated request first, as a server that has been
serving would have. Medians over the rounds; the issue's target is at most 0.25x.

Usage: python benchmarks/disk_cache.py [--target demo-target] [--drafter off] [--head-tokens 1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
import openai
import serving  # benchmarks/, beside this script

OPENINGS = ("Act", "Be", "Work", "Serve", "Help", "Code", "Edit", "Write", "Reply", "Answer")
README = Path(__file__).resolve().parents[1] / "README.md"
# Each server's first request pays the first passes' set-up (allocation, kernels): a short unrelated one goes first.
WARM_UP = [{"role": "user", "content": "Hello"}]
TARGET = 0.25  # the read after a restart, as a share of the cold read at most (issue #50)


def head(tokens: int, opening: str) -> str:
    """The README's first ~`tokens` tokens (about 4 characters each), opening with `opening`."""
    return f"{opening}: " + README.read_text()[: 4 * tokens]


def saved_files(folder: Path, wait_s: float = 60) -> list[Path]:
    """The folder's cache files, once the server has written one (it writes after the reply went out)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if files := sorted(f for f in folder.glob("*.safetensors") if not f.name.endswith(".partial.safetensors")):
            time.sleep(0.5)  # written whole, then renamed: a listed file is complete
            return files
        time.sleep(0.2)
    raise RuntimeError(f"no cache file appeared in {folder} within {wait_s:g} s")


def one_round(args: argparse.Namespace, r: int, snapshot: Path, logs: Path) -> dict:
    """(cold, after restart): one head, two servers on one cache folder."""
    folder = Path(tempfile.mkdtemp(prefix="uag-disk-cache-"))
    atexit.register(shutil.rmtree, folder, True)
    argv = (sys.executable, "-m", "uag", "serve", "--target", args.target, "--drafter", args.drafter, "--no-ui")
    argv += ("--drafters", "", "--model-alias", "*", "--cache-dir", str(folder), "--max-tokens", "4")
    condition = serving.Condition("uag", "uag", argv, args.target, cache=snapshot)
    messages = [
        {"role": "system", "content": head(args.head_tokens, OPENINGS[r % len(OPENINGS)])},
        {"role": "user", "content": "What does this project do, in one sentence?"},
    ]
    with serving.Server(condition, logs / f"round{r}-cold.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        serving.ask(client, condition, WARM_UP, 2)
        cold = serving.ask(client, condition, messages, 4)
        file_mb = sum(f.stat().st_size for f in saved_files(folder)) / 1e6
    turn = [*messages, {"role": "assistant", "content": cold.text}, {"role": "user", "content": "And how fast?"}]
    with serving.Server(condition, logs / f"round{r}-restarted.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        serving.ask(client, condition, WARM_UP, 2)
        warm = serving.ask(client, condition, turn, 4)
    return {
        "round": r,
        "head_tokens": cold.usage.get("prompt_tokens"),
        "cold_ttft_s": cold.ttft_s,
        "file_mb": file_mb,
        "turn_tokens": warm.usage.get("prompt_tokens"),
        "cached_tokens": (warm.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "restarted_ttft_s": warm.ttft_s,
    }


def summary(rows: list[dict]) -> dict:
    cold = statistics.median(r["cold_ttft_s"] for r in rows)
    warm = statistics.median(r["restarted_ttft_s"] for r in rows)
    return {"cold_s": cold, "restarted_s": warm, "ratio": warm / cold, "met": warm / cold <= TARGET}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo-target")
    parser.add_argument("--drafter", default="off", help="the server's drafter (off: the prompt read alone)")
    parser.add_argument("--head-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.head_tokens < 300:
        parser.error("--head-tokens: at least 300 (a shorter head is read in a moment, and not saved)")
    print(f"load before: {uptime()}", flush=True)
    snapshot, logs = serving.cache_snapshot(), Path(tempfile.mkdtemp(prefix="uag-disk-cache-logs-"))
    rows = []
    for r in range(args.rounds):
        rows.append(row := one_round(args, r, snapshot, logs))
        print(
            f"round {r}: head {row['head_tokens']} tokens, cold {row['cold_ttft_s']:.3f} s; after a restart "
            f"{row['cached_tokens']} of {row['turn_tokens']} tokens from a {row['file_mb']:.1f} MB file, "
            f"{row['restarted_ttft_s']:.3f} s",
            flush=True,
        )
    result = summary(rows)
    print(
        f"median cold read {result['cold_s']:.3f} s, after a restart {result['restarted_s']:.3f} s: "
        f"{result['ratio']:.2f}x (target <= {TARGET}x: {'met' if result['met'] else 'NOT met'})"
    )
    print(f"load after: {uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
