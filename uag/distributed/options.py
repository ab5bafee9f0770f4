"""The `--shard` flags of `python -m uag generate` (uag.distributed.sharded runs them). Standard library only, so
that building the parser loads no mlx."""

from __future__ import annotations

SHARD_WAYS = ("pipeline", "tensor")
DEFAULT_TIMEOUT_S = 120.0  # no progress for this long: a rank is gone (a long prompt on a 70B target fits)
DEFAULT_CONNECT_TIMEOUT_S = 60.0


def add_shard_options(parser) -> None:
    """`--shard` and its companions for `python -m uag generate` (run every rank through mlx.launch)."""
    parser.add_argument(
        "--shard",
        choices=SHARD_WAYS,
        help="the target split over the ranks of mlx.launch (pipeline: layers; tensor: every layer); the drafter "
        "runs on rank 0 only",
    )
    parser.add_argument(
        "--shard-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"with --shard: give up when no rank makes progress for S seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--shard-check",
        type=int,
        default=0,
        metavar="N",
        help="with --shard, debugging: every N cycles check that all ranks hold the same tokens (0: never)",
    )
