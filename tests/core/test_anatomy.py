"""Loss anatomy: every rejected or withheld draft gets a cause, and a drafter that knows the text loses
nothing to translation on the real tokenizer pairs.

The oracle drafter drafts exactly the text the target will write: each cycle it encodes the rest of the
text after its own sequence (as its tokenizer would, in context) and drafts the first k tokens. The target
'writes' the text's own tokenization. Whatever such a drafter loses is lost to translation or to the end
of the draft (`short`), never to the models.
"""

from __future__ import annotations

import pytest

from tests.support import real_tokenizers
from tests.support.fake_vocab import drafter_vocab, target_vocab
from uag.core import anatomy
from uag.core.anatomy import Loss, classify, token_texts
from uag.core.translate import NaiveTranslator, TextTranslator, encode_after
from uag.models.vocab import HFVocab

POLISH = [
    "Stolica Polski to Warszawa, a w winie jest prawda. W Wrocławiu i w Łodzi pada deszcz.",
    "Bitwa pod Grunwaldem odbyła się 15 lipca 1410 r.; 2024-05-03 to data, a 3,14 to liczba π.",
    "Kraków\nPowierzchnia: 326,8 km²\nLudność: 800 000\n\nWojewództwo: małopolskie",
    "Maria Skłodowska-Curie (ur. 7 listopada 1867 w Warszawie, zm. 4 lipca 1934) – fizyczka i chemiczka, "
    "dwukrotna laureatka Nagrody Nobla. Badała promieniotwórczość; odkryła polon i rad.",
    "Przepis na pierogi: 1) zagnieć ciasto z mąki, wody i jajka; 2) przygotuj farsz z ziemniaków i sera; "
    "3) lep pierogi i gotuj je ok. 3 minut. Smacznego!",
    "Emoji 🙂 i 👍🏽 oraz znaki ∑ ≈ ∞ 𝔸 — w tekście; cytat „Enigma” (1932).",
]
ENGLISH = [
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.",
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong's first words were: \"That's one small step for man.\"",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide and water, "
    "and release oxygen. Chlorophyll absorbs mostly blue and red light.",
]
PAIRS = [("mistral-v1", "qwen2.5"), ("mistral-v1", "llama-3.2"), ("demo-target", "demo-drafter")]


# --- classify: one cycle's verdict from texts --------------------------------------------------------


def test_the_docstring_cases():
    assert classify(" Kraków ma", [" Kra", "ków", " ma"], 0, [" Kraków", " jest"]) == Loss(split=3)
    assert classify(" Kra", [" Kra"], 0, [" Kraków"]) == Loss(short=1)
    assert classify(" Kraków", [" Kraków"], 1, [" Kraków", " ma"], dropped=[" ma"]) == Loss(held=1)


def test_texts_that_part_are_the_models_disagreeing():
    assert classify(" Ala ma psa", [" Ala", " ma", " psa"], 2, [" Ala", " ma", " kota"]) == Loss(disagree=1)
    # the text parts inside the target's token: still disagreement, even where the draft then runs out
    assert classify(" Kro", [" Kro"], 0, [" Kraków"]) == Loss(disagree=1)
    # the target wrote a lone space and then other text: " tym" proposed, " 1944" written
    assert classify(" tym", [" tym"], 0, [" ", "1", "9"]) == Loss(disagree=1)
    assert classify("stwa", ["stwa"], 0, ["st", "wem"]) == Loss(disagree=1)
    # the target ended the text (its EOS has no text)
    assert classify(" i tak", [" i", " tak"], 1, [" i", ""]) == Loss(disagree=1)


def test_every_position_after_the_first_rejection_shares_its_cause():
    assert classify(" a b c d", [" a", " b", " c", " d"], 1, [" a", " x"]) == Loss(disagree=3)
    assert classify(" wino jest", [" w", "ino", " jest"], 0, [" wino", " jest"]) == Loss(split=3)


def test_a_split_inside_an_absorbed_head_is_absorption():
    assert classify("ino jest", ["i", "no", " jest"], 0, ["ino", " jest"], anchored=2) == Loss(absorbed=3)
    assert classify("ino jest", ["ino", " je", "st"], 1, ["ino", " jest", "."], anchored=1) == Loss(split=2)


def test_a_draft_ending_inside_a_word_is_short_not_translation_loss():
    # " ma" is a whole target token, but the target goes on with "łopolskie" and splits " m" + "ał"
    assert classify(" ma", [" ma"], 0, [" m", "ał"]) == Loss(short=1)
    assert classify(" Wrocławi", [" W", "roc", "ł", "awi"], 0, [" Wrocław", "iu"]) == Loss(short=4)
    # ...but when the target's text shows the word ended there, the split was knowable
    assert classify(" ma", [" m", "a"], 0, [" ma", " kota"]) == Loss(split=2)
    # and a word finished inside the draft was knowable too
    assert classify(" Kraków ma", [" Kra", "ków", " ma"], 0, [" Kraków", " ma"]) == Loss(split=3)


def test_withheld_tokens_count_only_when_the_target_wrote_them():
    assert classify(" a", [" a"], 1, [" a", " b"], dropped=[" b", " c"]) == Loss(held=1)
    assert classify(" a", [" a"], 1, [" a", " b", " c"], dropped=[" b", " c"]) == Loss(held=2)
    assert classify(" a", [" a"], 1, [" a", " x"], dropped=[" b"]) == Loss()
    assert classify(" a", [" a"], 1, [" a", ""], dropped=[""]) == Loss()  # a control token has no text
    assert classify(" a b", [" a", " b"], 1, [" a", " x"], dropped=[" c"]) == Loss(disagree=1)


def test_losses_add_up():
    total = Loss(disagree=1, short=2) + Loss(split=3, held=1, absorbed=2)
    assert total == Loss(disagree=1, split=3, held=1, absorbed=2, short=2)
    assert total.translation == 6
    assert total.as_dict()["short"] == 2


def test_token_texts_keep_leading_spaces_and_whole_characters():
    t = target_vocab()
    assert token_texts(t, t.tokens("▁Ala"), t.tokens("▁ma", "▁kota")) == [" ma", " kota"]
    emoji = t.encode("🙂")[0]  # "▁" and four byte tokens
    assert token_texts(t, t.tokens("▁Ala"), emoji) == [" ", "", "", "", "🙂"]


def test_of_cycle_reads_the_translator_before_it_commits():
    t, d = target_vocab(), drafter_vocab()
    translator = TextTranslator(t, d, window=10)
    translator.start(t.encode_prompt("Ala ma"))
    proposal = translator.propose(d.encode(" kota")[0])
    assert proposal.text == " kota" and proposal.ids == t.tokens("▁kota")
    assert anatomy.of_cycle(translator, proposal, proposal.ids, 1, t.tokens("▁kota", "▁w")) == Loss()
    assert anatomy.of_cycle(translator, proposal, proposal.ids, 0, t.tokens("▁w")) == Loss(disagree=1)


# --- the oracle drafter on real tokenizer pairs ---------------------------------------------------------


@pytest.fixture(scope="module")
def vocabs():
    return {name: HFVocab(real_tokenizers.load(name)) for name in real_tokenizers.NAMES}


def demo_vocab(name: str) -> HFVocab:
    from transformers import AutoTokenizer

    from uag.errors import ModelError
    from uag.models import demo

    try:
        folder = demo.ensure(name)
    except ModelError as err:
        pytest.skip(f"the demo pair cannot be converted here: {err}")
    return HFVocab(AutoTokenizer.from_pretrained(folder))


def pair(vocabs, names):
    return tuple(vocabs[n] if n in vocabs else demo_vocab(n) for n in names)


def oracle(translator, target, drafter, text: str, k: int, prompt_tokens: int = 6) -> tuple[Loss, int, int]:
    """Cycles of a drafter that drafts the text's own continuation; (loss, proposed, accepted)."""
    full = target.encode_prompt(text)
    prompt, truth = full[:prompt_tokens], full[prompt_tokens:]
    whole = target.decode(full)
    translator.start(prompt)
    translator.commit([], truth[:1])  # the prompt pass writes the first token
    out = truth[:1]
    loss, proposed, accepted = Loss(), 0, 0
    while len(out) < len(truth):
        given = target.decode(translator.target_ids[: translator.target_stable])  # what the drafter was given
        assert whole.startswith(given)
        window = drafter.decode(translator.drafter_ids[-10:])
        drafts = translator.usable(encode_after(drafter, window, whole[len(given) :]).ids[:k])
        proposal = translator.propose(drafts)
        ids = proposal.ids[: len(truth) - len(out) - 1]
        n = 0
        while n < len(ids) and ids[n] == truth[len(out) + n]:
            n += 1
        new = [*ids[:n], truth[len(out) + n]]
        loss += anatomy.of_cycle(translator, proposal, ids, n, truth[len(out) :])
        translator.commit(drafts, new)
        out += new
        proposed, accepted = proposed + len(ids), accepted + n
    assert out == truth  # lossless
    return loss, proposed, accepted


def run_oracle(cls, target, drafter, k: int) -> tuple[Loss, int, int]:
    loss, proposed, accepted = Loss(), 0, 0
    for text in POLISH + ENGLISH:
        lo, p, a = oracle(cls(target, drafter, window=10), target, drafter, text, k)
        loss, proposed, accepted = loss + lo, proposed + p, accepted + a
    return loss, proposed, accepted


@pytest.mark.parametrize("names", [pytest.param(p, marks=pytest.mark.slow) if "demo" in p[0] else p for p in PAIRS])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_oracle_drafter_loses_almost_nothing_to_translation(vocabs, names, k):
    target, drafter = pair(vocabs, names)
    loss, proposed, accepted = run_oracle(TextTranslator, target, drafter, k)
    assert loss.disagree == 0, loss  # it drafts the target's own text
    assert loss.translation <= 0.01 * proposed, (loss, proposed)
    # every lost position has a cause
    assert proposed - accepted == loss.disagree + loss.split + loss.absorbed + loss.short, (loss, proposed, accepted)


@pytest.mark.parametrize("names", PAIRS[:2])
def test_the_anatomy_sees_what_naive_translation_loses(vocabs, names):
    target, drafter = pair(vocabs, names)
    loss, proposed, _ = run_oracle(NaiveTranslator, target, drafter, 2)
    assert loss.split > 0.05 * proposed, (loss, proposed)  # word boundaries lost without context
    assert loss.split > 10 * loss.disagree, loss  # (a few drafts start a word the naive re-sync glued on)


def test_of_ids_reads_a_proposal_that_is_target_tokens_already():
    """Prompt lookup and TLI propose target tokens: their own text is the draft."""
    t = target_vocab()
    context = t.encode_prompt("Ala ma")
    # "▁w" "ino" spell " wino", which the target writes as one token: a split, not a disagreement
    assert anatomy.of_ids(t, context, t.tokens("▁w", "ino"), 0, t.tokens("▁wino", "▁jest")) == Loss(split=2)
    assert anatomy.of_ids(t, context, t.tokens("▁kota", "▁w"), 1, t.tokens("▁kota", "▁jest")) == Loss(disagree=1)
