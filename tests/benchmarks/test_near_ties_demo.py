"""benchmarks/near_ties.py on the demo target, end to end: two replies to a chat request that part where the target
leads clearly (a bug) are classified from their texts alone, at the position where they part, with the margin a
one-token step computes there; under a bound above that margin the same parting is a near-tie."""

import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import near_ties as nt  # noqa: E402  (benchmarks/near_ties.py)

import uag.runtime.divergence  # noqa: E402
from uag.core.config import GenerationConfig  # noqa: E402
from uag.core.engine import generate  # noqa: E402
from uag.runtime.margins import completion_ids, margin, pass_logits  # noqa: E402
from uag.server.chat import render  # noqa: E402

pytestmark = pytest.mark.slow
ITEM = "alpaca-001"  # open chat's first Polish instruction


def test_two_texts_that_part_are_classified_from_the_target_s_margin_there(demo_pair, monkeypatch):
    target, _ = demo_pair
    turn = ("chat", ITEM, 1)
    prompt = render(target.tokenizer, nt.messages(turn, (), {}, nt.chat_texts()))
    greedy = generate(target, None, prompt, GenerationConfig("baseline", max_tokens=16)).token_ids
    reference = target.tokenizer.decode(greedy)
    assert completion_ids(target, reference) == greedy  # its text reads back as the tokens generated

    # the other reply: the greedy one up to the position where the target leads most, then its runner-up there
    leads = []
    for position, token in enumerate(greedy):
        context = [*prompt, *greedy[:position]]
        logits = pass_logits(target, context[:-1], context[-1:], 0)
        assert int(mx.argmax(logits)) == token
        runner_up = int(mx.argsort(logits)[-2])
        written = [*greedy[:position], runner_up]
        if completion_ids(target, target.tokenizer.decode(written)) == written:  # its text reads back as written
            leads.append((margin(logits), position, runner_up))
    lead, position, runner_up = max(leads)
    other = target.tokenizer.decode([*greedy[:position], runner_up])
    parted = nt.Parted(
        "uag:lookup", "uag:off", {"repeat": 0}, {"repeat": 0}, turn, (nt.Said(reference), nt.Said(other)), ()
    )

    (row,) = nt.classify([parted], target)
    found = row["verdict"]
    assert found is not None, row["why"]
    assert (found["position"], found["baseline_token"], found["speculative_token"]) == (
        position,
        greedy[position],
        runner_up,
    )
    bound = uag.runtime.divergence.near_tie_margin("float32")
    assert found["step_margin"] == pytest.approx(lead, abs=1e-4) and lead > bound
    assert found["kind"] == "diverged" and row["workload"] == "chat" and row["item"] == ITEM

    monkeypatch.setitem(uag.runtime.divergence.NEAR_TIE_MARGIN, "float32", lead + 1.0)
    (row,) = nt.classify([parted], target)
    assert row["verdict"]["kind"] == "diverged_near_tie"


def test_a_reply_that_ends_where_the_other_goes_on_is_weighed_only_if_the_model_ended_it(demo_pair):
    target, _ = demo_pair
    turn = ("chat", ITEM, 1)
    prompt = render(target.tokenizer, nt.messages(turn, (), {}, nt.chat_texts()))
    greedy = generate(target, None, prompt, GenerationConfig("baseline", max_tokens=8)).token_ids
    shorter = target.tokenizer.decode(greedy[:5])
    assert completion_ids(target, shorter) == greedy[:5]
    longer = nt.Said(target.tokenizer.decode(greedy))
    where = {"repeat": 0}
    cut = nt.Parted("uag:lookup", "uag:off", where, where, turn, (nt.Said(shorter), longer), ())
    ended = nt.Parted("uag:hybrid", "uag:off", where, where, turn, (nt.Said(shorter, ended=True), longer), ())
    cut_row, ended_row = nt.classify([cut, ended], target)
    assert cut_row["verdict"] is None  # cut short (a budget, a stop string): no token there to weigh
    found = ended_row["verdict"]
    assert found["position"] == 5 and found["speculative_token"] == greedy[5]
    assert found["baseline_token"] in (target.tokenizer.eos_token_ids or {target.tokenizer.eos_token_id})
    assert found["step_margin"] is not None and found["kind"] in ("diverged", "diverged_near_tie")
