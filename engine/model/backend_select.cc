#include "engine/model/backend_select.h"

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#ifdef DGSERVE_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

// Every binary that selects a backend by --device takes this flag (defined here, once).
ABSL_FLAG(std::string, cuda_gemm_input, "bf16",
          "--device cuda: how the GEMMs take float32 activations. bf16 (default): rounded to "
          "bf16 at the reference's rounding points (spec §5.3, HF's bf16 activations), the "
          "function of --cpu_gemm_input=bf16 up to the order of float32 additions; float32 (a "
          "check mode): split exactly into three bf16 terms, the CPU backend's float32 results "
          "up to addition order, at three times the tensor-core work");

ABSL_FLAG(std::string, cpu_gemm_input, "float32",
          "--device cpu: the GEMMs' inputs. float32 (default): float32 activations, each output "
          "one fma chain; bf16: activations rounded to bf16 at the reference's rounding points "
          "(spec §5.3; engine/README.md), each output the VDPBF16PS chain (native on CPUs with "
          "AVX512_BF16, the same bits emulated elsewhere)");

namespace dgserve {

absl::Status CheckDeviceFlags(const std::string& device) {
  if (absl::StatusOr<cpu::GemmInput> in = cpu::ParseGemmInput(absl::GetFlag(FLAGS_cpu_gemm_input));
      !in.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cpu_gemm_input '", absl::GetFlag(FLAGS_cpu_gemm_input), "': must be 'float32' or 'bf16'"));
  }
  const std::string gemm_input = absl::GetFlag(FLAGS_cuda_gemm_input);
  if (gemm_input != "float32" && gemm_input != "bf16") {
    return absl::InvalidArgumentError(absl::StrCat("--cuda_gemm_input '", gemm_input,
                                                   "': must be 'float32' or 'bf16'"));
  }
  if (device != "cpu" && device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", device, ": must be 'cpu' or 'cuda'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateBackendForDevice(const std::string& device,
                                                                     const ModelConfig& config,
                                                                     const ModelWeights& weights) {
  if (absl::Status st = CheckDeviceFlags(device); !st.ok()) return st;
  const std::string gemm_input = absl::GetFlag(FLAGS_cuda_gemm_input);
  if (device == "cpu") {
    CpuBackendOptions options;
    options.gemm_input = *cpu::ParseGemmInput(absl::GetFlag(FLAGS_cpu_gemm_input));
    return CreateCpuBackend(config, weights, options);
  }
  if (weights.format != WeightFormat::kBf16) {  // issue 37: the GPU part is not done yet
    return absl::FailedPreconditionError(absl::StrCat(
        "--device cuda: this checkpoint is quantized (", WeightFormatName(weights.format),
        "); quantized checkpoints run on the CPU backend only (--device cpu)"));
  }
#ifdef DGSERVE_HAVE_CUDA
  CudaBackendOptions options;
  options.gemm_input =
      gemm_input == "bf16" ? cuda::GemmInput::kBf16 : cuda::GemmInput::kFloat32;
  auto backend = CreateCudaBackend(config, weights, options);
  if (!backend.ok()) {
    return absl::Status(backend.status().code(),
                        absl::StrCat("--device cuda: ", backend.status().message()));
  }
  return backend;
#else
  return absl::FailedPreconditionError(
      "--device cuda: this binary was built without the CUDA backend (configure with "
      "-DDGSERVE_CUDA_BACKEND=ON)");
#endif
}

}  // namespace dgserve
