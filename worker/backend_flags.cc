#include "worker/backend_flags.h"

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/internal/private_handle_accessor.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "worker/backend_env.h"

namespace {
// The flag's default: BackendSelection's (0.9, as vLLM's --gpu-memory-utilization).
double DefaultMemoryUtilization() { return dgserve::BackendSelection{}.cuda_memory_utilization; }
}  // namespace

// Every program that selects a backend by --device takes these flags (defined here, once).
ABSL_FLAG(std::string, cuda_gemm_input, "bf16",
          "--device cuda: how the GEMMs take float32 activations. bf16 (default): rounded to "
          "bf16 at the reference's rounding points (spec §5.3, HF's bf16 activations), the "
          "function of --cpu_gemm_input=bf16 up to the order of float32 additions; float32 (a "
          "check mode): split exactly into three bf16 terms, the CPU backend's float32 results "
          "up to addition order, at three times the tensor-core work");

ABSL_FLAG(double, cuda_kv_pool_gb, 0,
          "--device cuda: bound on the device K/V block pool, in GB (1e9 bytes; 0, the default: "
          "what --cuda_memory_utilization leaves of the GPU once the weights are on it). Room "
          "under the bound keeps finished prompts' blocks for "
          "prefix hits. At the bound the blocks of idle sequences are reused, least recently used "
          "first (rows only the device has copied to the host first), and the full-attention and "
          "sliding-window pools give each other the memory of blocks no sequence holds; a pass "
          "that still lacks a block fails with RESOURCE_EXHAUSTED, and the workers run it in "
          "smaller parts. A request one sequence of which needs more than the bound alone is "
          "refused at once (OUT_OF_RANGE) (CudaBackendOptions::kv_pool_max_bytes)");

ABSL_FLAG(double, cuda_memory_utilization, DefaultMemoryUtilization(),
          "--device cuda: the fraction of the GPU's memory this process's backend may use, as "
          "vLLM's --gpu-memory-utilization; where --cuda_kv_pool_gb is 0, the device K/V block "
          "pool's bound is this fraction of the GPU's memory less what the backend itself holds "
          "once its weights are loaded (at most the memory then free: the pool grows in place, "
          "in 2 MiB granules), and the rest is left to the passes' buffers. "
          "Processes sharing a GPU (the "
          "prefill and denoise workers on one GPU) should take fractions that sum to at most 1; "
          "dgserve-server's two model roles each take it. In [0, 1]; 0: no bound but the GPU's "
          "memory (CudaBackendOptions::memory_utilization)");

ABSL_FLAG(std::string, cpu_gemm_input, "float32",
          "--device cpu: the GEMMs' inputs. float32 (default): float32 activations, each output "
          "one fma chain; bf16: activations rounded to bf16 at the reference's rounding points "
          "(spec §5.3; engine/README.md), each output the VDPBF16PS chain (native on CPUs with "
          "AVX512_BF16, the same bits emulated elsewhere)");

namespace dgserve {

namespace {

// A flag set to something other than its default, or given on the command line at all (a flag set
// shared by CPU and GPU deployments spells out the default: it does nothing either).
bool Set(absl::string_view name, bool changed) {
  if (changed) return true;
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr &&
         absl::flags_internal::PrivateHandleAccessor::IsSpecifiedOnCommandLine(*flag);
}

}  // namespace

std::vector<std::string> UnusedBackendFlags(const std::string& device) {
  std::vector<std::string> out;
  const std::string cuda_input = absl::GetFlag(FLAGS_cuda_gemm_input);
  if (device == "cpu" && Set("cuda_gemm_input", cuda_input != "bf16")) {
    out.push_back(absl::StrCat("--cuda_gemm_input=", cuda_input,
                               " has no effect with --device cpu (see --cpu_gemm_input)"));
  }
  if (const double gb = absl::GetFlag(FLAGS_cuda_kv_pool_gb);
      device == "cpu" && Set("cuda_kv_pool_gb", gb != 0)) {
    out.push_back(absl::StrCat("--cuda_kv_pool_gb=", gb, " has no effect with --device cpu"));
  }
  if (const double u = absl::GetFlag(FLAGS_cuda_memory_utilization);
      Set("cuda_memory_utilization", u != DefaultMemoryUtilization())) {
    if (device == "cpu") {
      out.push_back(
          absl::StrCat("--cuda_memory_utilization=", u, " has no effect with --device cpu"));
    } else if (absl::GetFlag(FLAGS_cuda_kv_pool_gb) != 0) {
      out.push_back(absl::StrCat("--cuda_memory_utilization=", u,
                                 " has no effect with --cuda_kv_pool_gb (the pool's bound given)"));
    }
  }
  const std::string cpu_input = absl::GetFlag(FLAGS_cpu_gemm_input);
  if (device == "cuda" && Set("cpu_gemm_input", cpu_input != "float32")) {
    out.push_back(absl::StrCat("--cpu_gemm_input=", cpu_input,
                               " has no effect with --device cuda (see --cuda_gemm_input)"));
  }
  return out;
}

absl::StatusOr<BackendSelection> BackendSelectionFromFlags(const std::string& device) {
  BackendSelection s;
  s.device = device;
  const std::string cpu_input = absl::GetFlag(FLAGS_cpu_gemm_input);
  absl::StatusOr<cpu::GemmInput> parsed = cpu::ParseGemmInput(cpu_input);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cpu_gemm_input '", cpu_input, "': must be 'float32' or 'bf16'"));
  }
  s.cpu_gemm_input = *parsed;
  const std::string cuda_input = absl::GetFlag(FLAGS_cuda_gemm_input);
  if (cuda_input == "bf16") {
    s.cuda_gemm_input = CudaGemmInput::kBf16;
  } else if (cuda_input == "float32") {
    s.cuda_gemm_input = CudaGemmInput::kFloat32;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_gemm_input '", cuda_input, "': must be 'float32' or 'bf16'"));
  }
  const double gb = absl::GetFlag(FLAGS_cuda_kv_pool_gb);
  if (!(gb >= 0 && gb <= 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_kv_pool_gb ", gb, ": must be a number of GB in [0, 1e6]"));
  }
  s.cuda_kv_pool_bytes = size_t(gb * 1e9);
  const double utilization = absl::GetFlag(FLAGS_cuda_memory_utilization);
  if (!(utilization >= 0 && utilization <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--cuda_memory_utilization ", utilization, ": must be a fraction in [0, 1]"));
  }
  s.cuda_memory_utilization = utilization;
  if (absl::Status st = CheckBackendSelection(s); !st.ok()) return st;
  if (const std::vector<std::string> unused = UnusedBackendFlags(device); !unused.empty()) {
    std::fprintf(stderr, "warning: %s\n", absl::StrJoin(unused, "; ").c_str());
  }
  s.cpu_gemm_isa = GemmIsaFromEnvironment();
  s.cpu_dense_self_conditioning = DenseSelfConditioningFromEnvironment();
  return s;
}

}  // namespace dgserve
