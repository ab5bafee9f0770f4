"""Aider's edit formats replayed without aider, for benchmarks/serve.py: the requests aider sends while it edits a
file with a model (its `whole` and `diff` formats), and each reply applied to the file as aider would apply it.

The layout comes from aider itself (`aider_layout/capture.py` writes `aider_layout/aider-<version>.json`): a fixed
head (system prompt and example conversation), the history of earlier turns, the file as it is now (aider re-sends
it every turn), and the user's request with the format's rules appended. A bundled `edit` conversation supplies the
file and the requests: its turn 1 gives the file inline and every turn ends "Return the whole file."; here the file
goes in aider's chat-files message and the requests are the change alone, since the format says how to answer.

After each reply the file moves on to what the reply's edits make of it. An edit that applies adds aider's
"I updated the files." / "Ok." to the history; one that does not (a SEARCH that is not in the file, no block, no
file listing) leaves the file as it was, where aider would ask the model again: the replay does not (one request a
turn, the same for every server), and the row says the edit did not apply.

Example:
    replay = Replay.of(load_conversations("edit", 1)[0], "diff")
    messages = replay.messages()               # turn 1 as aider would send it
    outcome = replay.answer(reply_text)        # applied? the file moves on; the next messages() is turn 2
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

LAYOUT = Path(__file__).resolve().parent / "aider_layout" / "aider-0.86.2.json"
FORMATS = ("whole", "diff")  # aider's --edit-format values replayed

_INTRO = re.compile(r"(?:Here is|Oto plik) `(?P<name>[^`]+)`:\n\n```[\w+-]*\n(?P<code>.*?\n)```\n\n(?P<ask>.*)\Z", re.S)
_WHOLE_FILE = re.compile(r"\s*(?:Return the whole file|Zwróć cały plik)\.\s*\Z")
# aider's SEARCH/REPLACE markers (aider.coders.editblock_coder: HEAD, DIVIDER, UPDATED)
_SEARCH = re.compile(r"^<{5,9} SEARCH>?\s*$")
_DIVIDER = re.compile(r"^={5,9}\s*$")
_REPLACE = re.compile(r"^>{5,9} REPLACE\s*$")


@cache
def _captured() -> dict:
    """`LAYOUT`, read once: the aider version and each edit format's layout."""
    return json.loads(LAYOUT.read_text(encoding="utf-8"))


def layout(edit_format: str) -> dict:
    """Aider's captured layout for one edit format (`aider_layout/*.json`)."""
    formats = _captured()["formats"]
    if edit_format not in formats:
        raise ValueError(f"no aider layout for edit format {edit_format!r} (there are {', '.join(formats)})")
    return formats[edit_format]


def aider_version() -> str:
    return _captured()["aider"]


@dataclass(frozen=True)
class EditTask:
    """An `edit` conversation as aider would run it: the file and the requests without the file or the format."""

    id: str
    name: str  # the file's name, as aider shows it
    content: str  # the file at turn 1
    requests: tuple[str, ...]

    @classmethod
    def of(cls, conversation) -> EditTask:
        """Example: turns ("Here is `a.py`:\\n\\n```python\\nx = 1\\n```\\n\\nRename x. Return the whole file.", …)
        -> EditTask(id, "a.py", "x = 1\\n", ("Rename x.", …))"""
        first = _INTRO.match(conversation.turns[0])
        if first is None:
            raise ValueError(f"{conversation.id}: turn 1 does not give a file as 'Here is `name`:' and a code block")
        asks = (first["ask"], *conversation.turns[1:])
        return cls(conversation.id, first["name"], first["code"], tuple(_WHOLE_FILE.sub("", a).strip() for a in asks))


@dataclass(frozen=True)
class Outcome:
    """What a reply did to the file: whether its edits applied, how many it held, and why not where they did not."""

    applied: bool
    edits: int
    why: str | None = None


@dataclass
class Replay:
    """One edit conversation in one aider edit format, turn by turn: `messages()` for the next turn, `answer(reply)`
    to move the file and the history on."""

    task: EditTask
    edit_format: str
    content: str
    done: list[dict] = field(default_factory=list)  # earlier turns, as aider keeps them
    turn: int = 0

    @classmethod
    def of(cls, conversation, edit_format: str) -> Replay:
        task = EditTask.of(conversation)
        layout(edit_format)  # refuse an unknown format now
        return cls(task, edit_format, task.content)

    @property
    def turns(self) -> int:
        return len(self.task.requests)

    def listing(self) -> str:
        """The file as aider lists it in its chat-files message (aider.coders.base_coder.get_files_content)."""
        opening, closing = layout(self.edit_format)["fence"]
        return f"\n{self.task.name}\n{opening}\n{self.content}{closing}\n"

    def messages(self) -> list[dict]:
        """The request aider would send for the next turn: head, history, the file now, the request and its rules."""
        shape = layout(self.edit_format)
        return [
            *shape["head"],
            *self.done,
            {"role": "user", "content": shape["files_prefix"] + self.listing()},
            {"role": "assistant", "content": shape["files_reply"]},
            {"role": "user", "content": self.task.requests[self.turn] + shape["reminder"]},
        ]

    def answer(self, reply: str) -> Outcome:
        """Apply the reply's edits to the file and keep the turn in the history, as aider does."""
        request = self.task.requests[self.turn]
        if self.edit_format == "whole":
            content, outcome = apply_whole(self.content, self.task.name, reply)
        else:
            content, outcome = apply_diff(self.content, self.task.name, reply)
        # aider's history holds the reply without its trailing newline (as captured: the request after a turn)
        self.done += [{"role": "user", "content": request}, {"role": "assistant", "content": reply.rstrip()}]
        if outcome.applied:
            self.content = content
            self.done += layout(self.edit_format)["applied"]
        self.turn += 1
        return outcome


def apply_whole(content: str, name: str, reply: str) -> tuple[str, Outcome]:
    """The file a `whole` reply lists: the last fenced block after a line naming the file (aider takes the one file in
    the chat when no name is given, so a block with no name counts when no block names it).

    Example: "a.py\\n```\\nx = 2\\n```" -> ("x = 2\\n", Outcome(True, 1))
    """
    named, unnamed = [], []
    lines = reply.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
            if end is None:
                break
            before = lines[i - 1].strip().strip("*`:#").strip() if i else ""
            (named if before and (before == name or before.endswith("/" + name)) else unnamed).append(
                "".join(lines[i + 1 : end])
            )
            i = end + 1
        else:
            i += 1
    blocks = named or unnamed
    if not blocks:
        return content, Outcome(False, 0, "no file listing")
    return blocks[-1], Outcome(True, 1)


def search_replace_blocks(reply: str) -> list[tuple[str, str]]:
    """The (search, replace) texts of a `diff` reply's SEARCH/REPLACE blocks, in order (lines end in newlines).

    Example: "a.py\\n```python\\n<<<<<<< SEARCH\\nx = 1\\n=======\\nx = 2\\n>>>>>>> REPLACE\\n```"
             -> [("x = 1\\n", "x = 2\\n")]
    """
    blocks, lines, i = [], reply.splitlines(keepends=True), 0
    while i < len(lines):
        if not _SEARCH.match(lines[i].rstrip("\n")):
            i += 1
            continue
        divider = next((j for j in range(i + 1, len(lines)) if _DIVIDER.match(lines[j].rstrip("\n"))), None)
        if divider is None:
            break
        end = next((j for j in range(divider + 1, len(lines)) if _REPLACE.match(lines[j].rstrip("\n"))), None)
        if end is None:
            break
        search, replace = "".join(lines[i + 1 : divider]), "".join(lines[divider + 1 : end])
        blocks.append((_ended(search), _ended(replace)))
        i = end + 1
    return blocks


def apply_diff(content: str, name: str, reply: str) -> tuple[str, Outcome]:
    """The file after a `diff` reply's SEARCH/REPLACE blocks, each replacing the first run of whole lines its search
    text matches: exactly, else ignoring trailing whitespace, else with every line's indentation shifted alike (aider's
    own matching tries these too). An empty search appends. Any block that matches nowhere: not applied, file kept.

    Example: ("x = 1\\n", "<<<<<<< SEARCH\\nx = 1\\n=======\\nx = 2\\n>>>>>>> REPLACE")
             -> ("x = 2\\n", Outcome(True, 1))
    """
    blocks = search_replace_blocks(reply)
    if not blocks:
        return content, Outcome(False, 0, "no SEARCH/REPLACE block")
    new = content
    for number, (search, replace) in enumerate(blocks, 1):
        changed = _replace(new, search, replace)
        if changed is None:
            return content, Outcome(False, len(blocks), f"block {number}'s SEARCH is not in {name}")
        new = changed
    return new, Outcome(True, len(blocks))


def _replace(content: str, search: str, replace: str) -> str | None:
    """`content` with the first run of whole lines that match `search` replaced: exactly, else ignoring trailing
    whitespace, else with every line's indentation shifted alike (the replacement shifted with it); None where
    no run matches."""
    if not search.strip():
        return _ended(content) + replace
    lines, wanted = content.splitlines(keepends=True), search.splitlines(keepends=True)
    starts, n = range(len(lines) - len(wanted) + 1), len(wanted)

    def splice(start: int, text: str) -> str:
        return "".join([*lines[:start], text, *lines[start + n :]])

    stripped = [w.rstrip() for w in wanted]
    for start in starts:
        if lines[start : start + n] == wanted:
            return splice(start, replace)
    for start in starts:
        if [x.rstrip() for x in lines[start : start + n]] == stripped:
            return splice(start, replace)
    for start in starts:
        shift = _indent_shift(lines[start : start + n], wanted)
        if shift is not None:
            return splice(start, "".join(shift + r if r.strip() else r for r in replace.splitlines(keepends=True)))
    return None


def _indent_shift(window: list[str], wanted: list[str]) -> str | None:
    """The indentation that every line of `window` has in front of `wanted`'s same line (one for all), or None.

    Example: (["    x = 1\n", "    y = 2\n"], ["x = 1\n", "y = 2\n"]) -> "    "
    """
    shifts = set()
    for have, want in zip(window, wanted):
        if have.strip() != want.strip():
            return None
        if want.strip():
            lead, base = _lead(have), _lead(want)
            if not lead.endswith(base):
                return None
            shifts.add(lead[: len(lead) - len(base)])
    return shifts.pop() if len(shifts) == 1 and "" not in shifts else None


def _lead(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _ended(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"
