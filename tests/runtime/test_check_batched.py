"""A server's `"check": true` for a request that ran in a batch (issue 52): the check runs where the request ran, so
its baseline and its recomputed margins are batched with whatever runs beside it. On a tiny float32 target, a reply
made to part from the target alone (its token at one position replaced by the target's runner-up) is classified in
the batch as it is alone: the same position, the same kind, and margins within rounding of the ones computed alone."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from tests.support.tiny_models import build_tiny, unshare
from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice
from uag.core.engine import generate
from uag.core.kept_caches import KeptCaches
from uag.core.records import Run
from uag.runtime.batching import Batch, handed_back, share
from uag.runtime.margins import pass_logits
from uag.runtime.pair import check_against_target
from uag.runtime.worker import Job

PROMPT = [3, 17, 23, 42, 8, 99, 61, 5, 17, 23, 42, 8]
CONFIG = GenerationConfig("context", 3, max_tokens=14)
PARTS_AT = 6  # the generated token the reply is made to part at


@pytest.fixture(scope="module")
def target(store):
    loaded = store.get(str(build_tiny("llama", "llama-3.2", seed=33, tie_embeddings=False)))
    yield loaded
    unshare(loaded)


def parted(target, run: Run, position: int) -> Run:
    """`run` with its token at `position` replaced by the target's runner-up there: a reply that parts from it."""
    context = [*run.prompt_ids, *run.token_ids[:position]]
    runner_up = int(mx.argsort(pass_logits(target, context[:-1], context[-1:], 0))[-2])
    tokens = list(run.tokens)
    tokens[position] = replace(tokens[position], id=runner_up)
    return replace(run, tokens=tokens)


def checked(job, target, out: dict, phase: list):
    """A request speculating with the target as its own drafter, then its check, as the server runs them."""
    run = generate(target, DrafterChoice(model=target), PROMPT, CONFIG)
    phase.append("checking")
    out["reply"] = parted(target, run, PARTS_AT)
    out["check"] = check_against_target(target, PROMPT, CONFIG, out["reply"])
    phase.append("done")
    handed_back()
    yield "checked"


def beside(job, target, out: dict):
    """Another request, long enough to run beside the first one's check."""
    out["beside"] = generate(target, None, [7, 7, 9] * 5, GenerationConfig("baseline", max_tokens=120))
    handed_back()
    yield "beside"


def test_a_check_run_in_a_batch_classifies_as_alone(target, monkeypatch):
    share(target, "target")
    phase: list = []
    shared_while_checking = []
    run = KeptCaches.run

    def recorded(kept, model, rows, inputs, wait=True, trees=None, packed=False):
        if phase and phase[-1] == "checking":
            shared_while_checking.append(len(rows))
        return run(kept, model, rows, inputs, wait, trees, packed)

    monkeypatch.setattr(KeptCaches, "run", recorded)
    out: dict = {}
    batch = Batch(max_size=2)
    batch.queued = lambda: True  # as under load: a member alone still waits for its rounds
    jobs = [Job(checked, (target, out, phase), "checked", shared=True), Job(beside, (target, out), "b", shared=True)]
    for job in jobs:
        batch.join(job)
    while batch:
        batch.round()
    for job in jobs:
        list(job)  # raises what the job raised
    assert phase == ["checking", "done"] and "beside" in out
    assert shared_while_checking and max(shared_while_checking) == 2  # the check's passes had a row beside them

    in_batch = out["check"].divergence
    alone = check_against_target(target, PROMPT, CONFIG, out["reply"]).divergence  # outside a batch: alone
    assert in_batch is not None and alone is not None
    assert in_batch.position == alone.position == PARTS_AT
    assert in_batch.kind == alone.kind and in_batch.kind in ("diverged", "diverged_near_tie")
    assert in_batch.step_margin == pytest.approx(alone.step_margin, abs=1e-4)
    assert in_batch.pass_margin == pytest.approx(alone.pass_margin, abs=1e-4)
