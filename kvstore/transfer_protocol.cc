#include "kvstore/transfer_protocol.h"

#include <map>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace dgserve::kv::internal {
namespace {

// `s` with a message naming the request and the target (kept as is when it already does).
absl::Status Named(const absl::Status& s, const std::string& request_id,
                   const std::string& target) {
  if (s.ok()) return s;
  const std::string message(s.message());
  if (absl::StrContains(message, request_id) && absl::StrContains(message, target)) return s;
  return absl::Status(s.code(), absl::StrCat("KV transfer for ", request_id, " to ", target,
                                             ": ", message));
}

}  // namespace

struct ProtocolSender::Outstanding {
  absl::Mutex mu;
  std::map<std::string, int> per_target ABSL_GUARDED_BY(mu);
};

ProtocolSender::ProtocolSender(std::string transport, int max_outstanding_per_target)
    : transport_(std::move(transport)),
      max_outstanding_(max_outstanding_per_target),
      outstanding_(std::make_shared<Outstanding>()) {}

absl::StatusOr<TransferResult> RunTransferProtocol(const std::string& transport,
                                                   const std::string& target,
                                                   const std::string& request_id,
                                                   const PagedKvCache& kv, int64_t lease_ms,
                                                   const MoverFactory& make_mover) {
  const absl::Time start = absl::Now();
  // The receiver drops the transfer when its lease expires, so working longer is pointless.
  const absl::Time deadline =
      lease_ms > 0 ? start + absl::Milliseconds(lease_ms) : absl::InfiniteFuture();
  const v1::KvTransferHeader header = MakeHeader(request_id, kv, lease_ms);
  const std::vector<OutgoingBlock> blocks = BlocksToSend(header.kv_descriptor(), kv);
  absl::StatusOr<std::unique_ptr<BlockMover>> mover = make_mover(target, request_id, deadline);
  if (!mover.ok()) return Named(mover.status(), request_id, target);
  BlockMover& m = **mover;
  if (absl::Status s = m.Open(header, blocks, deadline); !s.ok()) {
    return Named(s, request_id, target);
  }
  TransferResult result;
  const BlockPool* pool = kv.pool();
  for (size_t i = 0; i < blocks.size(); ++i) {
    absl::Status s;
    if (absl::Now() >= deadline) {
      s = absl::DeadlineExceededError(absl::StrCat("the lease of ", lease_ms,
                                                   " ms ran out after ", i, " of ",
                                                   blocks.size(), " blocks (", transport, ")"));
    } else {
      s = m.MoveBlock(kv, i);
    }
    if (!s.ok()) {
      s = Named(s, request_id, target);
      m.Cancel(s);
      return s;
    }
    ++result.blocks;
    result.bytes += int64_t(pool->layout().BlockBytes(blocks[i].kind));
  }
  v1::KvTransferTrailer trailer;
  trailer.set_blocks(result.blocks);
  absl::StatusOr<v1::KvAck> ack = m.Close(trailer);
  if (!ack.ok()) {
    const absl::Status s = Named(ack.status(), request_id, target);
    m.Cancel(s);
    return s;
  }
  if (ack->blocks() != result.blocks || ack->bytes() != result.bytes) {
    return absl::DataLossError(absl::StrCat("KV transfer for ", request_id, " to ", target,
                                            ": acknowledged ", ack->blocks(), " blocks / ",
                                            ack->bytes(), " bytes, sent ", result.blocks, " / ",
                                            result.bytes));
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

void ProtocolSender::Send(const std::string& target, const std::string& request_id,
                          std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
                          TransferCallback done, MoverFactory make_mover) {
  // Rows still only in a device backend's memory would be sent as stale host rows.
  if (kv != nullptr) {
    if (absl::Status st = CheckHostRowsCurrent(*kv, absl::StrCat("KV transfer for ", request_id));
        !st.ok()) {
      done(st);
      return;
    }
  }
  bool full = false;
  {
    absl::MutexLock lock(&outstanding_->mu);
    int& n = outstanding_->per_target[target];
    full = max_outstanding_ > 0 && n >= max_outstanding_;
    if (!full) ++n;
  }
  if (full) {
    done(KvPushLimitError(request_id, target, max_outstanding_));
    return;
  }
  std::thread([outstanding = outstanding_, transport = transport_, target, request_id,
               kv = std::move(kv), lease_ms, done = std::move(done),
               make_mover = std::move(make_mover)]() mutable {
    absl::StatusOr<TransferResult> result =
        kv == nullptr
            ? absl::InvalidArgumentError(
                  absl::StrCat("KV transfer for ", request_id, ": no KV to send"))
            : RunTransferProtocol(transport, target, request_id, *kv, lease_ms, make_mover);
    kv.reset();  // the sender's blocks are released before `done` runs
    make_mover = nullptr;
    {
      absl::MutexLock lock(&outstanding->mu);
      if (--outstanding->per_target[target] == 0) outstanding->per_target.erase(target);
    }
    TransferCallback callback = std::move(done);
    callback(std::move(result));
  }).detach();
}

}  // namespace dgserve::kv::internal
