// The gRPC server side of the TCP transport: KvTransferService.PushBlocks feeding a KvReceiver.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#include "absl/status/statusor.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "kvstore/transfer.h"

namespace dgserve::kv {

// The receiving side of one PushBlocks stream, over any source of chunks (the gRPC reader, or a
// fuzzer): `read` fills the next chunk and returns false at the end of the stream; `cancelled`
// says whether the sender cancelled (for the error message). The first chunk must be the header,
// then blocks, then the trailer. Any error, or a stream that ends without the trailer, aborts the
// transfer (blocks freed) and is returned; OK carries the acknowledgement.
absl::StatusOr<v1::KvAck> ReceiveKvStream(KvReceiver* receiver,
                                          const std::function<bool(v1::KvChunk*)>& read,
                                          const std::function<bool()>& cancelled);

// Bounds on what one sender can hold open on the receiver.
struct KvTransferServiceOptions {
  // PushBlocks streams open at once per peer address (its IP, any port); beyond:
  // RESOURCE_EXHAUSTED before the header is read.
  int max_transfers_per_peer = 64;
  // A stream still open this long after it started is cancelled (its transfer aborted and its
  // blocks freed, as at the end of its lease), so a stalled sender holds no server thread.
  absl::Duration max_stream_time = absl::Seconds(60);
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
  // UNIMPLEMENTED until the NCCL transport (issue #5).
  grpc::Status NcclBootstrap(grpc::ServerContext* context,
                             const v1::NcclBootstrapRequest* request,
                             v1::NcclBootstrapResponse* response) override;

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
