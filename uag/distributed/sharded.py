"""Speculation over a target sharded across processes (MLX's distributed engine), the drafter on rank 0.

    mlx.launch --hostfile hosts.json -- python -m uag generate --shard pipeline --target T --drafter D "…"

Every rank loads its shard of the target with mlx-lm's `sharded_load` (pipeline: a stage of the layers;
tensor: a slice of every layer) and runs the same engine (uag.core.engine: `Speculation`, `speculative_steps`,
`stream`). Only rank 0 holds the drafter. Each decision — a cycle's source, k and proposal, a plain
stretch's length, or the prompt pass — is rank 0's, and reaches every rank in one integer `all_sum`
(uag.distributed.decisions: `RankPolicy` on the policy seam, `LeaderDrafter` / `FollowerDrafter` on the
drafter seam). Every rank
then verifies the same tokens against the same logits, commits the same tokens and trims its own cache:
the output is the unsharded target's. Seeds are agreed at the start; only rank 0 writes output.

Python API (run the same program on every rank):

    ranks = connect()                                   # joins the group; a watchdog bounds every wait
    target = load_sharded("Qwen/…", "pipeline", ranks)
    drafter = load_rank0_drafter(ModelStore(), "lookup+demo-drafter", ranks)   # None off rank 0
    run = generate_sharded(target, drafter, "Stolica Polski to", GenerationConfig(k=4), ranks)

`stream_sharded` yields the same run's events as they come (`uag serve --shard`: uag.distributed.serving).
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from uag.core.config import MAX_SEED, DrafterSpec, GenerationConfig
from uag.core.costmodel import CostProfile
from uag.core.drafters import DrafterChoice, load_drafter_choice, make_drafter
from uag.core.engine import PromptCaches, Seams, prompt_ids, stream
from uag.core.evidence import Evidence
from uag.core.policy import make_policy
from uag.core.records import Event, Run
from uag.distributed.collective import (
    Link,
    RankLost,
    RanksDisagree,
    Watchdog,
    fingerprint,
    join_group,
    others,
)
from uag.distributed.decisions import (
    PLAIN,
    STOP,
    FollowerDrafter,
    LeaderDrafter,
    RankPolicy,
    Stopped,
    message_width,
)
from uag.distributed.options import (  # noqa: F401  add_shard_options: uag.cli's flags, re-exported
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    SHARD_WAYS,
    add_shard_options,
)
from uag.errors import InputError, ModelError
from uag.models.store import DEMO_NAMES, LoadedModel, ModelStore, check_pair, default_dtype, resolve

LOAD_TIMEOUT_S = 900.0  # reading a 70B shard from disk takes minutes; a hang beyond this is a lost rank


# --- the group and the target's shards --------------------------------------------------------------


@dataclass
class Ranks:
    """This process's place in the group, and the watchdog that bounds every wait."""

    group: mx.distributed.Group
    watchdog: Watchdog
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def close(self) -> None:
        self.watchdog.close()


def connect(*, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, timeout_s: float = DEFAULT_TIMEOUT_S) -> Ranks:
    """Join the group that mlx.launch (or MLX_RANK and MLX_HOSTFILE) describes; no wait lasts past the limits."""
    watchdog = Watchdog()
    try:
        return Ranks(join_group(watchdog, connect_timeout_s), watchdog, timeout_s)
    except BaseException:
        watchdog.close()
        raise


def shard_ways(model) -> tuple[str, ...]:
    """How mlx-lm can shard an (unloaded) model, tested as `sharded_load` tests it."""
    ways = []
    if hasattr(model, "model") and hasattr(model.model, "pipeline"):
        ways.append("pipeline")
    if hasattr(model, "shard"):
        ways.append("tensor")
    return tuple(ways)


def check_shardable(name: str, config: dict, shard: str, size: int) -> None:
    """ModelError in one line when mlx-lm cannot shard this architecture `shard`-wise over `size` ranks."""
    from mlx_lm.utils import _get_classes

    if shard not in SHARD_WAYS:
        raise InputError(f"--shard must be one of {', '.join(SHARD_WAYS)} (got {shard!r})")
    model_class, args_class = _get_classes(config)
    ways = shard_ways(model_class(args_class.from_dict(config)))  # lazy: nothing is computed
    kind = config.get("model_type", "?")
    if shard not in ways:
        can = f"only by {' or '.join(ways)}" if ways else "neither by pipeline nor by tensor: run it on one machine"
        raise ModelError(f"{name!r} ({kind}) cannot be sharded by {shard}: mlx-lm shards this architecture {can}")
    text = config.get("text_config", config)
    if shard == "tensor":
        heads = {k: text.get(k) for k in ("num_attention_heads", "num_key_value_heads") if text.get(k)}
        if any(v % size for v in heads.values()):
            raise ModelError(f"{name!r}: its attention heads {heads} do not split evenly over {size} ranks")
    elif text.get("num_hidden_layers", size) < size:
        raise ModelError(f"{name!r} has {text['num_hidden_layers']} layers: too few for {size} pipeline stages")


def load_sharded(name: str, shard: str, ranks: Ranks, *, progress: Callable[[str], None] | None = None) -> LoadedModel:
    """This rank's shard of the target `name` (hub id, local mlx-lm folder, offline model name)."""
    from mlx_lm.utils import load_model, load_tokenizer, sharded_load

    source = resolve(name, progress)
    path = source if isinstance(source, Path) else None
    if path is not None:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    else:
        from huggingface_hub import hf_hub_download

        config = json.loads(Path(hf_hub_download(source, "config.json")).read_text(encoding="utf-8"))
    check_shardable(name, config, shard, ranks.size)
    ranks.watchdog.arm(
        LOAD_TIMEOUT_S,
        f"error: rank {ranks.rank}: {others(ranks.rank, ranks.size)} did not "
        f"finish loading {name!r} within {LOAD_TIMEOUT_S:g} s",
    )
    if progress:
        progress(f"loading {name} ({shard} shard {ranks.rank + 1} of {ranks.size})")
    groups = (ranks.group, None) if shard == "pipeline" else (None, ranks.group)
    try:
        if shard == "pipeline" and path is not None and not (path / "model.safetensors.index.json").exists():
            # sharded_load reads the weight index to choose files to download; a local folder without one
            # (a single weights file) has everything here already: the same steps, without the index.
            model, config = load_model(path, lazy=True, strict=False)
            tokenizer = load_tokenizer(path, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id"))
            model.model.pipeline(ranks.group)
            mx.eval(model.parameters())
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=ranks.group, stream=mx.cpu))
        else:
            model, tokenizer, config = sharded_load(str(source), *groups, return_config=True)
    except RuntimeError as err:
        raise RankLost(f"rank {ranks.rank}: lost {others(ranks.rank, ranks.size)} while loading ({err})") from None
    if name in DEMO_NAMES:
        model.set_dtype(getattr(mx, default_dtype()))
        mx.eval(model.parameters())
    ranks.watchdog.progress()
    loaded = LoadedModel(name=name, path=path or Path(str(source)), model=model, tokenizer=tokenizer, config=config)
    loaded.check_trimmable("target")
    return loaded


def load_rank0_drafter(store: ModelStore, spec: str | DrafterSpec, ranks: Ranks, **kw) -> DrafterChoice | None:
    """The drafter, loaded on rank 0 only (the other ranks never hold it)."""
    return load_drafter_choice(store, spec, **kw) if ranks.rank == 0 else None


# --- a run -------------------------------------------------------------------------------------------


def _agree(link: Link, ids: Sequence[int], config: GenerationConfig, lookup: bool) -> tuple[int, bool]:
    """Every rank must have the same prompt and settings; rank 0's seed and drafter kind are taken by all."""
    settings = json.dumps({**asdict(config), "seed": None}, sort_keys=True)
    proposal = config.seed if config.seed is not None else random.randrange(MAX_SEED)
    mine = [*fingerprint(ids), *fingerprint(settings.encode()), proposal, int(lookup)]
    rows = link.gather(mine)
    differ = [r for r, row in enumerate(rows) if row[:6] != rows[0][:6]]
    if differ:
        raise RanksDisagree(
            f"rank {link.rank}: rank {', '.join(map(str, differ))} was started with a different prompt or "
            "settings than rank 0: give every rank the same command line"
        )
    return rows[0][6], bool(rows[0][7])


def check_sharded(config: GenerationConfig, drafter: DrafterChoice | None, rank: int) -> None:
    """What a sharded run refuses, said before any rank waits on another (a server checks it before it sends a
    request to the other ranks)."""
    config.validate()
    if config.speculative and config.translation == "tli" and config.temperature > 0:
        raise InputError(
            "--shard: tli at temperature > 0 needs the drafter's distributions on every rank; "
            "use temperature 0 or another strategy"
        )
    if config.speculative and rank == 0 and drafter is None:
        raise InputError(f"strategy {config.strategy!r} needs a drafter")


def generate_sharded(
    target: LoadedModel,
    drafter: DrafterChoice | None,
    prompt: str | Sequence[int],
    config: GenerationConfig,
    ranks: Ranks,
    *,
    on_event: Callable[[Event], None] | None = None,
    **kw,
) -> Run:
    """One generation on every rank (each rank calls this with the same prompt and config): the baseline
    over the sharded target, or speculation with `drafter`, which only rank 0 needs. Returns the run on
    every rank; only rank 0 should write it out. Options as `stream_sharded`'s."""
    run = None
    events = stream_sharded(target, drafter, prompt, config, ranks, **kw)
    try:
        for event in events:
            run = event.run
            if on_event is not None:
                on_event(event)
    finally:
        events.close()
    return run


def stream_sharded(
    target: LoadedModel,
    drafter: DrafterChoice | None,
    prompt: str | Sequence[int],
    config: GenerationConfig,
    ranks: Ranks,
    *,
    profile: CostProfile | None = None,
    evidence: Evidence | None = None,
    check_every: int = 0,
    cancel: threading.Event | None = None,
    cache: list | None = None,
    stop_checks: bool = False,
) -> Iterator[Event]:
    """`generate_sharded`'s events as they come; the last one's run is final (its notes included). Every rank
    reads to the end: one that stopped early would leave the others waiting at the next exchange, so rank 0
    stops every rank with `cancel` instead, at the next decision. `check_every` = N compares the ranks'
    committed tokens every N decisions (a debug option). A baseline run has no decisions: with `stop_checks`
    (the same on every rank; a server's) rank 0 says after every token whether to go on, so that `cancel`
    ends it too. `profile` and `evidence` seed rank 0's `auto` (uag.core.policy.make_policy)."""
    check_sharded(config, drafter, ranks.rank)
    ids = prompt_ids(target, prompt, chat=config.chat) if isinstance(prompt, str) else list(prompt)
    link = Link(ranks.group, message_width(config.k), ranks.watchdog)
    ranks.watchdog.arm(
        ranks.timeout_s,
        f"error: rank {ranks.rank}: no progress for {ranks.timeout_s:g} s while generating: "
        f"{others(ranks.rank, ranks.size)} stopped answering (it exited, hangs, or the link is down)",
    )
    seed, lookup = _agree(link, ids, config, bool(drafter is not None and drafter.lookup))
    if config.temperature > 0 and config.seed is None:
        config = config.replace(seed=seed)  # the default seed differs per rank: take rank 0's
    caches = PromptCaches(target_cache=target.make_cache() if cache is None else cache)
    policy, notes = None, ()
    if not config.speculative:
        events = stream(target, None, ids, config, caches=caches)
        if stop_checks:
            events = _token_stops(events, link, cancel)
    elif ranks.rank == 0:
        pair = check_pair(target, drafter.model) if drafter.model is not None else None
        inner = make_drafter(drafter, target, config, shared=pair is not None and pair.shared_vocabulary)
        leader = LeaderDrafter(inner, ranks.watchdog)
        own = make_policy(config, profile, pair.r if pair else 0.0, evidence)
        policy = RankPolicy(link, leader, own, check_every=check_every, cancel=cancel)
        notes = pair.notes if pair else ()
        events = stream(target, leader, ids, config, caches=caches, seams=Seams(policy=policy))
    else:
        follower = FollowerDrafter(lookup, ranks.watchdog)
        policy = RankPolicy(link, follower, None, k_policy=config.k_policy, check_every=check_every)
        events = stream(target, follower, ids, config, caches=caches, seams=Seams(policy=policy))
    return _drive(events, link, ranks, notes)


def _token_stops(events: Iterator[Event], link: Link, cancel: threading.Event | None) -> Iterator[Event]:
    """A baseline run's events, with rank 0's go-on (PLAIN) or stop (STOP) exchanged after each token, so that
    every rank ends the run at the same token when rank 0's `cancel` is set."""
    try:
        for event in events:
            yield event
            stop = link.rank == 0 and cancel is not None and cancel.is_set()
            op, *_ = link.exchange(([STOP] if stop else [PLAIN]) if link.rank == 0 else None)
            if op == STOP:
                raise Stopped
    finally:
        events.close()


def _drive(events: Iterator[Event], link: Link, ranks: Ranks, notes: Sequence[str] = ()) -> Iterator[Event]:
    """A rank's stream, passed on; a collective that fails in a model pass or an exchange names the lost rank.
    `notes`: what check_pair said about the pair (the engine hears of rank 0's drafter ready made)."""
    run = None
    link.phase = "generating (the prompt pass)"
    try:
        for event in events:
            run = event.run
            link.phase = f"generating (after token {run.generated})"
            yield event
    except Stopped:
        if run is None:  # rank 0 failed before the first token (a server's run): no run to end
            raise
        run.finish_reason = "stopped"
    except RuntimeError as err:
        if not str(err).startswith(("[ring]", "[jaccl]", "[mpi]", "[distributed]")):
            raise
        raise link.lost(err) from None
    finally:
        events.close()
        ranks.watchdog.arm(0, "")  # between runs nothing is awaited
    if run is None or run.finish_reason is None:
        raise RuntimeError("generation ended without a final record")
    run.notes[:0] = notes
    run.notes.append(f"target sharded over {ranks.size} ranks; {link.exchanges} decision exchanges")
