#!/usr/bin/env bash
# Configures the one sanitizer build tree that both the fuzz smoke (tests/fuzz/run_fuzz.sh) and
# the sanitized unit + integration run (tools/sanitize.sh) build in: clang under
# AddressSanitizer + UndefinedBehaviorSanitizer (every report fatal), OSS-Fuzz's -O1 with line
# tables only, no benchmarks, no CUDA, no gpu-emu tests (the labels run there use none of it).
# One tree for both, so the libraries are compiled once per CI run (issue 35: CI inside its
# time). In it:
#   - the libFuzzer harnesses are built (DGSERVE_BUILD_FUZZERS), and only they and the libraries
#     they fuzz get the coverage instrumentation (-fsanitize=fuzzer-no-link, tests/fuzz/);
#   - a test's own translation units are compiled at -O0 (DGSERVE_TEST_OPT_FLAGS): under ASan +
#     UBSan that halves their compile time (quant_test.cc: 22.5 s at -O1, 10.8 s at -O0, clang 14),
#     while the code under test, in the libraries, keeps -O1.
#
#   bash tools/configure_sanitize.sh [DIR]      # DIR: default build-asan
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build-asan}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
OPT="-O1 -gline-tables-only -DNDEBUG"
# lld where it is installed: a sanitized test binary links in about 0.4 s instead of 1.6 s with
# the default linker (89 links in this tree).
LINK="$SAN"
command -v ld.lld >/dev/null && LINK="$SAN -fuse-ld=lld"
# A tree configured with another compiler (build-asan/ was a g++ tree before 2026-12-06) cannot
# switch in place: CMake deletes its cache and then fails. Start it over.
if [ -f "$BUILD_DIR/CMakeCache.txt" ] &&
   ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++$' "$BUILD_DIR/CMakeCache.txt"; then
  echo "configure_sanitize: $BUILD_DIR was configured with another compiler: configuring it again"
  rm -rf "$BUILD_DIR/CMakeCache.txt" "$BUILD_DIR/CMakeFiles"
fi
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DDGSERVE_BUILD_FUZZERS=ON -DDGSERVE_BUILD_BENCH=OFF -DDGSERVE_ENABLE_CUDA=OFF \
  -DDGSERVE_BUILD_GPU_EMU=OFF -DDGSERVE_TEST_OPT_FLAGS=-O0 \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="$OPT" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="$OPT" \
  -DCMAKE_C_FLAGS="$SAN" -DCMAKE_CXX_FLAGS="$SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="$LINK" -DCMAKE_SHARED_LINKER_FLAGS="$LINK" >/dev/null
