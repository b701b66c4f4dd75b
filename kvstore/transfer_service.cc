#include "kvstore/transfer_service.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dgserve::kv {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace

grpc::Status KvTransferServiceImpl::PushBlocks(grpc::ServerContext* context,
                                               grpc::ServerReader<v1::KvChunk>* reader,
                                               v1::KvAck* ack) {
  v1::KvChunk chunk;
  if (!reader->Read(&chunk)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "KV transfer stream without a header");
  }
  if (!chunk.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "KV transfer stream must start with its header");
  }
  const std::string id = chunk.header().request_id();
  const v1::KvDescriptor& d = chunk.header().kv_descriptor();
  const int announced = d.full_block_count() + d.sliding_block_count();
  // Begin cleans up after itself (and must not abort another transfer in flight for the id).
  if (absl::Status s = receiver_->Begin(chunk.header()); !s.ok()) return ToGrpc(s);

  int blocks = 0;
  int64_t bytes = 0;
  while (reader->Read(&chunk)) {
    absl::Status s;
    if (chunk.has_block()) {
      const int64_t size = int64_t(chunk.block().data().size());
      s = receiver_->WriteBlock(id, chunk.block());
      if (s.ok()) {
        ++blocks;
        bytes += size;
        continue;
      }
    } else if (chunk.has_trailer()) {
      s = receiver_->Finish(id, chunk.trailer());
      if (s.ok()) {
        ack->set_blocks(blocks);
        ack->set_bytes(bytes);
        return grpc::Status::OK;
      }
    } else {
      s = absl::InvalidArgumentError(
          absl::StrCat("KV transfer for ", id, ": unexpected chunk after block ", blocks));
    }
    receiver_->Abort(id, s);  // no-op when the receiver already failed the transfer
    return ToGrpc(s);
  }
  const absl::Status cut = absl::UnavailableError(
      absl::StrCat("KV transfer for ", id, " ended after ", blocks, " of ", announced, " blocks",
                   context->IsCancelled() ? " (cancelled by the sender)" : ""));
  receiver_->Abort(id, cut);
  return ToGrpc(cut);
}

grpc::Status KvTransferServiceImpl::NcclBootstrap(grpc::ServerContext* context,
                                                  const v1::NcclBootstrapRequest* request,
                                                  v1::NcclBootstrapResponse* response) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      "NCCL KV transport is not implemented yet (issue #5)");
}

}  // namespace dgserve::kv
