"""Where `uag serve`'s MLX worker spends its time while it serves: py-spy attached to the server, its samples of the
worker thread ("uag-mlx") sorted into the batch's parts and its busiest lines.

`serve.py --concurrency … --py-spy` records each uag server through its waves (not its start-up: measuring costs,
loading and the warm-up would bury them; docs/results.md, cz) and prints, per server, the share of the worker's
samples spent in the batch's passes (`Batch._decode`, `Batch._read`), in its members (each request's own code
between passes: drafting, checking, streaming, and on a GPU the waits for passes queued without waiting, which
land at a member's `.item()` or `mx.eval`), and elsewhere (waiting for work), then the lines where the samples
fell. py-spy samples idle threads too (`--idle`), so a wait on the device, the GIL or a file shows where it waits.
Attaching needs ptrace rights: root, or `kernel.yama.ptrace_scope` 0; on macOS, sudo.

    recorder = record(pid, Path("spy.txt"))   # py-spy attached; stop it to write the file
    stop(recorder)
    summarize(Path("spy.txt"))                # {"samples": …, "parts": {…}, "lines": [(share, line), …]}
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

WORKER = "uag-mlx"  # the MLX worker thread's name (uag.runtime.worker.MLXWorker)
RATE = 250  # samples a second
PASSES = ("Batch._decode", "Batch._read")  # frames of the batch's passes (uag.runtime.batching)
MEMBER = "Member._main"  # the bottom frame of a member's greenlet: a request's own code


def py_spy() -> str | None:
    """The py-spy executable beside this Python (requirements-dev.txt), or on PATH; None where there is none."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record(pid: int, out: Path, rate: int = RATE) -> subprocess.Popen:
    """py-spy attached to `pid`, every thread, idle samples kept, without pausing it; raw stacks to `out` once
    stopped (`stop`)."""
    exe = py_spy()
    if exe is None:
        raise SystemExit("--py-spy needs py-spy (pip install -r requirements-dev.txt)")
    argv = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--threads", "--idle", "--nonblocking"]
    argv += ["--format", "raw", "--output", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(recorder: subprocess.Popen, timeout: float = 30.0) -> str:
    """Stop py-spy as Ctrl-C does (it writes its file then); its last error line, if it failed."""
    if recorder.poll() is None:
        recorder.send_signal(signal.SIGINT)
    try:
        _, err = recorder.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        recorder.kill()
        _, err = recorder.communicate()
    lines = [line for line in err.decode(errors="replace").splitlines() if "Error" in line or "error" in line]
    return lines[-1] if recorder.returncode and lines else ""


def summarize(path: Path, thread: str = WORKER, top: int = 12) -> dict:
    """The worker thread's samples in py-spy's raw file: how many, their shares by part (passes, members, other) and
    the `top` lines they fell on (share, "function (file:line)"), busiest first.

    Example: a line "thread (7): uag-mlx;Batch.round (b.py:2);Batch._decode (b.py:9) 30" counts 30 samples to
    passes, on "Batch._decode (b.py:9)"
    """
    parts: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    text = path.read_text(errors="replace") if path.exists() else ""
    for row in text.splitlines():
        stack, _, count = row.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or not frames[0].startswith("thread") or not frames[0].endswith(f": {thread}"):
            continue
        n, body = int(count), frames[1:]
        if any(frame.startswith(MEMBER) for frame in body):
            parts["members"] += n
        elif any(frame.startswith(PASSES) for frame in body):
            parts["passes"] += n
        else:
            parts["other"] += n
        lines[body[-1] if body else "(no Python frame)"] += n
    samples = sum(parts.values())
    share = (lambda n: n / samples) if samples else (lambda n: 0.0)
    return {
        "samples": samples,
        "parts": {part: share(parts[part]) for part in ("passes", "members", "other")},
        "lines": [(share(n), line) for line, n in lines.most_common(top)],
    }


def say(summary: dict) -> list[str]:
    """The summary as the lines serve.py prints."""
    parts = ", ".join(f"{part} {value:.0%}" for part, value in summary["parts"].items())
    out = [f"{summary['samples']} samples of the worker at {RATE} a second: {parts}"]
    return out + [f"  {value:6.1%}  {line}" for value, line in summary["lines"]]
