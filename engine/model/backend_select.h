// The backend a program selects ("cpu" or "cuda") and its options, as a plain struct that the
// program fills (from its flags: worker/backend_flags.h); the engine reads no flag or environment
// variable. This is the one place in dgserve that knows whether the CUDA backend is linked into
// the binary (DGSERVE_HAVE_CUDA, set on this library only when CMake is configured with
// -DDGSERVE_CUDA_BACKEND=ON and a CUDA toolkit is found).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cpu/gemm.h"
#include "engine/model/backend.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"

namespace dgserve {

// The CUDA backend's GEMM input (cuda::GemmInput, engine/cuda/cuda_backend.h), named here so that
// a binary built without the CUDA backend can carry the choice.
enum class CudaGemmInput {
  kBf16,     // activations rounded to bf16 at the reference's rounding points (the default)
  kFloat32,  // a check mode: activations split exactly into three bf16 terms
};

struct BackendSelection {
  std::string device = "cpu";  // "cpu" or "cuda"
  // --device cpu: the GEMMs' input mode (CpuBackendOptions::gemm_input).
  cpu::GemmInput cpu_gemm_input = cpu::GemmInput::kFloat32;
  // --device cpu: the dense self-conditioning product for every canvas
  // (CpuBackendOptions::dense_self_conditioning).
  bool cpu_dense_self_conditioning = false;
  // The CPU GEMM's instruction set, process-wide (cpu::SetGemmIsa), set by CreateBackend whatever
  // the device; nullopt: leave it (the best this CPU has unless something set another).
  std::optional<cpu::GemmIsa> cpu_gemm_isa;
  // --device cuda: the GEMMs' input mode.
  CudaGemmInput cuda_gemm_input = CudaGemmInput::kBf16;
  // --device cuda: the device K/V block pool's bound in bytes (CudaBackendOptions::
  // kv_pool_max_bytes; 0: none).
  size_t cuda_kv_pool_bytes = 0;
};

// Checks `selection` without loading anything (call it before a checkpoint load, so that a typo
// does not cost the load): INVALID_ARGUMENT "--device X: must be 'cpu' or 'cuda'" for another
// device. CreateBackend checks the same.
absl::Status CheckBackendSelection(const BackendSelection& selection);

// The backend `selection` names over `weights`. "cpu": CreateCpuBackend with the selection's CPU
// options. "cuda": the CUDA backend; FAILED_PRECONDITION when this binary was built without it,
// no GPU is present or the checkpoint holds a quantized matrix the device cannot keep in its format
// (an NVFP4 self-conditioning MLP; CreateCudaBackend's refusals; message prefixed
// "--device cuda: "). Another
// device: INVALID_ARGUMENT (CheckBackendSelection); a cpu_gemm_isa this CPU lacks:
// INVALID_ARGUMENT (cpu::SetGemmIsa). `weights` must outlive the CPU backend (the CUDA one copies
// them).
absl::StatusOr<std::unique_ptr<ModelBackend>> CreateBackend(const BackendSelection& selection,
                                                            const ModelConfig& config,
                                                            const ModelWeights& weights);

}  // namespace dgserve
