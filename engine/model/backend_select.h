// The backend named by a `--device` flag ("cpu" or "cuda"): the one place in dgserve that knows
// whether the CUDA backend is linked into the binary (DGSERVE_HAVE_CUDA, set on this library
// only when CMake is configured with -DDGSERVE_CUDA_BACKEND=ON and a CUDA toolkit is found).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/backend.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"

namespace dgserve {

// "cpu": CreateCpuBackend. "cuda": the CUDA backend; FAILED_PRECONDITION when this binary was
// built without it or no GPU is present (message prefixed "--device cuda: "). Anything else:
// INVALID_ARGUMENT. `weights` must outlive the CPU backend (the CUDA one copies them).
// The CUDA backend's GEMM input (cuda::GemmInput) is the flag --cuda_gemm_input ("bf16", the
// default, or "float32"; anything else: INVALID_ARGUMENT, whatever the device), defined in
// backend_select.cc for every binary that links this library.
// The CPU backend's GEMM input (CpuBackendOptions::gemm_input) is the flag --cpu_gemm_input
// ("float32", the default, or "bf16"; anything else: INVALID_ARGUMENT, whatever the device), also
// defined in backend_select.cc.
// The --device value and the --cuda_gemm_input and --cpu_gemm_input flags, checked without loading
// anything (call it before a checkpoint load, so that a typo does not cost the load):
// INVALID_ARGUMENT naming the flag. CreateBackendForDevice checks the same.
absl::Status CheckDeviceFlags(const std::string& device);

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateBackendForDevice(const std::string& device,
                                                                     const ModelConfig& config,
                                                                     const ModelWeights& weights);

}  // namespace dgserve
