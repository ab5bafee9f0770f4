"""benchmarks/near_ties.py without a model: which replies part from the reference's, which turns a parting carries
over, the messages a turn was sent, the summaries' verdicts (near-tie, bug, follows, not classified) in serve.py and
serve_many.py, and the rows a classification writes."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import near_ties as nt  # noqa: E402  (benchmarks/near_ties.py)
import serve  # noqa: E402  (benchmarks/serve.py)
import serve_many as sm  # noqa: E402  (benchmarks/serve_many.py)

from uag.study.datasets import Conversation  # noqa: E402

ONE = {"repeat": 0}


def said(**texts) -> dict:
    """{turn: Said} from keyword turns: e1_2="x" -> ("edit", "e1", 2): Said("x")."""
    out = {}
    for name, text in texts.items():
        item, number = name.rsplit("_", 1)
        out[("chat" if item.startswith("c") else "edit", item, int(number))] = nt.Said(text)
    return out


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        (("edit", "e", 3), [("edit", "e", 1), ("edit", "e", 2)]),
        (("edit", "e", 1), []),
        (("aider-diff", "e", 2), [("aider-diff", "e", 1)]),
        (("ttft", "e", 2), [("ttft", "e", 1)]),
        (("retry", "e", 2), [("edit", "e", 1)]),
        (("chat", "c", 1), []),
    ],
)
def test_sources_are_the_turns_a_turns_messages_carry(turn, expected):
    assert nt.sources(turn) == expected


def test_replies_by_run_leave_the_cold_read_out_and_know_who_ended_a_reply():
    rows = [
        {"kind": "meta"},
        {"kind": "turn", "condition": "uag:off", "repeat": 1, "workload": "chat", "item": "c", "turn": 1, "text": "a"},
        {"kind": "turn", "condition": "uag:off", "repeat": 1, "workload": "edit", "item": "e", "turn": 2, "text": "b"}
        | {"finish_reason": "stop"},
        {"kind": "turn", "condition": "uag:off", "repeat": 1, "workload": "ttft-cold", "item": "e", "turn": 2}
        | {"text": "c"},
    ]
    assert nt.replies(rows) == {
        "uag:off": {(1,): {("chat", "c", 1): nt.Said("a", False), ("edit", "e", 2): nt.Said("b", True)}}
    }


def test_compare_counts_equal_turns_and_finds_each_parting_with_what_its_messages_carry():
    reference = said(e1_1="a", e1_2="b", e1_3="c", c1_1="x", e2_2="late")
    other = said(e1_1="a", e1_2="B", e1_3="C", c1_1="x", c9_1="only here", e2_2="LATE")
    found = nt.compare("uag:lookup", "uag:off", other, reference, ONE, ONE)
    assert (found.same, found.total) == (2, 5)
    by_turn = {p.turn: p for p in found.parted}
    assert set(by_turn) == {("edit", "e1", 2), ("edit", "e1", 3), ("edit", "e2", 2)}
    second = by_turn["edit", "e1", 2]
    assert second.earlier == ("a",) and second.follows is None
    assert second.texts == (nt.Said("b"), nt.Said("B"))
    third = by_turn["edit", "e1", 3]  # its messages carry turn 2, which parted: it follows that one
    assert third.earlier is None and third.follows == ("edit", "e1", 2)
    orphan = by_turn["edit", "e2", 2]  # turn 1 is not in the rows: nothing to rebuild its messages from
    assert orphan.earlier is None and orphan.follows is None


def test_messages_rebuild_chat_conversation_retry_and_aider_turns():
    conversation = Conversation(
        "edit-x", "edit", ("Here is `a.py`:\n\n```python\nx = 1\n```\n\nRename x.", "Now add y."), system="Be brief."
    )
    conversations, chats = {"edit-x": conversation}, {"c1": "Hello?"}
    assert nt.messages(("chat", "c1", 1), (), conversations, chats) == [{"role": "user", "content": "Hello?"}]
    second = nt.messages(("edit", "edit-x", 2), ["Renamed."], conversations, chats)
    assert second == conversation.messages(["Renamed."])
    assert nt.messages(("retry", "edit-x", 2), ["Renamed."], conversations, chats) == second
    reply = "a.py\n```python\nz = 1\n```"
    aider = nt.messages(("aider-whole", "edit-x", 2), [reply], conversations, chats)
    assert {"role": "assistant", "content": reply} in aider  # the history holds turn 1's reply
    assert "z = 1" in aider[-3]["content"] and "x = 1" not in aider[-3]["content"]  # the file moved on by it
    assert aider[-1]["content"].startswith("Now add y.")


def parting(turn=("chat", "c1", 1), follows=None, where=ONE) -> nt.Parted:
    return nt.Parted("uag:lookup", "uag:off", where, where, turn, (nt.Said("a"), nt.Said("b")), (), follows)


def verdict(p: nt.Parted, kind: str | None, margin: float | None = None) -> dict:
    found = None if kind is None else {"kind": kind, "margin": margin}
    return nt.parted_row(p, found, None if kind else "not the target's choice")


def test_note_names_near_ties_and_bugs_and_counts_what_follows_or_is_unknown():
    tie, bug = parting(("chat", "c1", 1)), parting(("edit", "e1", 1), where={"repeat": 1, "concurrency": 4})
    after = parting(("edit", "e1", 2), follows=("edit", "e1", 1), where={"repeat": 1, "concurrency": 4})
    unknown = parting(("chat", "c2", 1))
    rows = [verdict(tie, "diverged_near_tie", 0.0031), verdict(bug, "diverged", 2.5), verdict(unknown, None)]
    rows.append(nt.parted_row(after, None, "follows turn 1"))
    found = nt.verdicts(rows)
    comparison = nt.Comparison("uag:lookup", "uag:off", same=60, total=64, parted=[tie, bug, after, unknown])
    text, met = nt.note(comparison, found)
    assert text == (
        "(1 near-tie: c1 t1 (r1) margin 0.0031; 1 bug: e1 t1 (r2, C=4) margin 2.5; 1 follows an earlier parting; "
        "1 not classified)"
    )
    assert met == "NOT met"
    comparison.parted = [tie, unknown]
    assert nt.note(comparison, found)[1] == "not classified"
    comparison.parted = [tie]
    assert nt.note(comparison, found) == ("(1 near-tie: c1 t1 (r1) margin 0.0031; 0 bugs)", "met: near-ties")
    tied_first = nt.parted_row(parting(("edit", "e1", 1), where=after.where), {"kind": "diverged_near_tie"}, None)
    comparison.parted = [after]  # follows a near-tie: as good as one
    assert nt.note(comparison, nt.verdicts([tied_first]))[1] == "met: near-ties"
    assert nt.note(nt.Comparison("a", "b", same=3, total=3), {}) == ("", "met")
    assert nt.note(nt.Comparison("a", "b"), {}) == ("", "NOT met")


def test_classify_writes_what_needs_no_model_without_loading_one():
    after = parting(("edit", "e1", 2), follows=("edit", "e1", 1))
    orphan = nt.Parted("uag:lookup", "uag:off", ONE, ONE, ("edit", "e2", 2), (nt.Said("a"), nt.Said("b")), None)
    rows = nt.classify([after, orphan], target="no such model: never loaded")
    assert [r["why"] for r in rows] == ["follows turn 1", "the turns its messages carry are not in the rows"]
    assert rows[0]["follows"] == ["edit", "e1", 1] and rows[0]["verdict"] is None
    assert {r["kind"] for r in rows} == {"parted"}


def turn_row(condition, item, number, text, *, workload="edit", concurrency=None, repeat=0) -> dict:
    """A turn row as serve.py writes it (a request row as serve_many.py does, given a concurrency), with the fields
    the summaries read."""
    row = {"kind": "turn", "condition": condition, "repeat": repeat, "workload": workload, "item": item}
    row |= {"turn": number, "text": text, "finish_reason": "length", "ttft_s": 0.1, "generation_s": 1.0}
    row |= {"e2e_s": 1.1, "completion_tokens": 5, "cached_tokens": 0, "prompt_tokens": 9}
    row |= {"drafted": None, "accepted": None, "wave": 0, "started_s": 0.0, "done_s": 1.1}
    if concurrency is not None:
        row |= {"kind": "request", "concurrency": concurrency}
    return row


def test_serve_summary_says_near_tie_on_the_lossless_line():
    rows = [
        {"kind": "meta", "target": "demo-target"},
        turn_row("uag:off", "c1", 1, "same", workload="chat"),
        turn_row("uag:off", "c2", 1, "off's", workload="chat"),
        turn_row("uag:lookup", "c1", 1, "same", workload="chat"),
        turn_row("uag:lookup", "c2", 1, "parted", workload="chat"),
    ]
    comparisons = serve.lossless(rows)
    assert [(c.condition, c.reference, c.same, c.total) for c in comparisons] == [("uag:lookup", "uag:off", 1, 2)]
    (p,) = comparisons[0].parted
    line = next(x for x in serve.summary(rows).splitlines() if x.startswith("lossless"))
    assert line.endswith("not classified (0 near-ties; 0 bugs; 1 not classified)")
    rows.append(nt.parted_row(p, {"kind": "diverged_near_tie", "margin": 0.003}, None))
    line = next(x for x in serve.summary(rows).splitlines() if x.startswith("lossless"))
    assert "1/2" in line and line.endswith("met: near-ties (1 near-tie: c2 t1 (r1) margin 0.003; 0 bugs)")


def test_serve_many_compares_uag_off_batched_with_itself_at_the_lowest_concurrency():
    rows = [
        turn_row("uag:off", "e1", 1, "a", concurrency=1),
        turn_row("uag:off", "e1", 1, "a", concurrency=4),
        turn_row("uag:off", "e1", 1, "A", concurrency=8),
        turn_row("uag:off", "e1", 2, "b", concurrency=1),
        turn_row("uag:off", "e1", 2, "B", concurrency=8),
        turn_row("uag:lookup", "e1", 1, "a", concurrency=4),
    ]
    found = {(c.condition, c.label): c for c in sm.comparisons(rows)}
    assert set(found) == {("uag:lookup", ""), ("uag:off", "C=4 vs C=1"), ("uag:off", "C=8 vs C=1")}
    assert (found["uag:lookup", ""].same, found["uag:lookup", ""].total) == (1, 1)
    eight = found["uag:off", "C=8 vs C=1"]
    assert (eight.same, eight.total) == (0, 2)
    first, second = sorted(eight.parted, key=lambda p: p.turn)
    assert first.where == {"repeat": 0, "concurrency": 8} and first.reference_where == {"repeat": 0, "concurrency": 1}
    assert second.follows == ("edit", "e1", 1)
    assert sm.lossless(rows) == [("uag:lookup", 1, 1)]  # the speculative conditions, as before
    rows.append(nt.parted_row(first, {"kind": "diverged_near_tie", "margin": 0.01}, None))
    lines = [x for x in sm.summary(rows).splitlines() if x.startswith("lossless")]
    assert any("C=8 vs C=1" in x and "0/2" in x and x.endswith("1 follows an earlier parting)") for x in lines)
    assert any("C=8 vs C=1" in x and "met: near-ties" in x for x in lines)
