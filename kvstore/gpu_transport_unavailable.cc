// The GPU KV transports in a build without CUDA/NCCL (or whose binaries do not link them, see
// kvstore/CMakeLists.txt): every Create* answers UNAVAILABLE; LocalKvPeerInfo reports TCP only.
#include "absl/status/status.h"
#include "kvstore/gpu_transport.h"
#include "kvstore/transfer_internal.h"
#include "kvstore/transfer_service.h"

namespace dgserve::kv {
namespace {
constexpr char kWhy[] = " (built without CUDA/NCCL)";
}  // namespace

KvPeerInfo LocalKvPeerInfo(int) {
  KvPeerInfo info;
  info.node = internal::KvNodeName();
  info.transports = {"tcp"};
  return info;
}

absl::StatusOr<std::unique_ptr<KvTransport>> CreateNcclTransport(const GpuTransportOptions&) {
  return absl::UnavailableError(std::string("NCCL KV transport unavailable") + kWhy);
}

absl::StatusOr<std::unique_ptr<KvTransport>> CreateCudaIpcTransport(
    const GpuTransportOptions&) {
  return absl::UnavailableError(std::string("CUDA IPC KV transport unavailable") + kWhy);
}

absl::StatusOr<std::shared_ptr<GpuReceiveEndpoint>> CreateGpuReceiveEndpoint(
    const GpuTransportOptions&) {
  return absl::UnavailableError(std::string("GPU KV transports unavailable") + kWhy);
}

}  // namespace dgserve::kv
