// The sending side of the KV transfer protocol, shared by every transport (not part of the public
// interface). A transport only moves bytes (a BlockMover); ProtocolSender does the rest, once:
// one thread per transfer, at most N transfers per target at once, the header → blocks → trailer
// order, the lease as the transfer's deadline, cancelling the receiver's side after a failure,
// the acknowledgement check (blocks and bytes), errors naming the request and the target, the
// TransferResult timing, and releasing the sender's KV reference before `done` runs. The
// receiving side's rules (descriptor, sizes, checksums, duplicates, missing blocks, leases,
// Forget; never a partial KV) are KvReceiver's, fed by ReceiveKvStream for the gRPC transports.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dgserve/v1/worker.pb.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_internal.h"

namespace dgserve::kv::internal {

// What a transport supplies for one transfer. Calls come from the transfer's thread only, in
// this order: Open, MoveBlock for each block (in the order of `blocks`), Close; Cancel after
// any error once Open succeeded (also when the deadline passed between calls). A mover whose
// Open fails cleans up after itself (the protocol must not abort another transfer in flight
// for the same request id at the receiver).
class BlockMover {
 public:
  virtual ~BlockMover() = default;
  // Starts the transfer at the receiver with `header`; `blocks` are what will follow (what the
  // header announces); `deadline` is the end of the lease: nothing may wait past it.
  virtual absl::Status Open(const v1::KvTransferHeader& header,
                            const std::vector<OutgoingBlock>& blocks, absl::Time deadline) = 0;
  // Moves block `index` of `blocks` (its bytes are kv.pool()->BlockData(kind, physical)).
  virtual absl::Status MoveBlock(const PagedKvCache& kv, size_t index) = 0;
  // Sends the trailer; returns the receiver's acknowledgement (or its error).
  virtual absl::StatusOr<v1::KvAck> Close(const v1::KvTransferTrailer& trailer) = 0;
  // Ends a failed transfer so that the receiver aborts it (frees its blocks). Idempotent.
  virtual void Cancel(const absl::Status& why) = 0;
};

// Makes the mover of one transfer to `target` (runs on the transfer's thread). An error fails
// the transfer (named by ProtocolSender) without anything sent.
using MoverFactory = std::function<absl::StatusOr<std::unique_ptr<BlockMover>>(
    const std::string& target, const std::string& request_id, absl::Time deadline)>;

// The sending half of KvTransport::Send for one transport. Thread-safe; transfers that are
// running keep their shared state alive after the sender is destroyed.
class ProtocolSender {
 public:
  // `max_outstanding_per_target` ≤ 0: no limit.
  ProtocolSender(std::string transport, int max_outstanding_per_target);

  // As KvTransport::Send: returns at once; `done` runs exactly once (at once with
  // RESOURCE_EXHAUSTED when `target` already has max_outstanding_per_target transfers).
  void Send(const std::string& target, const std::string& request_id,
            std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms, TransferCallback done,
            MoverFactory make_mover);

 private:
  struct Outstanding;
  const std::string transport_;
  const int max_outstanding_;
  const std::shared_ptr<Outstanding> outstanding_;
};

// The protocol of one transfer on the calling thread (ProtocolSender's body; tests).
absl::StatusOr<TransferResult> RunTransferProtocol(const std::string& transport,
                                                   const std::string& target,
                                                   const std::string& request_id,
                                                   const PagedKvCache& kv, int64_t lease_ms,
                                                   const MoverFactory& make_mover);

}  // namespace dgserve::kv::internal
