// What the float32 attention kernels (cuda_attention.cu) and the tensor-core ones
// (cuda_attention_tc.cu) share: the warp mask, a key range, and the shared-memory opt-in of a
// launch. Device code: included by those .cu files only.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "engine/cuda/cuda_device.cuh"

namespace dgserve::cuda::attention_internal {

inline constexpr unsigned kFull = 0xffffffffu;  // every lane of a warp

// Keys [lo, hi) of [context ++ new] (indices into the concatenation).
struct Range {
  int lo, hi;
};

// Lets `kernel` launch with `bytes` of dynamic shared memory: above the default 48 KiB, checks the
// device's opt-in limit and raises the kernel's own. INTERNAL naming `name` when it cannot.
template <typename Kernel>
absl::Status AllowSharedBytes(Kernel kernel, size_t bytes, const char* name) {
  if (bytes <= 48 * 1024) return absl::OkStatus();
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    return absl::InternalError(std::string(name) + ": " + cudaGetErrorString(e));
  }
  if (size_t(optin) < bytes) {
    return absl::InternalError(std::string(name) + ": needs " + std::to_string(bytes) +
                               " bytes of shared memory per block, the device allows " +
                               std::to_string(optin));
  }
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)) !=
      cudaSuccess) {
    const cudaError_t e = cudaGetLastError();
    return absl::InternalError(std::string(name) + ": " + cudaGetErrorString(e));
  }
  return absl::OkStatus();
}

}  // namespace dgserve::cuda::attention_internal
