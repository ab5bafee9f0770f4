"""Prompt sets: bundled data quality, user files with bad lines, spec resolution. No model, no network."""

from __future__ import annotations

import json
import re
import sys
import types
import unicodedata
from importlib import resources

import pytest

from uag import datasets as ds
from uag.datasets import BUNDLED, Prompt, load, load_bundled, load_file, load_hf

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


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- bundled sets ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_set_is_well_formed(name):
    prompts = load_bundled(name)
    ids = [p.id for p in prompts]
    assert len(set(ids)) == len(ids) >= 50
    for p in prompts:
        assert re.fullmatch(rf"{name}-\d{{3}}", p.id), p.id
        assert p.dataset == name and p.tags
        assert p.text.strip() and p.text == p.text.strip(), p.id  # a trailing space changes tokenization
        assert unicodedata.is_normalized("NFC", p.text), p.id


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_schema(name):
    allowed = {"id", "dataset", "prompt", "tags"} | ({"input"} if name == "alpaca" else set())
    for r in raw_records(name):
        assert set(r) <= allowed and {"id", "dataset", "prompt", "tags"} <= set(r), r
        assert r["dataset"] == name
        assert isinstance(r["prompt"], str) and isinstance(r.get("input", ""), str)
        assert r["tags"] and all(isinstance(t, str) and t for t in r["tags"])


@pytest.mark.parametrize("name", BUNDLED)
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


def test_synthetic_questions_are_short_one_liners():
    for p in load_bundled("synthetic"):
        assert "\n" not in p.text and p.text.endswith("?") and len(p.text) <= 100, p.id


def test_examples_are_short_and_come_from_the_sets():
    ex = ds.examples(k=2)
    assert set(ex) == set(BUNDLED)
    for name, texts in ex.items():
        assert len(texts) == 2 and all(len(t) <= ds.EXAMPLE_MAX_CHARS for t in texts)
        assert set(texts) <= {p.text for p in load_bundled(name)}
    with pytest.raises(ValueError, match="k must be positive"):
        ds.examples(k=0)


# --- n and names -------------------------------------------------------------------------------


def test_n_takes_the_first_prompts():
    everything = load_bundled("wiki")
    assert load_bundled("wiki", 5) == everything[:5]
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


# --- user files --------------------------------------------------------------------------------

JSONL_WITH_BAD_LINES = "\n".join(
    [
        '{"id": "a", "prompt": "Ile nóg ma pająk?", "tags": ["biology"]}',
        '{"prompt": "Jaka jest stolica Czech?"}',
        '{"prompt": "Zepsuta linia", ',  # 3: invalid JSON
        '{"prompt": "Przetłumacz na angielski.", "input": "Dzień dobry."}',
        '["not", "an", "object"]',  # 5
        '{"text": "no prompt field"}',  # 6
        '{"prompt": "   "}',  # 7
        "",
        '{"id": "a", "prompt": "Powtórzony identyfikator"}',  # 9: duplicate id
        '{"prompt": "Tekst z separatorem\u2028w środku"}',  # U+2028 is not a line break in JSONL
        "",
    ]
)


def test_jsonl_bad_lines_are_reported_and_the_rest_loaded(tmp_path):
    result = load_file(write(tmp_path, "moje.jsonl", JSONL_WITH_BAD_LINES))
    assert [e.line for e in result.errors] == [3, 5, 6, 7, 9]
    messages = dict((e.line, e.message) for e in result.errors)
    assert "invalid JSON" in messages[3]
    assert "JSON object" in messages[5]
    assert "missing text field 'prompt'" in messages[6]
    assert "empty text field" in messages[7]
    assert "duplicate id 'a' (first on line 1)" in messages[9]
    assert [p.id for p in result.prompts] == ["a", "moje-002", "moje-004", "moje-010"]
    assert result.prompts[0] == Prompt("a", "moje", "Ile nóg ma pająk?", ("biology",))
    assert result.prompts[2].text == "Przetłumacz na angielski.\n\nDzień dobry."
    assert "\u2028" in result.prompts[3].text


def test_load_warns_about_skipped_lines_and_applies_n(tmp_path):
    path = write(tmp_path, "moje.jsonl", JSONL_WITH_BAD_LINES)
    with pytest.warns(UserWarning, match="skipped 5 bad line.*line 3: invalid JSON"):
        prompts = load(str(path), n=2)
    assert [p.text for p in prompts] == ["Ile nóg ma pająk?", "Jaka jest stolica Czech?"]


def test_load_file_options(tmp_path):
    path = write(tmp_path, "x.jsonl", '{"question": "Ile to jest 2 + 2?"}\n')
    result = load_file(path, dataset="quiz", text_field="question")
    assert result.prompts == [Prompt("quiz-001", "quiz", "Ile to jest 2 + 2?")] and not result.errors


def test_csv_rows_with_multiline_cells_keep_their_line_numbers(tmp_path):
    text = 'id,prompt,tags\nq1,"Ile nóg ma pająk?","biology,short"\nq2,"Dwie\nlinie",\nq3,,\nq4,Ostatnie pytanie?,\n'
    result = load_file(write(tmp_path, "pytania.csv", "\ufeff" + text))  # with a BOM, as spreadsheets write
    assert [(p.id, p.text, p.tags) for p in result.prompts] == [
        ("q1", "Ile nóg ma pająk?", ("biology", "short")),
        ("q2", "Dwie\nlinie", ()),
        ("q4", "Ostatnie pytanie?", ()),
    ]
    assert [(e.line, e.message) for e in result.errors] == [(5, "empty text field 'prompt'")]


def test_csv_without_the_text_column_is_an_error(tmp_path):
    path = write(tmp_path, "bez.csv", "id,question\n1,Ile nóg ma pająk?\n")
    with pytest.raises(ValueError, match=r"no column 'prompt' \(columns: id, question\)"):
        load_file(path)
    assert load_file(path, text_field="question").prompts[0].text == "Ile nóg ma pająk?"


@pytest.mark.parametrize("name", ["pusty.jsonl", "pusty.csv"])
def test_empty_file_is_an_error(tmp_path, name):
    with pytest.raises(ValueError, match="no valid prompt|no column"):
        load_file(write(tmp_path, name, ""))


def test_file_with_only_bad_lines_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no valid prompt.*line 1: invalid JSON"):
        load_file(write(tmp_path, "zle.jsonl", "{nie json\n"))


def test_unreadable_files_are_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read prompt file"):
        load_file(tmp_path / "nie_ma.jsonl")
    with pytest.raises(ValueError, match="cannot read prompt file"):
        (tmp_path / "latin2.jsonl").write_bytes('{"prompt": "Zażółć"}'.encode("iso-8859-2"))
        load_file(tmp_path / "latin2.jsonl")
    with pytest.raises(ValueError, match="expected a .jsonl or .csv file"):
        load_file(write(tmp_path, "prompts.txt", "Ile nóg ma pająk?"))


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
