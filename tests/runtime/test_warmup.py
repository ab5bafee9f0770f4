"""The batched passes run once at a server's start where kernels are compiled at first use (uag.runtime.warmup)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlx_lm.models.cache import RotatingKVCache

import uag.runtime.host
from tests.support.tiny_models import build_tiny
from uag.core.config import GenerationConfig
from uag.core.engine import generate
from uag.core.kept_caches import KeptCaches
from uag.models.store import ModelStore
from uag.runtime.batching import SharedModel, share
from uag.runtime.host import Host
from uag.runtime.jobs import JobRunner
from uag.runtime.pair import Loaded
from uag.runtime.warmup import warm_batch, warm_kept_caches
from uag.runtime.worker import MLXWorker


@pytest.fixture
def shared_pair(store):
    target = store.get(str(build_tiny("llama", "mistral-v1", seed=3)))
    drafter = store.get(str(build_tiny("llama", "mistral-v1", seed=12)))
    share(target, "target")
    share(drafter, "drafter")
    yield target, drafter
    target.model, drafter.model = target.model.inner, drafter.model.inner  # the store's models, unshared again


def test_the_warm_up_runs_batched_passes_of_both_models_and_leaves_nothing_behind(shared_pair, monkeypatch):
    """Prompts read together, plain steps and drafts verified on the target's kept caches, and the drafter's passes
    batched too: every kind of pass a server's batch runs, once. Afterwards the models answer as before."""
    target, drafter = shared_pair
    before = generate(target, drafter, [5, 6, 7, 8] * 4, GenerationConfig(k=3, max_tokens=12)).token_ids
    kept_passes: list[int] = []
    run = KeptCaches.run

    def counted(self, model, rows, inputs, wait=True, trees=None, packed=False):
        kept_passes.append(id(model))
        return run(self, model, rows, inputs, wait, trees, packed)

    monkeypatch.setattr(KeptCaches, "run", counted)
    seconds = warm_batch(target, drafter)
    assert seconds > 0
    assert id(target.model.inner) in kept_passes and id(drafter.model.inner) in kept_passes
    assert isinstance(target.model, SharedModel) and isinstance(drafter.model, SharedModel)
    monkeypatch.setattr(KeptCaches, "run", run)
    assert generate(target, drafter, [5, 6, 7, 8] * 4, GenerationConfig(k=3, max_tokens=12)).token_ids == before


def test_the_warm_up_drafts_with_the_model_as_auto_does_as_well_as_with_fixed_k(shared_pair, monkeypatch):
    """One of its model runs drafts under a stop rule (what auto's drafts compute: each draft's chance), the other
    with fixed k: both kinds of drafter pass are built before a request needs them."""
    from uag.core.drafters import ModelDrafter

    target, drafter = shared_pair
    kinds: list[str] = []
    draft, until = ModelDrafter._draft, ModelDrafter._draft_until
    monkeypatch.setattr(ModelDrafter, "_draft", lambda self, k: kinds.append("fixed") or draft(self, k))
    monkeypatch.setattr(
        ModelDrafter, "_draft_until", lambda self, k, stop: kinds.append("until") or until(self, k, stop)
    )
    warm_batch(target, drafter)
    assert "fixed" in kinds and "until" in kinds


def test_the_warm_up_decodes_beside_a_longer_prompts_read(shared_pair, monkeypatch):
    """Its prompts differ in length, as a wave of first turns does: a member whose read ended decodes on the target
    in the same round as another's read of the target goes on, which prompts alike never did."""
    from uag.runtime.batching import Batch

    target, drafter = shared_pair
    rounds: list[set[str]] = []
    round_, read, decode = Batch.round, Batch._read, Batch._decode

    def counted_round(self):
        rounds.append(set())
        return round_(self)

    monkeypatch.setattr(Batch, "round", counted_round)

    def noted(kind, run):
        def passes(self, members, *args, **kwargs):
            rounds[-1].update((kind, self.waiting[m].model.role) for m in members)
            return run(self, members, *args, **kwargs)

        return passes

    monkeypatch.setattr(Batch, "_read", noted("read", read))
    monkeypatch.setattr(Batch, "_decode", noted("decode", decode))
    warm_batch(target, drafter)
    assert any({("read", "target"), ("decode", "target")} <= kinds for kinds in rounds)


def test_the_warm_up_compacts_kept_caches_and_reads_a_tree_once(shared_pair, monkeypatch):
    """What a batch does now and then, which a short made-up batch may never need, runs at start too: a pass over
    rows that are not next to each other, a tree, a compaction."""
    target, drafter = shared_pair
    before = generate(target, drafter, [5, 6, 7, 8] * 4, GenerationConfig(k=3, max_tokens=12)).token_ids
    seen, run, compact = [], KeptCaches.run, KeptCaches._compact

    def ran(self, model, rows, inputs, wait=True, trees=None, packed=False):
        seen.append(("tree", sum(t is not None for t in trees or [])))
        apart = sorted(rows) != list(range(min(rows), min(rows) + len(rows)))  # a row between them sits out
        seen.append(("apart", apart))
        return run(self, model, rows, inputs, wait, trees, packed)

    def compacted(self, longest):
        seen.append(("compact", longest))
        return compact(self, longest)

    monkeypatch.setattr(KeptCaches, "run", ran)
    monkeypatch.setattr(KeptCaches, "_compact", compacted)
    warm_batch(target, drafter)
    assert ("tree", 1) in seen and ("apart", True) in seen and any(kind == "compact" for kind, _ in seen)
    monkeypatch.undo()
    assert generate(target, drafter, [5, 6, 7, 8] * 4, GenerationConfig(k=3, max_tokens=12)).token_ids == before


def test_the_kept_caches_warm_up_leaves_a_target_whose_caches_its_batch_cannot_keep(shared_pair, monkeypatch):
    target, _ = shared_pair
    ran = []
    monkeypatch.setattr(KeptCaches, "run", lambda *a, **k: ran.append(1))
    monkeypatch.setattr(type(target), "make_cache", lambda self: [RotatingKVCache(max_size=8) for _ in range(2)])
    warm_kept_caches(target, list(range(5, 69)))
    assert not ran  # such caches are merged for each pass instead: nothing of the kept caches to build


def test_the_warm_up_gives_way_to_a_request(shared_pair):
    target, drafter = shared_pair
    asked = []

    def cancel() -> bool:
        asked.append(1)
        return len(asked) > 3  # a request arrives after three rounds

    assert warm_batch(target, drafter, cancel=cancel) > 0
    assert len(asked) == 4


def test_the_warm_up_needs_shared_models(store):
    target = store.get(str(build_tiny("llama", "mistral-v1", seed=3)))
    with pytest.raises(ValueError, match="shared"):
        warm_batch(target)


@pytest.mark.parametrize(("batched", "compiles", "expected"), [(True, True, 1), (True, False, 0), (False, True, 0)])
def test_a_batching_host_warms_its_batch_at_start_where_kernels_compile_at_first_use(
    monkeypatch, batched, compiles, expected
):
    """After loading its pair (and measuring costs), a host whose requests run together runs the warm-up, on a
    backend that compiles kernels at first use only; a request queued meanwhile stops it."""
    calls: list[tuple] = []
    runner = JobRunner(MLXWorker(max_batch=4 if batched else 1), budget_s=60.0)

    def request(job):
        yield "a reply"

    def spy(target, drafter, cancel):
        before = cancel()
        runner.worker.submit(request, label="a request")  # queued behind the start-up job
        calls.append((target, drafter, before, cancel()))
        return 0.5

    monkeypatch.setattr(uag.runtime.host, "warm_batch", spy)
    monkeypatch.setattr(uag.runtime.host, "compiles_at_first_use", lambda: compiles)
    host = Host(ModelStore(), runner, target="org/target")
    target = SimpleNamespace(name="org/target")
    host.open_target = lambda drafter, progress=None, between=None: Loaded(target, None, None)
    host.measure_missing = lambda job, offered, progress=None: None
    job = host.start(None, ())
    assert job.done.wait(10)
    assert calls == [(target, None, False, True)] * expected  # a request queued: the warm-up's cancel says stop
    runner.worker.close()
