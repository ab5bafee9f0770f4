"""A target pass's time at every width, after a long context: the shape `uag calibrate` samples (it times widths
1-16, 24, 33, 49 and 65 after 256 tokens and saves them; this saves nothing).

On a CPU the curve is not smooth: OpenBLAS's matrix kernels make some widths cheap and their neighbours dear (on the
2-core EPYC of docs/results.md, 16 rows cost less than 8, and 24 nearly twice 16), which is what auto prices a lookup
proposal and its branches by (docs/how-it-works.md, auto). Each width is timed as calibration times it
(`uag.costs.calibrate.time_forward`: a verification pass over the context's last tokens, one warm-up, then
`--repeats`, the cache rewound after each); the least is printed.

Usage: python benchmarks/width_curve.py [--target coder-target] [--contexts 256 1400] [--widths 1-40 48 64 65]
       [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys

import uag  # noqa: F401  (first: it loads OpenBLAS, which must precede mlx; uag/_blas.py)

# isort: split
from uag.costs.calibrate import filled_cache, time_forward


def widths(specs: list[str]) -> list[int]:
    """Widths from "N" and "A-B" items, sorted. Example: widths(["1-3", "8"]) -> [1, 2, 3, 8]"""
    out: set[int] = set()
    for spec in specs:
        lo, _, hi = spec.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out or min(out) < 1:
        raise ValueError("widths must be at least 1")
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="coder-target")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1400], help="tokens cached before each pass")
    p.add_argument("--widths", nargs="+", default=["1-40", "48", "49", "56", "63-65"], help='e.g. "1-16" "24" "65"')
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    try:
        chosen = widths(args.widths)
    except ValueError as e:
        p.error(f"--widths: {e}")
    if min(args.contexts) < chosen[-1]:
        p.error(f"--contexts: each at least the widest width ({chosen[-1]}): a pass reads the context's last tokens")
    target = uag.load(args.target)
    for context in args.contexts:
        cache, ids = filled_cache(target, context)
        row = [f"{w}:{time_forward(target, cache, ids, w, args.repeats):.0f}" for w in chosen]
        print(f"context {context}, ms per pass by width: {' '.join(row)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
