"""A screenshot of `uag serve`'s Server tab after real requests, taken in headless Chromium.

Starts `python -m uag serve` on a free port (unless --url), sends real traffic through the `openai` SDK, then
opens the app at /ui, clicks the Server tab and saves a PNG of the page down to the end of that tab. The traffic,
in this order: the first N bundled `edit` conversations turn by turn (each turn after the server's own reply to
the one before, streamed with include_usage), then the first conversation's last turn twice more: with
`"speculative": false` (the target alone) and with `"speculative": {"check": true}` (the server also runs the
target alone and compares).
Prints each request's figures and the tab's caption; nothing is retried or chosen behind your back: run it again
if the machine was busy. Needs Debian's chromium and the playwright package (as scripts/screenshots.py).

    python scripts/server_screenshot.py assets/screenshot-server.png      # demo pair, 2 conversations
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from screenshots import CHROMIUM, CHROMIUM_ARGS, WIDTH, launch, started  # this folder's app screenshots

START_TIMEOUT_S = 300  # the server answers /health at once; this is for importing mlx and gradio on a busy CPU
REQUEST_TIMEOUT_S = 1800  # one request, the first of which waits for the pair to load (and calibrate, once)
TAB_TIMEOUT_MS = 60_000
CAPTION = re.compile(r"\brequests? served")  # the tab's caption, not its description above


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "uag", "serve", "--target", args.target, "--drafter", args.drafter,
            "--drafters", "lookup,demo-drafter", "--port", str(port)]  # fmt: skip
    return launch(argv, f"http://127.0.0.1:{port}/health", "uag serve", START_TIMEOUT_S)


def ask(client, model: str, messages: list[dict], max_tokens: int, speculative: object = None) -> tuple[str, dict]:
    """One greedy streamed chat request: (the reply's text, the usage chunk's fields: usage, speculative, …)."""
    pieces, final = [], {}
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=None if speculative is None else {"speculative": speculative},
    )
    with stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                final = {"usage": chunk.usage.model_dump(), **(chunk.model_extra or {})}
    if not final:
        raise SystemExit("the stream ended without its usage chunk")
    return "".join(pieces), final


def describe(label: str, final: dict) -> str:
    """One request's figures as a line.

    Example: "edit-001 turn 1: 48 tokens, 21.3 tokens/s, α 0.82, 0 of 695 prompt tokens cached, est. speedup 2.95×"
    """
    usage, spec, timings = final["usage"], final.get("speculative") or {}, final.get("timings") or {}

    def num(value, form: str) -> str:
        return "–" if value is None else format(value, form)

    line = (
        f"{label}: {usage['completion_tokens']} tokens, {num(timings.get('predicted_per_second'), '.1f')} tokens/s, "
        f"α {num(spec.get('acceptance_rate'), '.2f')}, "
        f"{(usage.get('prompt_tokens_details') or {}).get('cached_tokens')} of {usage['prompt_tokens']} prompt "
        f"tokens cached, est. speedup {num(spec.get('estimated_speedup'), '.2f')}×"
    )
    if check := spec.get("check"):
        line += f"; check: {check.get('kind')}, measured speedup {num(check.get('measured_speedup'), '.2f')}×"
    return line


def send_traffic(args: argparse.Namespace, url: str) -> None:
    import openai

    from uag.study.datasets import load_conversations

    client = openai.OpenAI(base_url=url + "v1", api_key=os.environ.get("UAG_API_KEY", "none"), max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    conversations = load_conversations("edit", args.conversations)
    basis, sent = None, []
    for conversation in conversations:
        replies: list[str] = []
        for turn in range(len(conversation.turns)):
            sent.append(conversation.messages(replies))
            text, final = ask(client, args.target, sent[-1], args.max_tokens)
            replies.append(text)
            print(describe(f"{conversation.id} turn {turn + 1}", final), flush=True)
            basis = basis or (final.get("speculative") or {}).get("speedup_basis")
    first = conversations[0]
    last, where = sent[len(first.turns) - 1], f"{first.id} turn {len(first.turns)}"  # the first one's last turn
    for label, speculative in (("speculative false", False), ("check true", {"check": True})):
        _, final = ask(client, args.target, last, args.max_tokens, speculative)
        print(describe(f"{where} again, {label}", final), flush=True)
    print(f"estimated speedup: {basis}", flush=True)


def shoot(args: argparse.Namespace, url: str) -> str:
    """Opens the app, clicks the Server tab, saves the PNG; returns the tab's caption."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": 900})
            page.goto(url + "ui/")
            page.get_by_role("tab", name="Server", exact=True).click()
            panel = page.locator("[role=tabpanel]:visible")
            # A visible row naming the model: the tab's data (the table's hidden sizing rows don't count).
            panel.locator("[role=row]:visible", has_text=args.target).first.wait_for(timeout=TAB_TIMEOUT_MS)
            panel.locator(".js-plotly-plot").first.wait_for(timeout=TAB_TIMEOUT_MS)
            page.wait_for_timeout(1500)  # plotly's layout settles
            caption = panel.locator(".prose", has_text=CAPTION).first.inner_text()
            # The page from the top (the app's title and tabs) down to the end of the tab (the footer left out).
            page.evaluate("() => window.scrollTo(0, 0)")
            box = panel.bounding_box()
            height = int(box["y"] + box["height"] + 16)
            page.screenshot(path=str(args.out), full_page=True, clip={"x": 0, "y": 0, "width": WIDTH, "height": height})
            return caption
        finally:
            browser.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--target", default="demo-target", help="the server's --target (default demo-target)")
    parser.add_argument("--drafter", default="lookup+demo-drafter", help="the server's --drafter (default "
                        "lookup+demo-drafter)")  # fmt: skip
    parser.add_argument("--conversations", type=int, default=2, help="edit conversations to send (default 2)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per reply (default 48)")
    parser.add_argument("--url", help="use a server already running there (http://HOST:PORT/) instead of starting one")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with started(args.url, lambda port: start_server(args, port)) as url:
        print(f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}", flush=True)
        send_traffic(args, url)
        caption = shoot(args, url)
    size_kb = args.out.stat().st_size / 1000
    print(f"Server tab: {caption}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}; wrote {args.out} ({size_kb:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
