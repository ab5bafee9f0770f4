"""`python -m uag generate ...`: one generation from the command line, plain or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from uag.generate import DEFAULT_K, DEFAULT_MAX_TOKENS, MAX_K, MODES, GenerationConfig
from uag.translate import DEFAULT_WINDOW


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that generates (generate, bench, calibrate)."""
    parser.add_argument("--target", default="demo-target", help="hub id, local directory or demo-target")
    parser.add_argument("--drafter", default="demo-drafter", help="hub id, local directory or demo-drafter")
    parser.add_argument("-k", type=int, default=DEFAULT_K, help=f"draft length, 1..{MAX_K} (default {DEFAULT_K})")
    add_decoding_options(parser)


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """The decoding settings, for commands that take several drafters or draft lengths (uag.bench)."""
    parser.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW,
        help=f"committed tokens of context for translation (default {DEFAULT_WINDOW})",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--seed", type=int, default=None, help="random seed for temperature > 0")
    parser.add_argument("--chat", action="store_true", help="apply the target's chat template to the prompt")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m uag", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text, baseline or speculative")
    add_generation_options(gen)
    gen.add_argument(
        "--strategy",
        choices=MODES,
        default="context",
        help="baseline = target alone; none / naive / context = how drafts are translated",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, ids and records")
    gen.add_argument("prompt", help="the prompt text")
    return parser


def config_from(args: argparse.Namespace, strategy: str) -> GenerationConfig:
    return GenerationConfig(
        strategy=strategy,
        k=args.k,
        window=args.window,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        seed=args.seed,
        chat=args.chat,
    ).validate()


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
    from uag.generate import generate
    from uag.highlight import ansi
    from uag.models import ModelStore

    config = config_from(args, args.strategy)
    if not args.prompt.strip():
        raise ValueError("the prompt is empty")
    store = ModelStore()
    progress = None if args.json else (lambda msg: print(f"[uag] {msg}", file=sys.stderr))
    target = store.get(args.target, progress=progress)
    drafter = None if config.strategy == "baseline" else store.get(args.drafter, progress=progress)
    run = generate(target, drafter, args.prompt, config)
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
    try:
        return {"generate": run_generate}[args.command](args)
    except (ValueError, OSError) as err:  # ModelError is a ValueError: bad input, said plainly
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
