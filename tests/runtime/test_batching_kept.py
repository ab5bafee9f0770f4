"""A batch keeps its members' plain KV caches merged between passes (uag.core.kept_caches): requests of a tiny random
target run through the real engine in one `Batch`, speculating with drafters that are kept in full (the target as
its own drafter), rejected (another model), or in part (prompt lookup), at different k, one of them joining late,
and each one's greedy tokens equal the target alone's; no pass merges caches afresh, and every cache leaves the
batch as plain KV caches."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import uag.runtime.batching
from tests.support.tiny_models import build_tiny, unshare
from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice
from uag.core.engine import generate
from uag.core.kept_caches import KeptCaches
from uag.core.passes import PromptCaches
from uag.runtime.batching import Batch, PassCosts, SharedModel, handed_back, share
from uag.runtime.worker import Job


@pytest.fixture(scope="module")
def pair(store):
    target = store.get(str(build_tiny("llama", "llama-3.2", seed=21, tie_embeddings=False)))
    other = store.get(str(build_tiny("llama", "llama-3.2", seed=22, tie_embeddings=False)))
    yield target, other
    unshare(target, other)


def request(job, target, drafter, ids: list[int], config: GenerationConfig, out: dict, name: str):
    caches = PromptCaches()
    out[name] = generate(target, drafter, ids, config, caches=caches)
    handed_back()  # as the host does at a run's end
    out[name, "caches"] = caches
    yield name


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_members_on_kept_caches_match_the_target_alone_and_no_pass_merges(pair, monkeypatch, packing):
    """Packed (a CPU's default: a round's rows as one unpadded sequence) and padded (a GPU's) alike."""
    target, other = pair
    base = [5, 17, 23, 42, 8, 99, 61, 5, 17, 23, 42, 8, 99, 61]
    requests = {  # name: (drafter, prompt ids, k, max_tokens)
        "self": (DrafterChoice(model=target), [3, *base], 3, 24),  # kept in full
        "other": (DrafterChoice(model=other), [7, 7, 9] * 9, 2, 16),  # rejected: every cycle trims
        "lookup": (DrafterChoice(lookup=True), base * 3, 4, 30),  # kept in part
        "late": (DrafterChoice(model=other), [11, 12], 4, 20),
    }
    alone = {
        name: generate(target, None, ids, GenerationConfig("baseline", max_tokens=n)).token_ids
        for name, (_, ids, _, n) in requests.items()
    }

    def merged_afresh(*args, **kwargs):
        raise AssertionError("plain KV caches were merged for a pass")

    monkeypatch.setattr(uag.runtime.batching, "batched_pass", merged_afresh)
    passes, run = [], KeptCaches.run

    def recorded(kept, model, rows, inputs, wait=True, trees=None, packed=False):
        passes.append(sorted(int(x.shape[-1]) for x in inputs))
        packs.append(packed)
        read_trees.append(any(t is not None for t in trees or ()))
        return run(kept, model, rows, inputs, wait, trees, packed)

    packs: list[bool] = []
    read_trees: list[bool] = []  # a lookup proposal may go as a tree (its shared index's branches): padded
    monkeypatch.setattr(KeptCaches, "run", recorded)
    share(target, "target")
    share(other, "drafter")
    out: dict = {}
    batch = Batch(max_size=4)
    batch.packing = packing
    batch.queued = lambda: True  # as under load: a member alone still waits for its rounds
    jobs = {
        name: Job(request, (target, d, ids, GenerationConfig("context", k, max_tokens=n), out, name), name, shared=True)
        for name, (d, ids, k, n) in requests.items()
    }
    for name in ("self", "other", "lookup"):
        batch.join(jobs[name])
    held = []
    for rounds in range(10_000):
        if not batch:
            break
        if rounds == 6:
            batch.join(jobs["late"])
        batch.round()
        held.append(sum(len([o for o in k.owners if o is not None]) for k in batch.kept.values()))
    for job in jobs.values():
        list(job)  # raises what the job raised
    assert {name: out[name].token_ids for name in requests} == alone
    assert max(held) >= 3 and not batch.kept  # rows were kept across rounds, and all of them went back
    assert any(len(w) >= 3 and w[0] < w[-1] for w in passes)  # ragged passes of three members and more
    ragged = [w[0] < w[-1] and not tree for w, tree in zip(passes, read_trees)]  # each such pass packs, or none
    assert packs == (ragged if packing else [False] * len(passes)) and any(ragged)
    for name in requests:
        caches = out[name, "caches"]
        assert all(type(c) is KVCache for c in caches.target_cache)
        assert caches.target_cache[0].offset == len(caches.target_ids)


class Flaky:
    """A model whose pass over two rows fails (say, out of memory), after writing its first layer."""

    def __init__(self, model):
        self.model = model

    def __call__(self, inputs, cache=None):
        if inputs.shape[0] == 2:
            cache[0].update_and_fetch(*[mx.zeros((2, 2, inputs.shape[1], 16))] * 2)
            raise RuntimeError("out of memory")
        return self.model(inputs, cache=cache)


def steps(job, plan: list, caches: dict, name: str):
    """A member's passes: (shared model, loaded model, width) each, a cache per model; its caches go to `caches`."""
    for shared, loaded, width in plan:
        cache = caches.setdefault((name, id(shared)), loaded.make_cache())
        shared(mx.array([[5] * width]), cache=cache)
        yield width


def test_a_failed_pass_on_kept_caches_fails_every_member_holding_a_row_and_no_other(pair, monkeypatch):
    """b and c fail with their pass; a, whose target cache was a row beside theirs, fails at its next target pass
    (and its cache comes back empty); d, whose rows were never in the target's kept caches, runs to its end. The
    target's passes are served every round (HOLD_ROUNDS 0), so that a and d draft while b and c verify."""
    import uag.runtime.batching

    monkeypatch.setattr(uag.runtime.batching, "HOLD_ROUNDS", 0)
    target, other = pair
    flaky, drafter = SharedModel(Flaky(target.model), "target"), SharedModel(other.model, "drafter")
    plans = {
        "a": [(flaky, target, 3), (drafter, other, 1), (flaky, target, 1)],
        "b": [(flaky, target, 3), (flaky, target, 1)],
        "c": [(flaky, target, 3), (flaky, target, 1)],
        "d": [(drafter, other, 2), (drafter, other, 1), (drafter, other, 1)],
    }
    caches: dict = {}
    batch = Batch(max_size=4)
    batch.queued = lambda: True
    jobs = {name: Job(steps, (plan, caches, name), name, shared=True) for name, plan in plans.items()}
    for job in jobs.values():
        batch.join(job)
    while batch:
        batch.round()
    for name in "bc":
        with pytest.raises(RuntimeError, match="out of memory"):
            list(jobs[name])
    with pytest.raises(RuntimeError, match="lost with a batched pass that failed"):
        list(jobs["a"])
    assert list(jobs["d"]) == [2, 1, 1] and not batch.kept and not batch.lost
    assert all(type(c) is KVCache and c.offset == 0 for c in caches["a", id(flaky)])


class Device:
    """mlx.core as uag.runtime.batching sees it, where waiting for a queued pass fails once (on a GPU: the device
    ran out of memory computing it)."""

    def __init__(self):
        self.fail_next = False

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *arrays):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("[metal::malloc] Resource limit exceeded")
        return mx.eval(*arrays)


def test_one_token_passes_are_queued_and_one_that_fails_on_the_device_fails_its_members(pair, monkeypatch):
    """a, b and c step one token at a time on the target: their pass is queued (as on a GPU), not waited for, and
    each member runs on to its next pass meanwhile (`ahead`). The batch waits for it once the next one is queued
    behind it; where that fails, every member holding a row of those kept caches fails (their caches come back
    empty), and d, drafting with another model, runs to its end."""
    import uag.runtime.batching

    monkeypatch.setattr(uag.runtime.batching, "HOLD_ROUNDS", 0)
    device = Device()
    monkeypatch.setattr(uag.runtime.batching, "mx", device)
    target, other = pair
    shared, drafter = SharedModel(target.model, "target"), SharedModel(other.model, "drafter")
    plans = {name: [(shared, target, 1)] * 3 for name in "abc"}
    plans["d"] = [(drafter, other, 1)] * 3
    caches: dict = {}
    batch = Batch(max_size=4)
    batch.queued = lambda: True
    batch.pipelined = True  # as on a GPU
    jobs = {name: Job(steps, (plan, caches, name), name, shared=True) for name, plan in plans.items()}
    for job in jobs.values():
        batch.join(job)
    batch.round()
    kept = batch.kept[id(shared)]
    assert batch.ahead is not None and batch.ahead[0] is kept and len(batch.waiting) == 4
    device.fail_next = True
    while batch:
        batch.round()
    for name in "abc":
        with pytest.raises(RuntimeError, match="lost with a batched pass that failed"):
            list(jobs[name])
        assert all(type(c) is KVCache and c.offset == 0 for c in caches[name, id(shared)])
    assert list(jobs["d"]) == [1, 1, 1] and kept.broken and not batch.kept and not batch.lost


def test_queued_passes_give_the_tokens_waited_for_passes_give(pair):
    """Four requests decoding plainly in one batch, its one-token passes queued and waited for: the same tokens,
    the target alone's."""
    target, _ = pair
    prompts = [[3, 5, 7, 9], [11, 13] * 5, [17] * 9, [19, 23, 29]]
    alone = [generate(target, None, ids, GenerationConfig("baseline", max_tokens=12)).token_ids for ids in prompts]
    share(target, "target")
    for pipelined in (True, False):
        out: dict = {}
        batch = Batch(max_size=4)
        batch.pipelined = pipelined
        batch.queued = lambda: True
        config = GenerationConfig("baseline", max_tokens=12)
        jobs = [Job(request, (target, None, ids, config, out, i), str(i), shared=True) for i, ids in enumerate(prompts)]
        for job in jobs:
            batch.join(job)
        queued = 0
        while batch:
            batch.round()
            queued += batch.ahead is not None
        for job in jobs:
            list(job)
        assert [out[i].token_ids for i in range(4)] == alone
        assert (queued > 0) == pipelined


@pytest.mark.parametrize("beside, first", [(True, [48, 48, 48]), (False, [50, 69, 159])])
def test_prompts_arriving_together_share_their_reads_and_give_the_target_alones_tokens(
    pair, monkeypatch, beside, first
):
    """Three prompts longer than a read (`Batch.narrow`: here 48 tokens), of different lengths, join at once: their
    reads share a pass (`batched_pass`), a chunk each beside a member decoding, whole where nobody decodes (as mlx-lm
    prefills a wave of prompts); each member's greedy tokens, plain or speculating, equal the target alone's. The
    batch prices a pass as a GPU does (its fixed cost worth hundreds of tokens), so that padding the narrower reads
    pays."""
    target, other = pair
    prompts = {"short": [3, 5, 7] * 17, "long": [11, 13, 17, 19] * 40, "mid": [23, 29] * 35}
    drafters = {"short": None, "long": DrafterChoice(model=other), "mid": DrafterChoice(lookup=True), "beside": None}
    if beside:
        prompts["beside"] = [31, 37]
    alone = {
        name: generate(target, None, ids, GenerationConfig("baseline", max_tokens=10)).token_ids
        for name, ids in prompts.items()
    }
    reads, shared_pass = [], uag.runtime.batching.batched_pass

    def recorded(model, inputs, caches):
        reads.append(sorted(int(x.shape[-1]) for x in inputs))
        return shared_pass(model, inputs, caches)

    monkeypatch.setattr(uag.runtime.batching, "batched_pass", recorded)
    share(target, "target")
    share(other, "drafter")
    out: dict = {}
    batch = Batch(max_size=4, read_chunk=48)
    batch.queued, batch.costs = (lambda: True), PassCosts(prior_rows=500)
    jobs = {}
    for name, ids in prompts.items():
        config = GenerationConfig("baseline" if drafters[name] is None else "context", 3, max_tokens=10)
        jobs[name] = Job(request, (target, drafters[name], ids, config, out, name), name, shared=True)
    if beside:
        batch.join(jobs["beside"])
        batch.round()  # it reads its prompt alone, then decodes while the others read
    for name in ("short", "long", "mid"):
        batch.join(jobs[name])
    while batch:
        batch.round()
    for job in jobs.values():
        list(job)
    assert {name: out[name].token_ids for name in prompts} == alone
    assert reads[0] == first  # each prompt but its last token (the first step's input), read in one pass
    for name in prompts:
        caches = out[name, "caches"]
        assert all(type(c) is KVCache for c in caches.target_cache)
        assert caches.target_cache[0].offset == len(caches.target_ids)


@pytest.mark.parametrize("prior_rows, read", [(500, False), (16, True)])
def test_a_short_prompt_rides_in_the_kept_pass_where_a_pass_costs_hundreds_of_tokens(
    pair, monkeypatch, prior_rows, read
):
    """A prompt of 40 tokens joining a member that decodes: where a pass's fixed cost is worth hundreds of tokens
    (a GPU), it is read in the batch's pass on the kept caches beside the other's step, padded (`Batch.narrow`); where
    it is worth a few (a CPU), it is a read of its own on a plain cache. Both give the target alone's tokens."""
    target, other = pair
    prompts = {"beside": [31, 37], "turn": [3, 5, 7, 11] * 10}
    alone = {
        name: generate(target, None, ids, GenerationConfig("baseline", max_tokens=6)).token_ids
        for name, ids in prompts.items()
    }
    reads, widths = [], []
    shared_pass, run = uag.runtime.batching.batched_pass, KeptCaches.run

    def recorded(model, inputs, caches):
        reads.append(sorted(int(x.shape[-1]) for x in inputs))
        return shared_pass(model, inputs, caches)

    def kept(self, model, rows, inputs, wait=True, trees=None, packed=False):
        widths.append(sorted(int(x.shape[-1]) for x in inputs))
        return run(self, model, rows, inputs, wait, trees, packed)

    monkeypatch.setattr(uag.runtime.batching, "batched_pass", recorded)
    monkeypatch.setattr(KeptCaches, "run", kept)
    share(target, "target")
    share(other, "drafter")
    out: dict = {}
    batch = Batch(max_size=4)
    batch.queued, batch.costs = (lambda: True), PassCosts(prior_rows=prior_rows)
    jobs = {
        name: Job(
            request, (target, None, ids, GenerationConfig("baseline", max_tokens=6), out, name), name, shared=True
        )
        for name, ids in prompts.items()
    }
    batch.join(jobs["beside"])
    batch.round()  # it reads its prompt alone, then decodes
    batch.join(jobs["turn"])
    while batch:
        batch.round()
    for job in jobs.values():
        list(job)
    assert {name: out[name].token_ids for name in prompts} == alone
    assert ([1, 39] in widths) is not read  # the prompt but its last token, beside the other's step
    assert any(39 in w for w in widths) is not read


@pytest.mark.parametrize("pipelined", [True, False])
def test_members_verifying_greedily_get_the_targets_picks_read_with_the_pass(pair, monkeypatch, pipelined):
    """Greedy members verifying with others (a proposal, a lookup tree, a drafter model's) read none of the target's
    picks themselves: the batch reads them with the pass (one read-back a round), and every member gets the target
    alone's tokens, on a GPU's queued passes (`pipelined`) as on a CPU's."""
    from uag.core.sampling import TargetSampling

    target, other = pair
    base = [5, 17, 23, 42, 8, 99, 61, 5, 17, 23, 42, 8, 99, 61]
    requests = {
        "self": (DrafterChoice(model=target), [3, *base], 3, 20),
        "other": (DrafterChoice(model=other), [7, 7, 9] * 9, 2, 16),
        "lookup": (DrafterChoice(lookup=True), base * 3, 4, 24),
    }
    alone = {
        name: generate(target, None, ids, GenerationConfig("baseline", max_tokens=n)).token_ids
        for name, (_, ids, _, n) in requests.items()
    }
    read_back, own = [], TargetSampling.ids

    def counted(sampling, logits):
        read_back.append(logits.shape[0])
        return own(sampling, logits)

    monkeypatch.setattr(TargetSampling, "ids", counted)
    share(target, "target")
    share(other, "drafter")
    out: dict = {}
    batch = Batch(max_size=3)
    batch.pipelined = pipelined
    batch.queued = lambda: True  # never alone: every pass is the batch's
    jobs = {
        name: Job(request, (target, d, ids, GenerationConfig("context", k, max_tokens=n), out, name), name, shared=True)
        for name, (d, ids, k, n) in requests.items()
    }
    for job in jobs.values():
        batch.join(job)
    while batch:
        batch.round()
    for job in jobs.values():
        list(job)
    assert {name: out[name].token_ids for name in requests} == alone
    verified = [c.source for name in requests for c in out[name].cycles if c.source]
    assert {"model", "lookup"} <= set(verified) and len(verified) > 10 and read_back == []


def test_a_member_left_alone_verifying_a_proposal_hands_back_only_the_targets_cache(pair):
    """Once the others have ended, a greedy verify of one proposal is the target's own call, as any pass of a member
    alone: its target cache comes back plain; its drafter cache stays a row of the kept caches until a drafter pass
    of its own needs it (handing it back too would copy it out, and in again at its next batched pass)."""
    from uag.core.kept_caches import RowCache
    from uag.core.passes import verify_pass

    target, other = pair
    shared, drafter = SharedModel(target.model, "target"), SharedModel(other.model, "drafter")
    caches: dict = {}
    verified = []

    def alone_at_the_end(job):
        yield from steps(job, [(shared, target, 3), (drafter, other, 3), (shared, target, 1)], caches, "a")
        own = caches["a", id(shared)]
        logits, picks = verify_pass(shared, mx.array([[5, 6, 7]]), own, greedy=True)
        verified.append((logits.shape, picks, [type(c) for c in own], [type(c) for c in caches["a", id(drafter)]]))

    batch = Batch(max_size=2)
    waiting = [True]
    batch.queued = lambda: waiting[0]
    a = Job(alone_at_the_end, (), "a", shared=True)
    b = Job(steps, ([(shared, target, 3), (drafter, other, 3)], caches, "b"), "b", shared=True)
    batch.join(a)
    batch.join(b)
    while len(batch) > 1:
        batch.round()
    waiting[0] = False  # b has ended and nobody waits to start: a runs alone
    while batch:
        batch.round()
    list(a), list(b)
    [(shape, picks, target_types, drafter_types)] = verified
    assert shape == (1, 3, target.model.args.vocab_size) and picks is None  # its own call: it picks itself
    assert set(target_types) == {KVCache} and set(drafter_types) == {RowCache}


def test_a_verifying_pass_whose_picks_fail_on_the_device_fails_its_members_and_loses_its_kept_caches(pair, monkeypatch):
    """A greedy verifying pass is queued and waited for with its picks; where that fails (the device ran out of
    memory computing it), the members it served fail with the error, and the kept caches it wrote are lost: their
    caches come back empty, so that no later turn trusts them."""
    from uag.core.passes import verify_pass

    device = Device()
    monkeypatch.setattr(uag.runtime.batching, "mx", device)
    target, _ = pair
    shared = SharedModel(target.model, "target")
    caches: dict = {}

    def verifying(job, name):
        cache = caches.setdefault(name, target.make_cache())
        shared(mx.array([[5, 6]]), cache=cache)  # a row of the kept caches from here on
        yield "read"
        yield verify_pass(shared, mx.array([[7, 8, 9]]), cache, greedy=True)[1]

    batch = Batch(max_size=2)
    batch.queued = lambda: True
    jobs = {name: Job(verifying, (name,), name, shared=True) for name in "ab"}
    for job in jobs.values():
        batch.join(job)
    batch.round()
    kept = batch.kept[id(shared)]
    device.fail_next = True
    while batch:
        batch.round()
    for name in "ab":
        with pytest.raises(RuntimeError, match="Resource limit exceeded"):
            list(jobs[name])
        assert all(type(c) is KVCache and c.offset == 0 for c in caches[name])
    assert kept.broken and not batch.kept and not batch.lost
