"""Several lookup continuations verified as a tree in one target pass: the trie, its mask and walk (pure), the pass on
real tiny models (the logits and caches of reading the kept branch alone), lossless runs, and where it falls back."""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache
from scipy.stats import chisquare

import uag.core.engine as engine
from tests.support.tiny_models import build_tiny
from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice, LookupDrafter
from uag.core.kept_caches import position_runs
from uag.core.lookup import BRANCH_NODES, BRANCHES, OCCURRENCES, NgramIndex
from uag.core.passes import keep_path, prefill, tree_pass, tree_ready, verify_tree
from uag.core.sampling import TargetSampling
from uag.core.verify import Tree, accept_tree
from uag.runtime.batching import SharedModel

ARCHS = {"qwen2": "qwen2.5", "llama": "llama-3.2"}
PREFIX = [(7 * i) % 400 + 100 for i in range(20)]


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(store, request):
    return store.get(str(build_tiny(request.param, ARCHS[request.param], seed=3, tie_embeddings=False)))


def filled(model, ids) -> list:
    cache = make_prompt_cache(model.model)
    prefill(model.model, cache, ids)
    return cache


def close(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.allclose(a, b, atol=1e-4).item()


# --- the n-gram index's continuations (pure) -------------------------------------------------------------------


def test_continuations_are_the_distinct_followers_of_the_matched_ngram_latest_first():
    index = NgramIndex()
    index.extend([1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2])
    assert index.continuations(2, 4) == [[3, 9], [4, 1], [3, 1]]
    assert index.continuations(2, 4)[0] == index.propose(2)
    assert index.continuations(1, 4) == [[3], [4]]  # distinct: the two 3s are one
    assert index.continuations(2, 1) == [[3, 9]]
    assert NgramIndex().continuations(2, 3) == [] and index.continuations(0, 3) == []


def test_only_the_latest_occurrences_are_kept():
    index = NgramIndex()
    for follower in range(10, 10 + OCCURRENCES + 2):
        index.extend([1, 2, follower])
    index.extend([1, 2])
    assert index.continuations(1, 10) == [[f] for f in range(15, 15 - OCCURRENCES, -1)]  # 11 and 10 forgotten


def test_branches_only_for_a_short_match_and_within_their_node_budget():
    index = NgramIndex()
    index.extend([1, 2, 30, 31, 32, 33, 1, 2, 40, 41, 42, 43, 1, 2, 50, 51, 52, 53, 1, 2, 60, 61, 62, 63, 1, 2])
    assert index.propose(8)[:4] == [60, 61, 62, 63]
    branches = index.branches(8)  # room for 4 nodes over 3 alternatives, the latest first
    assert branches == [[50, 51], [40], [30]]
    assert index.branches(1) == [[50]]  # at least one node
    wide = index.branches(40)
    assert len(wide) == BRANCHES and sum(map(len, wide)) == BRANCH_NODES  # 8 nodes at most, shared evenly
    long = NgramIndex()
    copy = list(range(100, 120))
    long.extend([*copy, 7, 1, 2, 5, *copy])  # a 20-token match: a copy, verified alone
    assert long.match_length() >= 8 and long.branches(8) == []


def test_an_alternative_sharing_the_proposals_start_adds_only_its_own_nodes():
    index = NgramIndex()
    index.extend([1, 2, 5, 6, 9, 1, 2, 5, 6, 7, 1, 2])
    assert index.propose(4) == [5, 6, 7, 1]
    assert index.branches(4) == [[5, 6, 9, 1]]  # shares 5 6: two new nodes
    assert index.branches(2) == []  # 5 6 is the proposal itself: nothing new


def test_a_lookup_draft_carries_its_branches():
    class Vocab:
        pass

    drafter = LookupDrafter(Vocab())
    drafter.start([5, 1, 2, 3, 8, 6, 1, 2, 4, 8, 7, 1, 2])
    draft = drafter.propose("lookup", 4, 10)
    assert draft.proposed == [4, 8, 7, 1] and draft.branches == [[3, 8]]
    assert draft.cycle(4, 0, 1, verify_ms=0, resync_ms=0, resync_absorbed=False, loss=_no_loss()).branches == 2


def _no_loss():
    from uag.core.anatomy import Loss

    return Loss()


# --- the trie, its mask and its walk (pure) -------------------------------------------------------------------


def test_a_tree_merges_shared_prefixes_in_depth_first_order():
    tree = Tree.of([[5, 6, 7], [5, 8], [9], [5, 6, 7]])
    assert tree.tokens == [5, 6, 7, 8, 9]
    assert tree.parents == [-1, 0, 1, 0, -1]
    assert tree.depths == [1, 2, 3, 2, 1]
    assert tree.paths == [[0, 1, 2], [0, 3], [4], [0, 1, 2]]
    assert position_runs([[0, *tree.depths]]) == [(0, 4), (4, 5), (5, 6)]  # the rope calls of its pass


def test_each_row_sees_itself_and_its_ancestors_only():
    T, F = True, False
    assert Tree.of([[5, 6], [5, 8], [9]]).mask() == [
        [T, F, F, F, F],  # the pending token
        [T, T, F, F, F],  # 5
        [T, T, T, F, F],  # 5 6
        [T, T, F, T, F],  # 5 8: not 6
        [T, F, F, F, T],  # 9: none of the others
    ]


@pytest.mark.parametrize(
    ("choices", "path", "token", "branch"),
    [
        ([5, 6, 7, 0, 0, 0], [0, 1, 2], 0, 0),  # the first proposal, all kept, bonus 0
        ([5, 8, 0, 0, 3, 0], [0, 3], 3, 1),  # 5 then 8: the second proposal, bonus from 8's row
        ([9, 0, 0, 0, 0, 4], [4], 4, 2),
        ([2, 6, 7, 8, 3, 9], [], 2, 0),  # no child holds the target's choice: it is the next token
        ([5, 1, 0, 0, 0, 0], [0], 1, 0),  # 5 kept on both: the first given
    ],
)
def test_the_walk_follows_the_targets_choice_from_the_root(choices, path, token, branch):
    verdict = accept_tree(Tree.of([[5, 6, 7], [5, 8], [9]]), choices)
    assert (verdict.path, verdict.token, verdict.branch) == (path, token, branch)
    assert verdict.verdict.accepted == len(path)


def test_sampled_each_committed_token_is_distributed_as_the_target_alone_samples_it():
    """A 4-token target whose next-token distribution depends on the last token: rows are drawn once each, from
    the distribution of their context, and the walk's first two committed tokens follow p(t1) p(t2 | t1)."""
    first = mx.array([0.5, 1.5, 0.0, 1.0])
    after = mx.array([[2.0, 0.0, 0.5, 0.1], [0.0, 0.0, 2.0, 1.0], [1.0, 1.0, 0.0, -1.0], [0.2, 1.8, 0.3, 0.0]])
    tree = Tree.of([[1, 2], [3, 1], [0]])
    last = [None, *tree.tokens]  # the token each row reads
    logits = mx.stack([first if t is None else after[t] for t in last])
    mx.random.seed(0)
    pairs = []
    for _ in range(6000):
        choices = mx.random.categorical(logits).tolist()  # the sampler: one draw per row
        verdict = accept_tree(tree, choices)
        committed = [tree.tokens[i] for i in verdict.path] + [verdict.token]
        if len(committed) == 1:  # the next cycle draws the second token after it
            committed.append(mx.random.categorical(after[committed[0]]).item())
        pairs.append(committed[0] * 4 + committed[1])
    p1 = np.array(mx.softmax(first), dtype=np.float64)
    p2 = np.array(mx.softmax(after, axis=-1), dtype=np.float64)
    expected = (p1[:, None] * p2).reshape(-1)
    counts = np.bincount(pairs, minlength=16)
    assert chisquare(counts, expected / expected.sum() * len(pairs)).pvalue > 1e-3, (counts, expected)


# --- the pass on real models ------------------------------------------------------------------------------------


def test_a_tree_pass_gives_each_branch_the_logits_of_reading_it_alone(tiny):
    tree = Tree.of([[5, 6, 7], [5, 8, 9, 10], [11, 12]])
    cache = filled(tiny, PREFIX)
    logits = tree_pass(tiny.model, cache, 42, tree)[0]
    for path in tree.paths:
        alone = tiny.model(mx.array([42, *(tree.tokens[i] for i in path)])[None], cache=filled(tiny, PREFIX))[0]
        assert close(logits[mx.array([0, *(i + 1 for i in path)])], alone)
    # without the tree's mask and positions the third branch would read the first two
    causal = tiny.model(mx.array([42, *tree.tokens])[None], cache=filled(tiny, PREFIX))[0]
    assert not close(causal[-1], logits[-1])
    attention = tiny.model.layers[0].self_attn
    assert "rope" not in vars(attention) and "rope" in attention  # the layer's own rope is back


def test_keeping_a_later_branch_leaves_the_cache_as_reading_it_directly(tiny):
    tree = Tree.of([[5, 6, 7], [5, 8, 9, 10], [11, 12]])
    for path in [tree.paths[1], tree.paths[2], tree.paths[0][:2], []]:
        cache = filled(tiny, PREFIX)
        tree_pass(tiny.model, cache, 42, tree)
        keep_path(cache, len(PREFIX) + 1, path)
        direct = filled(tiny, [*PREFIX, 42, *(tree.tokens[i] for i in path)])
        for mine, theirs in zip(cache, direct):
            assert mine.offset == theirs.offset == len(PREFIX) + 1 + len(path)
            assert close(mine.keys[..., : mine.offset, :], theirs.keys[..., : theirs.offset, :])
            assert close(mine.values[..., : mine.offset, :], theirs.values[..., : theirs.offset, :])


def test_verify_tree_keeps_the_second_branch_where_the_target_writes_it(tiny):
    sampling = TargetSampling.of(GenerationConfig(max_tokens=8))
    cache = filled(tiny, PREFIX)
    logits = tiny.model(mx.array([42])[None], cache=filled(tiny, PREFIX))[0, -1]
    follows = int(mx.argmax(logits).item())  # what the target writes after the pending token 42
    wrong = (follows + 1) % 1000
    verdict = verify_tree(tiny.model, cache, 42, [[wrong, 3], [follows, 4]], sampling.ids)
    assert verdict.branch == 1 and verdict.path == [2]
    assert cache[0].offset == len(PREFIX) + 2
    direct = filled(tiny, [*PREFIX, 42, follows])
    assert all(close(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :]) for a, b in zip(cache, direct))


# --- runs: lossless, the kept branch recorded, fallbacks -------------------------------------------------------


def repeating_prompts(n: int) -> list[list[int]]:
    """Token prompts built of a few pieces, so that short n-grams recur followed differently."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        pieces = [rng.randrange(1000, 5000) for _ in range(6)]
        out.append([rng.choice(pieces) for _ in range(60)])
    return out


@pytest.fixture
def kept_branches(monkeypatch):
    kept: list[int] = []
    verify = engine.verify_tree

    def spy(*args, **kwargs):
        verdict = verify(*args, **kwargs)
        kept.append(verdict.branch)
        return verdict

    monkeypatch.setattr(engine, "verify_tree", spy)
    return kept


def test_greedy_runs_with_trees_equal_the_target_alone(tiny, kept_branches):
    trees = 0
    for prompt in repeating_prompts(6):
        expected = engine.generate(tiny, None, prompt, GenerationConfig("baseline", max_tokens=40)).token_ids
        for k in (2, 4, 8):
            kept_branches.clear()
            run = engine.generate(tiny, DrafterChoice(lookup=True), prompt, GenerationConfig(k=k, max_tokens=40))
            assert run.token_ids == expected, (prompt, k)
            assert sum(c.branches > 1 for c in run.cycles) == len(kept_branches)
            for i, cycle in enumerate(run.cycles):  # the record's proposal is the kept branch: its kept part written
                start = len(run.token_ids) - sum(c.emitted for c in run.cycles[i:])
                assert run.token_ids[start : start + cycle.accepted] == cycle.proposed_ids[: cycle.accepted]
                assert len(cycle.proposed_ids) <= k
            trees += len(kept_branches)
    assert trees > 0


def second_branch_prompt(model) -> tuple[list[int], int]:
    """A prompt ending in "a b", which occurred twice before: latest followed by a token the target does not write
    next, earlier by the one it does (found by feeding the target's choice back until it holds)."""
    rng = random.Random(1)
    a, b = 1500, 1501
    for _ in range(20):
        head, middle = [rng.randrange(2000, 5000) for _ in range(8)], [rng.randrange(2000, 5000) for _ in range(8)]
        right, wrong = rng.randrange(2000, 5000), rng.randrange(2000, 5000)
        for _ in range(6):
            prompt = [*head, a, b, right, *middle, a, b, wrong, 7, a, b]
            choice = int(mx.argmax(model.model(mx.array(prompt)[None])[0, -1]).item())
            if choice == right != wrong:
                return prompt, right
            right = choice
    raise AssertionError("no prompt found whose earlier continuation the target writes")


def test_a_run_keeps_the_second_continuation_where_the_target_writes_it(tiny, kept_branches):
    prompt, right = second_branch_prompt(tiny)
    expected = engine.generate(tiny, None, prompt, GenerationConfig("baseline", max_tokens=12)).token_ids
    run = engine.generate(tiny, DrafterChoice(lookup=True), prompt, GenerationConfig(k=4, max_tokens=12))
    assert run.token_ids == expected and expected[0] == right
    assert kept_branches[0] == 1  # the opening's tree: the second branch kept
    opening = run.cycles[0]
    assert opening.branches == 2 and opening.proposed_ids[0] == right and opening.accepted >= 1


def test_sampled_runs_with_trees_repeat_with_the_seed(tiny, kept_branches):
    prompt = repeating_prompts(5)[4]
    config = GenerationConfig(k=4, max_tokens=30, temperature=0.8, seed=11)
    runs = [engine.generate(tiny, DrafterChoice(lookup=True), prompt, config).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30
    assert kept_branches  # the tree was used


def test_penalties_verify_one_branch_losslessly(tiny, kept_branches):
    prompt = repeating_prompts(5)[4]
    expected = engine.generate(tiny, None, prompt, GenerationConfig("baseline", max_tokens=30, repetition_penalty=1.3))
    config = GenerationConfig(k=4, max_tokens=30, repetition_penalty=1.3)
    run = engine.generate(tiny, DrafterChoice(lookup=True), prompt, config)
    assert run.token_ids == expected.token_ids
    assert not kept_branches and all(c.branches == 1 for c in run.cycles)


def test_the_tree_is_not_tried_where_it_cannot_run(tiny):
    plain = TargetSampling.of(GenerationConfig(max_tokens=4))
    cache = make_prompt_cache(tiny.model)
    assert tree_ready(tiny.model, cache, plain)
    assert tree_ready(SharedModel(tiny.model, "target"), cache, plain)  # a server's, called outside a batch
    assert not tree_ready(tiny.model, cache, plain, batched=True)  # a model of its own, yet the run is in a batch
    assert not tree_ready(tiny.model, [RotatingKVCache(max_size=16) for _ in cache], plain)
    assert not tree_ready(tiny.model, [QuantizedKVCache() for _ in cache], plain)
    assert not tree_ready(tiny.model, cache[:-1], plain)
    penalized = TargetSampling.of(GenerationConfig(max_tokens=4, repetition_penalty=1.2))
    assert not tree_ready(tiny.model, cache, penalized)
    constrained = TargetSampling.of(GenerationConfig(max_tokens=4), grammar=object())  # a matcher follows one branch
    assert not tree_ready(tiny.model, cache, constrained)


def test_a_server_s_model_verifies_trees_in_a_batch_on_the_caches_it_keeps(tiny):
    """Alone, a member's tree pass is the model's own call (on plain caches); with others, the batch reads it on its
    kept caches (plain KV caches, or rows of them), so a rotating cache, which cannot be a row, gets no tree there."""
    from uag.runtime.batching import Batch
    from uag.runtime.worker import Job

    shared, plain = SharedModel(tiny.model, "target"), TargetSampling.of(GenerationConfig(max_tokens=4))
    seen = []

    def request(job, name):
        cache, rotating = make_prompt_cache(tiny.model), [RotatingKVCache(max_size=16) for _ in tiny.model.layers]
        seen.append((name, shared.alone(), tree_ready(shared, cache, plain), tree_ready(shared, rotating, plain)))
        shared(mx.array([[1, 2]]), cache=cache)  # a pass: the batch's round, where others run
        seen.append((name, shared.alone(), tree_ready(shared, cache, plain), tree_ready(shared, rotating, plain)))
        yield name

    batch, queued = Batch(max_size=2), [True]
    batch.queued = lambda: queued[0]
    jobs = [Job(request, (name,), name, shared=True) for name in ("a", "b")]
    batch.join(jobs[0])  # a job waits to start: not alone
    queued[0] = False
    batch.join(jobs[1])
    while batch:
        batch.round()
    assert seen[:2] == [("a", False, True, False), ("b", False, True, False)]  # two members: the batch reads trees
    assert seen[2][2:] == (True, False)  # after the pass its cache is a row of the kept caches: trees still
    alone = Job(request, ("alone",), "alone", shared=True)
    batch.join(alone)
    assert list(alone) == ["alone"] and seen[-2:] == [("alone", True, True, False)] * 2


def test_greedy_runs_with_trees_in_a_batch_equal_the_target_alone(tiny, kept_branches, monkeypatch):
    """Requests batched together verify their lookup trees in the batch's passes, beside each other's proposals and
    plain steps, and write what the target alone writes."""
    from uag.core.kept_caches import KeptCaches
    from uag.runtime.batching import Batch, sharing_now
    from uag.runtime.worker import Job

    passes, run = [], KeptCaches.run

    def spy(self, model, rows, inputs, wait=True, trees=None, packed=False):
        passes.append((len(rows), sum(t is not None for t in trees or [])))
        return run(self, model, rows, inputs, wait, trees, packed)

    monkeypatch.setattr(KeptCaches, "run", spy)
    prompts = repeating_prompts(4)
    expected = [engine.generate(tiny, None, p, GenerationConfig("baseline", max_tokens=40)).token_ids for p in prompts]
    shared = dataclasses.replace(tiny, model=SharedModel(tiny.model, "target"))

    def request(job, prompt, k):
        config = GenerationConfig(k=k, max_tokens=40)
        yield engine.generate(shared, DrafterChoice(lookup=True), prompt, config, sharing=sharing_now()).token_ids

    for k in (2, 4):
        kept_branches.clear()
        batch, joining = Batch(max_size=4), [True]
        batch.queued = lambda joining=joining: joining[0]  # the first does not run alone before the others join
        jobs = [Job(request, (p, k), f"r{i}", shared=True) for i, p in enumerate(prompts)]
        for job in jobs:
            batch.join(job)
        joining[0] = False
        while batch:
            batch.round()
        assert [next(iter(job)) for job in jobs] == expected, k
    assert kept_branches and any(rows > 1 and trees for rows, trees in passes)  # trees read beside other rows


def test_a_model_with_its_window_in_the_mask_verifies_trees_losslessly(store, kept_branches):
    gemma = store.get(str(build_tiny("gemma3_text", "llama-3.2", seed=3, tie_embeddings=False)))  # a window of 8
    for prompt in repeating_prompts(5):
        expected = engine.generate(gemma, None, prompt, GenerationConfig("baseline", max_tokens=30)).token_ids
        run = engine.generate(gemma, DrafterChoice(lookup=True), prompt, GenerationConfig(k=4, max_tokens=30))
        assert run.token_ids == expected
    assert kept_branches
