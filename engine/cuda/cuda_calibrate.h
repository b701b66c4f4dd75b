// The two ceilings a step on the device is judged against (issue 33), measured by the binary
// that runs the step: a large device-to-device copy and a large bf16 GEMM (cuBLAS).
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace dgserve::cuda {

struct Ceilings {
  // cudaMemcpy device → device of copy_bytes, best of the timed repetitions (CUDA events);
  // GB/s counts bytes read + bytes written (2 · copy_bytes / time), as CUDA's bandwidthTest.
  double copy_gbs = 0;
  size_t copy_bytes = 0;
  // C[n, n] (float32) = A[n, n] · B[n, n] in bf16 with float32 accumulation (cublasGemmEx,
  // CUBLAS_COMPUTE_32F, the GEMM the projections use), 2n³ / time, best of the repetitions.
  double gemm_tflops = 0;
  int gemm_n = 0;
};

// copy_bytes = 0 or gemm_n = 0 skips that measurement. Operands are filled with synthetic bf16
// values (cuda_synthetic.h) on the device. Errors: INTERNAL (CUDA / cuBLAS; out of memory).
absl::StatusOr<Ceilings> MeasureCeilings(size_t copy_bytes, int gemm_n, int repetitions = 5);

// The current device's name (cudaGetDeviceProperties), "" when it cannot be read.
std::string CurrentDeviceName();

}  // namespace dgserve::cuda
