"""Prompt lookup drafts a tool call's copy of the prompt: the forms a JSON reply copies text in (uag.core.copy_forms)
and the lookup drafter that indexes them (uag.core.drafters.LookupDrafter(copy_forms=True))."""

from __future__ import annotations

import json

import pytest

from tests.support import real_tokenizers
from uag.core.copy_forms import copy_forms, json_string, unnumbered
from uag.core.drafters import LookupDrafter, copy_views
from uag.core.lookup import NgramIndex, SharedIndex, own_match, proposal
from uag.models.vocab import HFVocab

SOURCE = '''def speedup(alpha: float, k: int, r: float) -> float:
    """What a cycle of k drafts buys: (1 + k * alpha) / (1 + k * r)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return (1 + k * alpha) / (1 + k * r)


def break_even(k: int, r: float) -> float:
    """The acceptance at which drafting k tokens pays nothing and loses nothing."""
    return r


def cycles(tokens: int, k: int, alpha: float) -> int:
    """Target passes for `tokens` tokens when each cycle keeps k * alpha drafts and one of its own."""
    return -(-tokens // int(1 + k * alpha))
'''


def numbered(text: str) -> str:
    """`text` as `cat -n` prints it (Claude Code's Read)."""
    return "\n".join(f"{i + 1:6}\t{line}" for i, line in enumerate(text.split("\n")))


def test_unnumbered_takes_a_listings_numbers_off_and_leaves_other_text_alone():
    assert unnumbered("     1\tx = 1\n     2\ty = 2\nz") == "x = 1\ny = 2\nz"
    assert unnumbered("  9→a\n 10→b") == "a\nb"
    assert unnumbered("x = 1\n2 apples") is None  # one number at a line's start is any text's
    assert unnumbered("     1\tonly one") is None
    assert unnumbered(numbered(SOURCE)) == SOURCE


def test_json_string_is_what_a_tool_calls_argument_holds():
    text = 'print("a\\tb")\n\tpass  # zażółć'
    assert json.loads(f'"{json_string(text)}"') == text
    assert json.loads(json.dumps({"old_string": text}))["old_string"] == text
    assert f'"old_string": "{json_string(text)}"' in json.dumps({"old_string": text}, ensure_ascii=False)


def test_copy_forms_are_the_forms_that_differ_with_the_likeliest_last():
    assert copy_forms("x = 1") == []
    assert copy_forms('x = "1"') == ['x = \\"1\\"']
    listing = numbered("a = 1\nb = 2")
    assert copy_forms(listing) == ["a = 1\nb = 2", json_string(listing), "a = 1\\nb = 2"]


def replay(prompt: list[int], reply: list[int], views: SharedIndex | None, k: int = 16) -> int:
    """Target passes lookup needs to write `reply` after `prompt` when every proposal of up to k tokens is verified:
    each pass keeps the proposal's agreeing prefix and the target's own next token."""
    index, at, passes = NgramIndex(), 0, 0
    index.extend(prompt)
    while at < len(reply):
        ids, _, _, _ = proposal(index, None, k, views)
        kept = next((i for i, t in enumerate(ids) if at + i >= len(reply) or reply[at + i] != t), len(ids))
        new = reply[at : at + kept + 1]
        index.extend(new)
        at, passes = at + len(new), passes + 1
    return passes


@pytest.fixture(scope="module")
def qwen() -> HFVocab:
    return HFVocab(real_tokenizers.load("qwen2.5"))


def agent_prompt(vocab: HFVocab) -> list[int]:
    """A Qwen chat in which the agent has read SOURCE through a Read tool (a numbered listing)."""
    text = (
        "<|im_start|>user\nAdd a docstring example to speedup.py.<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/repo/speedup.py"}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\n{numbered(SOURCE)}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    return vocab.encode(text)[0]


@pytest.mark.parametrize(
    "tool, arguments",
    [
        ("Write", {"file_path": "/repo/speedup.py", "content": SOURCE.replace("-> float", "-> 'float'")}),
        ("Edit", {"file_path": "/repo/speedup.py", "old_string": SOURCE[:400], "new_string": SOURCE[:380] + " "}),
    ],
)
def test_a_tool_calls_copy_of_a_listing_takes_far_fewer_passes_with_the_copy_forms(qwen, tool, arguments):
    prompt = agent_prompt(qwen)
    reply = qwen.encode(f"<tool_call>\n{json.dumps({'name': tool, 'arguments': arguments})}\n</tool_call>")[0]
    plain, viewed = replay(prompt, reply, None), replay(prompt, reply, copy_views(qwen, prompt))
    # between two line breaks the text as read matches too: most of a copy's passes are the line breaks' re-matches
    assert viewed * 2 < plain, (tool, len(reply), plain, viewed)


def test_the_lookup_drafter_offers_and_proposes_the_copy_only_with_copy_forms(qwen):
    prompt = agent_prompt(qwen)
    copied = SOURCE.index('"""What a cycle') + len('"""What')  # the copy has crossed its first line break
    opening = f'<tool_call>\n{{"name": "Write", "arguments": {{"content": "{json_string(SOURCE[:copied])}'
    for copying in (False, True):
        drafter = LookupDrafter(qwen, copy_forms=copying)
        drafter.start(prompt)
        drafter.commit(None, qwen.encode(opening)[0])
        offer = drafter.offer(16)
        draft = drafter.propose("lookup", 16, 64)
        written = qwen.decode(draft.proposed)
        if copying:  # the rest of the file as the JSON string goes on, its line breaks escaped
            assert offer.match >= 8 and len(draft.proposed) == 16, (offer, written)
            assert json_string(SOURCE[copied:]).startswith(written), written
            assert not draft.shared_index  # the request's own prompt, not an earlier request's text
        else:  # the text as read has nothing after the escaped line break and quotes to match
            assert offer.match == 0 and not draft.proposed, (offer, written)


def test_views_propose_only_where_they_match_further_back_than_the_text_as_read():
    views = SharedIndex(100)
    views.add([7, 3, 1, 2, 8, 9])
    index = NgramIndex()
    index.extend([5, 1, 2, 3, 1, 2])
    assert own_match(index, views, 2) == ([8, 9], 3, True)
    index = NgramIndex()
    index.extend([4, 3, 1, 2, 6, 4, 3, 1, 2])  # its own match runs back 4: it proposes
    assert own_match(index, views, 2) == ([6, 4], 4, False)
    assert own_match(index, None, 2) == ([6, 4], 4, False)


def test_no_copy_forms_no_views(qwen):
    drafter = LookupDrafter(qwen)
    drafter.start(agent_prompt(qwen))
    assert drafter.views is None
    assert copy_views(qwen, qwen.encode("plain words only")[0]) is None
