#!/usr/bin/env bash
# Packs what tools/gpu_check.sh runs into one folder that can travel to a GPU machine which cannot
# build dgserve itself (the device image has CUDA, CMake and ninja but not Debian's gRPC, protobuf,
# Abseil or prometheus-cpp development packages, and nothing can be fetched there).
#
#   cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
#     -DDGSERVE_CUDA_BACKEND=ON && cmake --build build-gpu --target <gpu_check's binaries>
#   bash tools/gpu_bundle.sh build-gpu gpubundle
#
# Refuses (exit 1, nothing written) a build configured without -DDGSERVE_CUDA_BACKEND=ON, a
# missing binary, a destination that exists and is not a bundle (no env.sh), and one inside the
# build folder or around it.
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
  engine/cuda/cuda_attention_tc_test engine/cuda/cuda_vocab_test engine/cuda/cuda_soft_embed_test
  engine/cuda/cuda_backend_kernels_test engine/cuda/cuda_backend_test
  engine/cuda/cuda_mma_test engine/cuda/cuda_graph_test engine/cuda/cuda_synthetic_test
  engine/cuda/cuda_moe_test engine/cuda/cuda_backend_w4a16_test kvstore/kvstore_nccl_self_send_test gateway/dgserve-gateway
  prefill_worker/dgserve-prefill-worker
  denoise_worker/dgserve-denoise-worker tools/dgserve-mkmodel bench/engine_bench
  bench/attention_bench"
# Everything is checked before anything is written, and the bundle is made beside DEST and
# moved there only when complete: a failed run leaves an earlier bundle (and the build) as they
# were.
[ -f "$BUILD_DIR/CMakeCache.txt" ] || { echo "$BUILD_DIR is not a CMake build folder" >&2; exit 1; }
if ! grep -q '^DGSERVE_CUDA_BACKEND:BOOL=ON$' "$BUILD_DIR/CMakeCache.txt"; then
  echo "$BUILD_DIR was configured without -DDGSERVE_CUDA_BACKEND=ON: its workers and" \
    "engine_bench would refuse --device cuda on the GPU machine" >&2
  exit 1
fi
for b in $BINS; do
  [ -x "$BUILD_DIR/$b" ] || { echo "missing $BUILD_DIR/$b: build it first" >&2; exit 1; }
done
build_abs=$(realpath -e "$BUILD_DIR")
dest_abs=$(realpath -m "$DEST")  # canonical, symbolic links resolved, need not exist yet
[ -d "$(dirname "$dest_abs")" ] || { echo "$(dirname "$DEST") does not exist" >&2; exit 1; }
if [ "$dest_abs" = / ] || { [ -e "$dest_abs" ] && [ ! -f "$dest_abs/env.sh" ]; }; then
  echo "$DEST exists and is not a bundle: not replaced" >&2
  exit 1
fi
case "$dest_abs/" in
  "$build_abs"/*) echo "the bundle may not be $BUILD_DIR or inside it" >&2; exit 1 ;;
esac
case "$build_abs/" in
  "$dest_abs"/*) echo "the bundle may not contain $BUILD_DIR" >&2; exit 1 ;;
esac
STAGE=$(mktemp -d "$dest_abs.partial.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/lib"
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
  mkdir -p "$STAGE/build-gpu/$(dirname "$b")"
  strip -o "$STAGE/build-gpu/$b" "$BUILD_DIR/$b"
  ldd "$BUILD_DIR/$b" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' |
    while read -r name path; do
      system_lib "$name" || [ -e "$STAGE/lib/$name" ] || cp -L "$path" "$STAGE/lib/$name"
    done
done
strip --strip-unneeded "$STAGE"/lib/*.so* 2> /dev/null || true
cat > "$STAGE/env.sh" << 'EOF'
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
rm -rf "$dest_abs"
mv "$STAGE" "$dest_abs"
trap - EXIT
du -sh "$DEST" "$DEST/lib" "$DEST/build-gpu"
