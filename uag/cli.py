"""`python -m uag generate ...`: one generation from the command line, plain or as JSON.

    python -m uag generate --drafter demo-drafter -k 2 "Stolica Polski to"
    python -m uag generate --drafter lookup --prompt-file notes.txt      # prompt lookup, no drafter model
    cat long.txt | python -m uag generate --strategy auto -k 8 -            # the prompt from stdin

Every decoding flag is checked by `GenerationConfig.parse`, the same checks as the app's and the API's, and
the prompt is checked against the target's context and the drafter's before anything is generated. Bad
input is one ``error: …`` line and exit 2 (uag.command).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from uag.command import CommandParser, literal, run
from uag.config import DEFAULT_K, DEFAULT_MAX_TOKENS, FIELD, MAX_K, MODES, DrafterSpec, GenerationConfig
from uag.errors import InputError
from uag.prompt_input import check_context, read_prompt
from uag.translate import DEFAULT_WINDOW

# The flag that sets each GenerationConfig field, for messages ("--seed: seed must be …").
FLAGS = {
    "strategy": "--strategy",
    "k": "-k",
    "window": "--window",
    "max_tokens": "--max-tokens",
    "temperature": "--temp",
    "seed": "--seed",
    "chat": "--chat",
}


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by commands that generate with one pair (generate, calibrate)."""
    parser.add_argument("--target", default="demo-target", help="hub id, local directory or demo-target")
    parser.add_argument(
        "--drafter",
        default="demo-drafter",
        help="hub id, local directory, demo-drafter, lookup (prompt lookup, no model) or lookup+<model>",
    )
    parser.add_argument("-k", default=str(DEFAULT_K), help=f"draft length, 1..{MAX_K} (default {DEFAULT_K})")
    add_decoding_options(parser)


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """The decoding settings, for commands that take several drafters or draft lengths (uag.bench).
    Taken as text: `decoding_config` checks them all at once, as the app does."""
    limits = {name: FIELD[name] for name in ("window", "max_tokens", "temperature", "seed")}
    parser.add_argument(
        "--window",
        default=str(DEFAULT_WINDOW),
        help=f"committed tokens of context for translation, 0..{limits['window'].hi:g} (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--max-tokens",
        default=str(DEFAULT_MAX_TOKENS),
        help=f"tokens to generate at most, 1..{limits['max_tokens'].hi:g} (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--temp", default="0", help=f"sampling temperature, 0..{limits['temperature'].hi:g}; 0 = greedy"
    )
    parser.add_argument("--seed", default=None, help=f"random seed for temperature > 0, 0..{int(limits['seed'].hi)}")
    parser.add_argument("--chat", action="store_true", help="apply the target's chat template to the prompt")


def decoding_config(args: argparse.Namespace, **fields: Any) -> GenerationConfig:
    """The GenerationConfig the flags ask for (plus `fields`); InputError naming every bad flag.

    Example: --seed -1 --temp inf -> InputError("--temp: temperature must be a number from 0 to 2 (got inf);
             --seed: seed must be a whole number from 0 to 2147483647 (got -1)")
    """
    raw: dict[str, Any] = {
        "window": literal(args.window),
        "max_tokens": literal(args.max_tokens),
        "temperature": literal(args.temp),
        "seed": None if args.seed is None else literal(args.seed),
        "chat": bool(args.chat),
        **fields,
    }
    problems = []
    for name, value in raw.items():
        try:
            GenerationConfig.parse(**{name: value})
        except InputError as err:
            problems.append(f"{FLAGS.get(name, name)}: {err}")
    if problems:
        raise InputError("; ".join(problems))
    return GenerationConfig.parse(**raw)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m uag", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    gen = commands.add_parser("generate", help="generate text, baseline or speculative")
    add_generation_options(gen)
    gen.add_argument(
        "--strategy",
        default="context",
        help=f"{' / '.join(MODES)}: baseline = target alone; none / naive / context / tli = how drafts are "
        "translated; auto = context with k re-decided each cycle",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, ids and records")
    gen.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 text file")
    gen.add_argument("prompt", nargs="?", help="the prompt text, or - to read it from stdin")
    from uag.shard_options import add_shard_options

    add_shard_options(gen)
    return parser


def drafter_prompt_length(target, drafter, ids: list[int], config: GenerationConfig) -> int:
    """How many tokens the drafter model reads for the target's prompt `ids`: the translator's own
    drafter-side prompt, so exactly what the run will feed it."""
    from uag.translate import make_translator
    from uag.vocab import same_vocabulary

    translation = "context" if config.strategy == "auto" else config.strategy
    shared = same_vocabulary(target.vocab, drafter.vocab)
    translator = make_translator(translation, target.vocab, drafter.vocab, window=config.window, shared=shared)
    return len(translator.start(ids))


def _stats_line(stats: dict) -> str:
    def fmt(value, pattern):
        return "–" if value is None else pattern.format(value)

    parts = [f"{stats['generated_tokens']} tokens", f"{fmt(stats['tokens_per_second'], '{:.1f}')} tok/s"]
    if stats["strategy"] != "baseline":
        parts += [
            f"α {fmt(stats['acceptance_rate'], '{:.0%}')}",
            f"accepted/cycle {fmt(stats['mean_accepted'], '{:.2f}')}",
            f"{stats['cycles']} cycles",
            f"translation: {stats['strategy']}",
        ]
    parts.append(f"prompt {fmt(stats['prompt_tps'], '{:.0f}')} tok/s")
    parts.append(f"finish: {stats['finish_reason']}")
    return " | ".join(parts)


def run_generate(args: argparse.Namespace) -> int:
    from uag.api import generate  # strategy auto: seeded with the pair's saved cost profile
    from uag.engine import prompt_ids
    from uag.loading_errors import load_drafter_choice, load_model
    from uag.models import ModelStore

    config = decoding_config(args, strategy=args.strategy, k=literal(args.k))
    if getattr(args, "shard", None) and args.prompt == "-":
        raise InputError("--shard: every rank needs the prompt: give it as an argument or with --prompt-file")
    prompt = read_prompt(args.prompt, args.prompt_file, sys.stdin.buffer)
    if not prompt.strip():
        raise InputError("the prompt is empty")
    if getattr(args, "shard", None):  # a target split over the ranks of mlx.launch
        return _print_run(args, _generate_sharded(args, config, prompt))
    spec = DrafterSpec.parse(args.drafter) if config.speculative else None
    store = ModelStore()
    progress = None if args.json else (lambda msg: print(f"[uag] {msg}", file=sys.stderr))
    target = load_model(store, args.target, role="target", progress=progress)
    choice = None if spec is None else load_drafter_choice(store, spec, progress=progress)
    ids = prompt_ids(target, prompt, chat=config.chat)  # checks the target's context
    if choice is not None and choice.model is not None:
        n = drafter_prompt_length(target, choice.model, ids, config)
        check_context(n, choice.model.context_length, "drafter", choice.model.name)
    return _print_run(args, generate(target, choice, ids, config))


def _generate_sharded(args: argparse.Namespace, config: GenerationConfig, prompt: str):
    """`generate --shard …` on one rank (uag.distributed): the run on rank 0, None on the others."""
    from uag.distributed import connect, generate_sharded, load_rank0_drafter, load_sharded
    from uag.engine import prompt_ids
    from uag.models import ModelStore

    if args.shard_timeout <= 0 or args.shard_check < 0:
        raise InputError("--shard-timeout must be above 0 and --shard-check at least 0")
    ranks = connect(timeout_s=args.shard_timeout)
    try:
        say = None if args.json or ranks.rank else (lambda msg: print(f"[uag] {msg}", file=sys.stderr))
        target = load_sharded(args.target, args.shard, ranks, progress=say)
        spec = DrafterSpec.parse(args.drafter) if config.speculative else None
        choice = None if spec is None else load_rank0_drafter(ModelStore(), spec, ranks, progress=say)
        ids = prompt_ids(target, prompt, chat=config.chat)
        if choice is not None and choice.model is not None:  # before any collective: no rank waits on a refusal
            n = drafter_prompt_length(target, choice.model, ids, config)
            check_context(n, choice.model.context_length, "drafter", choice.model.name)
        run = generate_sharded(target, choice, ids, config, ranks, check_every=args.shard_check)
    finally:
        ranks.close()
    return run if ranks.rank == 0 else None


def _print_run(args: argparse.Namespace, run) -> int:
    """The text with accepted drafts in green and a stats line, or one JSON object (nothing for None)."""
    from uag.highlight import ansi

    if run is None:
        return 0
    if args.json:
        json.dump(run.to_dict(), sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
        return 0
    print(ansi(run.tokens, colour=sys.stdout.isatty()))
    for note in run.notes:
        print(f"note: {note}", file=sys.stderr)
    print(_stats_line(run.stats()), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(f"python -m uag {args.command}", lambda: {"generate": run_generate}[args.command](args))
