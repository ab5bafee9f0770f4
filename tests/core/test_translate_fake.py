"""Translation logic on a hand-made tokenizer, where every merge is known (no models, no real vocab)."""

import pytest

from tests.support.fake_vocab import FakeVocab, drafter_vocab, target_vocab
from uag.core.translate import (
    NaiveTranslator,
    PassThroughTranslator,
    TextTranslator,
    Translator,
    encode_after,
    encode_anchored,
    longest_common_prefix,
    make_translator,
    stable_text,
    text_after,
)

T = target_vocab()
D = drafter_vocab()


def test_text_after_keeps_the_leading_space_that_a_lone_decode_drops():
    assert T.decode(T.tokens("▁ma")) == "ma"  # the dummy prefix is stripped at the start
    assert text_after(T, T.tokens("▁Ala"), T.tokens("▁ma")) == " ma"
    assert text_after(T, [], T.tokens("▁ma")) == "ma"


def test_stable_text_holds_back_an_incomplete_character():
    emoji = T.encode("🙂")[0]  # not a piece: four byte-fallback tokens
    assert len(emoji) == 5 and T.pieces[emoji[0]] == "▁"
    context = T.tokens("▁Ala")
    assert stable_text(T, context, emoji[:3]) == (" ", 1)
    assert stable_text(T, context, emoji) == (" 🙂", 5)
    # a genuine U+FFFD looks incomplete at the very end, so it waits until more text follows it
    lone = T.encode("\ufffd")[0]
    assert stable_text(T, context, lone + T.tokens("▁ma")) == (" \ufffd ma", len(lone) + 1)


def test_encode_after_starts_exactly_at_the_boundary():
    enc = encode_after(T, "Ala", " ma kota")
    assert enc.ids == T.tokens("▁ma", "▁kota") and not enc.absorbed


def test_encode_after_recovers_from_absorption():
    # "w" + "ino" re-encodes as the single piece "▁wino", which would swallow the committed "▁w".
    ids, offsets = T.encode("Ala w" + "ino")
    assert T.pieces[ids[-1]] == "▁wino"
    enc = encode_after(T, "Ala w", "ino jest")
    assert enc.absorbed and not enc.fallback
    assert enc.ids == T.tokens("ino", "▁jest")
    committed = T.encode("Ala w")[0]
    assert T.decode(committed + enc.ids) == "Ala wino jest"


def test_encode_anchored_has_no_dummy_prefix_and_no_backward_merge():
    assert T.encode("ino")[0] == T.tokens("▁i", "n", "o")  # what a naive re-encode gives
    assert encode_anchored(T, "ino") == T.tokens("ino")
    assert encode_anchored(T, " ma") == T.tokens("▁ma")
    assert encode_anchored(T, "") == []


def test_identity_translator_passes_ids_and_keeps_agreed_drafts():
    tr = Translator(T, T)
    tr.start([1, 5, 6])
    assert tr.propose([7, 8]).ids == [7, 8]
    resync = tr.commit([7, 8], [7, 9])
    assert resync.cut == 3 + 1
    assert tr.target_ids == tr.drafter_ids == [1, 5, 6, 7, 9]


def test_drafter_prompt_is_the_same_text_without_the_targets_bos():
    tr = TextTranslator(T, D, window=4)
    prompt = T.encode_prompt("Ala ma kota")
    drafter_prompt = tr.start(prompt)
    assert D.decode(drafter_prompt) == "Ala ma kota"
    assert drafter_prompt == D.encode("Ala ma kota")[0]  # the fake drafter adds no BOS


def test_begin_starts_once_on_a_prompt_and_again_on_another_or_after_a_commit(monkeypatch):
    """A server's request thread starts the translator to check the drafter's room; the run's `begin` on the same
    prompt does not translate it again, but a translator that has moved on, or another prompt, starts afresh."""
    tr = TextTranslator(T, D, window=4)
    prompt = T.encode_prompt("Ala ma kota")
    first = tr.start(prompt)
    starts = []
    start = TextTranslator.start
    monkeypatch.setattr(TextTranslator, "start", lambda self, ids: starts.append(list(ids)) or start(self, ids))
    assert tr.begin(list(prompt)) == first and starts == []
    tr.commit([], T.tokens("▁i"))
    assert tr.begin(prompt) == first and starts == [prompt]  # moved on: started again, where the run begins
    other = T.encode_prompt("Ala ma psa")
    assert D.decode(tr.begin(other)) == "Ala ma psa" and starts == [prompt, other]


def cycle(tr, drafts, target_says):
    """Propose drafts, let the 'target' accept per `target_says`, commit; return (proposal, resync)."""
    proposal = tr.propose(drafts)
    n = longest_common_prefix(proposal.ids, target_says)
    new = [*proposal.ids[:n], target_says[n]]
    return proposal, n, tr.commit(drafts, new)


def test_context_translation_round_trip_keeps_both_sides_on_the_same_text():
    tr = TextTranslator(T, D, window=4)
    tr.start(T.encode_prompt("Ala ma"))
    drafts = D.tokens("▁kot", "a", "▁w")  # drafter says " kota w"
    proposal = tr.propose(drafts)
    assert proposal.ids == T.tokens("▁kota", "▁w")
    # the target agrees with both and adds " jest" itself
    n = longest_common_prefix(proposal.ids, T.tokens("▁kota", "▁w", "▁jest"))
    resync = tr.commit(drafts, [*proposal.ids[:n], T.tokens("▁jest")[0]])
    assert n == 2
    assert T.decode(tr.target_ids) == "Ala ma kota w jest"
    assert D.decode(tr.drafter_ids) == "Ala ma kota w jest"
    # all three drafts were right, so the drafter keeps them and only " jest" is new to it
    assert resync.cut == len(D.encode("Ala ma")[0]) + 3
    assert tr.drafter_ids[resync.cut :] == D.tokens("▁jest")


def test_context_translation_absorption_never_stalls_and_extends_the_committed_sequence():
    tr = TextTranslator(T, D, window=4)
    tr.start(T.encode_prompt("Ala w"))
    committed = list(tr.target_ids)
    drafts = D.tokens("in", "o")  # drafter continues "w" -> "wino"
    proposal = tr.propose(drafts)
    assert proposal.absorbed
    assert proposal.ids == T.tokens("ino")
    assert T.decode(committed + proposal.ids) == "Ala wino"


def test_naive_translation_loses_the_word_boundary_context_keeps_it():
    start = T.encode_prompt("Ala ma")
    drafts = D.tokens("▁kot", "a")
    naive, context = NaiveTranslator(T, D), TextTranslator(T, D, window=4)
    naive.start(start), context.start(start)
    # " kota" re-encoded alone gets a dummy prefix on top of its own space: an extra "▁" token
    assert naive.propose(drafts).ids == T.tokens("▁", "▁kota")
    assert context.propose(drafts).ids == T.tokens("▁kota")
    after_w = T.encode_prompt("Ala w")
    naive.start(after_w), context.start(after_w)
    # and inside a word the dummy prefix is wrong: "ino" becomes "▁i n o", breaking "wino"
    assert naive.propose(D.tokens("in", "o")).ids == T.tokens("▁i", "n", "o")
    assert context.propose(D.tokens("in", "o")).ids == T.tokens("ino")


def test_commit_steps_back_when_the_drafter_would_merge_across_the_boundary():
    # The drafter knows "▁War", "sza", "wa"; the target commits "▁Warszawa" in one token while the
    # drafter had drafted only "▁War". Re-sync must give the drafter the rest, split canonically.
    tr = TextTranslator(T, D, window=4)
    tr.start(T.encode_prompt("Ala"))
    drafts = D.tokens("▁War")
    proposal = tr.propose(drafts)
    assert not proposal.ids or T.decode(tr.target_ids + proposal.ids).startswith("Ala")
    resync = tr.commit(drafts, T.tokens("▁Warszawa"))
    assert D.decode(tr.drafter_ids) == "Ala Warszawa"
    assert tr.drafter_ids[-3:] == D.tokens("▁War", "sza", "wa")
    assert resync.cut == len(D.encode("Ala")[0]) + 1  # "▁War" kept, the rest is new


def test_partial_character_from_the_target_waits_for_its_completion():
    tr = TextTranslator(T, D, window=4)
    tr.start(T.encode_prompt("Ala"))
    emoji = T.encode("🙂")[0]  # "▁" (the space after "Ala") then four byte tokens
    tr.commit([], emoji[:3])
    assert tr.target_stable == len(T.encode_prompt("Ala")) + 1  # only the "▁" is text yet
    assert D.decode(tr.drafter_ids) == "Ala "
    tr.commit([], emoji[3:])
    assert D.decode(tr.drafter_ids) == "Ala 🙂"


def test_pass_through_rejects_ids_the_target_lacks():
    tr = PassThroughTranslator(T, D, window=4)
    tr.start(T.encode_prompt("Ala"))
    assert tr.propose([T.size - 1, T.size + 5, 7]).ids == [T.size - 1]
    assert tr.propose([T.size + 5]).empty


def test_drafts_stop_at_the_drafters_control_tokens():
    tr = TextTranslator(T, D, window=4)
    assert tr.usable(D.tokens("▁ma") + [2] + D.tokens("▁kot")) == D.tokens("▁ma")
    assert Translator(T, T).usable([5, 2, 6]) == [5, 2, 6]  # shared vocabulary: EOS is a real guess


def test_make_translator_validates_and_prefers_identity():
    assert type(make_translator("context", T, D, window=3, shared=True)) is Translator
    assert type(make_translator("naive", T, D, window=3, shared=False)) is NaiveTranslator
    with pytest.raises(ValueError, match="unknown strategy"):
        make_translator("magic", T, D, window=3, shared=False)
    with pytest.raises(ValueError, match="window"):
        TextTranslator(T, D, window=-1)


@pytest.mark.parametrize("text", ["Ala ma kota", "wino jest dobre", "Ala w\nwino", "Warszawa 🙂 dziś"])
@pytest.mark.parametrize("cut", [1, 3, 5, 8])
def test_encode_after_always_extends_the_prefix_exactly(text, cut):
    vocab = FakeVocab(["▁Ala", "▁ma", "▁w", "▁wino", "ino", "▁kota", "a", "▁", "\n", "▁dzi", "ś", "▁Warszawa"])
    prefix, rest = text[:cut], text[cut:]
    enc = encode_after(vocab, prefix, rest)
    committed = vocab.encode(prefix)[0]
    assert vocab.decode(committed + enc.ids) == text


def test_a_proposal_says_what_it_was_made_of():
    tr = TextTranslator(T, D, window=4)
    tr.start(T.encode_prompt("Ala ma"))
    proposal = tr.propose(D.tokens("▁kot", "a", "▁w"))
    assert (proposal.text, proposal.anchored, proposal.dropped, proposal.held_drafts) == (" kota w", 0, [], 0)
    # absorption: the remainder "ino" of the merged "▁wino" is encoded on its own
    tr.start(T.encode_prompt("Ala w"))
    proposal = tr.propose(D.tokens("in", "o", "▁jest"))
    assert proposal.ids == T.tokens("ino", "▁jest") and proposal.anchored == 1
    assert encode_after(T, "Ala w", "ino jest").anchored == 1


def test_a_proposal_counts_the_drafts_it_holds_back_and_the_ids_it_drops():
    tr = TextTranslator(T, D, window=4)
    tr.start(T.encode_prompt("Ala"))
    emoji = D.encode("🙂")[0]  # four byte tokens in the drafter
    proposal = tr.propose(D.tokens("▁ma") + emoji[:2])
    assert proposal.ids == T.tokens("▁ma") and proposal.held_drafts == 2
    # a target control token spelled out in the drafts' text ends the proposal; what follows is dropped
    spelled = [D.ids[f"<0x{b:02X}>"] for b in b"</s>"]  # plain bytes to the drafter
    proposal = tr.propose(D.tokens("▁ma") + spelled + D.tokens("▁ma"))
    assert proposal.ids == T.tokens("▁ma")
    assert proposal.dropped == [T.special_id("</s>"), *T.tokens("▁ma")]
