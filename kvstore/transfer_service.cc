#include "kvstore/transfer_service.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_convert.h"

namespace dgserve::kv {
namespace {

grpc::Status ToGrpc(const absl::Status& s) { return ToGrpcStatus(s); }

}  // namespace

constexpr char kGpuOff[] = "GPU KV transports are off on this worker (no CUDA device for them)";

absl::StatusOr<v1::KvAck> ReceiveKvStream(KvReceiver* receiver,
                                          const std::function<bool(v1::KvChunk*)>& read,
                                          const std::function<bool()>& cancelled,
                                          GpuReceiveEndpoint* gpu) {
  v1::KvChunk chunk;
  if (!read(&chunk)) return absl::InvalidArgumentError("KV transfer stream without a header");
  if (!chunk.has_header()) {
    return absl::InvalidArgumentError("KV transfer stream must start with its header");
  }
  const std::string id = chunk.header().request_id();
  const v1::KvDescriptor& d = chunk.header().kv_descriptor();
  const int64_t announced = int64_t(d.full_block_count()) + d.sliding_block_count();
  // Out-of-band blocks: their control messages wait here until their round ends. The source
  // is opened before Begin so that a transfer Begin refuses also ends the GPU session's side
  // (a sender waiting on the device for this receiver then fails at once).
  std::unique_ptr<OutOfBandSource> source;
  absl::Status source_error;
  if (chunk.header().data_path() != v1::KV_DATA_INLINE) {
    absl::StatusOr<std::unique_ptr<OutOfBandSource>> opened =
        gpu == nullptr
            ? absl::FailedPreconditionError(kGpuOff)
            : gpu->OpenSource(chunk.header(),
                              absl::Now() + absl::Milliseconds(chunk.header().lease_ms()),
                              cancelled);
    if (opened.ok()) {
      source = *std::move(opened);
    } else {
      source_error = absl::Status(
          opened.status().code(),
          absl::StrCat("KV transfer for ", id, " over ",
                       v1::KvDataPath_Name(chunk.header().data_path()), ": ",
                       opened.status().message()));
    }
  }
  // Begin cleans up after itself (and must not abort another transfer in flight for the id).
  if (absl::Status s = receiver->Begin(chunk.header()); !s.ok()) {
    if (source != nullptr) source->Fail(s);
    return s;
  }
  if (!source_error.ok()) {
    receiver->Abort(id, source_error);  // the request waiting for this KV gets the refusal
    return source_error;
  }
  std::vector<v1::KvBlockPayload> round;

  int blocks = 0;
  int64_t bytes = 0;
  while (read(&chunk)) {
    absl::Status s;
    if (chunk.has_block() && chunk.block().out_of_band()) {
      if (source == nullptr) {
        s = absl::InvalidArgumentError(absl::StrCat(
            "KV transfer for ", id, ": out-of-band block in an inline transfer"));
      } else {
        round.push_back(std::move(*chunk.mutable_block()));
        if (!round.back().group_end()) continue;
        s = source->Fetch(round);
        if (s.ok()) {
          for (const v1::KvBlockPayload& b : round) {
            s = receiver->WriteBlock(id, b);
            if (!s.ok()) break;
            ++blocks;
            bytes += int64_t(b.data().size());
          }
        } else {
          s = absl::Status(s.code(), absl::StrCat("KV transfer for ", id, ": ", s.message()));
        }
        round.clear();
        if (s.ok()) continue;
      }
    } else if (!round.empty()) {
      s = absl::InvalidArgumentError(absl::StrCat(
          "KV transfer for ", id, ": staging round not ended before the next message"));
    } else if (chunk.has_block()) {
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
    if (source != nullptr) source->Fail(s);
    return s;
  }
  const absl::Status cut = absl::UnavailableError(
      absl::StrCat("KV transfer for ", id, " ended after ", blocks, " of ", announced, " blocks",
                   cancelled() ? " (cancelled by the sender)" : ""));
  receiver->Abort(id, cut);
  if (source != nullptr) source->Fail(cut);
  return cut;
}

std::string PeerAddress(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  const size_t scheme = peer.find(':');
  if (colon == std::string::npos || colon == scheme) return peer;
  return peer.substr(0, colon);
}

KvTransferServiceImpl::KvTransferServiceImpl(KvReceiver* receiver,
                                             KvTransferServiceOptions options)
    : receiver_(receiver), options_(options) {
  watchdog_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
      const absl::Time now = absl::Now();
      absl::MutexLock lock(&mu_);
      for (auto& [context, deadline] : deadlines_) {
        if (deadline <= now) {
          context->TryCancel();
          deadline = absl::InfiniteFuture();  // once
          ++cancelled_;
        }
      }
    }
  });
}

KvTransferServiceImpl::~KvTransferServiceImpl() {
  stop_.Notify();
  watchdog_.join();
}

int KvTransferServiceImpl::open_streams(const std::string& peer_address) const {
  absl::MutexLock lock(&mu_);
  auto it = per_peer_.find(peer_address);
  return it == per_peer_.end() ? 0 : it->second;
}

int64_t KvTransferServiceImpl::refused_streams() const {
  absl::MutexLock lock(&mu_);
  return refused_;
}

int64_t KvTransferServiceImpl::cancelled_streams() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

grpc::Status KvTransferServiceImpl::PushBlocks(grpc::ServerContext* context,
                                               grpc::ServerReader<v1::KvChunk>* reader,
                                               v1::KvAck* ack) {
  const std::string peer = PeerAddress(context->peer());
  {
    absl::MutexLock lock(&mu_);
    int& n = per_peer_[peer];
    if (n >= options_.max_transfers_per_peer) {
      ++refused_;
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat(n, " KV transfers from ", peer,
                                       " are already open (the limit per peer)"));
    }
    ++n;
    deadlines_[context] = absl::Now() + options_.max_stream_time;
  }
  absl::StatusOr<v1::KvAck> result = ReceiveKvStream(
      receiver_, [reader](v1::KvChunk* chunk) { return reader->Read(chunk); },
      [context] { return context->IsCancelled(); }, options_.gpu.get());
  {
    absl::MutexLock lock(&mu_);
    deadlines_.erase(context);
    if (--per_peer_[peer] == 0) per_peer_.erase(peer);
  }
  if (!result.ok()) return ToGrpc(result.status());
  *ack = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status KvTransferServiceImpl::NcclBootstrap(grpc::ServerContext* context,
                                                  const v1::NcclBootstrapRequest* request,
                                                  v1::NcclBootstrapResponse* response) {
  if (options_.gpu == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, kGpuOff);
  }
  absl::StatusOr<v1::NcclBootstrapResponse> r = options_.gpu->NcclBootstrap(*request);
  if (!r.ok()) return ToGrpc(r.status());
  *response = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status KvTransferServiceImpl::CudaIpcOpen(grpc::ServerContext* context,
                                                const v1::CudaIpcOpenRequest* request,
                                                v1::CudaIpcOpenResponse* response) {
  if (options_.gpu == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, kGpuOff);
  }
  absl::StatusOr<v1::CudaIpcOpenResponse> r = options_.gpu->CudaIpcOpen(*request);
  if (!r.ok()) return ToGrpc(r.status());
  *response = *std::move(r);
  return grpc::Status::OK;
}

}  // namespace dgserve::kv
