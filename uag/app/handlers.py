"""The app's event handlers, bound to a `Session`: plain values in, plain values out, no gradio.

Each handler takes what the page's components hold (and the request, for who is asking) and returns what
they should show next. `KEEP` means "leave the component as it is" and `Shown` sets a value and whether the
component is visible; `uag.app.ui` turns both into gradio updates. Tested without a browser, with a stand-in
request (`client.host`, `headers`, `session_hash`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from uag.app.compare_view import Update
from uag.app.history import history_frame
from uag.app.session import Session
from uag.app.settings import Settings
from uag.core.config import FIELDS
from uag.errors import UserError

KEEP = object()  # leave the component as it is
TABLE_COLUMNS = ["time", "prompt", "drafter", "strategy", "k", "alpha", "tps_base", "tps", "speedup", "identical"]
DECODING = tuple(f.name for f in FIELDS)  # the decoding controls, in the order of uag.core.config.FIELDS


@dataclass(frozen=True)
class Shown:
    """A component's new value and whether it is visible."""

    value: Any
    visible: bool


def _keep(value: Any) -> Any:
    return KEEP if value is None else value


def table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The history as the Plot tab's table: the columns a reader compares, prompts cut to 60 characters."""
    frame = history_frame(rows)[TABLE_COLUMNS].copy()
    frame["prompt"] = frame["prompt"].astype(str).str.slice(0, 60)
    return frame.round({"alpha": 3, "tps_base": 2, "tps": 2, "speedup": 3})


def show(update: Update, rows: list[dict]) -> tuple:
    """An `Update` as the outputs of a run: status, warning, both texts, ribbon, positions, stats, history."""
    warning = KEEP if update.warning is None else Shown(update.warning, bool(update.warning))
    positions = KEEP if update.positions is None else Shown(update.positions, True)
    return (
        update.status,
        warning,
        _keep(update.baseline_text),
        _keep(update.spans),
        _keep(update.ribbon),
        positions,
        _keep(update.stats_md),
        _keep(update.stats),
        [*rows, update.row] if update.row else KEEP,
    )


class Handlers:
    """Every handler of the page, bound to one `Session`."""

    def __init__(self, session: Session):
        self.session = session

    def _who(self, request: Any) -> tuple[Any, str, str | None]:
        host = request.client.host if request is not None and request.client is not None else None
        headers = dict(request.headers) if request is not None else None
        owner = getattr(request, "session_hash", None) if request is not None else None
        return self.session.access(host, headers), self.session.client(host, headers), owner

    def load(self, request: Any) -> Shown:
        access, _, _ = self._who(request)
        note = self.session.access_note(access)
        return Shown(note, bool(note))

    def preset(self, label: str) -> tuple:
        chosen = self.session.preset(label)
        if chosen is None:
            return KEEP, KEEP, ""
        return chosen.target, chosen.drafter, chosen.note

    def run(
        self, prompt: str, target: str, drafter: str, decoding: Mapping[str, Any], rows: list[dict], request: Any
    ) -> Iterator[tuple]:
        """A comparison's updates as output tuples (see `show`); `decoding` holds the FIELDS' values by name."""
        access, client, owner = self._who(request)
        try:
            settings = Settings.parse(target=target, drafter=drafter, **dict(decoding))
        except UserError as err:
            yield show(Update(f"**Cannot run:** {err}", state="error"), rows)
            return
        updates = self.session.compare(prompt, settings, access=access, owner=owner, client=client)
        try:  # closing the updates when the browser goes away cancels the comparison's job at once
            for update in updates:
                yield show(update, rows)
        finally:
            updates.close()

    def stop(self, request: Any) -> Any:
        _, _, owner = self._who(request)
        return "Stopped. Nothing was added to the history." if self.session.stop(owner) else KEEP

    def plot(self, rows, results, ks, c_choice, target, drafter) -> tuple:
        view = self.session.plot(rows, results, ks=ks or [], c_choice=c_choice, pair=(target, drafter))
        return view.figure, view.caption, table(rows)

    def costs(self, target: str, drafter: str) -> tuple:
        view = self.session.cost_view(target, drafter)
        return view.figure, view.caption

    def calibrate(self, target: str, drafter: str, request: Any) -> Iterator[tuple]:
        access, client, owner = self._who(request)
        updates = self.session.calibrate_pair(target, drafter, access=access, owner=owner, client=client)
        try:
            for update in updates:
                if update.view is None:
                    yield KEEP, update.status
                else:
                    yield update.view.figure, f"{update.status}\n\n{update.view.caption}"
        finally:
            updates.close()

    def results(self, path: str | None) -> tuple:
        return self.session.load_results(path)

    def export_history(self, rows: list[dict]) -> tuple:
        path = self.session.export_history(rows)
        return Shown([str(path)], True), f"History: {len(rows)} run{'s' * (len(rows) != 1)}."

    def export_figure(self, rows, results, ks, c_choice, target, drafter) -> tuple:
        view = self.session.plot(rows, results, ks=ks or [], c_choice=c_choice, pair=(target, drafter))
        paths, message = self.session.export_figure(view.figure)
        return Shown([str(p) for p in paths], True), message

    def api_compare(self, prompt: Any, options: Mapping[str, Any], request: Any) -> Iterator[tuple]:
        """The /compare endpoint: (baseline_text, speculative_text, spans, stats) as the run goes, the last
        one complete; UserError (one line) when it cannot run or does not finish. Closing it cancels the job."""
        access, client, owner = self._who(request)
        settings = Settings.parse(**dict(options))
        updates = self.session.compare(prompt, settings, access=access, client=client, owner=owner)
        final, shown = None, ("", "", [])
        try:
            for update in updates:  # one at least every heartbeat: the server can close this generator between them
                final = update
                if update.state == "running":
                    if update.stats is not None:
                        shown = (
                            update.baseline_text or "",
                            update.speculative_text,
                            [list(s) for s in update.spans or []],
                        )
                    yield *shown, {"status": update.status.replace("**", ""), "state": update.state}
        finally:
            updates.close()
        if final is None or final.state != "done":
            raise UserError(final.status.replace("**", "") if final else "the comparison produced nothing")
        yield final.baseline_text, final.speculative_text, [list(s) for s in final.spans], final.stats
