#!/usr/bin/env bash
# One real sweep of the offline demo pair (Gemma-3-270M target, SmolLM2-135M drafter) on this machine, then the
# analysis: 3 prompts per bundled set, strategies none / naive / context, k = 1, 2, 4, 40 tokens per run
# (9 baselines + 81 speculative runs; ~20 minutes on 2 CPU cores). Resumable: run it again after an
# interruption and it continues.
#
#   benchmarks/demo_sweep.sh                      # results/demo.db and results/demo-analysis/report.html
#   PYTHON=/work/venv/bin/python OUT=/tmp/demo.db benchmarks/demo_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-results/demo.db}  # *.db and results/ are git-ignored
mkdir -p "$(dirname "$OUT")"

"$PYTHON" -m uag bench --target demo-target --drafters demo-drafter \
    --strategies none naive context --k 1 2 4 --datasets wiki alpaca synthetic \
    --n 3 --max-tokens 40 --out "$OUT" --sweep demo
"$PYTHON" -m uag analyze "$OUT" --out "${OUT%.db}-analysis"
