// The TCP transport: the shared protocol (transfer_protocol.h) over KvTransferService.PushBlocks
// (gRPC client streaming) with the block bytes inline, one cached channel per target.
#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "kvstore/kv_stream_client.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_internal.h"
#include "kvstore/transfer_protocol.h"

namespace dgserve::kv {
namespace {

// Moves each block as one KvBlockPayload on the stream.
class TcpMover final : public internal::BlockMover {
 public:
  TcpMover(std::shared_ptr<grpc::Channel> channel, const std::string& target,
           const std::string& request_id, int64_t cut_after_bytes)
      : stream_(std::move(channel), target, request_id, cut_after_bytes > 0),
        target_(target),
        request_id_(request_id),
        cut_after_bytes_(cut_after_bytes) {}

  absl::Status Open(const v1::KvTransferHeader& header,
                    const std::vector<internal::OutgoingBlock>& blocks,
                    absl::Time deadline) override {
    blocks_ = &blocks;
    return stream_.Open(header, deadline);
  }

  absl::Status MoveBlock(const PagedKvCache& kv, size_t index) override {
    v1::KvBlockPayload* payload = chunk_.mutable_block();
    internal::FillPayload(kv, (*blocks_)[index], payload);
    const int64_t size = int64_t(payload->data().size());
    if (cut_after_bytes_ > 0 && sent_bytes_ + size > cut_after_bytes_) {
      // Fault injection: the block goes out truncated, then the stream is cut.
      payload->mutable_data()->resize(size_t(cut_after_bytes_ - sent_bytes_));
      stream_.WriteAndCut(chunk_);
      return absl::UnavailableError(absl::StrCat(
          "transfer cut by fault injection after ", cut_after_bytes_, " bytes (KV for ",
          request_id_, " to ", target_, ", ", index, " of ", blocks_->size(), " blocks)"));
    }
    if (absl::Status s = stream_.Write(chunk_); !s.ok()) return s;
    sent_bytes_ += size;
    return absl::OkStatus();
  }

  absl::StatusOr<v1::KvAck> Close(const v1::KvTransferTrailer& trailer) override {
    return stream_.Close(trailer);
  }

  void Cancel(const absl::Status&) override { stream_.Cancel(); }

 private:
  internal::KvStreamClient stream_;
  const std::string target_, request_id_;
  const int64_t cut_after_bytes_;
  const std::vector<internal::OutgoingBlock>* blocks_ = nullptr;
  v1::KvChunk chunk_;
  int64_t sent_bytes_ = 0;
};

class TcpTransport final : public KvTransport {
 public:
  explicit TcpTransport(const TcpTransportOptions& options)
      : options_(options), sender_("tcp", options.max_outstanding_per_target) {}

  std::string name() const override { return "tcp"; }

  void Send(const std::string& target, const std::string& request_id,
            std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
            TransferCallback done) override {
    std::shared_ptr<grpc::Channel> channel = Channel(target);
    const int64_t cut = options_.cut_after_bytes;
    sender_.Send(target, request_id, std::move(kv), lease_ms, std::move(done),
                 [channel = std::move(channel), cut](const std::string& target,
                                                     const std::string& request_id,
                                                     absl::Time) {
                   return absl::StatusOr<std::unique_ptr<internal::BlockMover>>(
                       std::make_unique<TcpMover>(channel, target, request_id, cut));
                 });
  }

 private:
  std::shared_ptr<grpc::Channel> Channel(const std::string& target) {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<grpc::Channel>& channel = channels_[target];
    if (channel == nullptr) {
      grpc::ChannelArguments args;
      args.SetMaxSendMessageSize(int(std::min<size_t>(options_.max_message_bytes, INT32_MAX)));
      channel = options_.make_channel
                    ? options_.make_channel(target, args)
                    : grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    }
    return channel;
  }

  const TcpTransportOptions options_;
  internal::ProtocolSender sender_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<KvTransport> CreateTcpTransport(const TcpTransportOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace dgserve::kv
