r"""The forms in which a reply copies its prompt's text: inside a JSON string, or out of a numbered listing. No mlx.

Prompt lookup drafts a reply's next tokens from where its last few occurred before (uag.core.lookup). A coding agent's
reply copies code it has read, but not always in the form it read it: a tool call's arguments are a JSON string, in
which every line break, tab, quote and backslash of the file is escaped (`"old_string": "def add(a, b):\n    return
a + b"`), and agents show files as numbered listings (`cat -n`, as Claude Code's Read returns them) whose numbers a copy
leaves out. Token for token such a copy matches its source only between two line breaks, so lookup drafts a few tokens
at a time where it could draft the whole copy. `copy_forms` gives the texts a reply may copy instead; lookup indexes
them beside the prompt where a reply may write JSON (`LookupDrafter(copy_forms=True)`: a request with tools or a JSON
grammar). Replayed token for token, a `Write` or an `Edit` of a file the agent read through `Read` then takes lookup
less than half the target passes (tests/core/test_copy_forms.py; the figures: docs/server.md, "Copying").

    copy_forms('     1\tdef add(a, b):\n     2\t    return a + b')
    -> ['def add(a, b):\n    return a + b',                     # the listing without its numbers
        '     1\\tdef add(a, b):\\n     2\\t    return a + b',   # the text as a JSON string holds it
        'def add(a, b):\\n    return a + b']                    # both
"""

from __future__ import annotations

import json
import re

# a listing's line: its number, right-aligned, then a tab (cat -n, nl) or an arrow (some agents' file readers)
NUMBERED_LINE = re.compile(r"^ *\d+(?:\t|→)")
LEAST_NUMBERED = 2  # lines a listing needs before its numbers are taken off: one number is any text's


def unnumbered(text: str) -> str | None:
    """`text` with the numbers of its numbered lines taken off; None where fewer than `LEAST_NUMBERED` lines have one.

    Example: '     1\\tx = 1\\n     2\\ty = 2\\nz' -> 'x = 1\\ny = 2\\nz';  'x = 1' -> None
    """
    lines = text.split("\n")
    if sum(1 for line in lines if NUMBERED_LINE.match(line)) < LEAST_NUMBERED:
        return None
    return "\n".join(NUMBERED_LINE.sub("", line, count=1) for line in lines)


def json_string(text: str) -> str:
    """`text` as the inside of a JSON string (what a tool call's argument holds), non-ASCII characters as they are.

    Example: 'a\\n"b"' -> 'a\\\\n\\\\"b\\\\"'
    """
    return json.dumps(text, ensure_ascii=False)[1:-1]


def copy_forms(text: str) -> list[str]:
    """The forms other than `text` itself in which a reply may copy it: without a listing's line numbers, as a JSON
    string holds it, and both; the most likely last (an index keeps the latest occurrence of an n-gram).

    Example: 'x = 1' -> [];  'x = "1"' -> ['x = \\\\"1\\\\"']
    """
    plain = unnumbered(text)
    forms = [] if plain is None else [plain]
    for source in (text, plain):
        if source is not None and (escaped := json_string(source)) != source:
            forms.append(escaped)
    return forms
