"""`uag serve` (or `python -m uag serve`): an OpenAI-compatible server that speculates across tokenizers.

    python -m uag serve                                             # demo pair, http://127.0.0.1:8000/v1
    python -m uag serve --target coder-target --drafter lookup+demo-drafter --drafters lookup,coder-drafter
    python -m uag serve --serve demo=demo-target --serve coder=coder-target,drafter=lookup+coder-drafter --max-gb 9
    UAG_API_KEY=secret python -m uag serve --host 0.0.0.0           # beyond loopback a key is required
    mlx.launch --hostfile hosts.json -- python -m uag serve --shard tensor --target T --drafter lookup

The app (Compare, and a Server tab with what the API served) is mounted at /ui on the same port, on the same
MLX worker and model store; `--no-ui` serves only the API. Options are checked by the same code as the CLI's.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import uvicorn
from fastapi.responses import RedirectResponse

from uag.app.files import MAX_UPLOAD_MB
from uag.app.session import Session
from uag.command import CommandParser, literal, port_taken, progress, run, whole
from uag.core.config import DEFAULT_K, DEFAULT_K_AUTO, MAX_K, SPECULATIVE, DrafterSpec, GenerationConfig, adaptive_k
from uag.core.policy import MECHANISMS, AutoSettings
from uag.core.translate import DEFAULT_WINDOW
from uag.distributed.options import DEFAULT_CONNECT_TIMEOUT_S, add_shard_options
from uag.distributed.serving import Leader, follow, join
from uag.errors import InputError, UserError
from uag.machine import backend
from uag.models.dtypes import add_dtype_options, parse_dtype, slow_dtype_note
from uag.models.store import ModelStore
from uag.runtime.access import ServedModels
from uag.runtime.host import Host
from uag.runtime.jobs import DEFAULT_PER_CLIENT, DEFAULT_STALL_S, JobRunner
from uag.runtime.presets import DEFAULT
from uag.runtime.worker import MLXWorker
from uag.server.connections import DEFAULT_IDLE_TIMEOUT_S, default_max_connections, raise_fd_limit, server_config
from uag.server.disk_cache import DEFAULT_CACHE_DIR_GB, DiskCaches
from uag.server.guards import Perimeter
from uag.server.keys import DEFAULT_NAME, ApiKeys, digest_of, hash_line
from uag.server.logs import LOG_FORMATS, configure
from uag.server.metrics import Metrics
from uag.server.prompt_cache import DEFAULT_CACHE_GB
from uag.server.protocol import ServerDefaults
from uag.server.routes import create_app
from uag.server.service import Service

KEY_ENV = "UAG_API_KEY"
DEFAULT_PORT = 8000
SERVE_MAX_TOKENS = 512  # per request unless it asks (uag generate's default, 64, is short for a chat reply)
DEFAULT_MAX_MODELS = 4
DEFAULT_MAX_BATCH = 4  # requests generated together (uag.runtime.batching)
DEFAULT_LOOKUP_MEMORY = 200_000  # tokens of earlier requests that prompt lookup drafts from (uag.core.lookup)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="python -m uag serve", description=__doc__.splitlines()[0])
    p.add_argument(
        "--target",
        help=f"hub id, local folder or offline name ({DEFAULT.target} unless --serve names the models); served "
        "under its own name, first",
    )
    p.add_argument(
        "--serve",
        action="append",
        default=[],
        metavar="NAME=TARGET[,FIELD=VALUE…]",
        help="also serve TARGET as model NAME (repeatable; a request's `model` picks); FIELDs, else the flags' "
        f"values: {', '.join(SERVE_FIELDS)} (docs/server.md#several-models)",
    )
    p.add_argument(
        "--drafter",
        default=DEFAULT.drafter,
        help=f"the default drafter: a model, lookup or lookup+<model>; 'off' for the target alone ({DEFAULT.drafter})",
    )
    p.add_argument(
        "--drafters",
        default="lookup",
        help="comma-separated drafters a request may pick besides --drafter (default: lookup)",
    )
    p.add_argument("--strategy", default="auto", help=f"{' / '.join(SPECULATIVE)} (default auto)")
    p.add_argument(
        "-k",
        help=f"draft length, 1..{MAX_K}: the most a request may ask for (default: {DEFAULT_K_AUTO} "
        f"with auto, the longest it may draft; {DEFAULT_K} with a fixed strategy)",
    )
    p.add_argument(
        "--window", default=str(DEFAULT_WINDOW), help=f"translation context window (default {DEFAULT_WINDOW})"
    )
    p.add_argument(
        "--max-tokens",
        default=str(SERVE_MAX_TOKENS),
        help=f"tokens a request generates unless it says (default {SERVE_MAX_TOKENS})",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=whole, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "--api-key",
        help=f"require this key (Authorization: Bearer KEY); prefer ${KEY_ENV}, which "
        "other users of this machine cannot read in the process list",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="require one of this file's keys: a `name: key` (or `name: sha256:<hex>`) line each, read again when "
        "it changes; each key is its own client (docs/server.md#several-api-keys)",
    )
    p.add_argument(
        "--hash-key",
        action="store_true",
        help="print the key read from standard input as a key file holds it (sha256:<hex>), and exit",
    )
    p.add_argument(
        "--cache-gb",
        type=float,
        default=DEFAULT_CACHE_GB,
        help="KV caches of recent conversations "
        f"kept for their next turn, in GB (default {DEFAULT_CACHE_GB:g}; 0: off)",
    )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="also keep conversations' KV caches in this folder, per API key and model, read back after a restart "
        "(default: none)",
    )
    p.add_argument(
        "--cache-dir-gb",
        type=float,
        default=DEFAULT_CACHE_DIR_GB,
        help=f"the most --cache-dir holds, in GB; the least recently used files go first (default "
        f"{DEFAULT_CACHE_DIR_GB:g})",
    )
    p.add_argument(
        "--lookup-memory",
        type=whole,
        metavar="TOKENS",
        help="earlier requests' prompts and replies "
        "that prompt lookup also drafts from, per API key and target, in tokens over all keys (default "
        f"{DEFAULT_LOOKUP_MEMORY}; 0: off)",
    )
    p.add_argument("--max-queue", type=whole, default=8, help="requests queued or running at once; then 429")
    p.add_argument(
        "--max-batch",
        type=whole,
        help="requests generated together, their "
        "passes batched; more wait in the queue (default "
        f"{DEFAULT_MAX_BATCH}; 1: one after another)",
    )
    p.add_argument(
        "--per-client",
        type=whole,
        help=f"requests one client may have queued or running (default: --max-batch, at least {DEFAULT_PER_CLIENT})",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="SECONDS",
        help="worker time per request, loading and reading included, then finish_reason length with the reason in "
        "the reply and the log (default: none; a request that makes no progress for "
        f"{DEFAULT_STALL_S / 60:g} min is stopped)",
    )
    p.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="PATTERN[=NAME]",
        help="answer requests for model ids matching this glob as the default served model, or as NAME with "
        "PATTERN=NAME (repeatable; e.g. 'claude-*' for Claude Code's --model and its side tasks' smaller model); "
        "other ids get 404",
    )
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body (default 4)")
    p.add_argument(
        "--max-models",
        type=whole,
        default=DEFAULT_MAX_MODELS,
        help=f"models kept loaded, targets and drafters; then the least recently used is unloaded, never one a "
        f"running request uses (default {DEFAULT_MAX_MODELS})",
    )
    p.add_argument(
        "--max-gb",
        type=float,
        metavar="GB",
        help="also unload the least recently used models beyond this many GB of weights (default: no limit)",
    )
    p.add_argument("--no-ui", action="store_true", help="serve only the API (no app at /ui)")
    p.add_argument(
        "--auto-off",
        action="append",
        default=[],
        choices=MECHANISMS,
        metavar="MECHANISM",
        help="switch off one part of auto for an ablation (repeatable; "
        f"{', '.join(MECHANISMS)}): auto then opens from the pair's saved evidence but saves none back "
        "(docs/how-it-works.md#what-each-part-earns)",
    )
    add_http_options(p)
    add_shard_options(p)  # every rank of mlx.launch runs `serve --shard`; rank 0 serves
    add_dtype_options(p)
    return p


def add_http_options(p: argparse.ArgumentParser) -> None:
    """Connections, who may call, and the log: what a server left running needs (uag.server.guards, connections)."""
    p.add_argument(
        "--max-connections",
        type=whole,
        help="open connections at once; then the longest idle is "
        "closed (default: from the open-file limit, at most 1024)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"a connection must send its request's head within this time (default {DEFAULT_IDLE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name clients may "
        "reach this server by besides its address and localhost (repeatable; *.example.com: any "
        "subdomain)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin whose "
        "pages may call the API across sites (repeatable; e.g. https://chat.example.com; default: "
        "none)",
    )
    p.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="IP[/BITS]",
        help="a reverse proxy "
        "whose X-Forwarded-For is believed (repeatable; default: none, each client is its "
        "address)",
    )
    p.add_argument(
        "--log-format", choices=LOG_FORMATS, default="text", help="text, or json: one object per line (default text)"
    )


SERVE_FIELDS = ("drafter", "drafters", "strategy", "k", "window", "max-tokens", "target-dtype", "drafter-dtype")


def parse_serve(text: str) -> tuple[str, str, dict[str, str]]:
    """One `--serve` value as (name, target, fields by their flag's name); InputError saying what is wrong. A
    field without `=` continues the list before it (drafters).

    Example: "coder=coder-target,drafter=lookup+coder-drafter,drafters=lookup,coder-drafter"
        -> ("coder", "coder-target", {"drafter": "lookup+coder-drafter", "drafters": "lookup,coder-drafter"})
    """
    name, _, rest = text.partition("=")
    name, items = name.strip(), [item.strip() for item in rest.split(",")]
    target = items[0]
    if not name or not target or any(c.isspace() for c in name):
        raise InputError("give NAME=TARGET[,FIELD=VALUE…], NAME without spaces (e.g. coder=coder-target)")
    fields: dict[str, str] = {}
    last = None
    for item in items[1:]:
        field, has_value, value = item.partition("=")
        field = field.strip().replace("_", "-")
        if not has_value:
            if last != "drafters" or not item:
                raise InputError(f"{item!r} is not FIELD=VALUE (fields: {', '.join(SERVE_FIELDS)})")
            fields[last] += f",{item}"
            continue
        if field not in SERVE_FIELDS:
            raise InputError(f"unknown field {field!r} (fields: {', '.join(SERVE_FIELDS)})")
        if field in fields:
            raise InputError(f"{field} is given twice")
        fields[field], last = value.strip(), field
    return name, target, fields


@dataclass(frozen=True)
class ServedModel:
    """One model `uag serve` serves: the name a request's `model` gives, its target, its default speculation, the
    drafters a request may pick, its dtypes and the `--model-alias` patterns answered as it."""

    name: str
    target: str
    config: GenerationConfig  # the default speculation: strategy, k (the most a request may ask for), window, …
    drafter: str | None  # the default drafter; None: drafter off
    drafters: tuple[str, ...]  # every drafter a request may pick, the default first
    target_dtype: str | None
    drafter_dtype: str | None
    aliases: tuple[str, ...] = ()

    @classmethod
    def parse(
        cls, name: str, target: str, values: dict[str, str | None], flag, problems: list[str]
    ) -> ServedModel | None:
        """The model's settings from `values` (by field: drafter, drafters, strategy, k, window, max-tokens and the
        dtypes; the command line's where `--serve` names none), each problem added to `problems` with `flag(field)`
        before it; None when there were any."""
        before = len(problems)
        strategy = values["strategy"]
        drafter = None if values["drafter"].strip().lower() == "off" else values["drafter"]
        k = values["k"] if values["k"] is not None else DEFAULT_K_AUTO if adaptive_k(strategy) else DEFAULT_K
        fields = {"strategy": strategy, "k": literal(k), "window": literal(values["window"])}
        fields["max_tokens"] = literal(values["max-tokens"])
        for field, value in fields.items():
            try:
                GenerationConfig.parse(**{field: value})
            except InputError as err:
                problems.append(f"{flag(field.replace('_', '-'))}: {err}")
        if strategy not in SPECULATIVE:
            problems.append(
                f"{flag('strategy')}: one of {', '.join(SPECULATIVE)} (for the target alone: {flag('drafter')} off)"
            )
        drafters = []
        for text in ([drafter] if drafter else []) + [d for d in values["drafters"].split(",") if d.strip()]:
            try:
                drafters.append(str(DrafterSpec.parse(text)))
            except InputError as err:
                problems.append(f"{flag('drafters')}: {err}")
        dtypes = {}
        for role in ("target", "drafter"):
            try:
                dtypes[role] = parse_dtype(values[f"{role}-dtype"], flag=flag(f"{role}-dtype"))
            except InputError as err:
                problems.append(str(err))
        if len(problems) > before:
            return None
        return cls(
            name=name,
            target=target,
            config=GenerationConfig.parse(**fields),
            drafter=drafters[0] if drafter else None,
            drafters=tuple(drafters),
            target_dtype=dtypes["target"],
            drafter_dtype=dtypes["drafter"],
        )


@dataclass(frozen=True)
class ServeSettings:
    """`uag serve`'s command line, parsed and checked once (`ServeSettings.parse`): what building the server,
    serving it and the sharded server read. Defaults that depend on other flags are filled in (k under auto,
    --max-batch, --per-client, --lookup-memory). `models`: what it serves, the default first; `target`, `config`,
    `drafter`, … are the default model's."""

    models: tuple[ServedModel, ...]
    host: str
    port: int
    key: str | None  # --api-key or $UAG_API_KEY
    keys: Any  # what create_app checks: the one key, an ApiKeys of a key file's (uag.server.keys), or None
    perimeter: Any  # uag.server.guards.Perimeter: allowed hosts, CORS origins, trusted proxies
    auto: AutoSettings | None  # --auto-off's switches; None: auto as shipped
    max_models: int
    max_gb: float | None  # None: no budget in GB
    max_batch: int  # 1 under --shard
    per_client: int
    max_queue: int
    time_budget: float | None
    max_body_mb: float
    cache_gb: float
    cache_dir: str | None
    cache_dir_gb: float
    lookup_memory: int
    no_ui: bool
    max_connections: int | None  # None: from the open-file limit
    idle_timeout: float
    log_format: str
    shard: str | None  # --shard's mode; None: one process
    shard_timeout: float
    shard_check: int

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    @property
    def target(self) -> str:
        return self.default.target

    @property
    def config(self) -> GenerationConfig:
        return self.default.config

    @property
    def drafter(self) -> str | None:
        return self.default.drafter

    @property
    def drafters(self) -> tuple[str, ...]:
        return self.default.drafters

    @property
    def target_dtype(self) -> str | None:
        return self.default.target_dtype

    @property
    def drafter_dtype(self) -> str | None:
        return self.default.drafter_dtype

    @property
    def model_alias(self) -> tuple[str, ...]:
        return self.default.aliases

    @classmethod
    def parse(cls, args: argparse.Namespace) -> ServeSettings:
        """The checked settings of a parsed command line; InputError naming every bad flag."""
        problems = []
        shard = args.shard
        models = _served_models(args, problems)
        max_batch = args.max_batch if args.max_batch is not None else 1 if shard else DEFAULT_MAX_BATCH
        max_batch = max_batch or 1  # --max-batch 0 runs one at a time, as it always did
        per_client = args.per_client if args.per_client is not None else max(DEFAULT_PER_CLIENT, max_batch)
        for flag, value, lo in (
            ("--max-queue", args.max_queue, 1),
            ("--per-client", per_client, 1),
            ("--max-models", args.max_models, 2),
            ("--max-batch", max_batch, 1),
        ):
            if value < lo:
                problems.append(f"{flag} must be at least {lo} (got {value})")
        for flag, value in (
            ("--time-budget", args.time_budget),
            ("--max-body-mb", args.max_body_mb),
            ("--max-gb", args.max_gb),
        ):
            if value is not None and not value > 0:
                problems.append(f"{flag} must be more than 0 (got {value:g})")
        if not args.cache_gb >= 0:
            problems.append(f"--cache-gb must be at least 0 (got {args.cache_gb:g})")
        lookup_memory = args.lookup_memory
        if lookup_memory is None:
            lookup_memory = 0 if shard else DEFAULT_LOOKUP_MEMORY
        if lookup_memory < 0:
            problems.append(f"--lookup-memory must be at least 0 (got {lookup_memory})")
        key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV) or None
        if key is not None and not key.strip():
            problems.append("--api-key is empty")
        if args.max_connections is not None and args.max_connections < 8:
            problems.append(f"--max-connections must be at least 8 (got {args.max_connections})")
        if not args.idle_timeout > 0:
            problems.append(f"--idle-timeout must be more than 0 (got {args.idle_timeout:g})")
        perimeter = None
        try:
            perimeter = Perimeter.parse(args.host, args.allowed_host, args.cors_origin, args.trusted_proxy)
        except InputError as err:
            problems.append(str(err))
        keys = key
        if args.api_key_file:
            try:
                keys = ApiKeys({DEFAULT_NAME: digest_of(key)} if key else None, args.api_key_file)
            except InputError as err:
                problems.append(str(err))
        cache_dir = args.cache_dir
        if cache_dir is not None:
            if not args.cache_dir_gb > 0:
                problems.append(f"--cache-dir-gb must be more than 0 (got {args.cache_dir_gb:g})")
            if shard:
                problems.append("--cache-dir: a sharded server keeps no conversation caches: drop it with --shard")
        if keys is None and not _loopback(args.host):
            problems.append(
                f"--host {args.host} lets other machines in: set ${KEY_ENV} (or --api-key, --api-key-file) so that "
                "only clients with the key can run models"
            )
        off = args.auto_off or []
        if off and not adaptive_k(args.strategy):
            problems.append(f"--auto-off switches off parts of auto: --strategy {args.strategy} has none")
        if shard:
            drafters = models[0].drafters if models and models[0] is not None else ()
            target = models[0].target if models and models[0] is not None else DEFAULT.target
            problems += _shard_problems(args, target, drafters, lookup_memory)
        if problems:
            raise InputError("; ".join(problems))
        return cls(
            models=tuple(models),
            host=args.host,
            port=args.port,
            key=key,
            keys=keys,
            perimeter=perimeter,
            auto=AutoSettings(**dict.fromkeys(off, False)) if off else None,
            max_models=args.max_models,
            max_gb=args.max_gb,
            max_batch=max_batch,
            per_client=per_client,
            max_queue=args.max_queue,
            time_budget=args.time_budget,
            max_body_mb=args.max_body_mb,
            cache_gb=args.cache_gb,
            cache_dir=cache_dir,
            cache_dir_gb=args.cache_dir_gb,
            lookup_memory=lookup_memory,
            no_ui=args.no_ui,
            max_connections=args.max_connections,
            idle_timeout=args.idle_timeout,
            log_format=args.log_format,
            shard=shard,
            shard_timeout=args.shard_timeout,
            shard_check=args.shard_check,
        )


def _served_models(args: argparse.Namespace, problems: list[str]) -> list[ServedModel | None]:
    """The models the command line serves: --target's (when it is given, or no --serve is) under its own name,
    then each --serve's, fields it does not give taken from the flags; --model-alias patterns given to the model
    they name (the default one without `=NAME`). A model with problems is None (they are in `problems`)."""
    flags = {
        "drafter": args.drafter,
        "drafters": args.drafters,
        "strategy": args.strategy,
        "k": args.k,
        "window": args.window,
        "max-tokens": args.max_tokens,
        "target-dtype": args.target_dtype,
        "drafter-dtype": args.drafter_dtype,
    }
    models = []
    if args.target is not None or not args.serve:
        target = DEFAULT.target if args.target is None else args.target
        models.append(
            ServedModel.parse(target, target, flags, lambda field: "-k" if field == "k" else f"--{field}", problems)
        )
    for text in args.serve:
        try:
            name, target, fields = parse_serve(text)
        except InputError as err:
            problems.append(f"--serve {text!r}: {err}")
            continue
        if args.shard:
            problems.append("--serve: a sharded server serves one model: drop it with --shard")
        flag = lambda field, name=name: f"--serve {name}: {field}"  # noqa: E731
        models.append(ServedModel.parse(name, target, {**flags, **fields}, flag, problems))
    names = [m.name for m in models if m is not None]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"--serve: two models are named {name!r}: give each its own NAME")
    aliases: dict[str, list[str]] = {}
    for text in args.model_alias:
        pattern, has_name, name = text.rpartition("=") if "=" in text else (text, "", "")
        if not pattern.strip():
            problems.append("--model-alias is empty: give a model id or a glob such as 'claude-*'")
        elif has_name and name not in names:
            problems.append(
                f"--model-alias {text!r}: no served model is named {name!r} (served: {', '.join(names) or 'none'})"
            )
        elif names:
            aliases.setdefault(name or names[0], []).append(pattern)
    return [m if m is None else replace(m, aliases=tuple(aliases.get(m.name, ()))) for m in models]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build(settings: ServeSettings, *, store=None, worker=None, stream=None, measure=None):
    """(the FastAPI app with the API and, unless --no-ui, the app at /ui; the Service): a `Host` per served model
    on one store (its budget: --max-models, --max-gb) and one runner, the default model's shared by the API's
    Service and the app's Session. `stream` and `measure`: the hosts' (a sharded server's run over its ranks)."""
    s = settings
    store = store or ModelStore(max_models=s.max_models, max_gb=s.max_gb)
    worker = worker or MLXWorker(max_batch=s.max_batch)
    runner = JobRunner(worker, per_client=s.per_client, budget_s=s.time_budget)
    # A host per served model: one per-client count for all, one Evidence per pair and one cost policy for /ui's
    # runs and the API's (costs measured off the requests' path, by each host's keeper), one lookup memory.
    hosts: list[Host] = []
    for model in s.models:
        hosts.append(
            Host(
                store,
                runner,
                target=model.target,
                target_dtype=model.target_dtype,
                drafter_dtype=model.drafter_dtype,
                stream=stream,
                measure=measure,
                auto=s.auto,
                lookup_memory=s.lookup_memory,
                memory=hosts[0].memory if hosts else None,
                off_path=True,
            )
        )
    every = [server_defaults(model, checks=not s.shard) for model in s.models]
    host, defaults = hosts[0], every[0]
    session = None
    if not s.no_ui:
        # /ui loads what the API serves, for every user (uag.runtime.access.ServedModels)
        served = ServedModels(s.target, defaults.allowed, s.target_dtype, s.drafter_dtype)
        session = Session(host=host, target=s.target, drafter=(defaults.allowed or ("lookup",))[0], served=served)
    disk = None
    if s.cache_dir is not None:  # conversation caches that survive a restart
        disk = DiskCaches(s.cache_dir, s.cache_dir_gb * 1e9)
    service = Service(
        host,
        defaults,
        cache_bytes=s.cache_gb * 1e9,
        metrics=Metrics(*(model.name for model in s.models)),
        disk=disk,
        others=list(zip(every[1:], hosts[1:])),
    )
    app = create_app(
        service, api_key=s.keys, max_body=int(s.max_body_mb * 2**20), max_queue=s.max_queue, perimeter=s.perimeter
    )
    if session is not None:
        _mount_ui(app, session, service, s.keys)
    return app, service


def server_defaults(model: ServedModel, *, checks: bool = True) -> ServerDefaults:
    """What a request for `model` runs with unless it says (uag.server.protocol); `checks`: whether it may ask for a
    check or a grammar (not under --shard)."""
    return ServerDefaults(
        model=model.name,
        drafter=model.drafter,
        strategy=model.config.strategy,
        k=model.config.k,
        window=model.config.window,
        max_tokens=model.config.max_tokens,
        drafters=model.drafters,
        checks=checks,
        aliases=model.aliases,
    )


def _mount_ui(app, session, service, key) -> None:
    """The app at /ui (behind the API key, as its password, when there is one: any of a key file's); / sends a
    browser there."""
    # gradio only here: a server without its app at /ui (--no-ui, --shard) never loads it (CONTRIBUTING's layout)
    import gradio as gr

    from uag.app.ui import STYLE, THEME, build
    from uag.server.dashboard import add_server_tab

    demo = build(session)
    add_server_tab(demo, service)
    keys = ApiKeys.one(key) if isinstance(key, str) else key
    auth = None if keys is None else (lambda _user, password: keys.match(password.strip()) is not None)
    app.add_api_route("/", lambda: RedirectResponse("/ui/"), include_in_schema=False)
    gr.mount_gradio_app(
        app,
        demo,
        path="/ui",
        auth=auth,
        auth_message="uag serve: any user name, the server's API key as password",
        theme=THEME,
        css_paths=[STYLE] if STYLE.exists() else None,
        ssr_mode=False,
        max_file_size=f"{MAX_UPLOAD_MB}mb",
    )


def serve(args: argparse.Namespace) -> int:
    if args.hash_key:  # a key file's line without the key in it: `printf %s KEY | python -m uag serve --hash-key`
        print(hash_line(sys.stdin.readline()))
        return 0
    settings = ServeSettings.parse(args)
    if settings.shard:
        return _serve_sharded(settings)
    if port_taken(settings.host, settings.port):
        raise UserError(f"port {settings.port} on {settings.host} is taken: use --port")
    connections = _logging_and_connections(settings)
    app, service = build(settings)
    say = logging.getLogger("uag.server.main").info  # in the log's format (--log-format json: JSON lines too)
    for model in settings.models:
        if model.target_dtype and (note := slow_dtype_note(model.target_dtype, backend())):
            say("note: %s: %s", model.name, note)
    service.preload(progress=lambda text: say("%s", text))
    where = f"http://{settings.host}:{settings.port}"
    served = ", ".join(model.name for model in settings.models)
    later = " (the others load on first use)" if len(settings.models) > 1 else ""
    say("serving %s%s at %s/v1%s", served, later, where, "" if settings.no_ui else f", the app at {where}/ui")
    uvicorn.Server(server_config(app, host=settings.host, port=settings.port, **connections)).run()
    return 0


def _logging_and_connections(settings: ServeSettings) -> dict[str, Any]:
    """Set up the log (--log-format), raise the open-file limit, warn of a short key; the connection limits."""
    configure(settings.log_format)
    say = logging.getLogger("uag.server").warning
    fd_limit = raise_fd_limit()
    max_connections = settings.max_connections or default_max_connections(fd_limit)
    if fd_limit is not None and max_connections > fd_limit - 64:
        say(
            "--max-connections %d is near this process's limit of %d open files: connections beyond it fail "
            "(raise `ulimit -n`, or lower --max-connections)",
            max_connections,
            fd_limit,
        )
    if settings.key is not None and len(settings.key) < 16:
        say(
            "the API key is %d characters: one of 16 or more (e.g. `openssl rand -hex 16`) resists guessing",
            len(settings.key),
        )
    return {"max_connections": max_connections, "idle_timeout_s": settings.idle_timeout}


def _shard_problems(args: argparse.Namespace, target: str, drafters: list[str], lookup_memory: int) -> list[str]:
    """What `serve --shard` refuses (beside the flags every serve checks)."""
    problems = []
    if args.target_dtype or args.drafter_dtype:
        problems.append("--shard loads the models as stored: drop --target-dtype and --drafter-dtype")
    if not args.shard_timeout > 0 or args.shard_check < 0:
        problems.append("--shard-timeout must be above 0 and --shard-check at least 0")
    models = [DrafterSpec.parse(d).model for d in drafters]
    if any(m and ModelStore.identity(m) == ModelStore.identity(target) for m in models):
        problems.append("--shard: the target cannot draft for itself (rank 0 holds only its shard)")
    if args.auto_off:
        problems.append("--auto-off is for a single process: drop it with --shard")
    if args.max_batch is not None and args.max_batch > 1:
        problems.append("--max-batch: a sharded server runs one request at a time: drop it with --shard")
    if lookup_memory:  # the other ranks end a parked stretch where their own lookup would
        problems.append("--lookup-memory: a sharded server drafts from each request alone: drop it with --shard")
    return problems


def _serve_sharded(settings: ServeSettings) -> int:
    """`serve --shard` on one rank of mlx.launch (uag.distributed.serving): every rank joins the group and loads
    its shard on the MLX worker thread; rank 0 serves the API, the other ranks run its requests until it stops."""
    worker = MLXWorker()
    start = partial(
        join,
        settings.target,
        settings.shard,
        connect_timeout_s=DEFAULT_CONNECT_TIMEOUT_S,
        timeout_s=settings.shard_timeout,
        progress=progress,
    )
    ranks, target = worker.call(start)
    if ranks.rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every local rank: rank 0 ends the others
        try:
            worker.call(follow, ranks, target)
        finally:
            ranks.close()
        return 0
    leader = Leader(ranks, target, worker, check_every=settings.shard_check)
    try:
        if port_taken(settings.host, settings.port):
            raise UserError(f"port {settings.port} on {settings.host} is taken: use --port")
        if not settings.no_ui:
            progress("--shard serves the API only: the app's Compare runs the target whole, on one machine")
            settings = replace(settings, no_ui=True)
        connections = _logging_and_connections(settings)
        store = leader.store(settings.target, max_models=settings.max_models)
        app, service = build(settings, store=store, worker=worker, stream=leader.stream, measure=leader.measure)
        worker.call(leader.prepare, store, settings.drafters, progress)
        service.preload(progress=progress).wait()  # the offered pairs without costs measured over the shards, first
        server = uvicorn.Server(server_config(app, host=settings.host, port=settings.port, **connections))
        leader.on_lost = lambda: setattr(server, "should_exit", True)  # a lost rank: stop serving, say which
        leader.keep_in_touch()
        progress(
            f"serving {settings.target} sharded by {settings.shard} over {ranks.size} ranks at http://{settings.host}:{settings.port}"
            "/v1; every request reads its whole prompt (no conversation caches across the shards)"
        )
        # uvicorn stops on SIGINT/SIGTERM, then raises the signal again: let it pass, tell the others, exit 0.
        before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run()
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
    finally:
        leader.close()
    if leader.lost is not None:
        raise leader.lost
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run("python -m uag serve", lambda: serve(args))
