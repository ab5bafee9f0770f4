"""Translation with the study's real tokenizer families on Polish text.

Target: Mistral v1 SentencePiece (Bielik-11B's base vocabulary). Drafters: Qwen2.5 and Llama-3.2
byte-level BPE. No models: an "oracle" drafter that knows the text (optionally with corrupted guesses)
drives the same propose → accept → commit bookkeeping the mlx loop uses, so we can check exactly that
the output is the target's, both sides stay on the same text, and nothing stalls.
"""

import random

import pytest

from tests.support import real_tokenizers
from uag.core.translate import (
    NaiveTranslator,
    PassThroughTranslator,
    TextTranslator,
    encode_after,
    longest_common_prefix,
    stable_text,
    text_after,
)
from uag.models.vocab import HFVocab, same_vocabulary

TEXTS = [
    "Zażółć gęślą jaźń – pchnąć w tę łódź jeża lub ośm skrzyń fig.",
    "Stolica Polski to Warszawa, a w winie jest prawda. W Wrocławiu i w Łodzi pada deszcz.",
    "Bitwa pod Grunwaldem odbyła się 15 lipca 1410 r.; 2024-05-03 to data, a 3,14 to liczba π.",
    "Kraków\nPowierzchnia: 326,8 km²\nLudność: 800 000\n\nWojewództwo: małopolskie",
    "Emoji 🙂 i 👍🏽 oraz znaki ∑ ≈ ∞ 𝔸 — w tekście; cytat „Enigma” (1932).",
    "Dwie  spacje,   trzy spacje, tab\tpo tabie i\nnowa linia,  a potem  koniec.",
    "  Zdanie zaczyna się od spacji: o, a, i, z, w – jednoliterowe słowa, ale też wino, zima, oko.",
]


@pytest.fixture(scope="module")
def vocabs():
    return {name: HFVocab(real_tokenizers.load(name)) for name in real_tokenizers.NAMES}


@pytest.mark.parametrize("name", real_tokenizers.NAMES)
@pytest.mark.parametrize("text", TEXTS)
def test_encode_after_extends_the_committed_sequence_exactly(vocabs, name, text):
    vocab = vocabs[name]
    rng = random.Random(hash((name, text)) & 0xFFFF)
    for cut in sorted(rng.sample(range(1, len(text)), 8)):
        committed = vocab.encode_prompt(text[:cut])
        for window in (0, 4, 10):
            prefix = vocab.decode(committed[-window:]) if window else ""
            enc = encode_after(vocab, prefix, text[cut:]) if window else None
            if enc is None:
                continue
            assert text_after(vocab, committed, enc.ids) == text[cut:], (cut, window, enc)


@pytest.mark.parametrize("name", real_tokenizers.NAMES)
@pytest.mark.parametrize("text", TEXTS)
def test_stable_text_grows_as_a_prefix_and_never_shows_a_broken_character(vocabs, name, text):
    vocab = vocabs[name]
    ids = vocab.encode(text)[0]
    seen = ""
    for n in range(1, len(ids) + 1):
        stable, covered = stable_text(vocab, [], ids[:n])
        assert "\ufffd" not in stable
        assert text.startswith(stable) or vocab.decode(ids).startswith(stable)
        assert stable.startswith(seen)
        assert stable == vocab.decode(ids[:covered])
        seen = stable
    assert seen == vocab.decode(ids)


def test_byte_fallback_characters_wait_until_all_their_bytes_are_committed(vocabs):
    vocab = vocabs["mistral-v1"]
    ids = vocab.encode("𝔸")[0]  # not in the 32K vocabulary (🙂 and 👍 are): "▁" + four UTF-8 bytes
    assert [vocab.token_content(i) for i in ids] == ["▁", "<0xF0>", "<0x9D>", "<0x94>", "<0xB8>"]
    context = vocab.encode("Ala")[0]
    for n in range(2, 5):
        assert stable_text(vocab, context, ids[:n]) == (" ", 1)
    assert stable_text(vocab, context, ids) == (" 𝔸", 5)


def test_a_real_absorption_is_recovered(vocabs):
    """The study's case: after a committed "w", re-encoding "w" + "inie" merges into "▁win"."""
    vocab = vocabs["mistral-v1"]
    committed = vocab.encode_prompt("Ala ma w")
    assert [vocab.token_content(i) for i in committed[-2:]] == ["▁ma", "▁w"]
    joint = [vocab.token_content(i) for i in vocab.encode("Ala ma winie jest")[0]]
    assert "▁win" in joint and "▁w" not in joint  # the committed "▁w" would be swallowed
    enc = encode_after(vocab, vocab.decode(committed[-4:]), "inie jest")
    assert enc.absorbed and not enc.fallback
    assert text_after(vocab, committed, enc.ids) == "inie jest"
    assert [vocab.token_content(i) for i in enc.ids][-1] == "▁jest"
    # only the crossing token's remainder ("▁win" minus the committed "w") was encoded on its own
    assert text_after(vocab, committed, enc.ids[: enc.anchored]) == "in"


def test_real_vocabularies_are_told_apart(vocabs):
    assert same_vocabulary(vocabs["qwen2.5"], HFVocab(real_tokenizers.load("qwen2.5")))
    assert not same_vocabulary(vocabs["qwen2.5"], vocabs["llama-3.2"])


def simulate(translator, target, drafter, text, *, k, corrupt=0.0, seed=0, prompt_tokens=6):
    """Run propose → accept → commit cycles against a target that 'generates' `text`.

    The oracle drafter proposes its own tokens for the text that really follows (as far as it can
    see), each replaced by a random id with probability `corrupt`. Returns (accepted, proposed).
    """
    rng = random.Random(seed)
    full = target.encode_prompt(text)
    prompt, generated = full[:prompt_tokens], full[prompt_tokens:]
    translator.start(prompt)
    translator.commit([], generated[:1])
    out = generated[:1]
    accepted = proposed = 0
    while len(out) < len(generated):
        known = text_after(target, prompt, out)  # text committed so far, as the target sees it
        if translator.window:  # naive re-encodes without context, so its drafter's text does drift
            drafter_text = drafter.decode(translator.drafter_ids)
            target_text = target.decode(translator.target_ids[: translator.target_stable])
            assert drafter_text.strip() == target_text.strip(), "drafter and target drifted apart"
        upcoming = text[text.index(known) + len(known) :] if known in text else ""
        window = translator.window or 10
        guess = encode_after(drafter, drafter.decode(translator.drafter_ids[-window:]), upcoming).ids[:k]
        drafts = [rng.randrange(drafter.size) if rng.random() < corrupt else d for d in guess]
        drafts = translator.usable(drafts)
        proposal = translator.propose(drafts).ids[: len(generated) - len(out) - 1]
        truth = generated[len(out) : len(out) + len(proposal) + 1]  # the target's choice per position
        n = longest_common_prefix(proposal, truth)
        new = [*proposal[:n], truth[n]]
        translator.commit(drafts, new)
        out += new
        accepted, proposed = accepted + n, proposed + len(proposal)
        assert new, "a cycle emitted nothing"
    assert out == generated  # lossless: every token is the target's own
    assert target.decode(translator.target_ids) == target.decode(full)
    return accepted, proposed


@pytest.mark.parametrize("drafter_name", ["qwen2.5", "llama-3.2"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_oracle_drafter_context_translation_is_lossless_and_accepted(vocabs, drafter_name, k):
    target, drafter = vocabs["mistral-v1"], vocabs[drafter_name]
    accepted = proposed = 0
    for i, text in enumerate(TEXTS):
        a, p = simulate(TextTranslator(target, drafter, window=10), target, drafter, text, k=k, seed=i)
        accepted, proposed = accepted + a, proposed + p
    # A drafter that knows the text is accepted nearly always once translation respects boundaries.
    assert accepted / proposed > 0.9, (accepted, proposed)


@pytest.mark.parametrize("drafter_name", ["qwen2.5", "llama-3.2"])
def test_context_beats_naive_and_none_with_the_same_oracle(vocabs, drafter_name):
    target, drafter = vocabs["mistral-v1"], vocabs[drafter_name]
    rates = {}
    for cls in (TextTranslator, NaiveTranslator, PassThroughTranslator):
        a = p = 0
        for i, text in enumerate(TEXTS):
            da, dp = simulate(cls(target, drafter, window=10), target, drafter, text, k=2, seed=i)
            a, p = a + da, p + dp
        rates[cls.name] = a / max(p, 1)
    assert rates["context"] > rates["naive"] + 0.2, rates
    assert rates["context"] > rates["none"] + 0.5, rates


@pytest.mark.parametrize("corrupt", [0.3, 0.7])
def test_corrupted_drafts_never_change_the_output(vocabs, corrupt):
    target, drafter = vocabs["mistral-v1"], vocabs["qwen2.5"]
    for i, text in enumerate(TEXTS):
        simulate(TextTranslator(target, drafter, window=10), target, drafter, text, k=4, corrupt=corrupt, seed=i)


def test_drafter_prompt_maps_chat_control_tokens_it_shares(vocabs):
    """ChatML control tokens the drafter also has pass as tokens; the target's BOS does not."""
    qwen, llama = vocabs["qwen2.5"], vocabs["llama-3.2"]
    prompt = llama.encode_prompt("<|start_header_id|>user<|end_header_id|>\n\nCześć!")
    drafter_prompt = TextTranslator(llama, qwen, window=10).start(prompt)
    assert "<|begin_of_text|>" not in qwen.decode(drafter_prompt)
    assert qwen.decode(drafter_prompt) == "user\n\nCześć!"
    to_qwen = TextTranslator(qwen, qwen, window=10)
    chatml = qwen.encode_prompt("<|im_start|>user\nCześć!<|im_end|>")
    assert to_qwen.start(chatml) == chatml
