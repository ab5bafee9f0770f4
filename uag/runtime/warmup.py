"""A server's batched passes run once before its first requests, where MLX compiles a kernel at its first use.

MLX's CUDA backend compiles many of its kernels when a graph first needs them (and keeps them in /tmp/mlx/<version>/ptx
for the next process). On a machine that has not compiled them yet, the first requests that run together paid for it,
their first turns stalling for seconds, and auto learned its costs from such timings (docs/results.md, bs;
uag.core.evidence.OUTLIER). `warm_batch` runs the kinds of pass a server's batch runs — prompts read together, plain
steps on the kept caches, lookup and model drafts verified beside them (one drafting under a stop rule, as auto does),
the caches trimmed and handed back — in a batch of its own, on made-up prompts, with fixed k (nothing learned, no
shared index touched), then what kept caches do now and then (`warm_kept_caches`: a tree's path kept, holes
compacted), before the server takes requests. It does not cover every shape a request brings (docs/results.md, bt:
one first-turn edit still stalled after it). Where kernels are built ahead of time (the CPU backend) it does not run
(`compiles_at_first_use`).

    warm_batch(target, drafter_model)   # seconds it took
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from uag.core.config import GenerationConfig
from uag.core.drafters import DrafterChoice
from uag.core.engine import Seams, generate
from uag.core.evidence import MODEL
from uag.core.kept_caches import KeptCaches, trees_fit
from uag.core.passes import keep_path, prefill, trim_to
from uag.core.policy import FixedK, StopRule
from uag.core.verify import Tree
from uag.models.store import LoadedModel
from uag.runtime.batching import Batch, Cancelled, SharedModel
from uag.runtime.worker import Job

log = logging.getLogger(__name__)

TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion about the costs"
    " of the new building, the members agreed to postpone the decision until the engineers had finished their report."
)
TOKENS = 24  # each warm-up request's reply
REPEATS = 20  # the text's copies in a prompt: as long as an edit turn's, read in chunks, a copy for lookup to draft


def copy_prompt(i: int, repeats: int = REPEATS) -> str:
    """The i-th of a batch of made-up prompts asking for a copy of `repeats` copies of TEXT, unlike the others'."""
    return f"Text {i + 1}. Repeat it word for word:\n\n" + " ".join([TEXT] * repeats)


def compiles_at_first_use() -> bool:
    """Whether the default device may compile kernels as graphs first need them: a GPU (MLX's CUDA backend does:
    docs/results.md, bt, for what the warm-up costs). Metal is untested here; the CPU backend's kernels are built
    ahead of time."""
    return mx.default_device() == mx.gpu


def warm_batch(target: LoadedModel, drafter: LoadedModel | None = None, cancel: Callable[[], bool] = lambda: False):
    """Run a batch of made-up requests through the shared `target` (and `drafter`): one plain, one drafting from
    lookup, two from the drafter model where there is one; return the seconds it took. `cancel()`, asked every
    round, ends it early (a request came in). The models must be `SharedModel`s (a batching host's)."""
    if not isinstance(target.model, SharedModel):
        raise ValueError("warm_batch runs a batch: the target must be shared (uag.runtime.batching.share)")
    fixed = GenerationConfig("context", k=4, k_policy="fixed", max_tokens=TOKENS)
    runs: list[tuple[DrafterChoice | LoadedModel | None, GenerationConfig, Seams | None]] = [
        (None, fixed.replace(strategy="baseline"), None),
        (DrafterChoice(lookup=True), fixed, None),
    ]
    if drafter is not None:  # two, so that the drafter's passes run batched too; one drafts as auto does
        runs += [(drafter, fixed, None), (drafter, fixed, Seams(policy=UntilK(fixed.k)))]
    # of different lengths, as a wave of first turns is: the shorter ones' reads end first and they decode beside
    # the longer ones' reads, joining the kept caches at different ends (what the first wave compiled on an H200
    # after a warm-up of prompts alike was a pass over rows apart, though: warm_kept_caches; docs/results.md, de)
    prompts = [target.tokenizer.encode(copy_prompt(i, REPEATS * (i + 1) // 2)) for i in range(len(runs))]

    def request(job: Job, i: int):
        choice, config, seams = runs[i]
        generate(target, choice, prompts[i], config, seams=seams)
        yield i

    tic = time.perf_counter()
    jobs = [Job(request, (i,), f"warm-up {i}", shared=True) for i in range(len(runs))]
    finished = Batch(max_size=len(runs)).run_all(jobs, cancel)
    for job in jobs:
        try:
            list(job)
        except Cancelled:
            pass
    if finished:
        warm_kept_caches(target, prompts[0][:64])
    return time.perf_counter() - tic


@dataclass
class UntilK(FixedK):
    """Fixed k, its model drafts made under a stop rule that never stops early: what auto's drafts compute and fixed
    k's do not (the drafter's distribution and its chance of each draft: uag.core.drafters.ModelDrafter._draft_until).
    Left out of the warm-up, a server's first request drafting with the model under auto builds those kernels, and
    the requests batched with it wait (docs/results.md, cz)."""

    def stop_rule(self, source: str, k: int) -> StopRule | None:
        return (lambda confidence: None) if source == MODEL else None


def warm_kept_caches(target: LoadedModel, ids: list[int]) -> None:
    """What a batch's kept caches do now and then, which the made-up batch above may never need: a pass over rows
    that are not next to each other (a member between them left, or waits on another pass), a row read as a tree and
    its path kept, holes compacted, rows handed back in position order (uag.core.kept_caches). On an H200 a process's
    first compaction took 11.6 s, its gather and scatter kernels compiling (docs/results.md, bw); a first pass over
    rows apart, in the first wave of edits, 8 s (de)."""
    model = target.model.inner if isinstance(target.model, SharedModel) else target.model
    caches = [target.make_cache() for _ in range(3)]
    if not all(KeptCaches.keepable(cache) for cache in caches) or len(ids) < 5:
        return  # its batch merges these caches for each pass instead (uag.core.passes.batched_pass)
    for cache, n in zip(caches, (len(ids), len(ids) // 3, len(ids) // 2)):
        prefill(model, cache, ids[:n])
    kept = KeptCaches()
    rows = [kept.adopt(cache) for cache in caches]
    tree = Tree.of([ids[1:3], ids[3:5]]) if trees_fit(model) else None
    first = mx.array([ids[0], *tree.tokens]) if tree is not None else mx.array(ids[:5])
    kept.run(model, [rows[0], rows[2]], [first, mx.array(ids[:3])], trees=[tree, None])  # the middle row sits out
    if tree is not None:
        keep_path(caches[0], caches[0][0].offset - len(tree), tree.paths[1][:1])
    trim_to(caches[2], caches[2][0].offset - 2)
    kept.compact()
    for cache in caches:
        kept.hand_back(cache)
    mx.eval([c.state for cache in caches for c in cache])
