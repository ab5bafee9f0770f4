"""Prompt sets: the five bundled sets, a user's JSONL/CSV file, or a Hugging Face dataset.

Standard library only; Hugging Face `datasets` is imported lazily (optional extra `uag[hf]`).

    load("wiki", n=10)            # bundled set (see BUNDLED and uag/data/README.md)
    load("my_prompts.jsonl")      # user file: one JSON object per line, text in "prompt"
    load("prompts.csv")           # user file: CSV with a header and a "prompt" column
    load("hf:org/name", n=50)     # Hugging Face dataset (hf:<name> or hf:<name>:<config>)
    load_conversations("edit")    # bundled multi-turn set: the user turns of each conversation, replayed in order

A record's text may come with an "input" (Alpaca style); the model then gets both, joined by
`alpaca_text`. A record may also say whether it is meant for a chat template ("chat": true/false);
`Prompt.chat` is None where it does not, and the run's own setting then decides (`chat_for`).
Bad input raises `uag.errors.InputError` (a ValueError) with a one-line message; a user file's bad
lines are reported one by one with their line numbers (`uag.study.prompt_files` reads the two formats).
An hf: spec the environment cannot serve (package missing, hub unreachable) raises RuntimeError.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from uag.errors import InputError
from uag.study.prompt_files import csv_rows, jsonl_rows

BUNDLED = ("wiki", "alpaca", "synthetic", "structured", "code")
CONVERSATIONS = ("edit",)  # multi-turn sets, CC0 1.0 like the prompt sets (uag/data/README.md)
DEFAULT_TEXT_FIELD = "prompt"
HF_PREFIX = "hf:"
DEFAULT_HF_N = 100
DEFAULT_HF_MAX_CHARS = 1000  # Wikipedia articles are long; a continuation prompt is an article's opening
HF_TEXT_FIELDS = ("text", "prompt", "instruction", "question")  # tried in order when none is given
EXAMPLE_MAX_CHARS = 240
CHAT_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False, "": None}


@dataclass(frozen=True)
class Prompt:
    """One prompt; `text` is exactly what is fed to a model (before any chat template).

    `chat`: True if the prompt is an instruction meant for the target's chat template, False if it is text
    to be continued as it stands, None if the record does not say (the run's setting decides: `chat_for`).
    """

    id: str
    dataset: str
    text: str
    tags: tuple[str, ...] = ()
    chat: bool | None = None


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


def chat_for(prompt: Prompt, default: bool) -> bool:
    """Whether a run applies the chat template to `prompt`: the prompt's own `chat`, else the run's `default`.

    Example: chat_for(Prompt("code-022", "code", "Write ...", chat=True), False) -> True
             chat_for(Prompt("wiki-001", "wiki", "Kraków – ..."), True) -> True
    """
    return default if prompt.chat is None else prompt.chat


def take(prompts: list[Prompt], n: int | None, name: str) -> list[Prompt]:
    """The first `n` prompts (all for None); InputError if n <= 0 or the set is smaller.

    Example: take([a, b, c], 2, "wiki") -> [a, b]
             take([a, b, c], 5, "wiki") -> InputError("dataset 'wiki' has 3 prompts; asked for 5")
    """
    if n is None:
        return prompts
    if n <= 0:
        raise InputError(f"n must be a positive number of prompts (got {n})")
    if n > len(prompts):
        raise InputError(f"dataset '{name}' has {len(prompts)} prompts; asked for {n}")
    return prompts[:n]


def _text(record: dict, name: str, *, required: bool) -> str:
    """A record's text field: a non-blank string of valid Unicode (a lone surrogate would break tokenizers)."""
    value = record.get(name)
    if value is None or (not required and value == ""):
        if required:
            raise InputError(f"missing text field '{name}'")
        return ""
    if not isinstance(value, str):
        raise InputError(f"field '{name}' must be a string (got {type(value).__name__})")
    if required and not value.strip():
        raise InputError(f"empty text field '{name}'")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(
            f"field '{name}' is not valid Unicode (a lone surrogate {value[e.start]!r} at character {e.start + 1})"
        ) from None
    return value


def _chat(value: Any) -> bool | None:
    """A record's "chat": JSON true/false/null, or a CSV cell true/false/yes/no/1/0/empty; nothing else."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in CHAT_WORDS:
        return CHAT_WORDS[value.strip().lower()]
    raise InputError(f"field 'chat' must be true, false or empty (got {value!r})")


def record_to_prompt(record: Any, *, dataset: str, text_field: str, default_id: str) -> Prompt:
    """Turn one parsed record (a dict) into a Prompt; InputError says what is wrong with it.

    Example: record_to_prompt({"prompt": "Ile nóg ma pająk?", "tags": ["biology"]},
                              dataset="mine", text_field="prompt", default_id="mine-001")
             -> Prompt(id="mine-001", dataset="mine", text="Ile nóg ma pająk?", tags=("biology",))
    """
    if not isinstance(record, dict):
        raise InputError(f"expected a JSON object, got {type(record).__name__}")
    text = _text(record, text_field, required=True)
    extra = _text(record, "input", required=False)
    tags = record.get("tags") or ()
    if isinstance(tags, str):  # CSV cells: "dates,list"
        tags = [t.strip() for t in tags.split(",") if t.strip()]
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise InputError(f"field 'tags' must be a list of strings (got {tags!r:.60})")
    rid = record.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int, type(None))):
        raise InputError(f"field 'id' must be a string or a whole number (got {rid!r:.60})")
    rid = "" if rid is None else str(rid).strip()
    return Prompt(
        id=rid or default_id,
        dataset=dataset,
        text=alpaca_text(text, extra),
        tags=tuple(tags),
        chat=_chat(record.get("chat")),
    )


# --- loaders -----------------------------------------------------------------------------------


def _collect(rows: Iterable[tuple[int, Any]], *, dataset: str, text_field: str) -> LoadResult:
    """Convert (line, record-or-InputError) pairs, keeping good prompts and one error per bad line."""
    result, seen = LoadResult(), {}
    for line, record in rows:
        try:
            if isinstance(record, InputError):
                raise record
            prompt = record_to_prompt(
                record, dataset=dataset, text_field=text_field, default_id=f"{dataset}-{line:03d}"
            )
            if prompt.id in seen:
                raise InputError(f"duplicate id '{prompt.id}' (first on line {seen[prompt.id]})")
        except InputError as e:
            result.errors.append(LineError(line, str(e)))
            continue
        seen[prompt.id] = line
        result.prompts.append(prompt)
    return result


def load_file(path: str | Path, *, dataset: str | None = None, text_field: str = DEFAULT_TEXT_FIELD) -> LoadResult:
    """Read a user's .jsonl or .csv prompt file, skipping bad lines and reporting each one with its line number.

    The dataset name defaults to the file's stem. Raises InputError if the file cannot be read, has
    another extension, a CSV header without the text column, or no valid line at all.
    """
    path = Path(path)
    dataset = dataset or path.stem
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise InputError(f"{path}: expected a .jsonl or .csv file (got '{suffix or 'no extension'}')")
    try:
        text = path.read_bytes().decode("utf-8-sig")  # -sig: spreadsheet CSVs often start with a BOM
    except OSError as e:
        raise InputError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise InputError(f"cannot read prompt file {path}: line {line} is not UTF-8 (save the file as UTF-8)") from None
    rows = jsonl_rows(text) if suffix == ".jsonl" else csv_rows(text, text_field, str(path))
    result = _collect(rows, dataset=dataset, text_field=text_field)
    if not result.prompts:
        detail = "; ".join(map(str, result.errors[:3])) or "the file is empty"
        raise InputError(f"no valid prompt in {path}: {detail}")
    return result


def load_bundled(name: str, n: int | None = None, ids: Collection[str] | None = None) -> list[Prompt]:
    """The first `n` prompts (all for None) of a bundled set: one of BUNDLED; or, given `ids`, those of its prompts
    (in the set's order, whatever `n`; ids of other sets are passed over, so one list can span several sets)."""
    if name not in BUNDLED:
        raise InputError(f"unknown bundled dataset '{name}' (choose from: {', '.join(BUNDLED)})")
    text = (resources.files("uag") / "data" / f"{name}.jsonl").read_text(encoding="utf-8")
    result = _collect(jsonl_rows(text), dataset=name, text_field=DEFAULT_TEXT_FIELD)
    if result.errors:  # a shipped file is ours: fail loudly rather than skip
        raise RuntimeError(f"bundled dataset '{name}' is corrupt: {result.errors[0]}")
    if ids is not None:
        return [p for p in result.prompts if p.id in ids]
    return take(result.prompts, n, name)


@dataclass(frozen=True)
class Conversation:
    """A conversation to replay: the user's turns in order, each sent after the model's reply to the one before
    (the assistant's turns are whatever the model answers), with an optional system prompt."""

    id: str
    dataset: str
    turns: tuple[str, ...]
    system: str | None = None
    tags: tuple[str, ...] = ()

    def messages(self, replies: Iterable[str], system: str | None = None) -> list[dict]:
        """The messages of the next turn after `replies` (the model's answers so far), OpenAI style.

        Example: Conversation("edit-001", "edit", ("Fix it.", "Rename it.")).messages(["Fixed."])
                 -> [{"role": "user", "content": "Fix it."}, {"role": "assistant", "content": "Fixed."},
                     {"role": "user", "content": "Rename it."}]
        """
        replies = list(replies)
        if len(replies) >= len(self.turns):
            raise ValueError(f"conversation {self.id} has {len(self.turns)} turns; got {len(replies)} replies")
        system = self.system if system is None else system
        out = [{"role": "system", "content": system}] if system else []
        for turn, reply in zip(self.turns, [*replies, None]):
            out.append({"role": "user", "content": turn})
            if reply is not None:
                out.append({"role": "assistant", "content": reply})
        return out


def load_conversations(name: str, n: int | None = None) -> list[Conversation]:
    """The first `n` conversations (all for None) of a bundled multi-turn set: one of CONVERSATIONS."""
    if name not in CONVERSATIONS:
        raise InputError(f"unknown bundled conversation set '{name}' (choose from: {', '.join(CONVERSATIONS)})")
    text = (resources.files("uag") / "data" / f"{name}.jsonl").read_text(encoding="utf-8")
    out, seen = [], set()
    for line, record in jsonl_rows(text):
        try:  # a shipped file is ours: fail loudly rather than skip
            if isinstance(record, InputError):
                raise record
            turns = record.get("turns")
            if not isinstance(turns, list) or not turns:
                raise InputError("field 'turns' must be a non-empty list of strings")
            texts = tuple(_text({"turn": t}, "turn", required=True) for t in turns)
            system = _text(record, "system", required=False) or None
            prompt = record_to_prompt(
                {**record, "prompt": texts[0]}, dataset=name, text_field="prompt", default_id=f"{name}-{line:03d}"
            )
            if prompt.id in seen:
                raise InputError(f"duplicate id '{prompt.id}'")
        except InputError as e:
            raise RuntimeError(f"bundled conversation set '{name}' is corrupt: line {line}: {e}") from None
        seen.add(prompt.id)
        out.append(Conversation(prompt.id, name, texts, system, prompt.tags))
    if n is not None and n <= 0:
        raise InputError(f"n must be a positive number of conversations (got {n})")
    if n is not None and n > len(out):
        raise InputError(f"conversation set '{name}' has {len(out)} conversations; asked for {n}")
    return out if n is None else out[:n]


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
    joined as in `alpaca_text` (pl_alpaca-style sets), and a string or integer "id" column gives the ids;
    other columns are ignored. Texts are clipped to `max_chars`; records without usable text are skipped
    with a warning.
    """
    if n <= 0:
        raise InputError(f"n must be a positive number of prompts (got {n})")
    dataset = name.rsplit("/", 1)[-1]
    prompts: list[Prompt] = []
    skipped = 0
    for i, record in enumerate(_hf_records(name, config, split), 1):
        if text_field is None:
            text_field = next((f for f in HF_TEXT_FIELDS if f in record), None)
            if text_field is None:
                raise InputError(
                    f"Hugging Face dataset '{name}': none of {', '.join(HF_TEXT_FIELDS)} found "
                    f"(columns: {', '.join(record)}); pass text_field="
                )
        # Only the text, an "input" and a usable "id": a hub dataset's other columns ("chat", "tags", ...) may
        # mean something else there, and must not cost the record.
        usable = {k: v for k, v in record.items() if k in (text_field, "input")}
        if isinstance(record.get("id"), (str, int)) and not isinstance(record.get("id"), bool):
            usable["id"] = record["id"]
        try:
            p = record_to_prompt(usable, dataset=dataset, text_field=text_field, default_id=f"{dataset}-{i:03d}")
        except InputError:
            skipped += 1
            continue
        prompts.append(p if max_chars is None else replace(p, text=clip(p.text, max_chars)))
        if len(prompts) == n:
            break
    if skipped:
        warnings.warn(f"Hugging Face dataset '{name}': skipped {skipped} record(s) without usable text", stacklevel=2)
    if not prompts:
        raise InputError(f"Hugging Face dataset '{name}' (split '{split}') gave no prompt")
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
            raise InputError(f"empty Hugging Face dataset name in '{spec}' (use hf:<name>)")
        prompts = load_hf(name, n=DEFAULT_HF_N if n is None else n, config=config or None)
        return take(prompts, n, spec)  # an explicit n the dataset cannot fill is an error
    if Path(spec).suffix.lower() in (".jsonl", ".csv"):
        result = load_file(spec)
        if result.errors:
            shown = "; ".join(map(str, result.errors[:5]))
            more = f" (and {len(result.errors) - 5} more)" if len(result.errors) > 5 else ""
            warnings.warn(f"{spec}: skipped {len(result.errors)} bad line(s): {shown}{more}", stacklevel=2)
        return take(result.prompts, n, Path(spec).stem)
    raise InputError(
        f"unknown dataset '{spec}': expected one of {', '.join(BUNDLED)}, a path to a .jsonl/.csv file, or hf:<name>"
    )


def examples(k: int = 2) -> dict[str, list[str]]:
    """A few short prompt texts per bundled set, for a UI whose chat template is off by default.

    The first `k` prompts of each set of at most EXAMPLE_MAX_CHARS that are not instructions meant for a
    chat template (`chat` is not True). Example: examples(1)["structured"] -> ["Lista zakupów (…):\\n3. mleko …\\n1."]
    """
    if k <= 0:
        raise InputError(f"k must be positive (got {k})")
    return {
        name: [p.text for p in load_bundled(name) if len(p.text) <= EXAMPLE_MAX_CHARS and p.chat is not True][:k]
        for name in BUNDLED
    }
