// The GPU KV transports in a build without CUDA/NCCL: this process reports its node and TCP
// only, and the GPU transports cannot be made. (Temporary copy for the transport-choice work;
// the NCCL/CUDA IPC work owns this file.)
#include <unistd.h>

#include <cstdlib>

#include "absl/status/status.h"
#include "kvstore/gpu_transport.h"

namespace dgserve::kv {

KvPeerInfo LocalKvPeerInfo(int /*cuda_device*/) {
  KvPeerInfo info;
  if (const char* node = std::getenv("NODE_NAME"); node != nullptr && *node != '\0') {
    info.node = node;
  } else {
    char host[256] = {};
    if (gethostname(host, sizeof host - 1) == 0) info.node = host;
  }
  info.transports = {"tcp"};
  return info;
}

absl::StatusOr<std::unique_ptr<KvTransport>> CreateNcclTransport(const GpuTransportOptions&) {
  return absl::UnavailableError("NCCL KV transport: this build has no CUDA/NCCL");
}

absl::StatusOr<std::unique_ptr<KvTransport>> CreateCudaIpcTransport(const GpuTransportOptions&) {
  return absl::UnavailableError("CUDA IPC KV transport: this build has no CUDA");
}

}  // namespace dgserve::kv
