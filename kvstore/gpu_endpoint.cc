// CreateGpuReceiveEndpoint (both GPU transports' receiving halves behind one
// GpuReceiveEndpoint) and LocalKvPeerInfo, for the builds with CUDA (real or emulated).
#include <cstdio>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvstore/gpu_internal.h"

namespace dgserve::kv {
namespace {

class CombinedEndpoint final : public GpuReceiveEndpoint {
 public:
  explicit CombinedEndpoint(const GpuTransportOptions& options)
      : nccl_(gpu::MakeNcclReceiveHalf(options)), ipc_(gpu::MakeCudaIpcReceiveHalf(options)) {}

  absl::StatusOr<v1::NcclBootstrapResponse> NcclBootstrap(
      const v1::NcclBootstrapRequest& request) override {
    return nccl_->NcclBootstrap(request);
  }
  absl::StatusOr<v1::CudaIpcOpenResponse> CudaIpcOpen(
      const v1::CudaIpcOpenRequest& request) override {
    return ipc_->CudaIpcOpen(request);
  }
  absl::StatusOr<std::unique_ptr<OutOfBandSource>> OpenSource(
      const v1::KvTransferHeader& header, absl::Time deadline,
      std::function<bool()> cancelled) override {
    switch (header.data_path()) {
      case v1::KV_DATA_NCCL:
        return nccl_->OpenSource(header, deadline, std::move(cancelled));
      case v1::KV_DATA_CUDA_IPC:
        return ipc_->OpenSource(header, deadline, std::move(cancelled));
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("no GPU data path ", int(header.data_path())));
    }
  }

 private:
  const std::shared_ptr<GpuReceiveEndpoint> nccl_, ipc_;
};

bool DeviceUsable(int device) {
  int count = 0;
  return device >= 0 && cudaGetDeviceCount(&count) == cudaSuccess && device < count;
}

}  // namespace

absl::StatusOr<std::shared_ptr<GpuReceiveEndpoint>> CreateGpuReceiveEndpoint(
    const GpuTransportOptions& options) {
  if (!DeviceUsable(options.cuda_device)) {
    return absl::UnavailableError(absl::StrCat("GPU KV transports: CUDA device ",
                                               options.cuda_device, " is not usable"));
  }
  if (options.staging_bytes < gpu::kStagingAlign) {
    return absl::InvalidArgumentError("GpuTransportOptions::staging_bytes too small");
  }
  return std::make_shared<CombinedEndpoint>(options);
}

KvPeerInfo LocalKvPeerInfo(int cuda_device) {
  KvPeerInfo info;
  info.node = internal::KvNodeName();
  info.transports = {"tcp"};
  cudaDeviceProp prop;
  if (!DeviceUsable(cuda_device) ||
      cudaGetDeviceProperties(&prop, cuda_device) != cudaSuccess) {
    return info;
  }
  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it.
  const auto* u = reinterpret_cast<const unsigned char*>(&prop.uuid);
  std::string uuid = "GPU-";
  for (int i = 0; i < 16; ++i) {
    char hex[3];
    std::snprintf(hex, sizeof(hex), "%02x", u[i]);
    uuid += hex;
    if (i == 3 || i == 5 || i == 7 || i == 9) uuid += '-';
  }
  info.gpu_uuid = uuid;
  info.transports.push_back("cuda_ipc");
  info.transports.push_back("nccl");
  return info;
}

}  // namespace dgserve::kv
