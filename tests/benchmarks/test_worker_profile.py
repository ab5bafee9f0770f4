"""benchmarks/worker_profile.py (serve.py --py-spy): the MLX worker's samples sorted into the batch's parts and its
busiest lines; and py-spy attached to a live process whose thread is named as uag serve's worker."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import worker_profile as wp  # noqa: E402  (benchmarks/worker_profile.py)

RAW = """\
thread (7): uag-mlx;Thread.run (t.py:1);Batch.round (b.py:2);Batch._decode (b.py:9);KeptCaches.run (k.py:220) 30
thread (7): uag-mlx;Member._main (b.py:132);Job._run (w.py:164);Speculation._verify (e.py:224) 10
thread (7): uag-mlx;Thread.run (t.py:1);Condition.wait (threading.py:355) 10
thread (1): MainThread;serve (m.py:3) 50
thread (9): uag-mlx-other;Batch._read (b.py:387) 5
not a sample
"""


def test_the_workers_samples_go_to_passes_members_or_other_and_name_their_lines(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(RAW)
    summary = wp.summarize(raw, top=2)
    assert summary["samples"] == 50  # the worker's only: not the main thread, not a thread of another name
    assert summary["parts"] == {"passes": 0.6, "members": 0.2, "other": 0.2}
    assert summary["lines"] == [(0.6, "KeptCaches.run (k.py:220)"), (0.2, "Speculation._verify (e.py:224)")]
    said = wp.say(summary)
    assert said[0] == "50 samples of the worker at 250 a second: passes 60%, members 20%, other 20%"
    assert said[1].strip() == "60.0%  KeptCaches.run (k.py:220)"
    assert wp.summarize(tmp_path / "none.txt") == {
        "samples": 0,
        "parts": {"passes": 0.0, "members": 0.0, "other": 0.0},
        "lines": [],
    }


def test_py_spy_attached_to_a_live_worker_thread_records_its_lines(tmp_path):
    if wp.py_spy() is None:
        pytest.skip("py-spy is not installed (requirements-dev.txt)")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time\n"
            "def spin():\n"
            "    while True: sum(range(1000))\n"
            "threading.Thread(target=spin, name='uag-mlx', daemon=True).start()\n"
            "time.sleep(60)\n",
        ]
    )
    try:
        time.sleep(0.5)
        out = tmp_path / "spy.txt"
        recorder = wp.record(child.pid, out)
        time.sleep(1.5)
        failed = wp.stop(recorder)
        if failed and "ermission" in failed:
            pytest.skip(f"py-spy may not attach here: {failed}")
        summary = wp.summarize(out)
    finally:
        child.kill()
    assert not failed and summary["samples"] > 50  # ~250 a second for 1.5 s
    assert summary["parts"]["other"] == 1.0 and "spin (<string>:3)" in [line for _, line in summary["lines"]]
