"""`uag serve` as a service people leave running, probed as issue 35's users and attacker met it, checkout by checkout.

Each checkout given (`--checkout`, default: this one; an older commit can be checked out beside it with
`git worktree add`) is served in turn by `python -m uag serve --no-ui` on the demo pair, from a cache of its own
(the converted models linked, nothing else shared) whose saved profile is the pair's costs measured at the start
of this run with every time multiplied by `--stale` (3: "measured while the machine was three times slower", no
load recorded, as files written before profiles kept it). Then, in one server process:

1. **Stale costs**: `--requests` short non-streamed chat requests (`--max-tokens` tokens, the server's default
   speculation: auto over lookup + SmolLM2), `--gap` seconds apart (longer than the 2 s a server waits before it
   measures in the background, so later requests arrive while it measures), timed end to end as an editor's
   client sees them. A request over `--stall` seconds stalled.
2. **Four at once from one client**: four such requests sent together from one address; their statuses and the
   time until the last one was answered.
3. **Idle connections**: `--flood` TCP connections opened and left idle (each server starts with the soft limit
   on open files most Linux sessions have, `--server-fd-limit` 1024, its hard limit as it is; this process
   raises its own limit for them), then `GET /health` with a 5 s timeout: its status and time (or the failure),
   and how many lines the server's log grew by meanwhile.

Printed per checkout, then side by side. One run per checkout: the figures are stalls of seconds against none,
refusals against answers, an answer against a timeout.

    git worktree add /tmp/uag-before 8fe4b21
    python benchmarks/serve_service.py --checkout /tmp/uag-before --checkout .
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

PROMPTS = [
    "Stolica Polski to",
    "def add(a, b):",
    "Lista: jeden, dwa, trzy,",
    "The capital of France is",
    "for i in range(10):",
    "Kraków leży nad",
    "import numpy as",
    "Dzień dobry, nazywam się",
]
STARTUP_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_profile(python: str, cache: Path) -> dict:
    """The demo pair's costs measured now (`uag calibrate`, this checkout) into `cache`; the saved JSON."""
    env = {**os.environ, "UAG_CACHE_DIR": str(cache)}
    subprocess.run(
        [python, "-m", "uag", "calibrate", "--target", "demo-target", "--drafter", "demo-drafter"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    (path,) = (cache / "profiles").glob("demo-target-demo-drafter-*.json")
    return json.loads(path.read_text())


def stale(profile: dict, factor: float) -> dict:
    """The profile with every time `factor` times longer, and no load recorded."""
    out = {k: v for k, v in profile.items() if k != "machine_load"}
    for name in ("target_ms", "read_ms"):
        if isinstance(out.get(name), dict):
            out[name] = {w: ms * factor for w, ms in out[name].items()}
    for name in ("drafter_ms", "translate_ms"):
        if isinstance(out.get(name), (int, float)):
            out[name] *= factor
    return out


def chat(url: str, i: int, max_tokens: int) -> tuple[int, float]:
    """(status, seconds) of one non-streamed chat request."""
    body = {
        "model": "demo-target",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
    }
    tic = time.perf_counter()
    try:
        status = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.perf_counter() - tic


def stale_costs(url: str, args) -> list[float]:
    times = []
    for i in range(args.requests):
        status, seconds = chat(url, i, args.max_tokens)
        if status != 200:
            raise SystemExit(f"a request was answered {status}")
        times.append(seconds)
        print(f"    request {i + 1}: {seconds:.2f} s", flush=True)
        time.sleep(args.gap)
    return times


def four_at_once(url: str, args) -> tuple[list[int], float]:
    tic = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: chat(url, i, args.max_tokens), range(4)))
    return [status for status, _ in answers], time.perf_counter() - tic


def idle_flood(port: int, n: int, log: Path) -> tuple[str, int]:
    """Open `n` idle connections, then ask /health; (what it answered and when, log lines added meanwhile)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 256)), hard))
    before = len(log.read_text(errors="replace").splitlines())
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        time.sleep(2)
        tic = time.perf_counter()
        try:
            reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            answer = f"{reply.status_code} in {time.perf_counter() - tic:.2f} s"
        except httpx.HTTPError as err:
            answer = f"no answer ({type(err).__name__} after {time.perf_counter() - tic:.1f} s)"
    finally:
        for s in sockets:
            s.close()
    time.sleep(1)
    return f"{answer}; {len(sockets)} connected", len(log.read_text(errors="replace").splitlines()) - before


def probe(checkout: Path, python: str, models: Path, profile: dict, args) -> dict:
    """Serve from `checkout` on a cache holding only `profile` (and the models), and run the three probes."""
    with tempfile.TemporaryDirectory(prefix="uag-service-") as tmp:
        cache = Path(tmp)
        (cache / "models").symlink_to(models)
        (cache / "profiles").mkdir()
        env = {**os.environ, "UAG_CACHE_DIR": str(cache), "PYTHONPATH": str(checkout)}
        where = subprocess.run(  # where this checkout looks for the profile (a digest of its key)
            [
                python,
                "-c",
                "import json,sys; from uag.costs.profiles import profile_path; "
                "print(profile_path(json.loads(sys.argv[1])))",
                json.dumps(profile["key"]),
            ],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        Path(where.stdout.strip()).write_text(json.dumps(profile))
        port, log_path = free_port(), cache / "server.log"
        log = open(log_path, "w")

        def usual_fd_limit() -> None:  # the soft limit most Linux sessions start with (macOS: 256)
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(args.server_fd_limit, hard), hard))

        server = subprocess.Popen(
            [python, "-m", "uag", "serve", "--port", str(port), "--no-ui"],
            cwd=checkout,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=usual_fd_limit,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + STARTUP_S
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        f"{checkout}: the server did not come up; its log:\n" + log_path.read_text()[-3000:]
                    )
                time.sleep(1)
            time.sleep(args.gap)
            times = stale_costs(url, args)
            statuses, together_s = four_at_once(url, args)
            print(f"    four at once: {statuses} in {together_s:.1f} s", flush=True)
            health, lines = idle_flood(port, args.flood, log_path)
            print(f"    /health under {args.flood} idle connections: {health}; log +{lines} lines", flush=True)
            return {"times": times, "statuses": statuses, "together_s": together_s, "health": health, "lines": lines}
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
            said = [line for line in log_path.read_text(errors="replace").splitlines() if "cost" in line]
            for line in said[:20]:
                print(f"    log: {line[:220]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", action="append", type=Path, help="a uag checkout to serve (repeatable)")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--gap", type=float, default=3.0, help="seconds between the stale-cost requests")
    p.add_argument("--stale", type=float, default=3.0, help="the saved times, as a multiple of today's")
    p.add_argument("--stall", type=float, default=5.0, help="a request over this many seconds stalled")
    p.add_argument("--flood", type=int, default=2100, help="idle connections opened at once")
    p.add_argument(
        "--server-fd-limit",
        type=int,
        default=1024,
        help="the servers' soft limit on open files as "
        "they start (1024: Linux's usual; the hard limit is left as it is)",
    )
    args = p.parse_args()
    checkouts = [c.resolve() for c in (args.checkout or [Path(__file__).resolve().parent.parent])]
    python = sys.executable
    from uag.machine import cache_dir

    models = cache_dir() / "models"
    print(f"load at the start: {os.getloadavg()[0]:.2f}; measuring the demo pair's costs now (this checkout)")
    with tempfile.TemporaryDirectory(prefix="uag-fresh-") as tmp:
        (Path(tmp) / "models").symlink_to(models)
        profile = stale(fresh_profile(python, Path(tmp)), args.stale)
    results = {}
    for checkout in checkouts:
        print(f"{checkout}:", flush=True)
        results[checkout] = probe(checkout, python, models, profile, args)
    head = f"{args.requests} short requests, s | median | max | over {args.stall:g} s | four at once"
    print(f"\n| checkout | {head} | /health under {args.flood} idle connections | log lines |")
    print("|---|---|---|---|---|---|---|---|")
    for checkout, r in results.items():
        times = r["times"]
        print(
            f"| {checkout} | {', '.join(f'{t:.1f}' for t in times)} | {statistics.median(times):.2f} | "
            f"{max(times):.2f} | {sum(t > args.stall for t in times)} | {r['statuses']} in {r['together_s']:.1f} s "
            f"| {r['health']} | {r['lines']} |"
        )
    if len(results) > 1:
        first = next(iter(results.values()))
        for checkout, r in list(results.items())[1:]:
            print(f"slowest short request, {checkout.name}: {max(r['times']) / max(first['times']):.3f}x the first's")
    print(f"load at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
