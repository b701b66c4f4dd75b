#!/usr/bin/env bash
# Packs what tools/gpu_check.sh runs into one folder that can travel to a GPU machine which cannot
# build dgserve itself (the device image has CUDA, CMake and ninja but not Debian's gRPC, protobuf,
# Abseil or prometheus-cpp development packages, and nothing can be fetched there).
#
#   cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
#     -DDGSERVE_CUDA_BACKEND=ON && cmake --build build-gpu --target <gpu_check's binaries>
#   bash tools/gpu_bundle.sh build-gpu gpubundle
#
# The folder holds build-gpu/<the binaries gpu_check.sh runs, stripped, at their paths> and lib/
# (every shared library they load except glibc's, the C++ runtime's and NVIDIA's: those are the
# GPU machine's own, so that its driver and CUDA 13 libraries are the ones used). On the GPU
# machine:
#
#   source gpubundle/env.sh && BUILD_DIR=gpubundle/build-gpu bash tools/gpu_check.sh
#
# env.sh puts lib/ and the machine's CUDA, cuBLAS and NCCL library folders (the toolkit's, or
# the Python wheels' under site-packages/nvidia) on LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build-gpu}
DEST=${2:-gpubundle}
BINS="engine/cuda/cuda_ops_test engine/cuda/cuda_gemm_test engine/cuda/cuda_attention_test
  engine/cuda/cuda_vocab_test engine/cuda/cuda_backend_kernels_test engine/cuda/cuda_backend_test
  kvstore/kvstore_nccl_self_send_test gateway/dgserve-gateway prefill_worker/dgserve-prefill-worker
  denoise_worker/dgserve-denoise-worker tools/dgserve-mkmodel bench/engine_bench"
rm -rf "$DEST"
mkdir -p "$DEST/lib"
# Libraries the GPU machine provides itself: glibc, the compiler runtime, the NVIDIA driver and
# CUDA toolkit libraries (the same CUDA 13 there).
system_lib() {
  case "$1" in
    linux-vdso* | ld-linux* | libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | \
      libstdc++.so* | libgcc_s.so* | libcuda.so* | libcudart.so* | libcublas.so* | \
      libcublasLt.so* | libnccl.so* | libnvidia*) return 0 ;;
  esac
  return 1
}
for b in $BINS; do
  [ -x "$BUILD_DIR/$b" ] || { echo "missing $BUILD_DIR/$b: build it first" >&2; exit 1; }
  mkdir -p "$DEST/build-gpu/$(dirname "$b")"
  strip -o "$DEST/build-gpu/$b" "$BUILD_DIR/$b"
  ldd "$BUILD_DIR/$b" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' |
    while read -r name path; do
      system_lib "$name" || [ -e "$DEST/lib/$name" ] || cp -L "$path" "$DEST/lib/$name"
    done
done
strip --strip-unneeded "$DEST"/lib/*.so* 2> /dev/null || true
cat > "$DEST/env.sh" << 'EOF'
# Sourced on the GPU machine: the bundle's libraries, then the machine's CUDA/cuBLAS/NCCL ones.
bundle_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dirs=$bundle_dir/lib
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  if ! ldconfig -p 2> /dev/null | grep -q "$lib "; then
    found=$(find /usr/local /opt /usr/lib -name "$lib" 2> /dev/null | head -n 1)
    [ -n "$found" ] && dirs=$dirs:$(dirname "$found")
  fi
done
export LD_LIBRARY_PATH=$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "gpubundle: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
EOF
du -sh "$DEST" "$DEST/lib" "$DEST/build-gpu"
