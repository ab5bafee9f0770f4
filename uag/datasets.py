"""Prompt sets: the three bundled Polish sets, a user's JSONL/CSV file, or a Hugging Face dataset.

Standard library only; Hugging Face `datasets` is imported lazily (optional extra `uag[hf]`).

    load("wiki", n=10)            # bundled set (see BUNDLED)
    load("my_prompts.jsonl")      # user file: one JSON object per line, text in "prompt"
    load("prompts.csv")           # user file: CSV with a header and a "prompt" column
    load("hf:org/name", n=50)     # Hugging Face dataset (hf:<name> or hf:<name>:<config>)

A record's text may come with an "input" (Alpaca style); the model then gets both, joined by
`alpaca_text`. Bad input raises ValueError; an hf: spec the environment cannot serve (package
missing, hub unreachable) raises RuntimeError.
"""

from __future__ import annotations

import csv
import io
import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

BUNDLED = ("wiki", "alpaca", "synthetic")
DEFAULT_TEXT_FIELD = "prompt"
HF_PREFIX = "hf:"
DEFAULT_HF_N = 100
DEFAULT_HF_MAX_CHARS = 1000  # Wikipedia articles are long; a continuation prompt is an article's opening
HF_TEXT_FIELDS = ("text", "prompt", "instruction", "question")  # tried in order when none is given
EXAMPLE_MAX_CHARS = 240


@dataclass(frozen=True)
class Prompt:
    """One prompt; `text` is exactly what is fed to a model."""

    id: str
    dataset: str
    text: str
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class LineError:
    """A skipped line of a user file (1-based line number)."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass
class LoadResult:
    """What `load_file` read: the good prompts, and one error per skipped line."""

    prompts: list[Prompt] = field(default_factory=list)
    errors: list[LineError] = field(default_factory=list)


# --- pure helpers ------------------------------------------------------------------------------


def alpaca_text(instruction: str, input: str = "") -> str:
    """The text a model gets for an Alpaca-style record: the instruction, a blank line, the input.

    Example: alpaca_text("Przetłumacz na angielski.", "Dzień dobry.")
             -> "Przetłumacz na angielski.\\n\\nDzień dobry."
             alpaca_text("Ile nóg ma pająk?") -> "Ile nóg ma pająk?"
    """
    return f"{instruction}\n\n{input}" if input else instruction


def clip(text: str, max_chars: int) -> str:
    """Cut `text` to at most `max_chars`, at the last whitespace so no word is split.

    Example: clip("Kraków – miasto w Polsce", 15) -> "Kraków – miasto"
    """
    if len(text) <= max_chars:
        return text
    head = text[: max_chars + 1]
    cut = max(head.rfind(" "), head.rfind("\n"))
    return (head[:cut] if cut > 0 else text[:max_chars]).rstrip()


def take(prompts: list[Prompt], n: int | None, name: str) -> list[Prompt]:
    """The first `n` prompts (all for None); ValueError if n <= 0 or the set is smaller.

    Example: take([a, b, c], 2, "wiki") -> [a, b]
             take([a, b, c], 5, "wiki") -> ValueError("dataset 'wiki' has 3 prompts; asked for 5")
    """
    if n is None:
        return prompts
    if n <= 0:
        raise ValueError(f"n must be a positive number of prompts (got {n})")
    if n > len(prompts):
        raise ValueError(f"dataset '{name}' has {len(prompts)} prompts; asked for {n}")
    return prompts[:n]


def record_to_prompt(record: Any, *, dataset: str, text_field: str, default_id: str) -> Prompt:
    """Turn one parsed record (a dict) into a Prompt; ValueError says what is wrong with it.

    Example: record_to_prompt({"prompt": "Ile nóg ma pająk?", "tags": ["biology"]},
                              dataset="mine", text_field="prompt", default_id="mine-001")
             -> Prompt(id="mine-001", dataset="mine", text="Ile nóg ma pająk?", tags=("biology",))
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    text = record.get(text_field)
    if text is None:
        raise ValueError(f"missing text field '{text_field}'")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"empty text field '{text_field}'")
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise ValueError(f"field 'input' must be a string (got {type(extra).__name__})")
    tags = record.get("tags") or ()
    if isinstance(tags, str):  # CSV cells: "dates,list"
        tags = [t.strip() for t in tags.split(",") if t.strip()]
    if not isinstance(tags, (list, tuple)):
        raise ValueError(f"field 'tags' must be a list of strings (got {type(tags).__name__})")
    rid = record.get("id")
    return Prompt(
        id=str(rid) if rid not in (None, "") else default_id,
        dataset=dataset,
        text=alpaca_text(text, extra),
        tags=tuple(str(t) for t in tags),
    )


# --- loaders -----------------------------------------------------------------------------------


def _collect(rows: Iterable[tuple[int, Any]], *, dataset: str, text_field: str) -> LoadResult:
    """Convert (line, record-or-error) pairs, keeping good prompts and one error per bad line."""
    result, seen = LoadResult(), {}
    for line, record in rows:
        try:
            if isinstance(record, Exception):
                raise record
            prompt = record_to_prompt(
                record, dataset=dataset, text_field=text_field, default_id=f"{dataset}-{line:03d}"
            )
            if prompt.id in seen:
                raise ValueError(f"duplicate id '{prompt.id}' (first on line {seen[prompt.id]})")
        except ValueError as e:
            result.errors.append(LineError(line, str(e)))
            continue
        seen[prompt.id] = line
        result.prompts.append(prompt)
    return result


def _jsonl_rows(text: str) -> Iterable[tuple[int, Any]]:
    # split("\n"), not splitlines(): JSON strings may hold a literal U+2028 or U+0085
    for line, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue  # blank lines (a trailing newline, spacing) are not errors
        try:
            yield line, json.loads(raw)
        except json.JSONDecodeError as e:
            yield line, ValueError(f"invalid JSON ({e.msg} at column {e.colno})")


def _csv_rows(text: str, text_field: str, source: str) -> Iterable[tuple[int, Any]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    columns = reader.fieldnames or []
    if text_field not in columns:
        raise ValueError(f"{source}: CSV has no column '{text_field}' (columns: {', '.join(columns) or 'none'})")
    start = reader.line_num + 1
    for row in reader:
        yield start, row  # a quoted cell may span lines: report the row's first line
        start = reader.line_num + 1


def load_file(path: str | Path, *, dataset: str | None = None, text_field: str = DEFAULT_TEXT_FIELD) -> LoadResult:
    """Read a user's .jsonl or .csv prompt file, skipping bad lines and reporting each one.

    The dataset name defaults to the file's stem. Raises ValueError if the file cannot be read,
    has another extension, or has no valid line at all.
    """
    path = Path(path)
    dataset = dataset or path.stem
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise ValueError(f"{path}: expected a .jsonl or .csv file (got '{suffix or 'no extension'}')")
    try:
        text = path.read_bytes().decode("utf-8-sig")  # -sig: spreadsheet CSVs often start with a BOM
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompt file {path}: {e}") from e
    rows = _jsonl_rows(text) if suffix == ".jsonl" else _csv_rows(text, text_field, str(path))
    try:
        result = _collect(rows, dataset=dataset, text_field=text_field)
    except csv.Error as e:
        raise ValueError(f"{path}: malformed CSV: {e}") from e
    if not result.prompts:
        detail = "; ".join(map(str, result.errors[:3])) or "the file is empty"
        raise ValueError(f"no valid prompt in {path}: {detail}")
    return result


def load_bundled(name: str, n: int | None = None) -> list[Prompt]:
    """The first `n` prompts (all for None) of a bundled set: one of BUNDLED."""
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled dataset '{name}' (choose from: {', '.join(BUNDLED)})")
    text = (resources.files("uag") / "data" / f"{name}.jsonl").read_text(encoding="utf-8")
    result = _collect(_jsonl_rows(text), dataset=name, text_field=DEFAULT_TEXT_FIELD)
    if result.errors:  # a shipped file is ours: fail loudly rather than skip
        raise RuntimeError(f"bundled dataset '{name}' is corrupt: {result.errors[0]}")
    return take(result.prompts, n, name)


def _hf_records(name: str, config: str | None, split: str) -> Iterator[dict]:
    """Stream a Hugging Face split; environment failures become RuntimeError with the reason."""
    try:
        import datasets as hf_datasets
    except ImportError as e:
        raise RuntimeError(
            f"loading '{HF_PREFIX}{name}' needs the Hugging Face `datasets` package: "
            "install the optional extra uag[hf] (pip install 'uag[hf]')"
        ) from e
    try:
        yield from hf_datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # the hub client raises many types (HTTP, connection, not found)
        raise RuntimeError(
            f"could not load Hugging Face dataset '{name}' (hub unreachable, or no such "
            f"dataset/config/split): {type(e).__name__}: {e}"
        ) from e


def load_hf(
    name: str,
    split: str = "train",
    n: int = DEFAULT_HF_N,
    text_field: str | None = None,
    *,
    config: str | None = None,
    max_chars: int | None = DEFAULT_HF_MAX_CHARS,
) -> list[Prompt]:
    """Up to `n` prompts from a Hugging Face dataset, streamed (no full download).

    `text_field` defaults to the first of HF_TEXT_FIELDS the records have; an "input" column is
    joined as in `alpaca_text` (pl_alpaca-style sets). Texts are clipped to `max_chars`; records
    without text are skipped with a warning.
    """
    if n <= 0:
        raise ValueError(f"n must be a positive number of prompts (got {n})")
    dataset = name.rsplit("/", 1)[-1]
    prompts: list[Prompt] = []
    skipped = 0
    for i, record in enumerate(_hf_records(name, config, split), 1):
        if text_field is None:
            text_field = next((f for f in HF_TEXT_FIELDS if f in record), None)
            if text_field is None:
                raise ValueError(
                    f"Hugging Face dataset '{name}': none of {', '.join(HF_TEXT_FIELDS)} found "
                    f"(columns: {', '.join(record)}); pass text_field="
                )
        try:
            p = record_to_prompt(record, dataset=dataset, text_field=text_field, default_id=f"{dataset}-{i:03d}")
        except ValueError:
            skipped += 1
            continue
        prompts.append(p if max_chars is None else Prompt(p.id, p.dataset, clip(p.text, max_chars), p.tags))
        if len(prompts) == n:
            break
    if skipped:
        warnings.warn(f"Hugging Face dataset '{name}': skipped {skipped} record(s) without text", stacklevel=2)
    if not prompts:
        raise ValueError(f"Hugging Face dataset '{name}' (split '{split}') gave no prompt")
    return prompts


def load(spec: str, n: int | None = None) -> list[Prompt]:
    """Resolve a dataset spec (bundled name, .jsonl/.csv path, or hf:<name>[:<config>]).

    Skipped lines of a user file are reported with `warnings.warn`; call `load_file` to get them.
    """
    if spec in BUNDLED:
        return load_bundled(spec, n)
    if spec.startswith(HF_PREFIX):
        name, _, config = spec[len(HF_PREFIX) :].partition(":")
        if not name:
            raise ValueError(f"empty Hugging Face dataset name in '{spec}' (use hf:<name>)")
        prompts = load_hf(name, n=DEFAULT_HF_N if n is None else n, config=config or None)
        return take(prompts, n, spec)  # an explicit n the dataset cannot fill is an error
    if Path(spec).suffix.lower() in (".jsonl", ".csv"):
        result = load_file(spec)
        if result.errors:
            shown = "; ".join(map(str, result.errors[:5]))
            more = f" (and {len(result.errors) - 5} more)" if len(result.errors) > 5 else ""
            warnings.warn(f"{spec}: skipped {len(result.errors)} bad line(s): {shown}{more}", stacklevel=2)
        return take(result.prompts, n, Path(spec).stem)
    raise ValueError(
        f"unknown dataset '{spec}': expected one of {', '.join(BUNDLED)}, a path to a .jsonl/.csv file, or hf:<name>"
    )


def examples(k: int = 2) -> dict[str, list[str]]:
    """A few short prompt texts per bundled set (the first `k` of at most EXAMPLE_MAX_CHARS)."""
    if k <= 0:
        raise ValueError(f"k must be positive (got {k})")
    return {name: [p.text for p in load_bundled(name) if len(p.text) <= EXAMPLE_MAX_CHARS][:k] for name in BUNDLED}
