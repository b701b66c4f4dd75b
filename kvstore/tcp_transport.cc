// The TCP transport: KvTransferService.PushBlocks (gRPC client streaming), one thread per
// transfer, one cached channel per target.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_internal.h"

namespace dgserve::kv {
namespace {

// Same code (gRPC and absl share the numbering), message naming the transfer and the target.
absl::Status FromGrpc(const grpc::Status& s, const std::string& request_id,
                      const std::string& target) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("KV transfer for ", request_id, " to ", target,
                                   " failed: ", s.error_message()));
}

absl::StatusOr<TransferResult> RunTransfer(const std::shared_ptr<grpc::Channel>& channel,
                                           const TcpTransportOptions& options,
                                           const std::string& target,
                                           const std::string& request_id,
                                           const PagedKvCache& kv, int64_t lease_ms) {
  const absl::Time start = absl::Now();
  auto stub = v1::KvTransferService::NewStub(channel);
  grpc::ClientContext context;
  // The receiver drops the transfer when its lease expires, so waiting longer is pointless.
  if (lease_ms > 0) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(lease_ms));
  }
  v1::KvAck ack;
  std::unique_ptr<grpc::ClientWriter<v1::KvChunk>> writer = stub->PushBlocks(&context, &ack);

  v1::KvChunk chunk;
  *chunk.mutable_header() = internal::MakeHeader(request_id, kv, lease_ms);
  const std::vector<internal::OutgoingBlock> blocks =
      internal::BlocksToSend(chunk.header().kv_descriptor(), kv);
  // With the fault hook armed, every write reaches the socket before the next step, so that
  // the cut lands mid-stream as on a real network (not in the client's send queue).
  grpc::WriteOptions write_options;
  if (options.cut_after_bytes > 0) write_options.set_write_through();
  bool stream_ok = writer->Write(chunk, write_options);
  TransferResult result;
  bool cut = false;
  for (size_t i = 0; stream_ok && i < blocks.size(); ++i) {
    v1::KvBlockPayload* payload = chunk.mutable_block();
    internal::FillPayload(kv, blocks[i], payload);
    const int64_t size = int64_t(payload->data().size());
    if (options.cut_after_bytes > 0 && result.bytes + size > options.cut_after_bytes) {
      // Fault injection: the block goes out truncated, then the stream is cut.
      payload->mutable_data()->resize(size_t(options.cut_after_bytes - result.bytes));
      writer->Write(chunk, write_options);
      context.TryCancel();
      cut = true;
      break;
    }
    stream_ok = writer->Write(chunk, write_options);
    if (stream_ok) {
      ++result.blocks;
      result.bytes += size;
    }
  }
  if (cut) {
    writer->Finish();  // CANCELLED; the server sees the stream end without a trailer
    return absl::UnavailableError(absl::StrCat(
        "transfer cut by fault injection after ", options.cut_after_bytes, " bytes (KV for ",
        request_id, " to ", target, ", ", result.blocks, " of ", blocks.size(), " blocks)"));
  }
  if (stream_ok) {
    chunk.mutable_trailer()->set_blocks(result.blocks);
    stream_ok = writer->Write(chunk);
  }
  if (stream_ok) writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return FromGrpc(status, request_id, target);
  if (!stream_ok) {
    return absl::UnavailableError(absl::StrCat("KV transfer for ", request_id, " to ", target,
                                               ": stream closed early"));
  }
  if (ack.blocks() != result.blocks || ack.bytes() != result.bytes) {
    return absl::DataLossError(absl::StrCat("KV transfer for ", request_id, " to ", target,
                                            ": acknowledged ", ack.blocks(), " blocks / ",
                                            ack.bytes(), " bytes, sent ", result.blocks, " / ",
                                            result.bytes));
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

class TcpTransport final : public KvTransport {
 public:
  explicit TcpTransport(const TcpTransportOptions& options) : options_(options) {}

  std::string name() const override { return "tcp"; }

  void Send(const std::string& target, const std::string& request_id,
            std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
            TransferCallback done) override {
    bool full = false;
    {
      absl::MutexLock lock(&outstanding_->mu);
      int& n = outstanding_->per_target[target];
      full = n >= options_.max_outstanding_per_target;
      if (!full) ++n;
    }
    if (full) {
      done(absl::ResourceExhaustedError(absl::StrCat(
          "KV transfer for ", request_id, " to ", target, ": ",
          options_.max_outstanding_per_target,
          " transfers to that target are already outstanding")));
      return;
    }
    std::shared_ptr<grpc::Channel> channel = Channel(target);
    std::thread([outstanding = outstanding_, channel = std::move(channel), options = options_,
                 target, request_id,
                 kv = std::move(kv), lease_ms, done = std::move(done)]() mutable {
      absl::StatusOr<TransferResult> result =
          kv == nullptr ? absl::InvalidArgumentError(absl::StrCat(
                              "KV transfer for ", request_id, ": no KV to send"))
                        : RunTransfer(channel, options, target, request_id, *kv, lease_ms);
      kv.reset();  // the sender's blocks are released before `done` runs
      {
        absl::MutexLock lock(&outstanding->mu);
        if (--outstanding->per_target[target] == 0) outstanding->per_target.erase(target);
      }
      TransferCallback callback = std::move(done);
      callback(std::move(result));
    }).detach();
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
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  // Transfers running per target; shared with their threads, which may outlive the transport.
  struct Outstanding {
    absl::Mutex mu;
    std::map<std::string, int> per_target ABSL_GUARDED_BY(mu);
  };
  const std::shared_ptr<Outstanding> outstanding_ = std::make_shared<Outstanding>();
};

}  // namespace

std::unique_ptr<KvTransport> CreateTcpTransport(const TcpTransportOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace dgserve::kv
