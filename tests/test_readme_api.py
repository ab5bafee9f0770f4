"""The Python examples of the README and of docs/ (blocks marked ```python api) run as written on the offline
demo pair, and the README's does what it says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import uag

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python api\n(.*?)^```", re.M | re.S)


def api_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def run_block(block: str, name: str) -> tuple[dict, str]:
    """Execute one example as a user would paste it; its namespace and what it printed."""
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, name, "exec"), scope)  # noqa: S102 (our own documents)
    return scope, out.getvalue()


def test_the_python_api_example_runs_verbatim(demo_pair):
    blocks = api_blocks(README)
    assert len(blocks) == 1, "the README has one block marked ```python api"
    scope, printed = run_block(blocks[0], "README.md")
    run = scope["run"]
    assert isinstance(run, uag.Run) and run.generated == 16 and run.drafter == "lookup+demo-drafter"
    assert set(run.stats()["sources"]) <= {"lookup", "model", "plain"} and run.text in printed
    baseline = uag.generate(scope["target"], None, "Stolica Polski to", scope["config"].replace(strategy="baseline"))
    assert printed.endswith(baseline.text)  # the streamed pieces are the baseline's text


def the_cancel_example_does_what_it_says(scope: dict, printed: str) -> None:
    """docs/python-api.md: bad settings print one line; Stop ends the run within one cycle of being set."""
    run, config = scope["run"], scope["config"]
    assert printed.splitlines()[0].startswith("strategy must be one of") and "k (draft length)" in printed
    assert run.finish_reason == "stopped" and 8 <= run.generated <= 8 + config.k < config.max_tokens


CLAIMS = {"python-api.md": the_cancel_example_does_what_it_says}


@pytest.mark.parametrize(
    "block", [(d, b) for d in DOCS for b in api_blocks(d)], ids=lambda db: str(db[0].relative_to(REPO))
)
def test_every_python_example_in_docs_runs_verbatim(demo_pair, block):
    document, code = block
    scope, printed = run_block(code, str(document.relative_to(REPO)))
    assert printed.strip(), f"{document.name}: an example that prints nothing shows the reader nothing"
    runs = [value for value in scope.values() if isinstance(value, uag.Run)]
    assert all(run.finish_reason is not None for run in runs), "a run the example shows was left unfinished"
    if document.name in CLAIMS:
        CLAIMS[document.name](scope, printed)


def test_the_docs_have_python_examples_to_run():
    assert any(api_blocks(d) for d in DOCS), "no block in docs/ is marked ```python api"
