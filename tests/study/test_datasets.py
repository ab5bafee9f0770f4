"""Prompt sets: bundled data quality, user files with bad lines, spec resolution. No model, no network."""

from __future__ import annotations

import ast
import json
import re
import sys
import types
import unicodedata
from importlib import resources

import pytest

from uag.study import datasets as ds
from uag.study.datasets import BUNDLED, Prompt, chat_for, load, load_bundled, load_hf

SIZES = {"wiki": 75, "alpaca": 72, "synthetic": 70, "structured": 42, "code": 44}  # as uag/data/README.md says
LENGTHS = {"structured": (150, 1200), "code": (15, 1200)}  # characters, as uag/data/README.md says
POLISH = ("wiki", "alpaca", "synthetic", "structured")  # `code` mixes English and Polish
FIELDS = {  # the schema of each bundled file: required fields, then optional ones
    "wiki": ({"id", "dataset", "prompt", "tags"}, set()),
    "alpaca": ({"id", "dataset", "prompt", "tags", "input"}, set()),
    "synthetic": ({"id", "dataset", "prompt", "tags"}, set()),
    "structured": ({"id", "dataset", "prompt", "tags", "chat", "reference"}, set()),
    "code": ({"id", "dataset", "prompt", "tags", "chat"}, {"reference"}),
}

DIACRITICS = "ąćęłńóśźż"
MONTHS = "stycznia|lutego|marca|kwietnia|maja|czerwca|lipca|sierpnia|września|października|listopada|grudnia"
# What each wiki format tag claims about the text; a tag must be backed by its regex.
FORMAT = {
    "dates": rf"\b\d{{1,2}} (?:{MONTHS}) \d{{3,4}}\b|\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b[IVX]+ (?:wiek|wieku|w\.)"
    rf"|\b\d{{3,4}} (?:r\.|roku)|\b1\d{{3}}[–-]\d{{4}}\b",
    "list": r"(?m)(?:^(?:\d+\.|[-•])(?: .*)?$\n?){2,}",
    "infobox": r"(?m)(?:^[A-ZĄĆĘŁŃÓŚŹŻ][^\n:]{1,40}: \S.*$\n?){2,}",
    "numbers": r"\d,\d|\b\d{1,3}(?: \d{3})+\b",
    "units": r"\d\s?(?:km²|km|m³/s|m n\.p\.m\.|m|mm|ha|°C|g/mol|g/cm³|g|kg|hPa|GW|GHz|GB|TB|%|‰)(?!\w)",
    "abbreviations": r"(?<!\w)(?:np|m\.in|ok|tzw|tj|ur|zm|p\.n\.e|n\.p\.m|tys|im|al|ks|godz|łac|sp|o\.o|r|w)\.",
    "quotes": r"„[^”]+”",
    "parentheses": r"\([^)]+\)",
}
FORMAT = {tag: re.compile(rx) for tag, rx in FORMAT.items()}


def raw_records(name: str) -> list[dict]:
    text = (resources.files("uag") / "data" / f"{name}.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line.strip()]


# --- bundled sets ------------------------------------------------------------------------------


def test_every_bundled_set_is_tested():
    assert set(SIZES) == set(BUNDLED) == set(FIELDS)


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_set_is_well_formed(name):
    prompts = load_bundled(name)
    ids = [p.id for p in prompts]
    assert len(set(ids)) == len(ids) == SIZES[name]
    for p in prompts:
        assert re.fullmatch(rf"{name}-\d{{3}}", p.id), p.id
        assert p.dataset == name and p.tags
        assert p.text.strip() and p.text == p.text.strip(), p.id  # a trailing space changes tokenization
        assert unicodedata.is_normalized("NFC", p.text), p.id


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_schema(name):
    required, optional = FIELDS[name]
    for r in raw_records(name):
        assert required <= set(r) <= required | optional, r
        assert r["dataset"] == name
        assert isinstance(r["prompt"], str) and isinstance(r.get("input", ""), str)
        assert r["tags"] and all(isinstance(t, str) and t for t in r["tags"])
        assert isinstance(r.get("chat", False), bool)
        assert isinstance(r.get("reference", "x"), str) and r.get("reference", "x").strip()


@pytest.mark.parametrize("name", BUNDLED)
def test_chat_comes_from_the_record_or_is_left_to_the_run(name):
    records = {r["id"]: r for r in raw_records(name)}
    for p in load_bundled(name):
        assert p.chat is records[p.id].get("chat")  # None where the record does not say
    if name in ("wiki", "alpaca", "synthetic"):
        assert all(p.chat is None for p in load_bundled(name))  # their runs decide, as before


@pytest.mark.parametrize("name", sorted(LENGTHS))
def test_new_sets_keep_their_length_limits_and_mix_lengths(name):
    low, high = LENGTHS[name]
    lengths = [len(p.text) for p in load_bundled(name)]
    assert low <= min(lengths) and max(lengths) <= high
    assert sum(n < 300 for n in lengths) >= 5 and sum(n > 500 for n in lengths) >= 3


@pytest.mark.parametrize("name", POLISH)
def test_bundled_set_is_polish_with_diacritics(name):
    texts = [p.text for p in load_bundled(name)]
    joined = " ".join(texts).lower()
    assert set(DIACRITICS) <= set(joined), set(DIACRITICS) - set(joined)
    with_diacritics = sum(any(c in DIACRITICS for c in t.lower()) for t in texts)
    assert with_diacritics >= 0.6 * len(texts)


def test_wiki_format_tags_are_backed_by_the_text():
    for p in load_bundled("wiki"):
        for tag in set(p.tags) & set(FORMAT):
            assert FORMAT[tag].search(p.text), f"{p.id} is tagged {tag!r} but its text has none"


@pytest.mark.parametrize(
    "tag, at_least", [("dates", 20), ("list", 5), ("infobox", 4), ("numbers", 10), ("units", 15), ("quotes", 5)]
)
def test_wiki_covers_the_hard_formats(tag, at_least):
    prompts = load_bundled("wiki")
    by_regex = sum(bool(FORMAT[tag].search(p.text)) for p in prompts)
    by_tag = sum(tag in p.tags for p in prompts)
    assert by_regex >= at_least and by_tag >= at_least


def test_wiki_has_each_kind_of_list_date_and_number():
    text = "\n".join(p.text for p in load_bundled("wiki"))
    for pattern in [
        r"(?m)^1\. .*\n2\. ",  # numbered list
        r"(?m)^[-•] .*\n[-•] ",  # bulleted list
        r"\b\d{1,2} września \d{4}",  # day-month-year
        r"\b\d{4}-\d{2}-\d{2}\b",  # ISO date
        r"\bX[IVX]* wiek",  # century in Roman numerals
        r"\d,\d+ ?(?:km²|°C|m|GHz)",  # decimal comma with a unit
        r"\d{1,3} \d{3} \d{3}",  # space-grouped millions
        r"(?m)^Powierzchnia: .+\n(?:Ludność|Województwo): ",  # infobox lines
        r"\bm\.in\.|\bnp\.|\btzw\.|\bok\.",  # abbreviations
    ]:
        assert re.search(pattern, text), pattern


@pytest.mark.parametrize("word", ["w", "z", "i", "o", "a"])
def test_wiki_uses_one_letter_words(word):
    prompts = load_bundled("wiki")
    standalone = sum(bool(re.search(rf"(?<!\w){word}(?!\w)", p.text)) for p in prompts)
    inside = sum(bool(re.search(rf"\w{word}\w", p.text)) for p in prompts)
    assert standalone >= 3 and inside >= 10


def test_alpaca_joins_instruction_and_input():
    records = raw_records("alpaca")
    prompts = {p.id: p for p in load_bundled("alpaca")}
    with_input = [r for r in records if r.get("input")]
    assert len(with_input) >= 15
    for r in records:
        expected = f"{r['prompt']}\n\n{r['input']}" if r.get("input") else r["prompt"]
        assert prompts[r["id"]].text == expected
    assert len({r["tags"][0] for r in records}) >= 10  # many kinds of task


def _copied_share(reference: str, prompt: str, span: int = 8) -> float:
    """The share of `reference`'s characters that lie in a run of >= `span` characters found in `prompt`."""
    covered, i = [False] * len(reference), 0
    while i + span <= len(reference):
        if reference[i : i + span] in prompt:
            j = i + span
            while j < len(reference) and reference[i : j + 1] in prompt:
                j += 1
            covered[i:j] = [True] * (j - i)
            i = j
        else:
            i += 1
    return sum(covered) / len(reference)


def _longest_copied_run(reference: str, prompt: str) -> int:
    best = 0
    for i in range(len(reference)):
        while i + best < len(reference) and reference[i : i + best + 1] in prompt:
            best += 1
    return best


def _words(text: str) -> list[str]:
    return [w.lower() for w in re.findall(r"\w{3,}", text)]


@pytest.mark.parametrize("record", raw_records("structured"), ids=lambda r: r["id"])
def test_structured_continuations_repeat_the_prompt(record):
    """The correct continuation (the record's `reference`) is mostly material the prompt already holds.

    Copies, reorderings and rewrites repeat whole runs of text: a run of >= 20 characters, and >= 60 % of the
    continuation in runs of >= 8 (the n-grams a lookup drafter can match). Format conversions (`convert`:
    CSV -> Markdown, JSON -> YAML) rewrite every separator, so there every word of >= 3 letters but a few
    (true -> "tak") must come from the prompt, and >= 40 % in runs of >= 8.
    """
    prompt, reference = record["prompt"], record["reference"]
    copied = _copied_share(reference, prompt)
    if "convert" in record["tags"]:
        words = _words(reference)
        assert sum(w in prompt.lower() for w in words) >= 0.9 * len(words)
        assert copied >= 0.4, copied
    else:
        assert _longest_copied_run(reference, prompt) >= 20
        assert copied >= 0.6, copied
    assert not prompt[-1].isspace() and record["chat"] is False


def test_structured_set_is_copy_heavy_and_covers_every_kind():
    records = raw_records("structured")
    shares = [_copied_share(r["reference"], r["prompt"]) for r in records]
    assert sum(shares) / len(shares) >= 0.8
    kinds = [r["tags"][0] for r in records]
    for kind, at_least in {
        "renumber": 4,
        "reorder": 3,
        "table-md": 3,
        "table-csv": 3,
        "facts": 5,
        "quote": 3,
        "json": 3,
        "code-edit": 3,
        "correct": 2,
        "template": 2,
        "list-from-text": 2,
    }.items():
        assert kinds.count(kind) >= at_least, kind
    assert sum(k.startswith("rewrite-") for k in kinds) >= 4


def test_code_continuations_are_python_that_parses():
    """A continuation-style prompt plus its reference completion is a valid Python module."""
    continuations = [r for r in raw_records("code") if not r["chat"]]
    for r in continuations:
        assert "reference" in r, r["id"]
        tree = ast.parse(r["prompt"] + r["reference"])
        assert any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in ast.walk(tree)), r["id"]
        assert re.search(r"^(def|class|@|import|from) ", r["prompt"], re.M), r["id"]


def test_code_instructions_hold_code_that_parses():
    instructions = [r for r in raw_records("code") if r["chat"]]
    with_code = 0
    for r in instructions:
        assert "reference" not in r and not r["prompt"].lstrip().startswith(("def ", "class ")), r["id"]
        for block in re.findall(r"```python\n(.*?)```", r["prompt"], re.S):
            ast.parse(block)
            with_code += 1
    assert with_code >= 8


def test_code_set_mixes_chat_and_continuation_kinds_and_languages():
    records = raw_records("code")
    chat = [r for r in records if r["chat"]]
    assert 0.4 <= len(chat) / len(records) <= 0.6
    kinds = {(r["tags"][0], r["chat"]) for r in records}
    for kind in ["complete", "rename", "refactor", "docstring", "tests", "parameter"]:
        assert (kind, False) in kinds, kind
    for kind in ["write", "rename", "refactor", "docstring", "tests"]:
        assert (kind, True) in kinds, kind
    for lang in ["en", "pl"]:
        assert sum(lang in r["tags"] and r["tags"][0] == "write" for r in records) >= 4, lang
        assert sum(lang in r["tags"] for r in records) >= 10, lang
    for r in records:
        assert ("en" in r["tags"]) != ("pl" in r["tags"]), r["id"]
        if "pl" in r["tags"]:
            assert any(c in DIACRITICS for c in r["prompt"].lower()), r["id"]


def test_chat_for_prefers_the_prompt_and_falls_back_to_the_run():
    assert chat_for(Prompt("a", "d", "t", chat=True), False) is True
    assert chat_for(Prompt("a", "d", "t", chat=False), True) is False
    assert chat_for(Prompt("a", "d", "t"), True) is True and chat_for(Prompt("a", "d", "t"), False) is False


def test_synthetic_questions_are_short_one_liners():
    for p in load_bundled("synthetic"):
        assert "\n" not in p.text and p.text.endswith("?") and len(p.text) <= 100, p.id


def test_examples_are_short_and_come_from_the_sets():
    ex = ds.examples(k=2)
    assert set(ex) == set(BUNDLED)
    for name, texts in ex.items():
        assert len(texts) == 2 and all(len(t) <= ds.EXAMPLE_MAX_CHARS for t in texts)
        assert set(texts) <= {p.text for p in load_bundled(name) if p.chat is not True}  # the app's chat is off
    with pytest.raises(ValueError, match="k must be positive"):
        ds.examples(k=0)


# --- n and names -------------------------------------------------------------------------------


def test_n_takes_the_first_prompts():
    everything = load_bundled("wiki")
    assert load_bundled("wiki", 5) == everything[:5]
    # by id, in the set's order, whatever n; another set's ids are passed over
    assert load_bundled("wiki", 5, ["wiki-009", "wiki-002", "code-001"]) == [everything[1], everything[8]]
    assert load("wiki", n=len(everything)) == everything


def test_n_too_large_says_how_many_there_are():
    size = len(load_bundled("wiki"))
    with pytest.raises(ValueError, match=rf"^dataset 'wiki' has {size} prompts; asked for {size + 1}$"):
        load_bundled("wiki", size + 1)


@pytest.mark.parametrize("n", [0, -3])
def test_n_must_be_positive(n):
    with pytest.raises(ValueError, match=rf"got {n}"):
        load_bundled("synthetic", n)


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="unknown bundled dataset 'wikipedia'.*wiki, alpaca, synthetic"):
        load_bundled("wikipedia")
    with pytest.raises(ValueError, match="unknown dataset 'wikipedia'"):
        load("wikipedia")


# --- Hugging Face (never the network) -------------------------------------------------------


def fake_datasets(records=None, error=None):
    """A stand-in `datasets` module whose load_dataset streams `records` or raises `error`."""
    module = types.ModuleType("datasets")

    def load_dataset(name, config=None, *, split, streaming):
        assert streaming, "uag must stream, not download whole splits"
        if error:
            raise error
        module.called_with = (name, config, split)
        return iter(records)

    module.load_dataset = load_dataset
    return module


def test_hf_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(RuntimeError, match=r"install the optional extra uag\[hf\]"):
        load("hf:speakleash/some-polish-set")


def test_hf_hub_unreachable_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(error=ConnectionError("no route to host")))
    with pytest.raises(RuntimeError, match="hub unreachable.*ConnectionError: no route to host"):
        load_hf("org/set")


def test_hf_records_become_prompts(monkeypatch):
    records = [
        {"instruction": "Przetłumacz na angielski.", "input": "Dzień dobry.", "output": "Good morning."},
        {"instruction": "", "input": "", "output": "skipped: no text"},
        {"instruction": "Napisz wiersz o Wiśle. " * 10, "input": "", "output": "…"},
        {"instruction": "Nie dotarliśmy tutaj.", "input": "", "output": "…"},
    ]
    records[2] |= {"chat": [{"role": "user"}], "tags": [1, 2], "id": 3.5}  # hub columns of other meanings
    fake = fake_datasets(records)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.warns(UserWarning, match="skipped 1 record"):
        prompts = load("hf:org/pl_alpaca:default", n=2)
    assert fake.called_with == ("org/pl_alpaca", "default", "train")
    assert [p.id for p in prompts] == ["pl_alpaca-001", "pl_alpaca-003"]
    assert prompts[0].text == "Przetłumacz na angielski.\n\nDzień dobry."
    with pytest.warns(UserWarning):
        clipped = load_hf("org/pl_alpaca", n=2, max_chars=30)[1].text
    assert clipped == "Napisz wiersz o Wiśle. Napisz"


def test_hf_without_a_known_text_column_asks_for_one(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets([{"tresc": "Ala ma kota."}]))
    with pytest.raises(ValueError, match="columns: tresc.*text_field="):
        load_hf("org/set")
    assert load_hf("org/set", text_field="tresc")[0].text == "Ala ma kota."


# --- pure helpers ------------------------------------------------------------------------------


def test_helpers_match_their_docstrings():
    assert ds.alpaca_text("Przetłumacz na angielski.", "Dzień dobry.") == "Przetłumacz na angielski.\n\nDzień dobry."
    assert ds.alpaca_text("Ile nóg ma pająk?") == "Ile nóg ma pająk?"
    assert ds.clip("Kraków – miasto w Polsce", 15) == "Kraków – miasto"
    assert ds.clip("krótki", 15) == "krótki"
    assert ds.record_to_prompt(
        {"prompt": "Ile nóg ma pająk?", "tags": ["biology"]}, dataset="mine", text_field="prompt", default_id="mine-001"
    ) == Prompt("mine-001", "mine", "Ile nóg ma pająk?", ("biology",))


# --- the multi-turn edit set (benchmarks/serve.py) ----------------------------------------------------------------

FENCED = re.compile(r"```(\w+)\n(.*?)\n```", re.S)


def test_edit_set_is_three_turn_code_conversations_under_cc0():
    records = raw_records("edit")
    conversations = ds.load_conversations("edit")
    assert len(conversations) == len(records) >= 20
    assert len({c.id for c in conversations}) == len(conversations)
    readme = (resources.files("uag") / "data" / "README.md").read_text(encoding="utf-8")
    assert "`edit.jsonl`" in readme and "CC0 1.0" in readme and "these six files" in readme
    languages = set()
    for record, conversation in zip(records, conversations):
        assert set(record) == {"id", "dataset", "system", "turns", "tags"}, record["id"]
        assert re.fullmatch(r"edit-\d{3}", conversation.id) and conversation.dataset == "edit"
        assert len(conversation.turns) == 3 and conversation.system
        assert all(t == t.strip() and unicodedata.is_normalized("NFC", t) for t in conversation.turns)
        blocks = FENCED.findall(conversation.turns[0])
        assert len(blocks) == 1, conversation.id  # turn 1 gives the code ...
        language, code = blocks[0]
        assert language == conversation.tags[0] and 40 <= code.count("\n") + 1 <= 120, conversation.id
        if language == "python":
            ast.parse(code)
        languages.add(language)
        # ... and every turn asks for the whole file back; later turns refer to the code already there.
        assert all(re.search(r"whole file|cały plik", t) for t in conversation.turns), conversation.id
        assert not any("```" in t for t in conversation.turns[1:]), conversation.id
        assert ("en" in conversation.tags) != ("pl" in conversation.tags)
    assert {"python", "javascript", "sql", "bash"} <= languages
    assert sum(c.tags[0] == "python" for c in conversations) >= 0.6 * len(conversations)


def test_a_conversation_replays_with_the_model_s_replies():
    conversation = ds.load_conversations("edit", 1)[0]
    first = conversation.messages([])
    assert [m["role"] for m in first] == ["system", "user"] and first[1]["content"] == conversation.turns[0]
    third = conversation.messages(["reply 1", "reply 2"], system="another system prompt")
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third[0]["content"] == "another system prompt" and third[4]["content"] == "reply 2"
    assert third[-1]["content"] == conversation.turns[2]
    with pytest.raises(ValueError, match="has 3 turns; got 3 replies"):
        conversation.messages(["a", "b", "c"])
    size = len(ds.load_conversations("edit"))
    with pytest.raises(ValueError, match=rf"has {size} conversations; asked for {size + 1}$"):
        ds.load_conversations("edit", size + 1)
    with pytest.raises(ValueError, match="unknown bundled conversation set 'wiki'"):
        ds.load_conversations("wiki")
