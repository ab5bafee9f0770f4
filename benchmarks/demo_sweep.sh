#!/usr/bin/env bash
# One real sweep of the offline demo pair (Gemma-3-270M target, SmolLM2-135M drafter) on this machine, then the
# analysis: 4 prompts per bundled set, strategies none / naive / context, k = 1, 2, 4, 48 tokens per run
# (12 baselines + 108 speculative runs). Resumable: run it again after an interruption and it continues.
#
#   benchmarks/demo_sweep.sh                      # results/demo.db and results/demo-analysis/report.html
#   PYTHON=/work/venv/bin/python OUT=/tmp/demo.db benchmarks/demo_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-results/demo.db}  # *.db and results/ are git-ignored
mkdir -p "$(dirname "$OUT")"

"$PYTHON" -m uag.bench --target demo-target --drafters demo-drafter \
    --strategies none naive context --k 1 2 4 --datasets wiki alpaca synthetic \
    --n 4 --max-tokens 48 --out "$OUT" --sweep demo
"$PYTHON" -m uag.analyze "$OUT" --out "${OUT%.db}-analysis"
