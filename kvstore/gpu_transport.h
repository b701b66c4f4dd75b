// The GPU KV transports (issue 14, design §1.4): the same transfer protocol as TCP (header,
// blocks with checksums, trailer, acknowledgement; leases, refusals and "never a partial KV"
// enforced once, by the shared protocol code and KvReceiver), with the block bytes moved by NCCL
// between any two GPUs or by CUDA IPC between two processes on one GPU. The control messages
// travel over the existing gRPC KvTransferService; NCCL communicators are bootstrapped over its
// NcclBootstrap call. KV blocks live in host memory (kvstore/block_pool.h); each transfer stages
// them through bounded device memory.
//
// Built three ways (kvstore/CMakeLists.txt): against the CUDA toolkit and NCCL where found,
// against the host emulation of engine/cuda/emu (tests, label gpu-emu), and without either,
// where Create* returns UNAVAILABLE naming why.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstore/transfer.h"

namespace dgserve::kv {

// What one end of a transfer reports about itself (the denoise worker in its Stats; the prefill
// worker about itself), so that `--kv_transport auto` can choose.
struct KvPeerInfo {
  std::string node;      // the Kubernetes node (env NODE_NAME), else the host name
  std::string gpu_uuid;  // the CUDA device's UUID ("GPU-…"); empty without a usable GPU
  // Transports this process can take part in, among "tcp", "cuda_ipc", "nccl" ("tcp" always).
  std::vector<std::string> transports;
};

// This process's KvPeerInfo for CUDA device `cuda_device` (< 0: no GPU; then only "tcp").
KvPeerInfo LocalKvPeerInfo(int cuda_device);

struct GpuTransportOptions {
  // Dials a target's KvTransferService (the internal credentials: InternalAuth::MakeChannel);
  // empty: plaintext without credentials (tests).
  std::function<std::shared_ptr<grpc::Channel>(const std::string& target,
                                               const grpc::ChannelArguments& args)>
      make_channel;
  int cuda_device = 0;
  // Device memory one transfer stages its blocks through, bytes (at least one block).
  int64_t staging_bytes = 64 << 20;
  // As TcpTransportOptions::max_outstanding_per_target.
  int max_outstanding_per_target = 64;
  // NCCL communicator set-up (both ranks joined) must finish within this, else it is aborted.
  absl::Duration nccl_init_timeout = absl::Seconds(30);
};

// NCCL: one communicator per (this process, target) pair, made on first use, rebuilt after an
// error. UNAVAILABLE without NCCL or a GPU.
absl::StatusOr<std::unique_ptr<KvTransport>> CreateNcclTransport(
    const GpuTransportOptions& options);
// CUDA IPC: for a target on the same node and device. UNAVAILABLE without CUDA or a GPU.
absl::StatusOr<std::unique_ptr<KvTransport>> CreateCudaIpcTransport(
    const GpuTransportOptions& options);

class GpuReceiveEndpoint;  // kvstore/transfer_service.h
// The receiving half of both GPU transports, for KvTransferServiceOptions::gpu: answers
// NcclBootstrap and CudaIpcOpen and takes out-of-band blocks out of its staging memory. Uses
// cuda_device, staging_bytes (device memory per sender session) and nccl_init_timeout of
// `options`. UNAVAILABLE without CUDA/NCCL or a GPU.
absl::StatusOr<std::shared_ptr<GpuReceiveEndpoint>> CreateGpuReceiveEndpoint(
    const GpuTransportOptions& options);

}  // namespace dgserve::kv
