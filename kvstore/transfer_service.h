// The gRPC server side of the TCP transport: KvTransferService.PushBlocks feeding a KvReceiver.
#pragma once

#include <functional>

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

class KvTransferServiceImpl final : public v1::KvTransferService::Service {
 public:
  // `receiver` must outlive the service.
  explicit KvTransferServiceImpl(KvReceiver* receiver) : receiver_(receiver) {}

  // ReceiveKvStream over the call's reader.
  grpc::Status PushBlocks(grpc::ServerContext* context, grpc::ServerReader<v1::KvChunk>* reader,
                          v1::KvAck* ack) override;
  // UNIMPLEMENTED until the NCCL transport (issue #5).
  grpc::Status NcclBootstrap(grpc::ServerContext* context,
                             const v1::NcclBootstrapRequest* request,
                             v1::NcclBootstrapResponse* response) override;

 private:
  KvReceiver* receiver_;
};

}  // namespace dgserve::kv
