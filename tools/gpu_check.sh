#!/usr/bin/env bash
# The prepared device check of issue #5, for a machine with an NVIDIA GPU: builds the CUDA
# kernels (unless BUILD_DIR already holds a CUDA build, e.g. carried from a machine with the
# packages), runs the `gpu` tests (each CUDA kernel against the CPU op it mirrors) and writes a
# short report to $OUT (default gpu_check_out/). Bounded: every step has a timeout; the whole
# check stays under 8 minutes.
#
# Today only the first kernels exist (engine/cuda: RMSNorm, softcap, gated GELU, RoPE); the CUDA
# backend, the cluster on one GPU over CUDA IPC and the benchmarks of issue #5 are not written.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
BUILD_DIR=${BUILD_DIR:-build-gpu}
mkdir -p "$OUT"
report() { echo "$*" | tee -a "$OUT/report.txt"; }
: > "$OUT/report.txt"
report "dgserve gpu_check $(date -u +%FT%TZ)"
timeout 20 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 && report "nvidia-smi: $(head -n 12 "$OUT/nvidia-smi.txt" | grep -m1 -E 'NVIDIA|Driver' || true)" \
  || report "nvidia-smi: not available"
if [ ! -x "$BUILD_DIR/engine/cuda/cuda_ops_test" ]; then
  report "building the CUDA kernels into $BUILD_DIR"
  timeout 300 cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DDGSERVE_BUILD_BENCH=OFF -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/configure.log" 2>&1 \
    || { report "configure failed (see configure.log)"; exit 1; }
  timeout 420 cmake --build "$BUILD_DIR" -j"$(nproc)" --target cuda_ops_test > "$OUT/build.log" 2>&1 \
    || { report "build failed (see build.log)"; exit 1; }
fi
ldd "$BUILD_DIR/engine/cuda/cuda_ops_test" | grep "not found" > "$OUT/missing_libraries.txt" \
  && report "missing shared libraries: $(tr '\n' ' ' < "$OUT/missing_libraries.txt")"
timeout 120 "$BUILD_DIR/engine/cuda/cuda_ops_test" > "$OUT/gpu_tests.log" 2>&1
rc=$?
report "gpu tests: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/gpu_tests.log" | tr '\n' ' ')"
exit $rc
