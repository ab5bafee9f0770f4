"""Prompt text from argv, stdin or a file, and the context check shared by target and drafter. No mlx."""

import io

import pytest

from uag.core.prompt_input import check_context, check_text, read_prompt
from uag.errors import InputError


def test_argv_bytes_that_are_not_utf8_are_named():
    text = b"Zaz\xf3\xb3\xe6".decode("utf-8", "surrogateescape")  # how Python hands such argv to us
    with pytest.raises(InputError, match="byte 0xf3 at character 4"):
        check_text(text, "the prompt")
    with pytest.raises(InputError, match="a lone surrogate U\\+D800"):
        check_text("Ala \ud800", "the prompt")  # what a raw JSON "\ud800" becomes
    assert check_text("Zażółć 🚀", "the prompt") == "Zażółć 🚀"


def test_prompt_from_stdin_and_from_a_file(tmp_path):
    big = "Ala ma kota. " * 20_000  # 260,000 characters: more than an argument may hold
    (tmp_path / "p.txt").write_text(big, encoding="utf-8")
    assert read_prompt(None, str(tmp_path / "p.txt"), io.BytesIO()) == big
    assert read_prompt("-", None, io.BytesIO("Zażółć".encode())) == "Zażółć"
    assert read_prompt("Ala", None, io.BytesIO(b"ignored")) == "Ala"


@pytest.mark.parametrize(
    ("argument", "prompt_file", "message"),
    [
        (None, None, "no prompt given"),
        ("Ala", "x.txt", "give the prompt once"),
        (None, "missing.txt", "'missing.txt': no such file"),
    ],
)
def test_prompt_source_mistakes(tmp_path, monkeypatch, argument, prompt_file, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=message):
        read_prompt(argument, prompt_file, io.BytesIO())


def test_context_check_for_target_and_drafter():
    check_context(8191, 8192, "drafter", "d")  # one token of room is enough to start
    check_context(10**6, None, "target", "t")  # no stated limit
    with pytest.raises(InputError, match="9432 tokens for the drafter 'd', whose context is 8192 tokens") as err:
        check_context(9432, 8192, "drafter", "d")
    assert "prompt lookup (drafter: lookup)" in str(err.value)
    with pytest.raises(InputError) as err:
        check_context(8192, 8192, "target", "t")
    assert "lookup" not in str(err.value)
