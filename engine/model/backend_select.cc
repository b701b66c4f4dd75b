#include "engine/model/backend_select.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#ifdef DGSERVE_HAVE_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

namespace dgserve {

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateBackendForDevice(const std::string& device,
                                                                     const ModelConfig& config,
                                                                     const ModelWeights& weights) {
  if (device == "cpu") return CreateCpuBackend(config, weights);
  if (device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", device, ": must be 'cpu' or 'cuda'"));
  }
#ifdef DGSERVE_HAVE_CUDA
  auto backend = CreateCudaBackend(config, weights);
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
