"""benchmarks/edit_formats.py: the edit conversations asked the way aider asks (its `whole` and `diff` formats), and
each reply applied to the file the way aider applies it. The replay is checked against requests aider 0.86.2 itself
sent (tests/fixtures/aider-0.86.2-sent.json: aider run on a two-line file, against a server that recorded each
request and answered with the fixture's replies; benchmarks/aider_layout/record.py writes it again)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import edit_formats  # noqa: E402  (benchmarks/edit_formats.py)
import serve  # noqa: E402
from edit_formats import EditTask, Outcome, Replay, apply_diff, apply_whole  # noqa: E402

from uag.study.datasets import Conversation, load_conversations  # noqa: E402

SENT = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "aider-0.86.2-sent.json").read_text())
FILE = "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n"


def conversation(*requests: str, name: str = "calc.py", content: str = FILE) -> Conversation:
    """An `edit` conversation as bundled: the file inline in turn 1, every turn asking for the whole file back."""
    first = f"Here is `{name}`:\n\n```python\n{content}```\n\n{requests[0]} Return the whole file."
    return Conversation("edit-x", "edit", (first, *(f"{r} Return the whole file." for r in requests[1:])))


@pytest.mark.parametrize("edit_format", edit_formats.FORMATS)
def test_the_replay_sends_what_aider_sent_turn_after_turn(edit_format):
    recorded = SENT["formats"][edit_format]
    replay = Replay.of(conversation(*SENT["requests"]), edit_format)
    assert edit_formats.aider_version() == SENT["aider"]
    for sent, reply in zip(recorded["sent"], recorded["replies"]):
        assert replay.messages() == sent
        assert replay.answer(reply).applied
    assert replay.content == 'def plus(a, b):\n    """Sum."""\n    return a + b\n\n\nprint(plus(1, 2))\n'


def test_every_bundled_edit_conversation_gives_a_file_and_bare_requests():
    for c in load_conversations("edit"):
        task = EditTask.of(c)
        assert task.content.endswith("\n") and task.content.strip() and "```" not in task.content
        assert len(task.requests) == len(c.turns) == 3
        assert all(r and not r.endswith(("Return the whole file.", "Zwróć cały plik.")) for r in task.requests), c.id
        assert task.name in c.turns[0] and "." in task.name


def test_a_turn_without_a_file_is_refused():
    with pytest.raises(ValueError, match="does not give a file"):
        EditTask.of(Conversation("x", "edit", ("Write me a poem.",)))
    with pytest.raises(ValueError, match="no aider layout"):
        Replay.of(conversation("Rename add."), "udiff")


def block(search: str, replace: str, name: str = "calc.py") -> str:
    return f"{name}\n```python\n<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n```\n"


def test_diff_blocks_apply_in_order_each_to_the_first_occurrence():
    reply = "Two edits.\n\n" + block("def add(a, b):\n", "def plus(a, b):\n")
    reply += block("print(add(1, 2))\n", "print(plus(1, 2))\n")
    assert apply_diff(FILE, "calc.py", reply) == (FILE.replace("add", "plus"), Outcome(True, 2))
    twice = "x = 1\nx = 1\n"
    assert apply_diff(twice, "a.py", block("x = 1\n", "x = 2\n"))[0] == "x = 2\nx = 1\n"


def test_diff_search_text_matches_despite_trailing_whitespace_or_a_shifted_indentation():
    spaced = FILE.replace("return a + b\n", "return a + b   \n")
    assert apply_diff(spaced, "calc.py", block("    return a + b\n", "    return b + a\n"))[1].applied
    shifted = block("return a + b\n", "return b + a\nprint('never')\n")  # the model left the indentation out
    assert not apply_diff(FILE, "calc.py", block("return a\n", "return b\n"))[1].applied  # whole lines only
    assert apply_diff(FILE, "calc.py", shifted)[0] == FILE.replace(
        "    return a + b\n", "    return b + a\n    print('never')\n"
    )


def test_a_diff_that_does_not_apply_leaves_the_file_and_says_why():
    missing = block("def add(a, b):\n", "def plus(a, b):\n") + block("def sub(a, b):\n", "def minus(a, b):\n")
    assert apply_diff(FILE, "calc.py", missing) == (FILE, Outcome(False, 2, "block 2's SEARCH is not in calc.py"))
    assert apply_diff(FILE, "calc.py", "I would rename it.") == (FILE, Outcome(False, 0, "no SEARCH/REPLACE block"))
    unclosed = "<<<<<<< SEARCH\ndef add(a, b):\n=======\ndef plus(a, b):\n"
    assert not apply_diff(FILE, "calc.py", unclosed)[1].applied


def test_an_empty_search_appends_the_replacement():
    assert apply_diff("x = 1", "a.py", block("", "y = 2\n", "a.py"))[0] == "x = 1\ny = 2\n"


def test_a_whole_reply_gives_the_last_listing_of_the_file_or_else_its_only_unnamed_block():
    named = "Renamed.\n\nother.py\n```\nz = 0\n```\n\ncalc.py\n```python\nx = 1\n```\n\ncalc.py\n```\nx = 2\n```\n"
    assert apply_whole(FILE, "calc.py", named) == ("x = 2\n", Outcome(True, 1))
    assert apply_whole(FILE, "calc.py", "Here:\n```python\nx = 3\n```")[0] == "x = 3\n"
    assert apply_whole(FILE, "calc.py", "No code here.") == (FILE, Outcome(False, 0, "no file listing"))
    assert apply_whole(FILE, "calc.py", "```\nx = 4\n")[1].applied is False  # never closed


def test_an_edit_that_does_not_apply_leaves_the_file_and_no_update_in_the_history():
    replay = Replay.of(conversation("Rename add to plus.", "Add a docstring."), "diff")
    outcome = replay.answer("Sorry, I cannot.\n")
    assert not outcome.applied and replay.content == FILE
    assert replay.done == [
        {"role": "user", "content": "Rename add to plus."},
        {"role": "assistant", "content": "Sorry, I cannot."},
    ]
    last = replay.messages()
    assert last[-1]["content"].startswith("Add a docstring.") and "def add(a, b)" in last[-3]["content"]


def test_serve_counts_the_turns_whose_edits_applied_and_weighs_the_whole_format_against_its_goal():
    def turn(condition, workload, number, applied, seconds):
        return {
            "kind": "turn",
            "condition": condition,
            "repeat": 0,
            "workload": workload,
            "item": "e1",
            "turn": number,
            "prompt_tokens": 900,
            "cached_tokens": 0,
            "completion_tokens": 101,
            "ttft_s": 1.0,
            "generation_s": seconds,
            "e2e_s": seconds + 1,
            "drafted": None,
            "accepted": None,
            "text": "x",
            "lookup": {"cycles": 2, "proposed_tokens": 60, "accepted_tokens": 40},
            "applied": applied,
        }

    rows = [
        turn("uag:lookup", "aider-whole", 1, True, 2.0),
        turn("uag:lookup", "aider-whole", 2, False, 2.0),
        turn("uag:lookup", "aider-diff", 1, True, 5.0),
        turn("mlx_lm", "aider-whole", 1, True, 10.0),
        turn("mlx_lm", "aider-whole", 2, True, 10.0),
        turn("mlx_lm", "aider-diff", 1, True, 10.0),
    ]
    tables = serve.medians(rows)
    assert serve.edits_applied(tables) == [
        ("uag:lookup", "aider-whole", 1, 2),
        ("uag:lookup", "aider-diff", 1, 1),
        ("mlx_lm", "aider-whole", 2, 2),
        ("mlx_lm", "aider-diff", 1, 1),
    ]
    found = {what: (value, goal, met) for what, value, goal, met in serve.copy_targets(tables)}
    assert found["aider-whole all turns tokens/s, uag:lookup / mlx_lm"] == (5.0, ">= 4.5x", True)
    assert found["aider-whole tokens kept per lookup cycle (30.0 proposed), uag:lookup"] == (20.0, ">= 10", True)
    assert found["aider-diff all turns tokens/s, uag:lookup / mlx_lm"] == (2.0, "(diff)", None)
    summary = serve.summary([{"kind": "meta"}, *rows])
    assert "edits applied to the file, aider-whole, uag:lookup" in summary and "1/2" in summary
    assert "aider-diff t1" in summary
