"""Fill-in-the-middle prompts (uag.server.fim): each family's tokens found by the texts a vocabulary holds and laid
out in its order, the repo-level layout of project files, and the user's text read as text, never as a control
token. Pure, with a one-id-per-character encoder; the last tests use the real Qwen2.5 tokenizer (and Llama-3.2's,
which has no FIM tokens)."""

from __future__ import annotations

import pytest

from uag.server.errors import APIError
from uag.server.fim import STOPS, Fill, FimTokens, fim_ids, literal, prompt_ids, tokens_of


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def text(ids: list[int], names: dict[int, str]) -> str:
    """The ids written back: a token id as its name in brackets, a character id as the character."""
    return "".join(f"[{names[i]}]" if i in names else chr(i) for i in ids)


QWEN = {"<|fim_prefix|>": 9001, "<|fim_suffix|>": 9002, "<|fim_middle|>": 9003, "<|repo_name|>": 9004}
QWEN_FILES = {**QWEN, "<|file_sep|>": 9005, "<|fim_pad|>": 9006}


@pytest.mark.parametrize(
    ("vocab", "family", "laid_out"),
    [
        (QWEN_FILES, "qwen", "[P]def f():\n    [S]\nf()[M]"),
        ({"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3, "<|file_separator|>": 4}, "qwen", None),
        ({"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3, "<file_sep>": 4}, "starcoder", None),
        ({"<fim-prefix>": 1, "<fim-suffix>": 2, "<fim-middle>": 3}, "santacoder", None),
        ({"▁<PRE>": 1, "▁<SUF>": 2, "▁<MID>": 3, "▁<EOT>": 4}, "codellama", None),
        ({"<｜fim▁begin｜>": 1, "<｜fim▁hole｜>": 2, "<｜fim▁end｜>": 3}, "deepseek", None),
        ({"[PREFIX]": 1, "[SUFFIX]": 2}, "codestral", "[S]\nf()[P]def f():\n    "),
    ],
)
def test_each_family_is_found_by_its_token_texts_and_laid_out_in_its_order(vocab, family, laid_out):
    tokens = tokens_of({**vocab, "hello": 5})
    assert tokens is not None and tokens.family == family
    names = {tokens.prefix: "P", tokens.suffix: "S", **({tokens.middle: "M"} if tokens.middle else {})}
    got = text(fim_ids(tokens, Fill("def f():\n    ", "\nf()"), enc), names)
    assert got == (laid_out or "[P]def f():\n    [S]\nf()[M]")


def test_a_vocabulary_without_the_three_tokens_has_no_fim():
    assert tokens_of({"<start_of_turn>": 1, "<end_of_turn>": 2}) is None  # Gemma-3
    assert tokens_of({"<fim_prefix>": 1, "<fim_suffix>": 2}) is None  # no middle token: not a family's whole set
    assert tokens_of({}) is None


def test_the_repo_level_layout_is_qwen2_5_coders():
    """Qwen2.5-Coder's repository format (as llama.cpp's /infill builds it): the project, each file behind a file
    separator and its name, the current file, then prefix, suffix, middle; `middle` (typed text) after the prefix."""
    tokens = tokens_of(QWEN_FILES)
    fill = Fill("x = ", "\n", files=(("util.py", "def g():\n    pass"), ("b.py", "B\n")), middle="g", repo_level=True)
    names = {9001: "P", 9002: "S", 9003: "M", 9004: "R", 9005: "F"}
    assert text(fim_ids(tokens, fill, enc, bos=[7]), names) == (
        "[R]myproject\n[F]util.py\ndef g():\n    pass\n[F]b.py\nB\n[F]filename\n\x07[P]x = g[S]\n[M]"
    )


def test_without_a_file_separator_extra_files_are_snippets():
    tokens = tokens_of({"<fim-prefix>": 1, "<fim-suffix>": 2, "<fim-middle>": 3})
    fill = Fill("a", "b", files=(("x.py", "X"),), repo_level=True)
    assert text(fim_ids(tokens, fill, enc), {1: "P", 2: "S", 3: "M"}) == "\n\n--- snippet ---\n\nX[P]a[S]b[M]"


def test_literal_cuts_a_control_token_written_as_text():
    """An encoder that reads "<C>" as id 7: the text holding it is encoded in pieces cut inside it."""

    def reads_controls(text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("<C>", i):
                ids, i = [*ids, 7], i + 3
            else:
                ids, i = [*ids, ord(text[i])], i + 1
        return ids

    encode = literal(reads_controls, ["<C>"], {7})
    assert encode("a<C>b") == enc("a<C>b") and encode("plain") == enc("plain")


def test_stops_are_every_families_end_and_fim_tokens_a_file_would_not_hold():
    assert {"<|fim_prefix|>", "<|file_sep|>", "<|endoftext|>", "<fim_middle>", "<｜fim▁end｜>", "<EOT>"} <= set(STOPS)
    assert not {"[PREFIX]", "<PRE>", "▁<EOT>"} & set(STOPS)


# --- real tokenizers ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    from tests.support.tiny_models import build_tiny

    return AutoTokenizer.from_pretrained(str(build_tiny("qwen2", "qwen2.5")))


def test_control_tokens_in_the_users_code_stay_text(qwen):
    """Code that writes Qwen's FIM and end tokens as text (a tokenizer's tests, say) gets no control id for them:
    the only FIM ids are the layout's own, and the prompt decodes to the code as written."""
    prefix = 'FIM = "<|fim_suffix|>"\nEND = "<|endoftext|>'
    suffix = '"\nSEP = "<|file_sep|>"\n'
    ids = prompt_ids(qwen, Fill(prefix, suffix, files=(("t.py", "<|fim_middle|>"),), repo_level=True))
    fim = {qwen.convert_tokens_to_ids(t): t for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")}
    assert [fim[i] for i in ids if i in fim] == ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    assert qwen.convert_tokens_to_ids("<|endoftext|>") not in ids
    assert [i for i in ids if i == qwen.convert_tokens_to_ids("<|file_sep|>")] == [
        qwen.convert_tokens_to_ids("<|file_sep|>")
    ] * 2
    assert qwen.decode(ids) == (
        f"<|repo_name|>myproject\n<|file_sep|>t.py\n<|fim_middle|>\n<|file_sep|>filename\n"
        f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    )


def test_a_tokenizer_without_fim_tokens_is_a_clear_400():
    from transformers import AutoTokenizer

    from tests.support.tiny_models import build_tiny

    llama = AutoTokenizer.from_pretrained(str(build_tiny("llama", "llama-3.2")))
    with pytest.raises(APIError) as err:
        prompt_ids(llama, Fill("def f():\n", "\n"))
    assert err.value.status == 400 and err.value.code == "fim_not_supported"
    assert "no fill-in-the-middle tokens" in err.value.message


def test_fim_tokens_name_what_a_reply_stops_at():
    tokens = tokens_of(QWEN_FILES)
    assert isinstance(tokens, FimTokens) and "<|file_sep|>" in tokens.controls and "<|fim_pad|>" in tokens.controls
