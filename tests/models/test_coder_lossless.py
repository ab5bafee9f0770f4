"""Speculation on the Qwen2.5-Coder-1.5B target is lossless with every drafter the app offers for it:
SmolLM2-135M and Gemma-3-270M across tokenizer families, Qwen2.5-Coder-0.5B with the same tokenizer, and
lookup + SmolLM2. Greedy output equals the target alone; at temperature 0.7 every emitted token is one the
target sampled. Runs where the coder pair is converted (make models-coder) or UAG_TEST_CODER=1 fetches it.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from tests.support.coder import needs_coder_pair
from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice
from uag.core.engine import Seams, generate, prompt_ids, stream

pytestmark = needs_coder_pair
PROMPTS = ["def quicksort(arr):", "# Zwraca silnię liczby n\ndef silnia(n):"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def coder():
    """The 1.5B target and its same-tokenizer drafter, in a store of their own, dropped after the module."""
    from uag.models.store import ModelStore

    store = ModelStore()
    target = store.get("coder-target")
    expected = {
        p: generate(target, None, p, GenerationConfig(translation="baseline", max_tokens=MAX_TOKENS)).token_ids
        for p in PROMPTS
    }
    yield store, target, expected
    del store, target
    gc.collect()
    mx.clear_cache()


@pytest.mark.parametrize("drafter", ["coder-drafter", "demo-drafter", "demo-target", "lookup+demo-drafter"])
def test_greedy_output_equals_the_target_alone(coder, store, drafter):
    from uag.models.store import ModelStore

    _, target, expected = coder
    lookup, _, name = drafter.rpartition("+")
    # The 0.5B is dropped with its scratch store (the demo models stay in the session's), and held in bf16: a
    # drafter's precision changes what it proposes, never what the target commits, and it halves the 0.5B's
    # memory (this module alone peaks at 9.6 GiB; the CI process's 11.8 GiB peak is not this drafter).
    scratch = ModelStore(dtype="bfloat16")
    model = (scratch if name.startswith("coder-") else store).get(name)
    choice = DrafterChoice(lookup=bool(lookup), model=model)
    runs = []
    for prompt, k in zip(PROMPTS, (3, 1)):  # both prompts and both widths, in half the runs of every pairing
        run = generate(target, choice, prompt, GenerationConfig(translation="context", k=k, max_tokens=MAX_TOKENS))
        assert run.token_ids == expected[prompt], (drafter, prompt, k)
        assert run.proposed > 0 and len(run.cycles) < MAX_TOKENS  # it drafted, and in fewer target passes
        runs.append(run)
    if name == "coder-drafter":
        assert runs[0].translation == "identity"  # same tokenizer: drafts pass untranslated
    del scratch, model, choice
    gc.collect()
    mx.clear_cache()  # give the 0.5B's buffers back: the module runs next to the session's demo models (CI: < 12 GB)


def test_sampling_every_emitted_token_is_one_the_target_sampled(coder, store):
    _, target, _ = coder
    calls: list[list[int]] = []
    base = make_sampler(0.7)

    def recording(logprobs):
        y = base(logprobs)
        calls.append(np.array(y).reshape(-1).tolist())
        return y

    config = GenerationConfig(translation="context", k=3, max_tokens=MAX_TOKENS, temperature=0.7, seed=7)
    ids = prompt_ids(target, PROMPTS[0])
    run = list(stream(target, store.get("demo-drafter"), ids, config, seams=Seams(sampler=recording)))[-1].run
    assert len(calls) == len(run.cycles) and run.opening == run.cycles[0].emitted  # the prompt pass verified a draft
    position = 0
    for cycle, sampled in zip(run.cycles, calls):
        assert run.token_ids[position : position + cycle.emitted] == sampled[: cycle.emitted]
        position += cycle.emitted
    assert position == run.generated == MAX_TOKENS


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def test_a_forced_tool_call_is_well_formed_and_lossless_under_speculation(coder, store):
    """tool_choice "required" on the coder target (its template renders the tools, its vocabulary has the
    <tool_call> tags): every call fits the declared parameters (a string city, never a list), and auto over lookup
    + SmolLM2 writes the constrained target alone's reply, the grammar's forced tokens proposed free."""
    import json

    from uag.core.config import GRAMMAR
    from uag.core.grammar import tool_constraint
    from uag.server.chat import parse_tool_calls, render

    _, target, _ = coder
    ask = [{"role": "user", "content": "What is the weather like in Kraków and in Gdańsk right now?"}]
    ids = render(target.tokenizer, ask, WEATHER)
    settings = dict(constraint=tool_constraint(WEATHER), max_tokens=64)
    alone = generate(target, None, ids, GenerationConfig.parse(strategy="baseline", **settings))
    choice = DrafterChoice(lookup=True, model=store.get("demo-drafter"))
    spec = generate(target, choice, ids, GenerationConfig.parse(strategy="auto", k=16, **settings))
    assert spec.token_ids == alone.token_ids and alone.finish_reason == "eos"
    reply = parse_tool_calls(alone.text, WEATHER)
    assert reply is not None and reply.calls, alone.text
    for call in reply.calls:
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    assert spec.sources().get(GRAMMAR, 0) > 0
