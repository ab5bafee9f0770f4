"""The index shared across requests (issue #39, item 2): earlier prompts and replies as a lookup draft source,
bounded, replaced by the conversation turn that re-sends them, per owner; lossless through the engine."""

from __future__ import annotations

import random

import pytest

from tests.support.tiny_models import build_tiny
from uag.core.anatomy import Loss
from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice, LookupDrafter
from uag.core.engine import generate, prompt_ids
from uag.core.lookup import MATCH_CAP, NgramIndex, SharedIndex, SharedIndexes, proposal, recall

# --- the index (pure) ------------------------------------------------------------------------------------------


def reference_find(documents: list[list[int]], ngrams, context: list[int], k: int) -> tuple[int, list[int]]:
    """What `SharedIndex.find` must answer, by brute force: the longest n-gram ending `context` with a token after
    it in some document, its latest such occurrence (the newest document, the furthest offset), how far it runs
    back."""
    for n in sorted(ngrams, reverse=True):
        if len(context) < n:
            continue
        gram = context[-n:]
        hits = [(d, end) for d, doc in enumerate(documents) for end in range(n, len(doc)) if doc[end - n : end] == gram]
        if hits:
            d, end = max(hits)
            doc, length = documents[d], n
            while length < MATCH_CAP and end - length > 0 and len(context) - length > 0:
                if doc[end - length - 1] != context[-length - 1]:
                    break
                length += 1
            return length, doc[end : end + k]
    return 0, []


def test_find_gives_the_longest_ngram_its_latest_occurrence_and_how_far_the_match_runs_back():
    index = SharedIndex(100, ngrams=(3, 2))
    index.add([5, 1, 2, 3, 4, 6])
    index.add([7, 2, 3, 8, 9])
    assert index.find([0, 2, 3], 3) == (2, [8, 9])  # "2 3": the newer document's
    assert index.find([5, 1, 2, 3], 3) == (4, [4, 6])  # "1 2 3" beats the newer "2 3", and runs back to the 5
    assert index.find([0, 2, 3], 1) == (2, [8]) and index.find([4, 4], 3) == (0, []) and index.find([], 3) == (0, [])
    assert index.find([8, 9], 2) == (0, [])  # "8 9" ends its document: nothing followed it


def test_a_document_that_a_new_one_starts_with_is_replaced_others_stay():
    index = SharedIndex(1000)
    turn = list(range(100, 140))
    index.add(turn)
    index.add([*turn, 7, 8, 9])  # the next turn re-sends the first
    index.add([1, 2, 3, 4])
    index.add(turn[:20])  # a shorter retry is a document of its own
    assert list(index.documents.values()) == [[*turn, 7, 8, 9], [1, 2, 3, 4], turn[:20]]
    assert len(index) == 43 + 4 + 20
    assert index.find(turn[:30], 2) == (30, turn[30:32])  # the whole query matched (at most MATCH_CAP back)


def test_a_conversation_s_next_turn_extends_its_document_and_indexes_only_its_new_tokens(monkeypatch):
    """A server adds every request's prompt and reply when it ends: a conversation's next turn re-sends its history,
    whose n-grams the index holds already where no other request's came in between (only the new ones are hashed);
    after another request's, the whole turn is indexed again, so its n-grams' latest occurrences are its own."""
    rng = random.Random(5)
    index, noted = SharedIndex(10_000, ngrams=(4, 3, 2)), []
    note = SharedIndex._note
    monkeypatch.setattr(
        SharedIndex, "_note", lambda self, serial, ids, start=0: noted.append(start) or note(self, serial, ids, start)
    )
    turn1 = [rng.randrange(8) for _ in range(200)]
    turn2 = turn1 + [rng.randrange(8) for _ in range(60)]
    other = turn1[:50] + [rng.randrange(8) for _ in range(40)]  # another request's: much of it alike
    turn3 = turn2 + [rng.randrange(8) for _ in range(30)]
    expected, kept = [0, 200, 0, 0], []
    for ids in (turn1, turn2, other, turn3):
        index.add(ids)
        kept = [d for d in kept if not (len(d) <= len(ids) and ids[: len(d)] == d)] + [ids]
        assert list(index.documents.values()) == kept and len(index) == sum(map(len, kept))
        for _ in range(40):
            end = rng.randrange(1, len(ids))
            context = ids[max(0, end - rng.randrange(1, 12)) : end]
            assert index.find(context, 5) == reference_find(kept, (4, 3, 2), context, 5), context
    assert noted == expected  # turn 2 from its new tokens on; turn 3, after `other`, whole


def test_bounded_evicts_the_oldest_never_exceeds_max_tokens_and_rebuilds_keep_the_answers_right():
    rng = random.Random(3)
    index, kept = SharedIndex(300, ngrams=(4, 3, 2)), []
    for _ in range(120):
        doc = [rng.randrange(6) for _ in range(rng.randrange(3, 60))]
        index.add(doc)
        kept = [d for d in kept if not (len(d) <= len(doc) and doc[: len(d)] == d)] + [doc]
        while sum(map(len, kept)) > 300:
            kept.pop(0)
        assert len(index) <= 300 and list(index.documents.values()) == kept
        for _ in range(5):
            context = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
            assert index.find(context, 5) == reference_find(kept, (4, 3, 2), context, 5), context
    assert index.rebuilds > 2  # the table was rebuilt (amortised) and answered right after every rebuild


def test_a_document_longer_than_the_index_keeps_its_end():
    index = SharedIndex(10)
    index.add(list(range(25)))
    assert list(index.documents.values()) == [list(range(15, 25))] and index.find([20, 21], 3) == (2, [22, 23, 24])
    with pytest.raises(ValueError):
        SharedIndex(0)


def test_indexes_are_per_owner_and_the_least_recently_used_owner_goes_first():
    indexes = SharedIndexes(100)
    indexes.add("a", list(range(1, 41)))
    indexes.add("b", list(range(50, 90)))
    assert indexes.get("c") is None and indexes.get("b").find([1, 2], 2) == (0, [])
    assert indexes.get("a").find([1, 2, 3], 2) == (3, [4, 5])
    indexes.add("c", list(range(200, 240)))  # 120 tokens over three owners: b was used longest ago
    assert indexes.get("b") is None and indexes.get("a") is not None and len(indexes) == 80
    indexes.add("c", list(range(300, 400)))  # one owner alone is bounded by its own index
    assert indexes.get("a") is None and len(indexes) <= 100


def test_recall_takes_the_shared_match_only_where_it_runs_back_further():
    shared = SharedIndex(100)
    shared.add([9, 1, 2, 3, 4])
    own = NgramIndex()
    own.extend([7, 2, 3, 9, 1, 2, 3])  # its own match: "2 3", 2 tokens
    assert recall(shared, own, 2) == (4, [4]) and recall(None, own, 2) == (0, [])
    own.extend([4, 1, 2, 3])  # now its own "1 2 3 4 … 1 2 3" copy runs back as far as the shared one
    assert recall(shared, own, 2) == (0, [])


def test_a_lookup_drafter_drafts_from_the_shared_index_and_says_so():
    shared = SharedIndex(100)
    shared.add([11, 12, 13, 14, 15, 16, 17])
    drafter = LookupDrafter(vocab=None, shared=shared)
    drafter.start([1, 2, 12, 13, 14])
    offer = drafter.offer(8)
    assert dict(offer) == {"lookup": 3} and offer.match == 3  # as much as the document holds after the match
    draft = drafter.propose("lookup", 8, 2)
    assert draft.proposed == [15, 16] and draft.match == 3 and draft.shared_index
    record = draft.cycle(8, 2, 3, verify_ms=1.0, resync_ms=0.0, resync_absorbed=False, loss=Loss())
    assert record.shared_index and record.match == 3
    drafter.commit(draft, [15, 16, 5])
    assert drafter.offer(8) == {}
    assert not LookupDrafter(vocab=None).offer(8)


# --- through the engine, on a tiny real mlx-lm model ------------------------------------------------------------

PROMPT = "Ala ma kota, a kot ma Alę."


@pytest.fixture(scope="module")
def target(store):
    return store.get(str(build_tiny("mistral", "mistral-v1", seed=5, tie_embeddings=False)))  # varied, random text


@pytest.mark.parametrize("strategy", ["context", "auto"])
def test_a_later_run_drafts_an_earlier_reply_from_the_shared_index_and_stays_lossless(target, strategy):
    ids = prompt_ids(target, PROMPT)
    expected = generate(target, None, ids, GenerationConfig(translation="baseline", max_tokens=24)).token_ids
    shared = SharedIndex(1000)
    shared.add([*ids, *expected])  # the earlier request: its prompt and reply
    config = GenerationConfig.parse(strategy=strategy, k=8, max_tokens=24)
    run = generate(target, DrafterChoice(lookup=True, shared_index=shared), ids, config)
    assert run.token_ids == expected
    if strategy == "context":
        assert all(c.shared_index for c in run.cycles if c.source == "lookup") and run.accepted >= 16
    alone = generate(target, DrafterChoice(lookup=True), ids, config)
    assert alone.token_ids == expected and not any(c.shared_index for c in alone.cycles)


def test_a_wrong_continuation_in_the_shared_index_is_rejected_and_the_output_is_the_targets(target):
    ids = prompt_ids(target, PROMPT)
    expected = generate(target, None, ids, GenerationConfig(translation="baseline", max_tokens=16)).token_ids
    shared = SharedIndex(1000)
    shared.add([*ids, *[(t + 1) % 1000 + 3 for t in expected]])  # the same prompt, followed by other tokens
    run = generate(target, DrafterChoice(lookup=True, shared_index=shared), ids, GenerationConfig(k=4, max_tokens=16))
    assert run.token_ids == expected and any(c.shared_index for c in run.cycles)


def test_a_proposal_comes_from_the_source_that_matches_further_back_and_the_other_s_continuation_is_a_branch():
    own = NgramIndex()
    own.extend([1, 2, 3, 9, 1, 2])
    tie = SharedIndex(100)
    tie.add([1, 2, 7, 7])
    assert proposal(own, tie, 2) == ([3, 9], 2, [[7]], False)  # a tie: the request's own, the earlier one beside
    longer = SharedIndex(100)
    longer.add([5, 9, 1, 2, 4, 4, 4])  # "9 1 2" runs back 3: further than the request's own "1 2"
    assert proposal(own, longer, 4) == ([4, 4, 4], 3, [[3, 9]], True)
    same = SharedIndex(100)
    same.add([1, 2, 3, 9, 8])
    assert proposal(own, same, 2) == ([3, 9], 2, [], False)  # both continue alike: nothing to add
    assert proposal(own, None, 4) == (own.propose(4), 2, own.branches(4), False)
    nothing = NgramIndex()
    nothing.extend([4, 5, 6])
    assert proposal(nothing, tie, 3) == ([], 0, [], False)
