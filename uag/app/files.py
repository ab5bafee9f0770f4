"""Files in and out of the app: a results file uploaded to the Plot tab, and the exports (CSV, HTML, PNG).

An upload is the user's file, saved by the web server under a temporary path: every message names it by
its base name and says what is wrong with it, never the server's path, SQL or Python internals.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sqlite3
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from uag.app.history import history_frame
from uag.errors import UserError

log = logging.getLogger(__name__)

MAX_UPLOAD_MB = 50  # MiB, as gradio counts them; a sweep's results file is a few MB at most
EXPORT_TTL_S = 3600
SQLITE_MAGIC = b"SQLite format 3\x00"
NEEDED_COLUMNS = {"alpha", "speedup", "k", "group"}


def _scrub(message: str, path: Path) -> str:
    """The message with the server's path of the file replaced by its base name, and any other absolute
    path left out.

    Example: _scrub("no runs in /tmp/gradio/ab12/x.db", Path("/tmp/gradio/ab12/x.db")) -> "no runs in x.db"
    """
    message = message.replace(str(path.resolve()), path.name).replace(str(path), path.name)
    return re.sub(r"(?<![\w.])/[^\s'\"]+", "(a server path)", message)


def load_results(path: str | Path | None, *, max_mb: float = MAX_UPLOAD_MB) -> tuple[pd.DataFrame | None, str]:
    """A benchmark results file for the plot, and a line saying what was read (or why not)."""
    if not path:
        return None, ""
    path = Path(path)
    name = path.name
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(len(SQLITE_MAGIC))
    except OSError:
        return None, f"Could not read {name}: the upload did not arrive whole. Try again."
    if size > max_mb * 2**20:
        path.unlink(missing_ok=True)  # not kept on the server
        return None, f"{name} is {size / 2**20:.0f} MB; this app takes results files of at most {max_mb:.0f} MB."
    if head != SQLITE_MAGIC:
        return None, f"{name} is not a results file: the Plot tab reads the SQLite file a benchmark sweep writes."
    try:
        from uag.study.results import load_runs  # the benchmark side; imported only when a file is given

        frame = load_runs(path)
    except UserError as err:
        return None, f"Could not read {name}: {_scrub(str(err), path)}"
    except ValueError as err:  # results.py's own checks ("holds no speculative runs", "not a results file")
        return None, f"Could not read {name}: {_scrub(str(err), path)}"
    except (sqlite3.DatabaseError, pd.errors.DatabaseError):
        log.warning("reading an uploaded results file failed", exc_info=True)
        return None, f"{name} is an SQLite file, but not one a uag sweep wrote (its tables or columns differ)."
    missing = NEEDED_COLUMNS - set(frame.columns)
    if missing:
        return None, f"{name} lacks the columns {', '.join(sorted(missing))}."
    for column in ("alpha", "speedup", "k"):
        if not pd.api.types.is_numeric_dtype(frame[column]):
            return None, f"{name} holds values in its {column} column that are not numbers."
    return frame, f"Loaded {len(frame)} speculative runs from {name}."


class Exports:
    """Files made for download, in a temporary folder of their own; each is removed after an hour."""

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder) if folder else None  # made on first export

    def history(self, rows: Sequence[Mapping[str, Any]]) -> Path:
        """The history as a CSV file."""
        path = self._path("uag-history", "csv")
        history_frame(rows).to_csv(path, index=False)
        return path

    def figure(self, figure: Any) -> tuple[list[Path], str]:
        """The figure as self-contained HTML, and as PNG where kaleido is installed; a line on what was made."""
        html = self._path("uag-speedup-vs-alpha", "html")
        figure.write_html(html, include_plotlyjs=True)  # inline plotly.js: opens offline
        if importlib.util.find_spec("kaleido") is None:
            return [html], (
                "Saved HTML. PNG export needs the kaleido package (not installed); the camera icon above the "
                "plot saves a PNG from the browser."
            )
        png = html.with_suffix(".png")
        try:
            figure.write_image(png, width=1100, height=650, scale=2)
        except Exception:  # kaleido present but unable to run (e.g. no browser for it)
            log.warning("PNG export failed", exc_info=True)
            return (
                [html],
                (
                    "Saved HTML. PNG export failed on this server (see its log); the camera icon above the plot "
                    "saves a PNG from the browser."
                ),
            )
        return [html, png], "Saved HTML and PNG."

    def _path(self, stem: str, suffix: str) -> Path:
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="uag-exports-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in self.folder.glob("uag-*"):  # the browser has them by now (HTML exports are ~5 MB)
            if time.time() - old.stat().st_mtime > EXPORT_TTL_S:
                old.unlink(missing_ok=True)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        return self.folder / f"{stem}-{stamp}.{suffix}"
