"""A user's prompt files (prompt_files via datasets.load_file/load): every bad line reported with its
number, the rest used. Issue 14, finding 13: an unterminated CSV quote must not swallow the rest of the file."""

from __future__ import annotations

import pytest

from uag.errors import InputError
from uag.study import prompt_files
from uag.study.datasets import Prompt, load, load_file


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


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


def test_csv_unterminated_quote_is_one_bad_line_not_the_rest_of_the_file(tmp_path):
    """Finding 13: an unterminated quote used to swallow the rest of the file into one prompt, silently."""
    text = 'id,prompt\nq1,"Ile nóg ma pająk?\nq2,Jaka jest stolica Czech?\nq3,Kto napisał „Lalkę”?\n'
    result = load_file(write(tmp_path, "pytania.csv", text))
    assert [(p.id, p.text) for p in result.prompts] == [
        ("q2", "Jaka jest stolica Czech?"),
        ("q3", "Kto napisał „Lalkę”?"),
    ]
    assert [e.line for e in result.errors] == [2]
    assert "unterminated quote" in result.errors[0].message and "never closed" in result.errors[0].message
    with pytest.warns(UserWarning, match="skipped 1 bad line.*line 2: unterminated quote"):
        assert len(load(str(tmp_path / "pytania.csv"))) == 2


def test_csv_quote_closed_lines_later_is_reported_where_it_opens(tmp_path):
    text = 'id,prompt\nq1,"Ile nóg ma pająk?\nq2,Jaka jest stolica Czech?\nq3,"Kto napisał „Lalkę”?"\nq4,Ostatnie\n'
    result = load_file(write(tmp_path, "pytania.csv", text))
    assert [p.id for p in result.prompts] == ["q2", "q3", "q4"]
    assert [(e.line, e.message) for e in result.errors] == [
        (
            2,
            "unterminated quote? the quoted cell that opens on this line runs to line 4, then has text after its "
            "closing quote",
        )
    ]


def test_csv_text_after_a_closing_quote_and_split_cells_are_bad_lines(tmp_path):
    text = 'id,prompt,tags\nq1,"Ala" ma kota,\nq2,Ala, ma kota,zwierzęta,dom\nq3,"Cytat: ""Ala ma kota""",\nq4,ok,a,,\n'
    result = load_file(write(tmp_path, "zdania.csv", text))
    assert [(p.id, p.text) for p in result.prompts] == [("q3", 'Cytat: "Ala ma kota"'), ("q4", "ok")]
    messages = {e.line: e.message for e in result.errors}
    assert set(messages) == {2, 3}
    assert messages[2].startswith("text after a closing quote")
    assert messages[3].startswith("5 cells, but the header has 3 columns")


def test_csv_line_numbers_hold_with_crlf_and_blank_rows(tmp_path):
    text = 'id,prompt\r\n\r\nq1,"Dwie\r\nlinie"\r\n , \r\nq2,"otwarty\r\nq3,ostatni\r\n'
    result = load_file(write(tmp_path, "okna.csv", text))
    assert [(p.id, p.text) for p in result.prompts] == [("q1", "Dwie\r\nlinie"), ("q3", "ostatni")]
    assert [e.line for e in result.errors] == [6]


def test_csv_with_semicolons_and_a_chat_column(tmp_path):
    text = "id;prompt;chat\nq1;Napisz funkcję w Pythonie.;tak\nq2;def f(x):;false\n"
    text += "q3;Ile nóg ma pająk?;\nq4;Kraków to;TRUE\n"
    result = load_file(write(tmp_path, "excel.csv", text))
    assert [(p.id, p.chat) for p in result.prompts] == [("q2", False), ("q3", None), ("q4", True)]
    assert [(e.line, e.message) for e in result.errors] == [
        (2, "field 'chat' must be true, false or empty (got 'tak')")
    ]


def test_csv_header_problems_are_errors(tmp_path):
    with pytest.raises(InputError, match=r"line 1: the CSV header names column 'prompt' twice"):
        load_file(write(tmp_path, "dwa.csv", "prompt,prompt\na,b\n"))
    with pytest.raises(InputError, match=r"line 1: cannot read the CSV header"):
        load_file(write(tmp_path, "zly.csv", 'id,"prompt\n'))


def test_jsonl_records_that_are_not_one_object_per_line_are_reported(tmp_path):
    text = "\n".join(
        [
            "{",  # 1: a pretty-printed object
            '  "prompt": "Ile nóg ma pająk?"',  # 2
            "}",  # 3
            '[{"prompt": "Tablica zamiast obiektu"}]',  # 4
            '{"prompt": "pierwszy", "prompt": "drugi"}',  # 5
            "[" * 100_000 + "]" * 100_000,  # 6: too deep for the parser
            '{"prompt": "Zepsuty \\ud800 znak"}',  # 7: a lone surrogate would break every tokenizer
            '{"prompt": "Dobry", "chat": "no"}',  # 8: explicit words are fine
            '{"prompt": "Zły", "chat": 1}',  # 9: no truthiness
            '{"prompt": "Zły", "id": ["a"]}',  # 10
            '{"prompt": "Zły", "tags": ["ok", 3]}',  # 11
            '{"prompt": "Zły", "input": 7}',  # 12
            '{"prompt": "Dobry", "id": 12, "chat": true, "reference": "ignored"}',  # 13
        ]
    )
    result = load_file(write(tmp_path, "zle.jsonl", text))
    assert [(p.id, p.chat) for p in result.prompts] == [("zle-008", False), ("12", True)]
    messages = {e.line: e.message for e in result.errors}
    assert sorted(messages) == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12]
    assert messages[1].endswith("the record does not end on this line (JSON Lines needs one whole object per line)")
    assert "got an array" in messages[4]
    assert messages[5] == "key 'prompt' appears twice in one object"
    assert messages[6] == "invalid JSON (nested too deeply to read)"
    assert messages[7] == "field 'prompt' is not valid Unicode (a lone surrogate '\\ud800' at character 9)"
    assert "field 'chat' must be true, false or empty (got 1)" == messages[9]
    assert "field 'id' must be" in messages[10] and "field 'tags' must be a list of strings" in messages[11]
    assert messages[12] == "field 'input' must be a string (got int)"
    assert all("\n" not in m for m in messages.values())


def test_files_that_are_not_utf8_say_which_line(tmp_path):
    (tmp_path / "latin2.csv").write_bytes("id,prompt\nq1,Zażółć\n".encode("iso-8859-2"))
    with pytest.raises(InputError, match=r"latin2.csv: line 2 is not UTF-8 \(save the file as UTF-8\)"):
        load_file(tmp_path / "latin2.csv")


@pytest.mark.parametrize("name", ["pusty.jsonl", "pusty.csv"])
def test_empty_file_is_an_error(tmp_path, name):
    with pytest.raises(InputError, match="no valid prompt in .*the file is empty|the CSV file is empty"):
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


def test_reader_docstring_examples():
    rows = list(prompt_files.jsonl_rows('{"prompt": "Ile nóg ma pająk?"}\n\n[1]'))
    assert rows[0] == (1, {"prompt": "Ile nóg ma pająk?"}) and rows[1][0] == 3
    assert str(rows[1][1]).startswith("expected a JSON object, got an array")
    rows = list(prompt_files.csv_rows('id,prompt\nq1,"Ile nóg\nq2,Jaka jest stolica Czech?\n', "prompt", "p.csv"))
    assert rows[0][0] == 2 and str(rows[0][1]).startswith("unterminated quote")
    assert rows[1] == (3, {"id": "q2", "prompt": "Jaka jest stolica Czech?"})
