"""Rejection sampling over a vocabulary intersection leaves the target's distribution unchanged."""

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from uag.core.verify import IdMap, Verdict, accept_greedy, accept_rejection, draft_distribution

# A 5-token target and a 6-token drafter: drafter ids 0..4 map to target ids 4..0 (reversed), drafter
# id 5 has no target counterpart and must never be drafted.
TO_TARGET = {0: 4, 1: 3, 2: 2, 3: 1, 4: 0}
P_LOGITS = mx.array([[2.0, 0.5, 0.1, -1.0, 1.0], [0.0, 1.0, 2.0, 0.5, -0.5]])  # positions 0 and 1 (bonus)
Q_LOGITS = mx.array([[0.3, 1.5, -0.2, 0.8, 0.0, 5.0]])  # the drafter prefers the masked id 5


def sample_outputs(trials: int, temperature: float) -> list[int]:
    """First emitted token of many independent cycles with one draft each."""
    id_map = IdMap(TO_TARGET, 6)
    q = draft_distribution(Q_LOGITS + id_map.drafter_mask, temperature)
    p = mx.softmax(P_LOGITS / temperature, axis=-1)
    outputs = []
    for _ in range(trials):
        draft = mx.random.categorical(mx.log(q[0])).item()
        assert draft != 5
        verdict = accept_rejection(p, q, [draft], [TO_TARGET[draft]], id_map)
        accepted, token = verdict.accepted, verdict.token
        outputs.append(TO_TARGET[draft] if accepted else token)
    return outputs


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_first_token_is_distributed_as_the_target_alone_would_sample_it(temperature):
    mx.random.seed(0)
    outputs = sample_outputs(6000, temperature)
    expected = np.array(mx.softmax(P_LOGITS[0] / temperature), dtype=np.float64)
    expected /= expected.sum()
    counts = np.bincount(outputs, minlength=5)
    assert chisquare(counts, expected * len(outputs)).pvalue > 1e-3, (counts, expected)


def test_the_drafter_mask_removes_tokens_the_target_lacks():
    id_map = IdMap(TO_TARGET, 6)
    q = np.array(draft_distribution(Q_LOGITS + id_map.drafter_mask, 1.0))[0]
    assert q[5] == 0 and q[:5].sum() == pytest.approx(1.0, abs=1e-6)
    in_target = np.array(id_map.to_target_space(mx.array(q), 5))
    assert in_target.tolist() == pytest.approx(q[:5][::-1].tolist())


def test_a_drafter_that_matches_the_target_is_always_accepted():
    id_map = IdMap(TO_TARGET, 6)
    q_logits = mx.array([[1.0, -1.0, 0.1, 0.5, 2.0, 0.0]])  # target logits of position 0, in drafter order
    q = draft_distribution(q_logits + id_map.drafter_mask, 1.0)
    mx.random.seed(1)
    for draft in range(5):
        accepted = accept_rejection(mx.softmax(P_LOGITS, axis=-1), q, [draft], [TO_TARGET[draft]], id_map).accepted
        assert accepted == 1


def test_greedy_keeps_the_agreed_prefix_and_takes_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 4]).committed([5, 6, 7]) == [5, 6, 9]
    assert accept_greedy([5, 6], [5, 6, 8]) == Verdict(2, 8)
    assert accept_greedy([], [3]).committed([]) == [3]
    assert accept_greedy([1, 2], [0, 2, 2]).accepted == 0
