"""The app in headless Chromium: type a prompt, run, and see both texts, the highlighted spans and the stats.

Needs Debian's chromium (scripts/system-deps.sh test installs it) and the playwright package; Playwright's own
browser download is never used.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
RUN_TIMEOUT_MS = 300_000  # models load and warm up on first use; a 2-core CPU is slow

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)"),
]


@pytest.fixture
def page(tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context.new_page()
        finally:
            context.close()


def test_a_comparison_in_the_browser(app_url, page):
    page.goto(app_url)
    page.get_by_label("Prompt").fill("The capital of France is")
    page.locator("input[aria-label='number input for Max tokens']").fill("12")  # labels from uag.core.config.FIELDS
    page.locator("#run").click()
    page.wait_for_function(
        "() => /Done|Cannot run|error/i.test(document.querySelector('#status')?.innerText ?? '')",
        timeout=RUN_TIMEOUT_MS,
    )
    assert page.locator("#status").inner_text().startswith("Done"), page.locator("#status").inner_text()

    baseline = page.locator("#baseline-text textarea").input_value()
    spans = page.locator("#speculative-text .textfield .token .text").all_inner_texts()
    legend = page.locator("#speculative-text [data-testid='highlighted-text:category-legend'] .legend-item")
    assert baseline.strip() and spans
    assert "".join(spans).split() == baseline.split()  # greedy: the same text, shown as highlighted spans
    assert legend.all_inner_texts() == ["accepted draft", "target"]

    stats = page.locator("#stats").inner_text()
    for expected in ("tokens/s", "target alone", "speculative", "Speedup", "Time per phase", "Speculation"):
        assert expected in stats
    assert page.locator("#ribbon .js-plotly-plot").count() == 1
    assert not page.locator("#mismatch").is_visible()  # no greedy mismatch


def test_the_first_example_is_structured_and_runs_on_the_default_pair(app_url, page):  # issue 12
    from playwright.sync_api import expect

    from uag.app.settings import DEFAULT_GENERATION
    from uag.runtime.presets import DEFAULT
    from uag.study.datasets import load_bundled

    page.goto(app_url)
    assert page.locator("#drafter textarea, #drafter input").first.input_value() == DEFAULT.drafter
    page.locator(".gallery-item").first.click()  # gr.Examples: a newcomer's first click
    expect(page.get_by_label("Prompt")).to_have_value(load_bundled("structured")[0].text)
    page.locator("input[aria-label='number input for Max tokens']").fill("16")
    page.locator("#run").click()
    page.wait_for_function(
        "() => /Done|Cannot run|error/i.test(document.querySelector('#status')?.innerText ?? '')",
        timeout=RUN_TIMEOUT_MS,
    )
    assert page.locator("#status").inner_text().startswith("Done"), page.locator("#status").inner_text()
    stats = page.locator("#stats").inner_text()
    # auto shows its maximum k; the speedup itself is not asserted: a shared CPU is too noisy for that
    assert "Speedup" in stats and f"auto, k ≤ {DEFAULT_GENERATION.k}" in stats
