#!/usr/bin/env bash
# tools/gpu_bundle.sh on fake build folders (copies of /bin/true as the binaries): what it
# refuses leaves every folder as it was; a good build gives a bundle whose env.sh works.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
check() {  # $1: description, rest: a command that must succeed
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; fails=$((fails + 1)); fi
}
BINS="engine/cuda/cuda_ops_test engine/cuda/cuda_gemm_test engine/cuda/cuda_attention_test
  engine/cuda/cuda_attention_tc_test engine/cuda/cuda_vocab_test engine/cuda/cuda_soft_embed_test
  engine/cuda/cuda_backend_kernels_test engine/cuda/cuda_backend_test
  engine/cuda/cuda_mma_test engine/cuda/cuda_graph_test engine/cuda/cuda_synthetic_test
  engine/cuda/cuda_moe_test engine/cuda/cuda_backend_w4a16_test kvstore/kvstore_nccl_self_send_test gateway/dgserve-gateway
  prefill_worker/dgserve-prefill-worker
  denoise_worker/dgserve-denoise-worker tools/dgserve-mkmodel bench/engine_bench
  bench/attention_bench"
fake_build() {  # $1: folder, $2: the DGSERVE_CUDA_BACKEND value
  mkdir -p "$1"
  echo "DGSERVE_CUDA_BACKEND:BOOL=$2" > "$1/CMakeCache.txt"
  for b in $BINS; do mkdir -p "$1/$(dirname "$b")"; cp /bin/true "$1/$b"; done
  echo keep > "$1/keep.txt"
}
bundle() { bash tools/gpu_bundle.sh "$@" > "$T/out" 2>&1; }

fake_build "$T/cpu-build" OFF
fake_build "$T/gpu-build" ON
check "a build without the CUDA backend is refused" bash -c "! bash tools/gpu_bundle.sh '$T/cpu-build' '$T/b1' > /dev/null 2>&1"
check "... and nothing is written" test ! -e "$T/b1"
check "the build folder itself is refused" bash -c "! bash tools/gpu_bundle.sh '$T/gpu-build' '$T/gpu-build' > /dev/null 2>&1"
check "... and the build folder is intact" test -f "$T/gpu-build/keep.txt"
check "a folder inside the build is refused" bash -c "! bash tools/gpu_bundle.sh '$T/gpu-build' '$T/gpu-build/b' > /dev/null 2>&1"
check "a folder around the build is refused" bash -c "! bash tools/gpu_bundle.sh '$T/gpu-build' '$T' > /dev/null 2>&1"
mkdir -p "$T/other" && echo x > "$T/other/file"
check "an existing folder that is not a bundle is refused" bash -c "! bash tools/gpu_bundle.sh '$T/gpu-build' '$T/other' > /dev/null 2>&1"
check "... and left as it was" test -f "$T/other/file"

check "a good build makes a bundle" bundle "$T/gpu-build" "$T/bundle"
for b in $BINS; do
  [ -x "$T/bundle/build-gpu/$b" ] || { echo "FAILED: $b not in the bundle"; fails=$((fails + 1)); }
done
check "env.sh puts the bundle's lib/ first" bash -c "source '$T/bundle/env.sh' > /dev/null && [[ \$LD_LIBRARY_PATH == '$T/bundle/lib'* ]]"
echo marker > "$T/bundle/marker"
rm "$T/gpu-build/bench/engine_bench"
check "a failed run (a binary missing) is refused" bash -c "! bash tools/gpu_bundle.sh '$T/gpu-build' '$T/bundle' > /dev/null 2>&1"
check "... and the earlier bundle is kept" test -f "$T/bundle/marker"
cp /bin/true "$T/gpu-build/bench/engine_bench"
check "a second good run replaces the bundle" bundle "$T/gpu-build" "$T/bundle"
check "... whole" test ! -e "$T/bundle/marker" -a -f "$T/bundle/env.sh"
check "the bundle carries attention_bench (gpu_check's attention step)" \
  test -x "$T/bundle/build-gpu/bench/attention_bench"
rm "$T/gpu-build/bench/attention_bench"
check "a build without attention_bench is refused" bash -c "! bash tools/gpu_bundle.sh '$T/gpu-build' '$T/bundle' > /dev/null 2>&1"
check "... and the earlier bundle is kept" test -x "$T/bundle/build-gpu/bench/attention_bench"
check "no staging folder is left" bash -c "! ls -d '$T'/*.partial.* > /dev/null 2>&1"
echo "$fails failure(s)"
[ "$fails" = 0 ]
