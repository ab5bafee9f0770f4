"""The README's "Python API" example runs as written (on the offline demo pair) and does what it says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import uag

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_python_api_example_runs_verbatim(demo_pair):
    blocks = re.findall(r"^```python api\n(.*?)^```", README.read_text(), re.M | re.S)
    assert len(blocks) == 1, "the README has one block marked ```python api"
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102 (our own README)
    run = scope["run"]
    assert isinstance(run, uag.Run) and run.generated == 16 and run.drafter == "lookup+demo-drafter"
    assert set(run.stats()["sources"]) <= {"lookup", "model", "plain"} and run.text in out.getvalue()
    baseline = uag.generate(scope["target"], None, "Stolica Polski to", scope["config"].replace(strategy="baseline"))
    assert out.getvalue().endswith(baseline.text)  # the streamed pieces are the baseline's text
