"""benchmarks/serve.py's figures for issue 39 (copying) without a server: lookup's tokens proposed and kept per
cycle carried from the replies into the summary, its targets, and the conditions and workload that weigh the
index shared across requests."""

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cold_read  # noqa: E402  (benchmarks/cold_read.py)
import edit_cycles  # noqa: E402  (benchmarks/edit_cycles.py)
import serve  # noqa: E402  (benchmarks/serve.py)
import serving  # noqa: E402  (benchmarks/serving.py)
import width_curve  # noqa: E402  (benchmarks/width_curve.py)


def turn(condition, workload, item, number, *, tokens=101, seconds=10.0, ttft=1.0, lookup=None) -> dict:
    """A turn row as serve.py writes it, with the fields the summary reads."""
    return {
        "kind": "turn",
        "condition": condition,
        "repeat": 0,
        "workload": workload,
        "item": item,
        "turn": number,
        "prompt_tokens": 500,
        "cached_tokens": 0,
        "completion_tokens": tokens,
        "ttft_s": ttft,
        "generation_s": seconds,
        "e2e_s": seconds + ttft,
        "drafted": None,
        "accepted": None,
        "text": "x",
        "lookup": lookup,
    }


def test_copy_targets_weigh_every_edit_turn_lookup_s_kept_tokens_and_the_cold_read():
    copy = {"cycles": 4, "proposed_tokens": 120, "accepted_tokens": 60}
    rows = [
        turn("uag:lookup", "edit", "e1", 1, seconds=2.0, lookup=copy),  # 50 tokens/s
        turn("uag:lookup", "edit", "e1", 2, seconds=2.0, lookup=copy),
        turn("uag:lookup", "ttft-cold", "e1", 2, ttft=3.0),
        turn("uag:lookup", "retry", "e1", 2, seconds=1.0),
        turn("uag:lookup:noshare", "retry", "e1", 2, seconds=2.0),
        turn("mlx_lm", "edit", "e1", 1, seconds=10.0),  # 10 tokens/s
        turn("mlx_lm", "edit", "e1", 2, seconds=10.0),
        turn("mlx_lm", "ttft-cold", "e1", 2, ttft=2.5),
    ]
    found = {what: (value, goal, met) for what, value, goal, met in serve.copy_targets(serve.medians(rows))}
    assert found["edit all turns tokens/s, uag:lookup / mlx_lm"] == (5.0, ">= 4.5x", True)
    assert found["edit tokens kept per lookup cycle (30.0 proposed), uag:lookup"] == (15.0, ">= 10", True)
    assert found["cold read TTFT, uag:lookup / mlx_lm"] == (1.2, "<= 1.05x", False)
    assert found["retries tokens/s, uag:lookup / uag:lookup:noshare"] == (2.0, "(shared index)", None)
    assert not any(what.startswith("edit") and what.endswith("uag:lookup:noshare") for what in found)  # no edit turns


def test_a_row_carries_lookup_s_figures_from_the_reply():
    reply = serving.Reply(
        "x",
        0.1,
        1.0,
        1.2,
        usage={"completion_tokens": 3},
        speculative={"lookup": {"cycles": 1, "proposed_tokens": 2, "accepted_tokens": 2}, "shared_lookup_cycles": 1},
    )
    row = serving.row(serving.Condition("uag:lookup", "uag", (), "t"), 0, "retry", "e1", 2, reply)
    assert row["lookup"]["accepted_tokens"] == 2 and row["shared_lookup_cycles"] == 1


def test_without_shared_index_adds_a_noshare_condition_per_drafter():
    args = argparse.Namespace(
        target="/models/t",
        drafters=["lookup"],
        max_tokens=8,
        peer_draft=None,
        num_draft_tokens=[2],
        only=None,
        ablate=[],
        without_shared_index=True,
    )
    conds = {c.name: c for c in serving.conditions(args)}
    assert list(conds) == ["uag:lookup", "uag:lookup:noshare", "uag:off", "mlx_lm"]
    argv = conds["uag:lookup:noshare"].argv
    assert argv[argv.index("--lookup-memory") + 1] == "0" and "--lookup-memory" not in conds["uag:lookup"].argv


def test_cold_read_asks_every_request_with_a_prefix_no_other_request_shares(capsys):
    messages = [{"role": "system", "content": "Act as an expert."}, {"role": "user", "content": "Rename x."}]
    opened = [cold_read.opened_with(messages, w) for w in cold_read.OPENINGS]
    assert opened[0][0]["content"] == "Act: Act as an expert." and opened[0][1:] == messages[1:]
    assert len({m[0]["content"] for m in opened}) == len(cold_read.OPENINGS)  # every request its own prefix
    assert messages[0]["content"] == "Act as an expert."  # the conversation itself untouched
    with pytest.raises(SystemExit):
        cold_read.main(["--rounds", "7"])  # two openings a round: no prefix asked twice
    assert "--rounds: from 1 to 6" in capsys.readouterr().err


def test_edit_cycles_takes_earlier_turns_from_a_serve_run_and_sums_each_source(tmp_path, capsys):
    from uag.core.records import Cycle

    rows = [turn("uag:lookup", "aider-whole", "edit-008", n) | {"server": "uag", "text": f"reply {n}"} for n in (2, 1)]
    rows.append(turn("mlx_lm", "aider-whole", "edit-008", 1) | {"server": "mlx_lm", "text": "peer"})
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(map(json.dumps, rows)), encoding="utf-8")
    assert edit_cycles.saved_replies(path, "edit-008") == ["reply 1", "reply 2"]  # uag's, in turn order
    copy = Cycle(
        index=3,
        k=15,
        draft_ids=[],
        proposed_ids=list(range(15)),
        accepted=15,
        emitted=16,
        verify_ms=1900.0,
        source="lookup",
        match=20,
        branches=2,
        nodes=22,
    )
    plain = Cycle.plain(4, verify_ms=800.0)
    assert edit_cycles.by_source([copy, plain, plain]) == {"lookup": (1, 16, 1.9), "plain": (2, 2, 1.6)}
    assert "rows  23" in edit_cycles.cycle_line(copy)  # the tree pass's rows: every branch's nodes and the pending
    with pytest.raises(SystemExit):
        edit_cycles.main(["--turns", "9"])
    assert "turns run from 1 to" in capsys.readouterr().err


def test_width_curve_takes_widths_and_ranges():
    assert width_curve.widths(["1-3", "8", "2"]) == [1, 2, 3, 8]
    with pytest.raises(ValueError):
        width_curve.widths(["0-2"])
