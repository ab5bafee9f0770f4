"""Speculation under a grammar (issue #38): the target is masked at every position it samples or verifies, a draft
ends at its first token the grammar refuses, and what the grammar forces is proposed free — so a constrained reply
is the constrained target alone's, token for token, whatever drafts. On the demo pair (real tokenizers, a real
cross-tokenizer drafter)."""

from __future__ import annotations

import json

import pytest

from uag.core.anatomy import Loss
from uag.core.config import GRAMMAR, GenerationConfig
from uag.core.drafters import Draft, DrafterChoice
from uag.core.engine import Seams, generate
from uag.core.grammar import response_format_constraint
from uag.core.policy import FixedK
from uag.core.records import Offer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON = response_format_constraint({"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
ANY_OBJECT = response_format_constraint({"type": "json_object"})
PROMPT = "Ala ma kota. Kot ma trzy lata. Opis kota w JSON:"


def constrained(constraint: str = PERSON, **settings) -> GenerationConfig:
    return GenerationConfig.parse(constraint=constraint, max_tokens=40, **settings)


def fits(text: str) -> dict:
    reply = json.loads(text)
    assert set(reply) == {"name", "age"} and isinstance(reply["name"], str) and isinstance(reply["age"], int)
    assert len(reply["name"]) <= 12
    return reply


@pytest.fixture(scope="module")
def alone(demo_pair):
    """The constrained target alone (greedy): the reference every speculative run must equal."""
    target, _ = demo_pair
    return generate(target, None, PROMPT, constrained(strategy="baseline"))


def test_the_target_alone_writes_what_the_schema_allows_and_stops(alone):
    assert alone.finish_reason == "eos"
    fits(alone.text)
    assert alone.grammar_ms > 0


@pytest.mark.parametrize(
    "drafter, strategy",
    [("lookup", "context"), ("model", "context"), ("model", "auto"), ("hybrid", "auto"), ("model", "tli")],
)
def test_every_drafter_keeps_the_constrained_reply_token_for_token(demo_pair, alone, drafter, strategy):
    target, model = demo_pair
    choice = {"lookup": DrafterChoice(lookup=True), "model": model, "hybrid": DrafterChoice(True, model)}[drafter]
    run = generate(target, choice, PROMPT, constrained(strategy=strategy, k=4))
    assert run.token_ids == alone.token_ids
    fits(run.text)


def test_what_the_grammar_forces_is_proposed_free_and_kept(demo_pair, alone):
    """The schema's keys and punctuation are forced: grammar cycles propose them without a drafter pass."""
    target, model = demo_pair
    run = generate(target, model, PROMPT, constrained(strategy="context", k=8))
    forced = [c for c in run.cycles if c.source == GRAMMAR]
    assert forced and run.sources()[GRAMMAR] == len(forced)
    assert all(c.drafter_passes == 0 and c.proposed_ids for c in forced)
    assert sum(c.accepted for c in forced) >= 3  # at least '{"name": "' … '"age": ' held
    assert run.token_ids == alone.token_ids


class Refused:
    """A drafter whose every proposal opens with a token no JSON reply allows anywhere (a raw line break: inside a
    string it must be escaped, and between tokens the reply is written without line breaks)."""

    name = translation = "lookup"

    def __init__(self, bad: list[int]):
        self.bad = bad

    def start(self, prompt):
        return 0

    def offer(self, k_max):
        return Offer({"lookup": k_max}, match=8)

    def propose(self, source, k, budget, stop=None):
        ids = self.bad[: max(0, min(k, budget))]
        return Draft("lookup", list(ids), draft_ids=list(ids), usable=list(ids))

    def loss(self, draft, accepted, written):
        return Loss()

    def commit(self, draft, new):
        return False

    def rehearse(self):
        return None

    def restore(self):
        pass


def test_a_draft_ends_at_the_first_token_the_grammar_refuses(demo_pair, alone):
    target, _ = demo_pair
    bad = target.tokenizer.encode("\n\n", add_special_tokens=False)
    run = generate(target, Refused(bad), PROMPT, constrained(strategy="context", k=4), seams=Seams(policy=FixedK(4)))
    drafted = [c for c in run.cycles if c.source == "lookup"]
    assert drafted and all(c.proposed_ids == [] for c in drafted)  # cut to nothing: a plain step's width
    assert run.token_ids == alone.token_ids


def test_penalties_and_the_grammar_together_stay_the_target_alones(demo_pair):
    target, model = demo_pair
    settings = dict(constraint=ANY_OBJECT, repetition_penalty=1.2)
    base = generate(target, None, PROMPT, GenerationConfig.parse(strategy="baseline", max_tokens=24, **settings))
    spec = generate(
        target, DrafterChoice(True, model), PROMPT, GenerationConfig.parse(strategy="auto", max_tokens=24, **settings)
    )
    assert spec.token_ids == base.token_ids and base.text.lstrip().startswith("{")


@pytest.mark.parametrize("strategy", ["context", "tli"])
def test_a_sampled_reply_keeps_to_the_grammar(demo_pair, strategy):
    """At temperature > 0 (rejection sampling over masked distributions) every reply still fits the schema."""
    target, model = demo_pair
    for seed in (1, 2, 3):
        run = generate(target, model, PROMPT, constrained(strategy=strategy, k=4, temperature=0.9, seed=seed))
        if run.finish_reason == "eos":
            fits(run.text)
        else:  # cut by max_tokens: every token still allowed — the prefix opens as the schema does
            assert run.text.lstrip().startswith('{"name"')
