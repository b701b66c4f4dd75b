// The backend a program selects ("cpu" or "cuda") and its options, as a plain struct that the
// program fills (from its flags: worker/backend_flags.h); the engine reads no flag or environment
// variable. This is the one place in dgserve that knows whether the CUDA backend is linked into
// the binary (DGSERVE_HAVE_CUDA, set on this library, and its test, only when CMake is configured
// with -DDGSERVE_CUDA_BACKEND=ON and a CUDA toolkit is found).
#pragma once

#include <cstdint>
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
  // --device cuda: the fraction of the device's memory the backend may use, which bounds the
  // K/V block pool where cuda_kv_pool_bytes is 0 (CudaBackendOptions::memory_utilization).
  double cuda_memory_utilization = 0.9;
};

// The device K/V block pools of a backend that keeps K/V in device memory (the CUDA backend's,
// CudaKvPoolStats and CudaKvCopyStats of engine/cuda/cuda_backend.h), as a plain struct that a
// binary built without the CUDA backend can name: what the workers export as metrics
// (worker/kv_metrics.h). Index [kind]: 0 the full layers' pool, 1 the sliding layers'.
struct DeviceKvStats {
  static constexpr int kFull = 0, kSliding = 1;
  int block_size = 0;        // positions per block; 0: per-sequence mirrors (no pool, no blocks)
  int blocks[2] = {0, 0};    // allocated on the device (a pool shrinks only when compacted)
  int in_use[2] = {0, 0};    // held by a sequence's mirror
  int cached[2] = {0, 0};    // held by none, kept for their rows (a later prefix hit takes them)
  int64_t device_bytes = 0;  // K and V of every allocated block, every layer
  // Running totals since the backend was made:
  int64_t shared_blocks_taken = 0;  // blocks a sequence took instead of uploading their rows
  int64_t swap_outs = 0;  // idle sequences whose device-only rows went to the host to free blocks
  // A pool compacted to give the other kind's pool the memory of its unheld blocks (the two share
  // one bound), and the blocks those compactions moved on the device.
  int64_t compactions = 0, blocks_moved = 0;
  int64_t growths = 0;       // a pool grew (mapped more device memory)
  int64_t max_bytes = 0;     // the pools' bound (0: none but the device's memory)
  int64_t upload_bytes = 0;  // rows uploaded from host caches into the device (as stored there)
  int64_t sync_to_host_bytes = 0;  // rows copied from the device to host caches (SyncKvToHost)
  // Blocks neither in use nor cached: blocks − in_use − cached.
  int free_blocks(int kind) const { return blocks[kind] - in_use[kind] - cached[kind]; }
};

// The device K/V pools of `backend`: a CUDA backend's (GetCudaKvPoolStats and
// GetCudaKvCopyStats); nullopt for any other backend, and always in a binary built without the
// CUDA backend. Thread-safe (the CUDA backend takes its lock: a call may wait for a pass).
std::optional<DeviceKvStats> GetDeviceKvStats(const ModelBackend& backend);

// The refusal of `--device cuda` by a binary built without the CUDA backend, naming how to get
// one: "--device cuda: this binary was built without the CUDA backend (configure with
// -DDGSERVE_CUDA_BACKEND=ON ...)". CreateBackend's FAILED_PRECONDITION carries it; a program
// that refuses the flag itself before loading anything (engine_bench) prints it.
std::string CudaBackendMissingMessage();

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
