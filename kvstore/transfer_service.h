// The gRPC server side of the TCP transport: KvTransferService.PushBlocks feeding a KvReceiver.
#pragma once

#include "dgserve/v1/worker.grpc.pb.h"
#include "kvstore/transfer.h"

namespace dgserve::kv {

class KvTransferServiceImpl final : public v1::KvTransferService::Service {
 public:
  // `receiver` must outlive the service.
  explicit KvTransferServiceImpl(KvReceiver* receiver) : receiver_(receiver) {}

  // First chunk must be the header, then blocks, then the trailer. Any error, or a stream that
  // ends without the trailer, aborts the transfer (blocks freed) and returns the error.
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
