// The KV transfer engine (design §1.4): one sending interface with several transports
// (in-process, TCP over gRPC streaming, NCCL later), and the receiving side that checks every
// transfer, holds its blocks under a lease and hands the finished KV to the request waiting for
// it. A transfer moves a list of blocks per layer kind; a mismatched descriptor, a bad or
// missing block, or a cut stream fails the transfer, frees its blocks, and fails the request
// waiting for it with a clear status — never output from partial KV.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "dgserve/v1/worker.pb.h"
#include "kvstore/block_pool.h"
#include "kvstore/paged_kv_cache.h"

namespace grpc {
class Channel;
class ChannelArguments;
}  // namespace grpc

namespace dgserve::kv {

// What the sender sends for a sequence: its descriptor and the blocks, in order.
// The layout part of a descriptor for `layout`: what CheckDescriptor compares (model id, layer
// kinds and shapes, dtype, block size, window), with token_count and block counts 0. Workers
// report it in Stats.kv_layout so that the gateway can see a mismatch before any transfer.
v1::KvDescriptor DescribeLayout(const KvLayout& layout);
// Descriptor of `kv` (all of its num_tokens() committed positions) for `layout`.
v1::KvDescriptor DescribeSequence(const KvLayout& layout, const PagedKvCache& kv);
// OK, or FAILED_PRECONDITION naming the first field of `got` that differs from what `layout`
// expects (model id, layer count/kinds/shapes, dtype, block size, window) or a block range
// inconsistent with token_count.
absl::Status CheckDescriptor(const KvLayout& layout, const v1::KvDescriptor& got);

// A receiver's refusal for want of free blocks right now (RESOURCE_EXHAUSTED whose message
// carries kKvPoolFull; the text crosses gRPC where a status payload would not): the pool could
// hold the KV once requests finish, so a sender may keep the KV and push it again later.
inline constexpr char kKvPoolFull[] = "KV pool full: ";
bool IsKvPoolFull(const absl::Status& s);
// A sender's refusal of its own: `max_outstanding` transfers to `target` are already running
// (RESOURCE_EXHAUSTED whose message carries kKvPushLimit). Nothing was sent and the target may
// have room: the KV can be pushed again once one of them ends.
inline constexpr char kKvPushLimit[] = "KV push limit: ";
absl::Status KvPushLimitError(const std::string& request_id, const std::string& target,
                              int max_outstanding);
bool IsKvPushLimit(const absl::Status& s);
// The cause of a failed transfer, without the "KV transfer for ID[ to TARGET][ failed]: "
// prefixes each layer (receiver, stream client, sender) adds: a client sees it once.
std::string TransferFailureCause(absl::string_view message);

struct TransferResult {
  int blocks = 0;
  int64_t bytes = 0;
  double seconds = 0;
  // The transport that moved the bytes ("tcp", "cuda_ipc", "nccl", "inprocess"); set by
  // RoutingKvTransport (kvstore/transport_selection.h); empty from a transport used directly.
  std::string transport;
};

using TransferCallback = std::function<void(absl::StatusOr<TransferResult>)>;

// Sending side. Send() returns at once; `done` runs exactly once, on any thread, after the
// receiver acknowledged every block (OK) or the transfer failed. `kv` is kept alive (and its
// blocks referenced) until then.
class KvTransport {
 public:
  virtual ~KvTransport() = default;
  virtual std::string name() const = 0;  // "inprocess", "tcp", "nccl"
  virtual void Send(const std::string& target, const std::string& request_id,
                    std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
                    TransferCallback done) = 0;
};

// Receiving side, one per denoise worker. Transports call Begin / WriteBlock / Finish / Abort;
// the worker calls Expect / Forget. A request's KV may arrive before or after Expect.
class KvReceiver {
 public:
  // `pool` must outlive the receiver; max_tokens bounds the sequences built from transfers.
  // A transfer's lease (its deadline to complete, then the completed KV's time to be claimed)
  // is the sender's lease_ms clamped to `max_lease_ms`.
  KvReceiver(BlockPool* pool, int max_tokens, int64_t max_lease_ms = 60000);
  ~KvReceiver();

  // Starts an incoming transfer: checks the descriptor and starts its lease (blocks are taken as
  // their data arrives, WriteBlock). FAILED_PRECONDITION (descriptor), RESOURCE_EXHAUSTED (more
  // blocks than the pool has), ALREADY_EXISTS (same request id in flight), INVALID_ARGUMENT
  // (empty request id / lease ≤ 0).
  absl::Status Begin(const v1::KvTransferHeader& header);
  // One block: its kind and logical index must be one the descriptor announced and not yet
  // written, its size exactly BlockBytes, its checksum right; its storage is taken now
  // (RESOURCE_EXHAUSTED when the pool has no free block). Any error aborts the transfer.
  absl::Status WriteBlock(const std::string& request_id, const v1::KvBlockPayload& block);
  // Completes it: every announced block written and trailer.blocks() equal to their number,
  // else the transfer is aborted. The KV goes to the request's Expect callback (now or later).
  absl::Status Finish(const std::string& request_id, const v1::KvTransferTrailer& trailer);
  // Fails an incoming transfer (stream cut, sender error): frees its blocks and fails the
  // Expect callback with `why`. No-op for an unknown id.
  void Abort(const std::string& request_id, const absl::Status& why);

  using KvCallback = std::function<void(absl::StatusOr<std::unique_ptr<PagedKvCache>>)>;
  // Calls `done` exactly once: with the KV when the transfer completes (at once if it already
  // has), with the transfer's error if it fails, or DEADLINE_EXCEEDED if nothing complete
  // arrives by `deadline`. Runs on a transport thread, the reaper, or the caller's thread.
  void Expect(const std::string& request_id, absl::Time deadline, KvCallback done);
  // Drops everything about the request (its Expect callback is not called; incoming blocks are
  // freed and a later transfer for it is refused with `why`: CANCELLED, or DEADLINE_EXCEEDED
  // when the request's deadline passed).
  void Forget(const std::string& request_id,
              absl::StatusCode why = absl::StatusCode::kCancelled);
  // Frees the request's KV, complete or still arriving, when nothing waits for it (no Expect):
  // a request the worker refused before it would wait. Unlike Forget nothing is remembered (a
  // later transfer for the id is taken as any other). Returns whether KV was freed.
  bool Drop(const std::string& request_id);

  // Reclaims leases and expectations that are past due (called by a background thread every
  // 50 ms; tests may call it with their own clock).
  void ReapExpired(absl::Time now);

  int pending_transfers() const;  // begun, not finished
  int64_t clamped_leases() const;  // transfers whose lease_ms was above max_lease_ms
  int64_t failed_transfers() const;
  // Bytes of KV block payload written so far (every transfer, whatever its end).
  int64_t received_bytes() const;
  // The same, by how the bytes travelled (the header's data_path: inline over the PushBlocks
  // stream, NCCL, CUDA IPC).
  std::map<v1::KvDataPath, int64_t> received_bytes_by_path() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// In-process transport: targets are names registered here, the receiver written directly.
void RegisterInProcessReceiver(const std::string& name, KvReceiver* receiver);
void UnregisterInProcessReceiver(const std::string& name);
std::unique_ptr<KvTransport> CreateInProcessTransport();

// TCP transport: KvTransferService.PushBlocks (gRPC client streaming) to `target`
// ("host:port"). `cut_after_bytes` > 0 is a fault-injection hook for tests: the stream is cut
// inside the block where that many payload bytes have been sent.
// `make_channel` dials a target (with the internal credentials: InternalAuth::MakeChannel);
// empty: plaintext without credentials (tests). At most `max_outstanding_per_target` transfers
// to one target run at once: beyond, Send fails at once with RESOURCE_EXHAUSTED (a target that
// never answers holds at most that many, each until its lease deadline).
struct TcpTransportOptions {
  int64_t cut_after_bytes = 0;
  size_t max_message_bytes = 64 << 20;
  std::function<std::shared_ptr<grpc::Channel>(const std::string& target,
                                               const grpc::ChannelArguments& args)>
      make_channel;
  int max_outstanding_per_target = 64;
};
std::unique_ptr<KvTransport> CreateTcpTransport(const TcpTransportOptions& options = {});

}  // namespace dgserve::kv
