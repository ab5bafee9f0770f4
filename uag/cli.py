"""`uag COMMAND …` (or `python -m uag COMMAND …`): the one command, and its `generate`.

    uag generate | serve | app | calibrate | bench | analyze | models      (`uag COMMAND --help` for each)

`generate`: one generation from the command line, plain or as JSON.

    python -m uag generate --drafter demo-drafter -k 2 "Stolica Polski to"
    python -m uag generate --drafter lookup --prompt-file notes.txt      # prompt lookup, no drafter model
    cat long.txt | python -m uag generate --strategy auto -k 8 -            # the prompt from stdin
    python -m uag generate --strategy auto --json-schema person.json --chat "Describe Ala as JSON"

Every decoding flag is checked by `GenerationConfig.parse`, the same checks as the app's and the API's, and
the prompt is checked against the target's context and the drafter's before anything is generated. Bad
input is one ``error: …`` line and exit 2 (uag.command).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Iterable
from functools import partial
from pathlib import Path

from uag._blas import end_with
from uag.command import USER_ERROR, CommandParser, add_generation_options, decoding_config, literal, progress, run, say
from uag.core.config import MODES, DrafterSpec, GenerationConfig
from uag.core.prompt_input import read_prompt
from uag.core.records import Token, spans
from uag.distributed.options import add_shard_options
from uag.errors import InputError
from uag.machine import backend
from uag.models.dtypes import add_dtype_options, parse_dtype, slow_dtype_note
from uag.models.loading import user_facing_load_errors


def build_parser() -> argparse.ArgumentParser:
    gen = CommandParser(prog="python -m uag generate", description=__doc__.splitlines()[0])
    add_generation_options(gen)
    gen.add_argument(
        "--strategy",
        default="context",
        help=f"{' / '.join(MODES)}: baseline = target alone; none / naive / context / tli = how drafts are "
        "translated; auto = context with k re-decided each cycle (tli+auto: tli with it; see --k-policy)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, ids and records")
    add_dtype_options(gen)
    gen.add_argument(
        "--compare",
        action="store_true",
        help="run the target alone too, and say whether (and why) greedy outputs differ (JSON: baseline, "
        "speculative, divergence)",
    )
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="PATH",
        help="the reply must fit this JSON Schema (a file holding the schema, or OpenAI's response_format "
        "json_schema object with name, schema, strict)",
    )
    shape.add_argument("--json-object", action="store_true", help="the reply must be one JSON object")
    gen.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 text file")
    gen.add_argument("prompt", nargs="?", help="the prompt text, or - to read it from stdin")
    add_shard_options(gen)
    return gen


def _stats_line(stats: dict) -> str:
    def fmt(value, pattern):
        return "–" if value is None else pattern.format(value)

    parts = [f"{stats['generated_tokens']} tokens", f"{fmt(stats['tokens_per_second'], '{:.1f}')} tok/s"]
    if stats["translation"] != "baseline":
        parts += [
            f"α {fmt(stats['acceptance_rate'], '{:.0%}')}",
            f"accepted/cycle {fmt(stats['mean_accepted'], '{:.2f}')}",
            f"{stats['cycles']} cycles",
            f"translation: {stats['translation']}",
        ]
    parts.append(f"prompt {fmt(stats['prompt_tps'], '{:.0f}')} tok/s")
    parts.append(f"finish: {stats['finish_reason']}")
    return " | ".join(parts)


def run_generate(args: argparse.Namespace) -> int:
    # mlx is loaded only by a command that runs a model: the dispatcher below, `uag --help` and `uag app` go without
    from uag.api import generate  # strategy auto: opens from the pair's saved costs and evidence, and saves them
    from uag.models.store import ModelStore
    from uag.runtime.pair import open_pair, prompt_ids_for

    config = decoding_config(args, strategy=args.strategy, k=literal(args.k), constraint=_constraint(args))
    if getattr(args, "shard", None) and args.prompt == "-":
        raise InputError("--shard: every rank needs the prompt: give it as an argument or with --prompt-file")
    prompt = read_prompt(args.prompt, args.prompt_file, sys.stdin.buffer)
    if not prompt.strip():
        raise InputError("the prompt is empty")
    target_dtype = parse_dtype(args.target_dtype, flag="--target-dtype")
    drafter_dtype = parse_dtype(args.drafter_dtype, flag="--drafter-dtype")
    if getattr(args, "shard", None):  # a target split over the ranks of mlx.launch
        if target_dtype or drafter_dtype or args.compare or config.constraint:
            raise InputError(
                "--shard loads the models as stored and runs once, unconstrained: drop --*-dtype, "
                "--compare, --json-schema and --json-object"
            )
        return _print_run(args, *_generate_sharded(args, config, prompt))
    if args.compare and not config.speculative:
        raise InputError("--compare sets a speculative run against the target alone: pick a --strategy but baseline")
    say_progress = None if args.json else progress
    drafter = args.drafter if config.speculative else None
    loaded = open_pair(
        ModelStore(),
        args.target,
        drafter,
        target_dtype=target_dtype,
        drafter_dtype=drafter_dtype,
        progress=say_progress,
    )
    ids = prompt_ids_for(loaded, prompt, config)  # the target's template and context, the drafter's room
    if config.speculative and (note := slow_dtype_note(loaded.target.dtype, backend())):
        say(f"note: {note}")  # before the run: it may take a while
    if args.compare:
        return _print_comparison(args, loaded, ids, config)
    return _print_run(args, generate(loaded.target, loaded.choice, ids, config), _ran(loaded, config))


def _constraint(args: argparse.Namespace) -> str | None:
    """The grammar --json-schema or --json-object asks for (uag.core.grammar); InputError naming the flag."""
    from uag.core.grammar import response_format_constraint  # llguidance: loaded only when a grammar is asked for

    if args.json_object:
        return response_format_constraint({"type": "json_object"})
    if args.json_schema is None:
        return None
    try:
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"--json-schema: cannot read a JSON Schema from {args.json_schema}: {err}") from None
    wrapped = isinstance(schema, dict) and isinstance(schema.get("schema"), dict)  # response_format's json_schema
    spec = schema if wrapped else {"name": Path(args.json_schema).stem, "schema": schema}
    try:
        return response_format_constraint({"type": "json_schema", "json_schema": spec})
    except InputError as err:
        raise InputError(f"--json-schema: {str(err).removeprefix('response_format.json_schema.')}") from None


def _ran(loaded, config: GenerationConfig) -> dict:
    from uag.runtime.pair import what_ran

    return what_ran(loaded.target, loaded.choice, config)


def _print_comparison(args: argparse.Namespace, loaded, ids: list[int], config: GenerationConfig) -> int:
    """The target alone, then the speculative run, and the verdict on their greedy outputs (the same as a server
    reply's `"check": true`: uag.runtime.pair.check_against_target)."""
    from uag.api import generate
    from uag.runtime.pair import check_against_target

    baseline = generate(loaded.target, None, ids, config.replace(strategy="baseline"))
    speculative = generate(loaded.target, loaded.choice, ids, config)
    checked = check_against_target(loaded, ids, config, speculative, baseline=baseline)
    if args.json:
        out = {"ran": _ran(loaded, config), "baseline": baseline.to_dict(), "speculative": speculative.to_dict()}
        json.dump({**out, "divergence": checked.to_dict()}, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    _print_run(args, speculative)
    print(f"target alone: {_stats_line(baseline.stats())}", file=sys.stderr)
    verdict = checked.divergence
    if verdict is None:
        say(f"note: {checked.to_dict()['message']}")
    elif verdict.kind == "identical":
        print("same output as the target alone, token for token", file=sys.stderr)
    else:
        p = verdict.position
        piece = lambda run: run.tokens[p].text if p < len(run.tokens) else None  # noqa: E731
        say(verdict.message(piece(baseline), piece(speculative)))
    return 0


def _generate_sharded(args: argparse.Namespace, config: GenerationConfig, prompt: str):
    """`generate --shard …` on one rank (uag.distributed.sharded): (the run, what ran) on rank 0, (None, None) on
    the others. The prompt is read and checked as every front end's (uag.runtime.pair); the pair is loaded its
    own way (a sharded target, the drafter on rank 0 only) and `auto` opens from no saved costs: measuring them
    would take every rank's passes (`uag serve --shard` measures them over the shards)."""
    from uag.distributed.sharded import connect, generate_sharded, load_rank0_drafter, load_sharded
    from uag.models.store import ModelStore
    from uag.runtime.pair import pair_of, prompt_ids_for

    if args.shard_timeout <= 0 or args.shard_check < 0:
        raise InputError("--shard-timeout must be above 0 and --shard-check at least 0")
    ranks = connect(timeout_s=args.shard_timeout)
    try:
        say_progress = None if args.json or ranks.rank else progress
        with user_facing_load_errors("target", args.target):
            target = load_sharded(args.target, args.shard, ranks, progress=say_progress)
        spec = DrafterSpec.parse(args.drafter) if config.speculative else None
        choice = None if spec is None else load_rank0_drafter(ModelStore(), spec, ranks, progress=say_progress)
        loaded = pair_of(target, choice)  # rank 0 only holds the drafter: checked there
        ids = prompt_ids_for(loaded, prompt, config)  # before any collective: no rank waits on a refusal
        run = generate_sharded(target, choice, ids, config, ranks, check_every=args.shard_check)
    finally:
        ranks.close()
    return (run, _ran(loaded, config)) if ranks.rank == 0 else (None, None)


def ansi(tokens: Iterable[Token], *, colour: bool = True) -> str:
    """The text with accepted draft spans in green, for a terminal (plain text when `colour` is off).

    Example: [('Ala', draft), (' ma', draft), (' kota', target)] -> '\x1b[32mAla ma\x1b[0m kota'
    """
    if not colour:
        return "".join(t.text for t in tokens)
    return "".join(f"\x1b[32m{text}\x1b[0m" if label else text for text, label in spans(tokens))


def _print_run(args: argparse.Namespace, run, ran: dict | None = None) -> int:
    """The text with accepted drafts in green and a stats line, or one JSON object with what ran (nothing for
    None)."""
    if run is None:
        return 0
    if args.json:
        json.dump({**run.to_dict(), "ran": ran}, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    print(ansi(run.tokens, colour=sys.stdout.isatty()))
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    print(_stats_line(run.stats()), file=sys.stderr)
    return 0


def generate_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run("python -m uag generate", lambda: run_generate(args))


# name -> (module with main(argv), what it does). Each module is imported only when its command runs.
COMMANDS = {
    "generate": ("uag.cli", "generate_main", "one generation, baseline or speculative, plain or as JSON"),
    "serve": ("uag.server.main", "main", "an OpenAI-compatible server that speculates (with the app mounted)"),
    "app": ("uag.app.launch", "main", "the app: the target alone vs speculative decoding, side by side"),
    "calibrate": ("uag.costs.calibrate", "main", "measure a pair's costs on this machine, for auto and α*"),
    "bench": ("uag.study.bench", "main", "sweep drafters, strategies and k over prompt sets into SQLite"),
    "analyze": ("uag.study.analyze", "main", "the study's tables and figures from a sweep's database"),
    "models": ("uag.models.demo", "main", "fetch and convert the offline models into the user cache"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return (
        "usage: uag COMMAND [options]   (or python -m uag COMMAND)\n\ncommands:\n"
        + "\n".join(lines)
        + ("\n\n`uag COMMAND --help` lists a command's options.")
    )


def command_line(command: str | None = None) -> None:
    """`uag` on the command line: `main`, its code the process's exit status (uag._blas.end_with). `command`: the one
    a script named after it runs (`uag-bench` is `uag bench`)."""
    sys.exit(end_with(main(sys.argv[1:] if command is None else [command, *sys.argv[1:]])))


bench, analyze, calibrate = (partial(command_line, name) for name in ("bench", "analyze", "calibrate"))  # scripts


def main(argv: list[str] | None = None) -> int:
    """Run one command: `argv` is what follows `uag` (default: sys.argv[1:])."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else USER_ERROR
    if argv[0] not in COMMANDS:
        say(f"error: unknown command {argv[0]!r}: choose one of {', '.join(COMMANDS)} (see uag --help)")
        return USER_ERROR
    module, function, _ = COMMANDS[argv[0]]
    try:
        command = getattr(importlib.import_module(module), function)
    except ModuleNotFoundError as err:  # an installation without the command's module, or without a package it needs
        if err.name and module.startswith(err.name):
            say(f"error: `uag {argv[0]}` is not part of this installation of uag (no module {err.name})")
        else:
            say(
                f"error: `uag {argv[0]}` needs the Python package {err.name!r}, which is not installed: "
                "pip install -r requirements.txt"
            )
        return USER_ERROR
    return command(argv[1:])
