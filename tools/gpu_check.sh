#!/usr/bin/env bash
# The prepared device check of issue #5, for a machine with an NVIDIA GPU: builds the CUDA
# kernels and their `gpu` tests (unless BUILD_DIR already holds all test binaries, e.g. carried
# from a machine with the packages), runs every `gpu` test binary (each CUDA kernel against the
# CPU code it mirrors) and writes a short report to $OUT (default gpu_check_out/): one
# PASSED / FAILED / SKIPPED line per test, plus CRASHED / TIMEOUT lines for a binary that died.
# Bounded: every step has a timeout taken from one overall deadline; the whole check stays under
# 8 minutes.
#
# Kernels (engine/cuda): RMSNorm, softcap, gated GELU, RoPE (cuda_ops), the bf16 cuBLAS
# projections (cuda_gemm), flash-style prefill/canvas attention (cuda_attention), the fused
# vocabulary step of the sampler (cuda_vocab), the backend's small kernels (embedding gather,
# residual ops, MoE gather/combine, self-conditioning probabilities: cuda_backend_kernels), and
# the whole CUDA ModelBackend against the CPU backend on a tiny random checkpoint
# (cuda_backend). The cluster on one GPU over CUDA IPC and
# the benchmarks of issue #5 are not written.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_check_out}
BUILD_DIR=${BUILD_DIR:-build-gpu}
TESTS="cuda_ops_test cuda_gemm_test cuda_attention_test cuda_vocab_test cuda_backend_kernels_test
  cuda_backend_test"
NUM_TESTS=$(echo $TESTS | wc -w)
PER_TEST_S=${PER_TEST_S:-45}          # per test binary (each needs a few seconds on an H100)
DEADLINE=$((SECONDS + 470))           # 7 min 50 s for everything
# Seconds a step may take: at most $1, leaving $2 for the steps after it (never below 1).
budget() {
  local want=$1 left=$((DEADLINE - SECONDS - $2))
  ((left < want)) && want=$left
  ((want < 1)) && want=1
  echo "$want"
}
mkdir -p "$OUT"
report() { echo "$*" | tee -a "$OUT/report.txt"; }
: > "$OUT/report.txt"
report "dgserve gpu_check $(date -u +%FT%TZ)"
timeout 20 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 && report "nvidia-smi: $(head -n 12 "$OUT/nvidia-smi.txt" | grep -m1 -E 'NVIDIA|Driver' || true)" \
  || report "nvidia-smi: not available"

reserve=$((PER_TEST_S * NUM_TESTS))
missing=0
for t in $TESTS; do [ -x "$BUILD_DIR/engine/cuda/$t" ] || missing=1; done
if [ "$missing" = 1 ]; then
  report "building the CUDA kernels and gpu tests into $BUILD_DIR"
  if [ ! -f "$BUILD_DIR/build.ninja" ] && [ ! -f "$BUILD_DIR/Makefile" ]; then
    timeout "$(budget 120 $((reserve + 120)))" cmake -S . -B "$BUILD_DIR" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release -DDGSERVE_BUILD_BENCH=OFF -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DDGSERVE_CUDA_BACKEND=ON \
      > "$OUT/configure.log" 2>&1 || { report "configure failed (see configure.log)"; exit 1; }
  fi
  # shellcheck disable=SC2086
  timeout "$(budget 330 "$reserve")" cmake --build "$BUILD_DIR" -j"$(nproc)" --target $TESTS \
    > "$OUT/build.log" 2>&1 || { report "build failed or timed out (see build.log)"; exit 1; }
  report "build: $(grep -c -i 'warning' "$OUT/build.log") warning lines (see build.log)"
fi
ldd "$BUILD_DIR/engine/cuda/cuda_ops_test" | grep "not found" > "$OUT/missing_libraries.txt" \
  && report "missing shared libraries: $(tr '\n' ' ' < "$OUT/missing_libraries.txt")"

rc=0
left_tests=$NUM_TESTS
for t in $TESTS; do
  left_tests=$((left_tests - 1))
  log="$OUT/$t.log"
  bin="$BUILD_DIR/engine/cuda/$t"
  if [ ! -x "$bin" ]; then
    report "MISSING $t"
    rc=1
    continue
  fi
  limit=$(budget "$PER_TEST_S" $((left_tests * 10)))
  start=$SECONDS
  timeout "$limit" "$bin" --gtest_color=no > "$log" 2>&1
  status=$?
  # One line per finished test: "[       OK ] Suite.Name (12 ms)" and friends (the summary at
  # the end repeats names without the time; those lines are not matched).
  sed -n -E \
    -e "s/^\[       OK \] ([^ ]+) \(([0-9]+ ms)\)$/PASSED  $t \1 (\2)/p" \
    -e "s/^\[  FAILED  \] ([^ ]+) \(([0-9]+ ms)\)$/FAILED  $t \1 (\2)/p" \
    -e "s/^\[  SKIPPED \] ([^ ]+) \(([0-9]+ ms)\)$/SKIPPED $t \1 (\2)/p" "$log" |
    while read -r line; do report "$line"; done
  # A test that started but never finished: the binary crashed or ran out of time in it.
  last_run=$(grep -E '^\[ RUN      \] ' "$log" | tail -n 1 | sed -E 's/^\[ RUN      \] //')
  if [ -n "$last_run" ] && ! grep -q -E "^\[ *(OK|FAILED|SKIPPED) *\] $last_run( |$)" "$log"; then
    if [ "$status" = 124 ]; then report "TIMEOUT $t $last_run (after ${limit}s)"; else
      report "CRASHED $t $last_run (exit $status)"; fi
  fi
  report "$t: exit $status in $((SECONDS - start))s (log: $t.log)"
  [ "$status" = 0 ] || rc=1
done
report "gpu tests: $(grep -c '^PASSED' "$OUT/report.txt") passed, $(grep -c '^FAILED' "$OUT/report.txt") failed, $(grep -c '^SKIPPED' "$OUT/report.txt") skipped, $(grep -c -E '^(CRASHED|TIMEOUT|MISSING)' "$OUT/report.txt") crashed/timed out/missing; exit $rc"
exit $rc
