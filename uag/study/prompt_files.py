"""The two file formats a user's prompts come in, read line by line so that no bad line is ever swallowed.

`jsonl_rows` and `csv_rows` yield ``(line, record)`` pairs: `line` is the 1-based line an editor shows, and
`record` is either a dict of the record's fields or an `InputError` saying why that line is skipped.
`uag.study.datasets` turns the dicts into prompts. Standard library only.

What counts as a bad line:

- **JSON Lines**: a line that is not one complete JSON object — invalid JSON, an object spread over several
  lines (a pretty-printed file), an array, a key given twice, nesting too deep to read.
- **CSV** (comma-, semicolon- or tab-separated: the first of these whose header has the text column): a
  quote opened and never closed (reported on the line where it opens; reading goes on with the next line,
  so the rest of the file is not swallowed into one cell), text after a closing quote, more cells than the
  header has columns (an unquoted comma split the text). A quoted cell may span lines; its record is
  reported on its first line.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

from uag.errors import InputError

CSV_DELIMITERS = (",", ";", "\t")  # spreadsheets in Polish locales write ';'

Row = tuple[int, "dict[str, Any] | InputError"]


# --- JSON Lines --------------------------------------------------------------------------------


def _object_without_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise InputError(f"key '{key}' appears twice in one object")
        seen[key] = value
    return seen


def _json_error(raw: str, err: json.JSONDecodeError) -> str:
    """`invalid JSON (...)`, with a hint when the line ends before the JSON value does."""
    message = f"invalid JSON ({err.msg} at column {err.colno})"
    if err.pos >= len(raw.rstrip()) and raw.strip():
        message += ": the record does not end on this line (JSON Lines needs one whole object per line)"
    return message


def jsonl_rows(text: str) -> Iterator[Row]:
    """One record per non-blank line of a JSON Lines text.

    Lines are split on "\\n" only (a JSON string may hold a literal U+2028 or U+0085); blank lines are skipped.

    Example: list(jsonl_rows('{"prompt": "Ile nóg ma pająk?"}\\n\\n[1]'))
             -> [(1, {"prompt": "Ile nóg ma pająk?"}), (3, InputError("expected a JSON object, got an array ..."))]
    """
    for line, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue  # a trailing newline or spacing is not an error
        try:
            record = json.loads(raw, object_pairs_hook=_object_without_repeated_keys)
        except json.JSONDecodeError as err:
            yield line, InputError(_json_error(raw, err))
            continue
        except InputError as err:
            yield line, err
            continue
        except RecursionError:
            yield line, InputError("invalid JSON (nested too deeply to read)")
            continue
        if isinstance(record, list):
            yield line, InputError("expected a JSON object, got an array (JSON Lines needs one object per line)")
        elif not isinstance(record, dict):
            yield line, InputError(f"expected a JSON object, got {type(record).__name__}")
        else:
            yield line, record


# --- CSV ---------------------------------------------------------------------------------------


def _header(lines: list[str], text_field: str, source: str) -> tuple[list[str], str, int]:
    """The header's column names, the delimiter, and how many lines the header took.

    InputError if the header cannot be read, has no `text_field` column, or names a column twice.
    """
    if not lines:
        raise InputError(f"{source}: the CSV file is empty (it needs a header row with a '{text_field}' column)")
    candidates = []
    for delimiter in CSV_DELIMITERS:
        reader = csv.reader(iter(lines), delimiter=delimiter, strict=True)
        try:
            columns = [name.strip() for name in next(reader, [])]
        except csv.Error as err:
            raise InputError(f"{source}: line 1: cannot read the CSV header ({err})") from None
        if text_field in columns:
            break
        candidates.append(columns)
    else:
        shown = ", ".join(candidates[0]) or "none"
        raise InputError(f"{source}: CSV has no column '{text_field}' (columns: {shown})")
    twice = sorted({name for name in columns if name and columns.count(name) > 1})
    if twice:
        raise InputError(f"{source}: line 1: the CSV header names column '{twice[0]}' twice")
    return columns, delimiter, reader.line_num


def _csv_error(err: csv.Error, first: int, last: int) -> str:
    """A user's account of a csv.Error met while reading the record that starts on line `first`."""
    text = str(err)
    if text.startswith("unexpected end of data"):
        return "unterminated quote: the quoted cell that opens on this line is never closed"
    if "expected after" in text:
        if last == first:
            return 'text after a closing quote (inside a quoted cell, write a quote as "")'
        return (
            f"unterminated quote? the quoted cell that opens on this line runs to line {last}, "
            "then has text after its closing quote"
        )
    span = f" (reading lines {first}–{last})" if last > first else ""
    return f"malformed CSV: {text}{span}"


def _csv_record(row: list[str], columns: list[str]) -> dict[str, str] | InputError:
    extra = row[len(columns) :]
    if any(cell.strip() for cell in extra):
        return InputError(
            f"{len(row)} cells, but the header has {len(columns)} column{'s' if len(columns) > 1 else ''} "
            "(a cell that holds the separator must be quoted)"
        )
    return {name: cell for name, cell in zip(columns, row) if name}


def csv_rows(text: str, text_field: str, source: str) -> Iterator[Row]:
    """One record per CSV row after the header; InputError (raised) if the header itself is unusable.

    Rows whose cells are all blank are skipped. After a quoting error the reader starts again on the line
    after the bad record's first line, so an unterminated quote costs one line, not the rest of the file.

    Example: list(csv_rows('id,prompt\\nq1,"Ile nóg\\nq2,Jaka jest stolica Czech?\\n', "prompt", "p.csv"))
             -> [(2, InputError("unterminated quote: ...")), (3, {"id": "q2", "prompt": "Jaka jest stolica Czech?"})]
    """
    lines = io.StringIO(text, newline="").readlines()  # splits on \n, \r\n and \r, keeping them, as csv wants
    columns, delimiter, base = _header(lines, text_field, source)
    while base < len(lines):
        rest = (lines[i] for i in range(base, len(lines)))
        reader = csv.reader(rest, delimiter=delimiter, strict=True)
        first = base + 1  # the line the next record starts on
        try:
            for row in reader:
                if any(cell.strip() for cell in row):
                    yield first, _csv_record(row, columns)
                first = base + reader.line_num + 1
            return
        except csv.Error as err:
            yield first, InputError(_csv_error(err, first, base + reader.line_num))
            base = first  # read on from the line after the one the bad record opens on
