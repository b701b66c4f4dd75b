// Choosing the KV transport per target (issue 14, item 4; design §1.4): the prefill worker's
// `--kv_transport auto|tcp|cuda_ipc|nccl` and what each end reports about itself (KvPeerInfo: the
// denoise worker in its Stats reply). `auto` takes CUDA IPC between two processes on one GPU,
// else NCCL where both ends can, else TCP. RoutingKvTransport applies the choice to every Send.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dgserve/v1/worker.pb.h"
#include "kvstore/gpu_transport.h"
#include "kvstore/transfer.h"

namespace dgserve::kv {

enum class KvTransportMode { kAuto, kTcp, kCudaIpc, kNccl };

// "auto", "tcp", "cuda_ipc", "nccl" → the mode; anything else INVALID_ARGUMENT listing them.
absl::StatusOr<KvTransportMode> ParseKvTransportMode(std::string_view name);
std::string KvTransportModeName(KvTransportMode mode);

// The transport ("tcp", "cuda_ipc" or "nccl") that moves KV from `local` to `peer` (the end
// reachable as `target`, named in errors) under `mode`:
// - auto: "cuda_ipc" when both report it, the same node and the same non-empty gpu_uuid; else
//   "nccl" when both report it; else "tcp".
// - tcp: always "tcp".
// - cuda_ipc / nccl: that transport when the pair can use it (cuda_ipc: as for auto), else
//   FAILED_PRECONDITION naming the mode, the target and what each end reported.
// An end reporting no transports at all (a worker older than the field) counts as {"tcp"}.
absl::StatusOr<std::string> ChooseKvTransport(KvTransportMode mode, const KvPeerInfo& local,
                                              const KvPeerInfo& peer,
                                              const std::string& target = "the peer");

// "node N, GPU U (or no GPU), transports a,b" — for logs and error messages.
std::string DescribeKvPeer(const KvPeerInfo& info);

// KvPeerInfo from / into a Stats reply (fields node, gpu_uuid, kv_transports).
KvPeerInfo KvPeerInfoFromStats(const v1::StatsResponse& stats);
void FillKvPeerInfo(const KvPeerInfo& info, v1::StatsResponse* stats);

// Asks a denoise worker for its KvPeerInfo: DenoiseService.Stats on `target` over a channel
// made by `make_channel` (empty: plaintext, tests), within `timeout`. The gRPC error otherwise.
using KvPeerLookup = std::function<absl::StatusOr<KvPeerInfo>(const std::string& target)>;
KvPeerLookup StatsKvPeerLookup(
    std::function<std::shared_ptr<grpc::Channel>(const std::string& target,
                                                 const grpc::ChannelArguments& args)>
        make_channel,
    absl::Duration timeout = absl::Seconds(5));

// The transport that failed a transfer, as RoutingKvTransport attaches it to the error (a
// status payload); `fallback` when the status carries none.
std::string FailedKvTransport(const absl::Status& status, const std::string& fallback);

struct RoutingKvTransportOptions {
  KvTransportMode mode = KvTransportMode::kAuto;
  KvPeerInfo local;  // this process (LocalKvPeerInfo)
  // Where a target's KvPeerInfo comes from (StatsKvPeerLookup in the prefill worker). Not
  // called in mode tcp. It may block (bounded); it runs on a thread of its own.
  KvPeerLookup lookup;
  // A target's KvPeerInfo is looked up again after this long, and after a failed transfer.
  absl::Duration peer_info_ttl = absl::Seconds(60);
  // In auto mode, a transfer that failed over cuda_ipc or nccl (for any reason but a cancel:
  // a firewall that blocks NCCL's own sockets, a communicator that cannot be made) sends that
  // target's transfers over TCP for this long before the GPU transport is tried again.
  absl::Duration gpu_failure_backoff = absl::Seconds(300);
};

// A KvTransport that sends each transfer over the transport ChooseKvTransport picks for its
// target. The TCP transport is required; the CUDA IPC and NCCL ones may be null (not built or
// no GPU): `auto` then skips them, and an explicit mode needing one fails every Send with
// FAILED_PRECONDITION. In auto mode a target whose lookup fails is sent over TCP (its own
// error, if unreachable, is the transfer's); in an explicit GPU mode the lookup error fails the
// transfer. The result's `transport` names the transport used; a failure carries it as a
// payload (FailedKvTransport). In auto mode a failed GPU transfer makes the target's next
// transfers go over TCP for gpu_failure_backoff, and the transport chosen for a target is
// logged whenever it changes ("KV to T over nccl"). Send returns at once (a lookup runs on its own thread; one per
// target at a time, the Sends that arrive meanwhile wait for its answer); destruction waits for
// running lookups, not for transfers (the transports' own contract).
class RoutingKvTransport final : public KvTransport {
 public:
  RoutingKvTransport(RoutingKvTransportOptions options, std::unique_ptr<KvTransport> tcp,
                     std::unique_ptr<KvTransport> cuda_ipc, std::unique_ptr<KvTransport> nccl);
  ~RoutingKvTransport() override;

  std::string name() const override;  // the mode: "auto", "tcp", "cuda_ipc" or "nccl"
  void Send(const std::string& target, const std::string& request_id,
            std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
            TransferCallback done) override;

  // The transports this process can use (local.transports with a transport object), in the
  // order tcp, cuda_ipc, nccl.
  std::vector<std::string> available() const;
  // Peer lookups made so far (tests).
  int64_t lookups() const;

 private:
  // Picks (or fails) and sends; runs on the caller's thread or a lookup thread.
  void Route(const std::string& target, const absl::StatusOr<KvPeerInfo>& peer,
             const std::string& request_id, std::shared_ptr<const PagedKvCache> kv,
             int64_t lease_ms, TransferCallback done);
  KvTransport* ByName(const std::string& name) const;
  KvPeerInfo EffectiveLocal() const;  // local with the transports lacking an object removed

  const RoutingKvTransportOptions options_;
  std::unique_ptr<KvTransport> tcp_, cuda_ipc_, nccl_;
  // The peer cache and the count of running lookups, shared with lookup threads and transfer
  // callbacks (a transfer may end after this object is gone).
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace dgserve::kv
