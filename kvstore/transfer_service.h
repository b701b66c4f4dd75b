// The gRPC server side of the KV transports: KvTransferService.PushBlocks feeding a KvReceiver
// (block bytes inline for TCP; out of band through a GpuReceiveEndpoint for NCCL and CUDA IPC),
// and the GPU transports' session set-up (NcclBootstrap, CudaIpcOpen).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#include "absl/status/statusor.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "kvstore/transfer.h"

namespace dgserve::kv {

// Where the bytes of a transfer's out-of-band blocks come from (KvBlockPayload.out_of_band: the
// receiving half of the NCCL or CUDA IPC transport, for one transfer).
class OutOfBandSource {
 public:
  virtual ~OutOfBandSource() = default;
  // Fills each block's `data` with its `data_bytes` bytes, taken out of the staging round that
  // the blocks' control messages (in order, the last with group_end) describe. The blocks are
  // then checked and written by KvReceiver::WriteBlock as inline ones are. Any error fails
  // the transfer.
  virtual absl::Status Fetch(std::vector<v1::KvBlockPayload>& blocks) = 0;
  // The transfer failed or was cut: the source's session must not be reused as is.
  virtual void Fail(const absl::Status& why) {}
};

// The receiving half of the GPU transports (kvstore/gpu_transport.h: CreateGpuReceiveEndpoint).
class GpuReceiveEndpoint {
 public:
  virtual ~GpuReceiveEndpoint() = default;
  virtual absl::StatusOr<v1::NcclBootstrapResponse> NcclBootstrap(
      const v1::NcclBootstrapRequest& request) = 0;
  virtual absl::StatusOr<v1::CudaIpcOpenResponse> CudaIpcOpen(
      const v1::CudaIpcOpenRequest& request) = 0;
  // The source of the out-of-band blocks of the transfer `header` starts (its data_path and
  // gpu_session); nothing may wait past `deadline`, nor once `cancelled()` says the sender
  // cancelled. NOT_FOUND for an unknown session.
  virtual absl::StatusOr<std::unique_ptr<OutOfBandSource>> OpenSource(
      const v1::KvTransferHeader& header, absl::Time deadline,
      std::function<bool()> cancelled) = 0;
};

// The receiving side of one PushBlocks stream, over any source of chunks (the gRPC reader, or a
// fuzzer): `read` fills the next chunk and returns false at the end of the stream; `cancelled`
// says whether the sender cancelled (for the error message). The first chunk must be the header,
// then blocks, then the trailer. Any error, or a stream that ends without the trailer, aborts the
// transfer (blocks freed) and is returned; OK carries the acknowledgement. A header whose
// data_path is not INLINE takes its blocks' bytes from `gpu` (nullptr: refused with
// FAILED_PRECONDITION, the transfer failed at the receiver).
absl::StatusOr<v1::KvAck> ReceiveKvStream(KvReceiver* receiver,
                                          const std::function<bool(v1::KvChunk*)>& read,
                                          const std::function<bool()>& cancelled,
                                          GpuReceiveEndpoint* gpu = nullptr);

// Bounds on what one sender can hold open on the receiver.
struct KvTransferServiceOptions {
  // PushBlocks streams open at once per peer address (its IP, any port); beyond:
  // RESOURCE_EXHAUSTED before the header is read.
  int max_transfers_per_peer = 64;
  // A stream still open this long after it started is cancelled (its transfer aborted and its
  // blocks freed, as at the end of its lease), so a stalled sender holds no server thread.
  absl::Duration max_stream_time = absl::Seconds(60);
  // The GPU transports' receiving half (CreateGpuReceiveEndpoint, for this worker's CUDA
  // device). nullptr: NcclBootstrap, CudaIpcOpen and transfers over NCCL or CUDA IPC are
  // refused with FAILED_PRECONDITION ("GPU KV transports are off on this worker").
  std::shared_ptr<GpuReceiveEndpoint> gpu;
};

class KvTransferServiceImpl final : public v1::KvTransferService::Service {
 public:
  // `receiver` must outlive the service.
  explicit KvTransferServiceImpl(KvReceiver* receiver, KvTransferServiceOptions options = {});
  ~KvTransferServiceImpl() override;

  // Streams open now from peers with this address (as grpc::ServerContext::peer() without
  // its port, e.g. "ipv4:127.0.0.1").
  int open_streams(const std::string& peer_address) const;
  int64_t refused_streams() const;   // refused for the per-peer limit
  int64_t cancelled_streams() const; // cancelled at max_stream_time

  // ReceiveKvStream over the call's reader.
  grpc::Status PushBlocks(grpc::ServerContext* context, grpc::ServerReader<v1::KvChunk>* reader,
                          v1::KvAck* ack) override;
  // GpuReceiveEndpoint::NcclBootstrap / CudaIpcOpen; FAILED_PRECONDITION without `gpu`.
  grpc::Status NcclBootstrap(grpc::ServerContext* context,
                             const v1::NcclBootstrapRequest* request,
                             v1::NcclBootstrapResponse* response) override;
  grpc::Status CudaIpcOpen(grpc::ServerContext* context, const v1::CudaIpcOpenRequest* request,
                           v1::CudaIpcOpenResponse* response) override;

 private:
  KvReceiver* receiver_;
  const KvTransferServiceOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, int> per_peer_ ABSL_GUARDED_BY(mu_);
  std::map<grpc::ServerContext*, absl::Time> deadlines_ ABSL_GUARDED_BY(mu_);
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification stop_;
  std::thread watchdog_;  // cancels streams past max_stream_time
};

// "ipv4:127.0.0.1:5555" → "ipv4:127.0.0.1", "ipv6:[::1]:5555" → "ipv6:[::1]".
std::string PeerAddress(const std::string& peer);

}  // namespace dgserve::kv
