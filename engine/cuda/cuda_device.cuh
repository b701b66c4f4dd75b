// What the kernel files (*.cu) include instead of <cuda_runtime.h>: the CUDA runtime and two
// helpers that let the same device code also compile for the host under the emulation of
// engine/cuda/emu/ (label `gpu-emu`, see engine/cuda/README.md):
//   LaunchKernel(kernel, grid, block, shared_bytes, stream, args...)  instead of  <<<...>>>
//   DynamicShared<T>()                                      instead of  extern __shared__ T x[]
// Under nvcc (__CUDACC__) they are the plain CUDA constructs; with DGSERVE_CUDA_EMULATION the
// emulation header provides them, and the CUDA builtins, for g++.
#pragma once

#if defined(__CUDACC__)

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "engine/cuda/cuda_profile.h"

namespace dgserve::cuda {

// kernel<<<grid, block, shared_bytes, stream>>>(args...); errors show in cudaGetLastError().
template <typename... Params, typename... Args>
void LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                  cudaStream_t stream, Args&&... args) {
  NoteKernelLaunch();
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
}

// The block's dynamic shared memory (the launch's shared_bytes), 16-byte aligned.
template <typename T>
__device__ __forceinline__ T* DynamicShared() {
  extern __shared__ __align__(16) unsigned char dgserve_dynamic_shared[];
  return reinterpret_cast<T*>(dgserve_dynamic_shared);
}

}  // namespace dgserve::cuda

#elif defined(DGSERVE_CUDA_EMULATION)

#include "engine/cuda/emu/cuda_emu.h"

#else
#error "engine/cuda kernels need nvcc, or DGSERVE_CUDA_EMULATION (the dgserve_cuda_emu target)"
#endif
