#!/usr/bin/env bash
# The one list of what the device check runs, read by tools/gpu_check.sh, tools/gpu_bundle.sh
# and tools/gpu_bundle_test.sh (paths relative to a build folder). A new `gpu` test binary is
# added here only.
#
#   source tools/gpu_binaries.sh          # sets GPU_TESTS, CLUSTER_BINS, BENCH_BINS, GPU_BUNDLE_BINS
#   bash tools/gpu_binaries.sh --targets  # prints the CMake target names of GPU_BUNDLE_BINS
GPU_TESTS="engine/cuda/cuda_ops_test engine/cuda/cuda_gemm_test engine/cuda/cuda_attention_test
  engine/cuda/cuda_attention_tc_test engine/cuda/cuda_vocab_test engine/cuda/cuda_soft_embed_test
  engine/cuda/cuda_backend_kernels_test engine/cuda/cuda_backend_test
  engine/cuda/cuda_mma_test engine/cuda/cuda_graph_test engine/cuda/cuda_synthetic_test
  engine/cuda/cuda_moe_test engine/cuda/cuda_moe_w4a16_test engine/cuda/cuda_backend_w4a16_test
  engine/cuda/cuda_nvfp4_test engine/cuda/cuda_backend_nvfp4_test engine/cuda/cuda_fp8_test
  engine/cuda/cuda_fp8_upload_test engine/cuda/cuda_backend_fp8_test
  kvstore/kvstore_nccl_self_send_test"
CLUSTER_BINS="gateway/dgserve-gateway prefill_worker/dgserve-prefill-worker
  denoise_worker/dgserve-denoise-worker tools/dgserve-mkmodel"
# attention_bench exists only in a build with the CUDA kernels (gpu_check.sh's dry run runs
# attention_bench_emu instead).
BENCH_BINS="bench/engine_bench"
GPU_BUNDLE_BINS="$GPU_TESTS $CLUSTER_BINS $BENCH_BINS bench/attention_bench"
if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "${1:-}" = --targets ]; then
  for b in $GPU_BUNDLE_BINS; do basename "$b"; done | tr '\n' ' '
  echo
fi
