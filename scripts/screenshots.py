"""Screenshots of the app for the README, taken in headless Chromium as a user would see them.

Starts `python app.py` on a free port, picks a preset, enters a prompt (or clicks an example), runs the
comparison, waits for it to finish and saves a PNG of the Compare tab. Prints the measured speedup; nothing
is retried or chosen behind your back: run it again if the machine was busy. Needs Debian's chromium and the
playwright package (as tests/app/test_browser.py).

    python scripts/screenshots.py assets/screenshot-compare.png --example 0
    python scripts/screenshots.py assets/screenshot-coder.png \\
        --preset "Qwen2.5-Coder-1.5B ← SmolLM2-135M (cross-family)" --prompt "def quicksort(arr):" \\
        --strategy context -k 3
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
WIDTH = 1280
START_TIMEOUT_S = 120
RUN_TIMEOUT_MS = 1_800_000  # the coder target runs ~3 tokens/s on a 2-core CPU, twice over, after loading
SPEEDUP = re.compile(r"Speedup ([0-9.]+)×")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """Terminate a server this script started (killed if it takes over 30 s)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


@contextmanager
def started(url: str | None, start: Callable[[int], subprocess.Popen]) -> Iterator[str]:
    """The server at `url`, or one `start(port)` brings up on a free port and that is stopped when the block
    ends: its URL, ending in /."""
    if url is not None:
        yield url.rstrip("/") + "/"
        return
    port = free_port()
    process = start(port)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        stop(process)


def launch(argv: list[str], url: str, what: str, timeout_s: float = START_TIMEOUT_S) -> subprocess.Popen:
    """Start `argv` in the repository and return it once `url` answers; stopped (and SystemExit) if it exits
    first, does not answer within `timeout_s`, or anything else goes wrong while waiting."""
    process = subprocess.Popen(argv, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"{what} exited with status {process.returncode}")
            try:
                urllib.request.urlopen(url, timeout=2)
                return process
            except OSError:
                time.sleep(1)
        raise SystemExit(f"{what} did not answer {url} within {timeout_s:g} s")
    except BaseException:
        stop(process)
        raise


def start_app(port: int) -> subprocess.Popen:
    return launch([sys.executable, "app.py", "--port", str(port)], f"http://127.0.0.1:{port}/", "the app")


def pick_preset(page, label: str) -> None:
    page.get_by_label("Preset pair").click()
    page.get_by_role("option", name=label, exact=True).click()


def set_number(page, label: str, value: int) -> None:
    field = page.locator(f"input[aria-label='number input for {label}']")
    field.fill(str(value))
    field.press("Enter")


def shoot(args: argparse.Namespace, url: str) -> float | None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.goto(url)
            page.wait_for_selector("#run")
            if args.preset:
                pick_preset(page, args.preset)
                page.wait_for_timeout(1000)
            if args.strategy:
                page.get_by_role("radio", name=args.strategy, exact=True).check()
            if args.k:
                set_number(page, "K (draft length)", args.k)
            if args.max_tokens:
                set_number(page, "Max tokens", args.max_tokens)
            if args.prompt is not None:
                page.get_by_label("Prompt").fill(args.prompt)
            else:
                page.locator(".gallery-item").nth(args.example).click()  # gr.Examples' buttons
                expect(page.get_by_label("Prompt")).not_to_have_value("")  # filled asynchronously
            print("prompt:", repr(page.get_by_label("Prompt").input_value()), flush=True)
            page.locator("#run").click()
            page.wait_for_function(
                "() => /^(Done|Cannot run|Stopped)|error/i.test(document.querySelector('#status')?.innerText ?? '')",
                timeout=RUN_TIMEOUT_MS,
            )
            status = page.locator("#status").inner_text()
            print("status:", status, flush=True)
            stats = page.locator("#stats").inner_text()
            print(stats, flush=True)
            page.wait_for_timeout(1500)  # the ribbon plot and the Plot tab's follow-ups
            # The page from the top down to the stats (the Plot tab's table and the footer left out).
            page.evaluate("() => window.scrollTo(0, 0)")
            box = page.locator("#stats").bounding_box()
            height = int(box["y"] + box["height"] + 16)
            page.screenshot(path=str(args.out), full_page=True, clip={"x": 0, "y": 0, "width": WIDTH, "height": height})
            found = SPEEDUP.search(stats)
            return float(found.group(1)) if found else None
        finally:
            browser.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--preset", help="a preset label (default: the one the app opens on)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt to type")
    source.add_argument("--example", type=int, default=0, help="else: click this example prompt (default 0)")
    parser.add_argument("--strategy", help="translation strategy (default: the app's)")
    parser.add_argument("-k", type=int, help="draft length (default: the app's)")
    parser.add_argument("--max-tokens", type=int, help="tokens to generate (default: the app's)")
    parser.add_argument("--url", help="use an app already running there instead of starting one")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with started(args.url, start_app) as url:
        print(f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}", flush=True)
        speedup = shoot(args, url)
    size_kb = args.out.stat().st_size / 1000
    print(f"load average {os.getloadavg()[0]:.1f}; speedup: {speedup}; wrote {args.out} ({size_kb:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
