// Host helpers shared by the kernel files (*.cu), after their launches: a launch error as
// absl::Status, and the opaque stream of the plain C++ headers (void*) as a cudaStream_t. Under
// the emulation (engine/cuda/emu/) the .cu files compile as C++ and these are the same code.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "engine/cuda/cuda_device.cuh"

namespace dgserve::cuda {

// OK, or INTERNAL "<kernel>: <CUDA error>" when the last launch failed (cudaGetLastError, which
// also clears the error).
inline absl::Status Check(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(kernel) + ": " + cudaGetErrorString(e));
}

// The stream argument of the kernels' C++ interfaces (nullptr: the default stream).
inline cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace dgserve::cuda
