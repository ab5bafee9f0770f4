"""`python -m uag bench`: a resumable sweep of one target against drafters × strategies × k over prompt sets.

Per prompt: the baseline once, then every drafter × strategy × k condition. Each run goes into a results file
(uag.study.results) the moment it finishes, with its cycles, in one transaction. Running the same command again
skips the runs already there, so a killed sweep continues where it stopped and never duplicates a run; two
sweeps on one file at once share the work (each run is claimed before it is computed, see ResultsDB.claim).
A drafter is a model, `lookup` (prompt lookup, no model) or `lookup+<model>`.

    python -m uag bench --target demo-target --drafters demo-drafter --strategies none naive context \\
        --k 1 2 4 --datasets wiki alpaca synthetic --n 4 --max-tokens 48 --out results.db
    python -m uag analyze results.db

Everything that can be checked is checked before the first run: settings, datasets, the results file, then
the models (loaded once each) and every prompt's tokens, against the target's context and each drafter's.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from tqdm import tqdm

import uag
from uag import _blas
from uag.command import CommandParser, add_decoding_options, decoding_config, progress, run, whole
from uag.core.config import DEFAULT_K, SPECULATIVE, DrafterSpec, GenerationConfig, short_name
from uag.core.records import Run, Token
from uag.errors import InputError
from uag.machine import backend
from uag.models.dtypes import add_dtype_options, parse_dtype, slow_dtype_note
from uag.models.loading import check_memory, load_model
from uag.study.analyze import k_list, k_table
from uag.study.datasets import BUNDLED, Prompt, chat_for, load
from uag.study.report import markdown
from uag.study.results import ResultsDB, load_runs
from uag.study.runspec import Machine, RunSpec

WARMUP_TOKENS = 8  # enough for every phase of a cycle to have run once
DEFAULT_STRATEGIES = ("none", "naive", "context")  # the paper's three


@dataclass(frozen=True)
class Sweep:
    """What to run: one target against each drafter × strategy × k, all with the decoding settings of `config`
    (its strategy and k are replaced per run). A drafter is a model, "lookup" or "lookup+<model>"."""

    target: str
    drafters: tuple[str, ...]
    strategies: tuple[str, ...]
    ks: tuple[int, ...]
    datasets: tuple[str, ...]
    n: int | None  # prompts per dataset; None = all
    config: GenerationConfig
    target_dtype: str | None = None  # uag.models.dtypes; None: as stored (the offline models: float32)
    drafter_dtype: str | None = None

    def validate(self) -> Sweep:
        """InputError naming the first bad setting; the settings themselves are GenerationConfig's checks."""
        if not self.target:
            raise InputError("no target given (--target)")
        if not self.drafters or not all(self.drafters):
            raise InputError("give at least one drafter (--drafters)")
        for drafter in self.drafters:
            DrafterSpec.parse(drafter)
        if not self.strategies or not self.ks or not self.datasets:
            raise InputError("give at least one strategy, one k and one dataset")
        for strategy in self.strategies:
            if strategy not in SPECULATIVE:
                raise InputError(f"unknown strategy {strategy!r}; choose from {', '.join(SPECULATIVE)}")
        for k in self.ks:
            try:
                self.config.replace(k=k)
            except InputError as err:
                raise InputError(f"--k: {err}") from None
        return self


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: its spec and its prompt."""

    spec: RunSpec
    prompt: Prompt


def plan(sweep: Sweep, prompts: Sequence[Prompt], *, chat_template: bool = True) -> list[PlannedRun]:
    """Every run of the sweep, prompt by prompt: the baseline, then each drafter × strategy × k.

    A prompt that says whether it wants the chat template (the `code` set's records do) gets its way, where the
    target has a template (`chat_template`); --chat decides for the prompts that do not say.
    Example: 2 prompts, drafters (d,), strategies (none, context), k (1, 2) -> 2 × (1 + 4) = 10 planned runs:
    p1 baseline, p1 d·none·1, p1 d·none·2, p1 d·context·1, p1 d·context·2, p2 baseline, …
    """
    jobs = []
    for prompt in prompts:
        where = dict(dataset=prompt.dataset, prompt_id=prompt.id)
        chat = chat_for(prompt, sweep.config.chat) and (chat_template or sweep.config.chat)
        config = sweep.config.replace(chat=chat)
        dtypes = dict(target_dtype=sweep.target_dtype, drafter_dtype=sweep.drafter_dtype)
        baseline = config.replace(strategy="baseline")
        jobs.append(PlannedRun(RunSpec(sweep.target, None, baseline, **where, target_dtype=sweep.target_dtype), prompt))
        for drafter, strategy, k in itertools.product(sweep.drafters, sweep.strategies, sweep.ks):
            spec = RunSpec(sweep.target, drafter, config.replace(strategy=strategy, k=k), **where, **dtypes)
            jobs.append(PlannedRun(spec, prompt))
    return jobs


def load_prompts(datasets: Sequence[str], n: int | None) -> tuple[list[Prompt], list[str]]:
    """The first `n` prompts of each dataset, in order, and a warning per user file with skipped lines.

    InputError for an unknown dataset, too small a one, or two prompts with the same dataset and id.
    """
    prompts, notes = [], []
    for name in datasets:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                prompts += load(name, n)
            except (ValueError, RuntimeError) as err:  # uag.study.datasets: a bad name or file; hf: not servable here
                raise InputError(str(err)) from None
        notes += [str(w.message) for w in caught]
    seen = set()
    for p in prompts:
        if (p.dataset, p.id) in seen:
            raise InputError(f"two prompts are named {p.dataset}/{p.id}: give each dataset file its own name")
        seen.add((p.dataset, p.id))
    return prompts, notes


def machine(target, drafter) -> Machine:
    """This machine and the pair's sizes, as stored with every run (`drafter`: a model, or None for lookup
    and baselines)."""
    import mlx.core as mx  # mlx: `uag bench --help` and a sweep's checks load none of it

    return Machine(
        platform=platform.platform(),
        python=platform.python_version(),
        uag_version=uag.__version__,
        mlx_version=mx.__version__,
        device=str(mx.default_device()),
        backend=backend(),
        blas=_blas.status,
        target_bytes=target.weight_bytes,
        target_dtype=target.dtype,
        drafter_bytes=None if drafter is None else drafter.weight_bytes,
        drafter_dtype=None if drafter is None else drafter.dtype,
    )


def summary(runs: pd.DataFrame, keys: set[str]) -> pd.DataFrame:
    """Table 4 (α, tokens/s, speedup per drafter × strategy × k) over this sweep's runs in the results file."""
    table = k_table(runs[runs["run_key"].isin(keys)]).drop(columns="target")
    return table.assign(drafter=table["drafter"].map(short_name))


def _label(spec: RunSpec) -> str:
    """Example: wiki/wiki-003 demo-drafter·context·k2;  wiki/wiki-003 baseline"""
    what = "baseline" if spec.drafter is None else f"{short_name(spec.drafter)}·{spec.strategy}·k{spec.k}"
    return f"{spec.dataset}/{spec.prompt_id} {what}"


def _say(message: str) -> None:
    progress(f"bench: {message}")


def _load(sweep: Sweep):
    """Load the models and check the pairs."""
    from uag.core.drafters import load_drafter_choice  # mlx (as every import below that loads a model or runs one)
    from uag.models.store import ModelStore, check_pair

    store = ModelStore()
    models = [("drafter", DrafterSpec.parse(d).model, sweep.drafter_dtype) for d in sweep.drafters]
    check_memory(store, [("target", sweep.target, sweep.target_dtype), *models])
    # Drafters first: usually the smaller models, so a bad name fails fast.
    choices = {d: load_drafter_choice(store, d, progress=_say, dtype=sweep.drafter_dtype) for d in sweep.drafters}
    target = load_model(store, sweep.target, role="target", progress=_say, dtype=sweep.target_dtype)
    if note := slow_dtype_note(target.dtype, backend()):
        _say(f"note: {note}")
    for choice in choices.values():
        if choice.model is not None:
            check_pair(target, choice.model)
    return target, choices


def _prompt_ids(target, choices, pending: list[PlannedRun]) -> dict:
    """Every pending prompt's ids for the target, checked against both contexts before any run."""
    from uag.core.drafters import check_drafter_fits
    from uag.core.engine import prompt_ids

    ids = {}
    for job in pending:
        where = (job.spec.dataset, job.spec.prompt_id)
        if where not in ids:
            ids[where] = prompt_ids(target, job.prompt.text, chat=job.spec.config.chat)
    for job in pending:
        try:
            check_drafter_fits(
                target, choices.get(job.spec.drafter), ids[job.spec.dataset, job.spec.prompt_id], job.spec.config
            )
        except InputError as err:
            raise InputError(f"prompt {job.spec.dataset}/{job.spec.prompt_id}: {err}") from None
    return ids


def _generate(target, choice, ids: list[int], config: GenerationConfig):
    """One run; adaptive k (auto) starts from the pair's measured costs (uag.costs.pair), as through uag.api."""
    from uag.core.engine import generate
    from uag.costs.pair import profile_for

    profile = profile_for(target, choice) if config.k_policy == "adaptive" else None
    return generate(target, choice, ids, config, profile=profile)


def _divergence(target, run, spec: RunSpec, baselines: dict, db: ResultsDB) -> str | None:
    """How a speculative run's greedy output compares with its baseline's (uag.runtime.divergence's kind: the
    `divergence` column); None when not comparable (sampled, no baseline stored)."""
    from uag.runtime.margins import compare_runs

    key = spec.baseline_spec().key
    baseline = baselines.get(key)
    if baseline is None and (stored := db.tokens(key)) is not None:  # a resumed sweep: the baseline is in the file
        ids, finish = stored
        tokens = [Token(i, "", False) for i in ids]
        baseline = Run("baseline", target.name, temperature=run.temperature, tokens=tokens, finish_reason=finish)
        baseline.prompt_ids = list(run.prompt_ids)
    verdict = None if baseline is None else compare_runs(target, baseline, run)
    return None if verdict is None else verdict.kind


def execute(
    sweep: Sweep, prompts: Sequence[Prompt], db: ResultsDB, *, name: str | None
) -> tuple[list[PlannedRun], int, int]:
    """Load and check everything, warm up, then run and store each pending job that no other sweep on the same
    file has taken. Returns (the sweep's planned runs, runs stored here, runs left to another sweep)."""
    target, choices = _load(sweep)
    has_template = target.tokenizer.has_chat_template
    jobs = plan(sweep, prompts, chat_template=has_template)
    if not has_template and not sweep.config.chat and any(p.chat for p in prompts):
        _say(f"{target.name} has no chat template: the prompts that ask for one run as plain text")
    pending = [job for job in jobs if not db.has(job.spec.key)]
    done = len(jobs) - len(pending)
    if not pending:
        return jobs, 0, 0
    ids = _prompt_ids(target, choices, pending)
    machines = {None: machine(target, None), **{d: machine(target, c.model) for d, c in choices.items()}}

    # Warm-up: one short run per drafter (it runs the target too) on the first prompt, before any timing.
    first = ids[pending[0].spec.dataset, pending[0].spec.prompt_id]
    warm_ups: dict[str, RunSpec] = {}
    for job in pending:
        if job.spec.drafter is not None:
            warm_ups.setdefault(job.spec.drafter, job.spec)
    for drafter, spec in warm_ups.items():
        _say(f"warm-up with {drafter} (not recorded)")
        _generate(
            target, choices[drafter], first, spec.config.replace(max_tokens=min(WARMUP_TOKENS, spec.config.max_tokens))
        )

    stored = elsewhere = 0
    baselines: dict[str, Run] = {}  # this sweep's baseline runs by key, to compare the speculative runs with
    total = done + len(pending)
    with tqdm(total=total, initial=done, unit="run", file=sys.stderr, smoothing=0.1, dynamic_ncols=True) as bar:
        for job in pending:
            spec = job.spec
            if not db.claim(spec.key):  # finished meanwhile, or running in another sweep on this file
                elsewhere += 1
                bar.update()
                continue
            bar.set_postfix_str(_label(spec), refresh=True)
            result = _generate(target, choices.get(spec.drafter), ids[spec.dataset, spec.prompt_id], spec.config)
            if spec.drafter is None:
                baselines[spec.key] = result
            verdict = None if spec.drafter is None else _divergence(target, result, spec, baselines, db)
            where = dict(machine=machines[spec.drafter], sweep=name, divergence=verdict)
            if db.add(result, spec=spec, prompt=job.prompt.text, **where) is None:
                elsewhere += 1
            else:
                stored += 1
            bar.update()
    return jobs, stored, elsewhere


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="python -m uag bench",
        description="Resumable sweep: baseline and speculative runs per prompt into a SQLite results file.",
    )
    parser.add_argument("--target", required=True, help="hub id, local directory or demo-target")
    parser.add_argument(
        "--drafters", nargs="+", required=True, help="hub ids, local directories, demo-drafter, lookup, lookup+<model>"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=SPECULATIVE,
        default=list(DEFAULT_STRATEGIES),
        help=f"default: {' '.join(DEFAULT_STRATEGIES)} (auto, tli+auto: k is the maximum it may choose)",
    )
    parser.add_argument("--k", type=k_list, nargs="+", default=[[DEFAULT_K]], help="draft lengths: 1 2 4 or 1,2,4")
    parser.add_argument(
        "--datasets", nargs="+", default=list(BUNDLED), help="bundled sets, .jsonl/.csv files or hf:<name>"
    )
    parser.add_argument("--n", type=whole, default=None, help="first N prompts of each dataset (default: all)")
    add_decoding_options(parser)
    parser.add_argument(
        "--out", type=Path, required=True, help="results file (SQLite); created, with its folder, if missing"
    )
    parser.add_argument("--sweep", default=None, help="a label stored with every run of this command")
    add_dtype_options(parser)
    return parser


def _unique(items) -> tuple:
    """Example: [2, 1, 2] -> (2, 1): order kept, repeats dropped."""
    return tuple(dict.fromkeys(items))


def sweep_from(args: argparse.Namespace) -> Sweep:
    return Sweep(
        target=args.target.strip(),
        drafters=_unique(str(DrafterSpec.parse(d)) if d.strip() else "" for d in args.drafters),
        strategies=_unique(args.strategies),
        ks=_unique(k for group in args.k for k in group),
        datasets=_unique(args.datasets),
        n=args.n,
        config=decoding_config(args),
        target_dtype=parse_dtype(args.target_dtype, flag="--target-dtype"),
        drafter_dtype=parse_dtype(args.drafter_dtype, flag="--drafter-dtype"),
    )


def _sweep(args: argparse.Namespace) -> int:
    sweep = sweep_from(args).validate()
    prompts, notes = load_prompts(sweep.datasets, sweep.n)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    try:
        with ResultsDB(args.out) as db:
            jobs = plan(sweep, prompts)  # as if the target had a chat template; execute() knows
            pending = [job for job in jobs if not db.has(job.spec.key)]
            _say(f"{len(jobs)} runs in this sweep, {len(jobs) - len(pending)} already in {args.out}")
            if pending:
                jobs, stored, elsewhere = execute(sweep, prompts, db, name=args.sweep)
                _say(f"stored {stored} runs; {elsewhere} were stored or are being run by another sweep on this file")
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: finished runs are saved in {args.out}; run the same command to continue", file=sys.stderr
        )
        return 130
    print(markdown(summary(load_runs(args.out), {job.spec.key for job in jobs})))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run("python -m uag bench", lambda: _sweep(args))
