#!/usr/bin/env bash
# Runs a benchmark on the accelerator machine (MLX-CUDA), which has no package registry. Staging, from the
# repository root here: bash benchmarks/stage_device.sh (MLX's CUDA wheels, the server's needs and the demo pair as one
# tar cut into folders .devN, each carried by one back-to-back `run` that copies it into /root/stash). Then, on the
# device:  bash benchmarks/on_device.sh benchmarks/<script>.py [args]   (installs into /root/site once a machine)
set -euo pipefail
export PYTHONPATH="/root/site:$PWD" UAG_CACHE_DIR=/root/uag-cache PYTHONUNBUFFERED=1 PATH="/root/site/bin:$PATH"
if [ ! -e /root/site/mlx_lm ]; then
    mkdir -p /root/wheels
    (cd /root/stash && cat wheels.tar.part.* | tar -C /root/wheels -xf - && rm -f wheels.tar.part.*)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site /root/wheels/*.whl
    python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, mx.default_device(), 'mlx-lm', mlx_lm.__version__)"
fi
exec python3 "$@"
