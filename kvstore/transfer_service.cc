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

absl::StatusOr<v1::KvAck> ReceiveKvStream(KvReceiver* receiver,
                                          const std::function<bool(v1::KvChunk*)>& read,
                                          const std::function<bool()>& cancelled) {
  v1::KvChunk chunk;
  if (!read(&chunk)) return absl::InvalidArgumentError("KV transfer stream without a header");
  if (!chunk.has_header()) {
    return absl::InvalidArgumentError("KV transfer stream must start with its header");
  }
  const std::string id = chunk.header().request_id();
  const v1::KvDescriptor& d = chunk.header().kv_descriptor();
  const int64_t announced = int64_t(d.full_block_count()) + d.sliding_block_count();
  // Begin cleans up after itself (and must not abort another transfer in flight for the id).
  if (absl::Status s = receiver->Begin(chunk.header()); !s.ok()) return s;

  int blocks = 0;
  int64_t bytes = 0;
  while (read(&chunk)) {
    absl::Status s;
    if (chunk.has_block()) {
      const int64_t size = int64_t(chunk.block().data().size());
      s = receiver->WriteBlock(id, chunk.block());
      if (s.ok()) {
        ++blocks;
        bytes += size;
        continue;
      }
    } else if (chunk.has_trailer()) {
      s = receiver->Finish(id, chunk.trailer());
      if (s.ok()) {
        v1::KvAck ack;
        ack.set_blocks(blocks);
        ack.set_bytes(bytes);
        return ack;
      }
    } else {
      s = absl::InvalidArgumentError(
          absl::StrCat("KV transfer for ", id, ": unexpected chunk after block ", blocks));
    }
    receiver->Abort(id, s);  // no-op when the receiver already failed the transfer
    return s;
  }
  const absl::Status cut = absl::UnavailableError(
      absl::StrCat("KV transfer for ", id, " ended after ", blocks, " of ", announced, " blocks",
                   cancelled() ? " (cancelled by the sender)" : ""));
  receiver->Abort(id, cut);
  return cut;
}

grpc::Status KvTransferServiceImpl::PushBlocks(grpc::ServerContext* context,
                                               grpc::ServerReader<v1::KvChunk>* reader,
                                               v1::KvAck* ack) {
  absl::StatusOr<v1::KvAck> result = ReceiveKvStream(
      receiver_, [reader](v1::KvChunk* chunk) { return reader->Read(chunk); },
      [context] { return context->IsCancelled(); });
  if (!result.ok()) return ToGrpc(result.status());
  *ack = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status KvTransferServiceImpl::NcclBootstrap(grpc::ServerContext* context,
                                                  const v1::NcclBootstrapRequest* request,
                                                  v1::NcclBootstrapResponse* response) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      "NCCL KV transport is not implemented yet (issue #5)");
}

}  // namespace dgserve::kv
