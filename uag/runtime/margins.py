"""The target's margins where two greedy runs part, and the verdict on it (uag.runtime.divergence).

Runs do not keep their logits, so when a baseline and a speculative run of one prompt differ, the target
computes its margin (top-two logit gap) at the first differing position once more, the two ways the runs
did: as a one-token step after reading the shared prefix (the baseline's computation), and as the very
verification pass of the speculative run's cycle that committed that position — same pending token, same
proposal, same place in it — after reading what came before (found from the run's cycle records; a run whose
cycles do not account for its tokens, such as a sharded one, gets one pass over the whole shared prefix).
Two prefills and two passes of the target, only when outputs differ. Replies known only as text (a benchmark's
servers) are tokenized and weighed as a step after the prompt and their common prefix (`text_divergence`).

    divergence = compare_runs(target, baseline_run, speculative_run)   # None when not comparable
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from uag.core.passes import prefill
from uag.core.records import Run
from uag.runtime.divergence import Divergence, classify, first_difference


def margin(logits: mx.array) -> float:
    """The gap between the two largest logits of one position (computed in float32).

    Example: [0.1, 2.5, 2.4] -> 0.1 (to float32 rounding)
    """
    top = mx.topk(logits.astype(mx.float32).reshape(-1), 2)
    return float(mx.max(top) - mx.min(top))


def pass_logits(target, read: Sequence[int], pass_ids: Sequence[int], index: int) -> mx.array:
    """The target's logits at `pass_ids[index]`'s output when it reads `read`, then `pass_ids` in one pass."""
    cache = target.make_cache()
    prefill(target.model, cache, list(read))
    return target.model(mx.array(list(pass_ids))[None], cache=cache)[0, index]


def pass_margin(target, read: Sequence[int], pass_ids: Sequence[int], index: int) -> float:
    """The target's margin at `pass_ids[index]`'s output when it reads `read`, then `pass_ids` in one pass.

    Example: pass_margin(t, prompt[:-1], [prompt[-1]], 0) is the margin of the first generated token as a
    one-token step; pass_margin(t, prompt[:-1], [prompt[-1], d1, d2], 1) as the second position of a k=2 pass.
    """
    return margin(pass_logits(target, read, pass_ids, index))


def step_margin(target, context: Sequence[int]) -> float:
    """The margin of the target's next token after `context`, computed as a one-token step (as the baseline and
    plain cycles do): read all but the last token, then step on it."""
    return pass_margin(target, context[:-1], context[-1:], 0)


def speculative_pass(run: Run, position: int) -> tuple[int, list[int], int] | None:
    """Where the speculative `run` computed generated token `position`: (tokens committed before that pass, the
    proposal it verified, `position`'s index in the pass's outputs); None when its cycles do not account for its
    tokens. A plain step (no proposal) is a pass over the pending token alone.

    Example: cycles emitting 3 (proposal [a, b, c]) then 2 -> position 4 is (3, <that cycle's proposal>, 1)
    """
    emitted = sum(c.emitted for c in run.cycles)
    start = run.generated - emitted  # 1 where the prompt pass verified no draft (its token has no cycle record)
    if start not in (0, 1) or position >= run.generated:
        return None
    if position < start:
        return 0, [], 0
    for cycle in run.cycles:
        if position < start + cycle.emitted:
            return start, list(cycle.proposed_ids), position - start
        start += cycle.emitted
    return None


def compare_runs(target, baseline: Run, speculative: Run) -> Divergence | None:
    """The verdict on a greedy speculative run against the target alone on the same prompt (module doc);
    None when they cannot be compared: sampled, stopped, or not the same prompt."""
    if (
        baseline.temperature
        or speculative.temperature
        or "stopped" in (baseline.finish_reason, speculative.finish_reason)
        or list(baseline.prompt_ids) != list(speculative.prompt_ids)
    ):
        return None
    a, b = baseline.token_ids, speculative.token_ids
    position = first_difference(a, b)
    if position is None or position >= min(len(a), len(b)):  # identical, or one stopped early: no token to weigh
        return classify(a, b, dtype=target.dtype)
    prompt = list(baseline.prompt_ids)
    context = prompt + a[:position]
    step = step_margin(target, context)
    where = speculative_pass(speculative, position)
    if where is None:  # one pass over everything before it (as long as the prompt: rounds like a verification)
        spec = pass_margin(target, [], context, len(context) - 1)
    else:
        start, proposal, index = where
        committed = prompt + a[:start]
        spec = pass_margin(target, committed[:-1], [committed[-1], *proposal], index)
    return classify(a, b, dtype=target.dtype, step_margins={position: step}, pass_margins={position: spec})


def completion_ids(target, text: str) -> list[int]:
    """A reply's text as target tokens, as they follow a prompt (no BOS).

    Example: completion_ids(t, " Warszawa.") -> the ids of " Warszawa." alone
    """
    return list(target.tokenizer.encode(text, add_special_tokens=False))


def text_divergence(
    target, prompt_ids: Sequence[int], reference: str, other: str, *, ended: tuple[bool, bool] = (False, False)
) -> Divergence | None:
    """The verdict on two greedy replies to the prompt `prompt_ids` known only as text (a benchmark's servers keep
    no tokens): both tokenized (`completion_ids`), and where they part, the target's margin computed as a one-token
    step after the prompt and their common prefix. `ended`: whether each reply was ended by the model (finish reason
    "stop"): where one text is a prefix of the other, the one that ended wrote an end-of-text token there (the
    target's likeliest), and one cut short wrote nothing to weigh. None where it cannot be told: one cut short, or
    neither text's token at that position is the target's top choice there (their tokens are not the ones generated,
    so the margin would weigh other tokens).

    Example: " a b c" vs " a b d" where the target's top two after prompt + " a b" are 0.003 apart (float32)
             -> kind "diverged_near_tie", position 2, step_margin 0.003
    """
    said = [completion_ids(target, reference), completion_ids(target, other)]
    position = first_difference(*said)
    if position is None:
        return classify(*said, dtype=target.dtype)
    context = [*prompt_ids, *said[0][:position]]
    logits = pass_logits(target, context[:-1], context[-1:], 0)
    for i, ids in enumerate(said):
        if len(ids) == position:  # this reply ends where the other goes on
            if not ended[i]:
                return None
            ends = getattr(target.tokenizer, "eos_token_ids", None) or [target.tokenizer.eos_token_id]
            ids.append(max(ends, key=lambda token: float(logits[token])))
    if int(mx.argmax(logits)) not in (said[0][position], said[1][position]):
        return None
    return classify(*said, dtype=target.dtype, step_margins={position: margin(logits)})
