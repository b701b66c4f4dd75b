#include "engine/model/backend_select.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#ifdef DGSERVE_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

namespace dgserve {

std::string CudaBackendMissingMessage() {
  // DGSERVE_CUDA_BACKEND=ON links the backend only where CMake finds the CUDA toolkit.
  return "--device cuda: this binary was built without the CUDA backend (configure with "
         "-DDGSERVE_CUDA_BACKEND=ON on a machine with the CUDA toolkit, as tools/gpu_check.sh "
         "does)";
}

absl::Status CheckBackendSelection(const BackendSelection& selection) {
  if (selection.device != "cpu" && selection.device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", selection.device, ": must be 'cpu' or 'cuda'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateBackend(const BackendSelection& selection,
                                                            const ModelConfig& config,
                                                            const ModelWeights& weights) {
  if (absl::Status st = CheckBackendSelection(selection); !st.ok()) return st;
  if (selection.cpu_gemm_isa.has_value()) {
    if (absl::Status st = cpu::SetGemmIsa(*selection.cpu_gemm_isa); !st.ok()) return st;
  }
  if (selection.device == "cpu") {
    CpuBackendOptions options;
    options.gemm_input = selection.cpu_gemm_input;
    options.dense_self_conditioning = selection.cpu_dense_self_conditioning;
    return CreateCpuBackend(config, weights, options);
  }
  // Issue 37: every format runs on the CUDA backend in its own format (FP8: 8-bit weights and
  // per-token e4m3 activations on the FP8 tensor cores, cuda_fp8.h; W4A16 and NVFP4: every
  // quantized Linear in 4 bits, cuda_moe.h / cuda_nvfp4.h; W4A16 with float32 activations in both
  // GEMM modes, as the CPU backend's), except an NVFP4 self-conditioning MLP, which the device
  // cannot keep in 4 bits: refused here (CreateCudaBackend refuses any quantized matrix it would
  // have to widen to bf16, with a less specific message).
  if (weights.format == WeightFormat::kNvfp4) {
    for (const cpu::PackedMatrix* m :
         {&weights.sc_gate_proj, &weights.sc_up_proj, &weights.sc_down_proj}) {
      if (m->quant() != nullptr) {
        return absl::FailedPreconditionError(
            "--device cuda: this nvfp4 checkpoint quantizes the self-conditioning MLP, which the "
            "CUDA backend cannot keep in 4 bits (leave it in the ignore list, or use --device "
            "cpu)");
      }
    }
  }
#ifdef DGSERVE_HAVE_CUDA
  CudaBackendOptions options;
  options.gemm_input = selection.cuda_gemm_input == CudaGemmInput::kBf16
                           ? cuda::GemmInput::kBf16
                           : cuda::GemmInput::kFloat32;
  options.kv_pool_max_bytes = selection.cuda_kv_pool_bytes;
  options.memory_utilization = selection.cuda_memory_utilization;
  auto backend = CreateCudaBackend(config, weights, options);
  if (!backend.ok()) {
    return absl::Status(backend.status().code(),
                        absl::StrCat("--device cuda: ", backend.status().message()));
  }
  return backend;
#else
  return absl::FailedPreconditionError(CudaBackendMissingMessage());
#endif
}

std::optional<DeviceKvStats> GetDeviceKvStats(const ModelBackend& backend) {
#ifdef DGSERVE_HAVE_CUDA
  const std::optional<CudaKvPoolStats> pool = GetCudaKvPoolStats(backend);
  const std::optional<CudaKvCopyStats> copies = GetCudaKvCopyStats(backend);
  if (!pool.has_value() || !copies.has_value()) return std::nullopt;
  DeviceKvStats s;
  s.block_size = pool->block_size;
  s.blocks[DeviceKvStats::kFull] = pool->full_blocks;
  s.in_use[DeviceKvStats::kFull] = pool->full_blocks_in_use;
  s.cached[DeviceKvStats::kFull] = pool->full_blocks_cached;
  s.blocks[DeviceKvStats::kSliding] = pool->sliding_blocks;
  s.in_use[DeviceKvStats::kSliding] = pool->sliding_blocks_in_use;
  s.cached[DeviceKvStats::kSliding] = pool->sliding_blocks_cached;
  s.device_bytes = pool->device_bytes;
  s.shared_blocks_taken = pool->shared_blocks_taken;
  s.swap_outs = pool->swap_outs;
  s.compactions = pool->compactions;
  s.growths = pool->growths;
  s.blocks_moved = pool->blocks_moved;
  s.max_bytes = pool->max_bytes;
  s.upload_bytes = copies->upload_bytes;
  s.sync_to_host_bytes = copies->sync_to_host_bytes;
  return s;
#else
  (void)backend;
  return std::nullopt;
#endif
}

}  // namespace dgserve
