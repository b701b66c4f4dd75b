// The gateway's view of its workers (design §1.1): endpoints given as host:port or as
// dns:///name:port (a headless Service resolving to every pod), re-resolved periodically; each
// endpoint's health and load from its Stats RPC; routing — prefill by prefix affinity then
// load, denoise by load (active canvases, queue) then free KV blocks.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/synchronization/mutex.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "service/address_list.h"  // SplitTargets

namespace dgserve {

struct WorkerEndpoint {
  std::string address;  // host:port as dialled (and as the KV target for denoise workers)
  std::shared_ptr<grpc::Channel> channel;
  bool healthy = false;
  v1::StatsResponse stats;
  int inflight = 0;       // requests this gateway has given this worker and not finished
  int missed_polls = 0;   // consecutive Stats polls that timed out
  bool polled = false;    // a Stats poll has judged it (the first one is logged either way)
};

// Stats polls in a row that may time out before a worker counts as unhealthy: a busy worker's
// slow answer is not a dead worker. A refused connection or a wrong answer counts at once.
inline constexpr int kMaxMissedPolls = 3;

class WorkerPool;

// One in-flight request counted against a worker by WorkerPool::Pick, released once: by
// Release() or at destruction. Movable.
class WorkerHold {
 public:
  WorkerHold() = default;
  WorkerHold(WorkerPool* pool, std::string address) : pool_(pool), address_(std::move(address)) {}
  WorkerHold(WorkerHold&& o) noexcept : pool_(std::exchange(o.pool_, nullptr)),
                                        address_(std::move(o.address_)) {}
  WorkerHold& operator=(WorkerHold&& o) noexcept {
    if (this != &o) {
      Release();
      pool_ = std::exchange(o.pool_, nullptr);
      address_ = std::move(o.address_);
    }
    return *this;
  }
  ~WorkerHold() { Release(); }
  void Release();

 private:
  WorkerPool* pool_ = nullptr;
  std::string address_;
};

// Makes the channel to one worker (with the internal credentials: InternalAuth::MakeChannel).
using ChannelFactory = std::function<std::shared_ptr<grpc::Channel>(
    const std::string& target, const grpc::ChannelArguments& args)>;

class WorkerPool {
 public:
  // `targets`: comma-separated host:port or dns:///host:port entries. `role`: "prefill" or
  // "denoise" (checked against Stats.role; a mismatch is unhealthy). `make_channel` dials a
  // worker; empty: plaintext without credentials (tests).
  WorkerPool(std::string role, std::vector<std::string> targets, std::string model_id,
             ChannelFactory make_channel = {});
  ~WorkerPool();

  // Starts polling (Stats every poll_interval, DNS every 5 s). The first poll runs before
  // Start returns.
  void Start(absl::Duration poll_interval = absl::Milliseconds(250));

  // Chooses an endpoint among the healthy, not excluded ones and counts one in-flight request
  // against it at once (the caller calls Release(address) once when the request is done with
  // it), so that a burst of picks between two polls spreads over the workers; nullopt when there
  // is none. Prefill: rendezvous hash of `affinity_key` (the first block of prompt tokens)
  // unless that endpoint's queue is much longer than the shortest; denoise (`affinity_key` 0):
  // fewest (active canvases + queued + in-flight) per batch slot, then most free full KV
  // blocks, then a random one of the equals.
  std::optional<std::string> Pick(uint64_t affinity_key, const std::set<std::string>& exclude);
  std::shared_ptr<grpc::Channel> Channel(const std::string& address);
  // Ends one in-flight request counted by Pick.
  void Release(const std::string& address);
  // Marks an endpoint unhealthy at once (a call to it failed with UNAVAILABLE: `cause`). The
  // change is logged once, naming the worker and the cause, as the polls log theirs: a worker
  // already unhealthy is not logged again.
  void MarkUnhealthy(const std::string& address, const std::string& cause);

  int healthy_count() const;
  int total_count() const;
  // One round of Stats polls now (Start's thread runs them every poll interval; tests call it).
  void PollNow() {
    Resolve();
    Poll();
  }
  // The KV layout `address` reported in its last Stats answer (Stats.kv_layout; empty when
  // unknown or from a worker that predates it).
  v1::KvDescriptor KvLayoutOf(const std::string& address) const;
  // (address, KV layout) of every healthy endpoint, in endpoint order.
  std::vector<std::pair<std::string, v1::KvDescriptor>> HealthyKvLayouts() const;
  // This gateway's in-flight requests on `address` (tests, metrics).
  int inflight(const std::string& address) const;
  const std::string& role() const { return role_; }

 private:
  void Resolve();
  void Poll();

  const std::string role_;
  const std::vector<std::string> targets_;
  const std::string model_id_;
  const ChannelFactory make_channel_;
  mutable absl::Mutex mu_;
  std::vector<WorkerEndpoint> endpoints_ ABSL_GUARDED_BY(mu_);
  absl::BitGen tie_breaker_ ABSL_GUARDED_BY(mu_);
  absl::Time last_resolve_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // dns:/// targets whose last resolution failed (logged when they enter and leave the set).
  std::set<std::string> unresolved_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  absl::Duration interval_;
  std::thread thread_;
};

// The first KV layout field (those kvstore CheckDescriptor compares) that differs between what
// prefill worker `prefill_address` sends and denoise worker `denoise_address` accepts, as
// "KV layout mismatch: prefill worker A has block_size 16, denoise worker B has block_size 7";
// empty when they agree or either layout is unknown (block_size 0: not polled yet, or a worker
// that predates Stats.kv_layout).
std::string KvLayoutMismatch(const std::string& prefill_address, const v1::KvDescriptor& prefill,
                             const std::string& denoise_address, const v1::KvDescriptor& denoise);
// The first mismatch (as above) between any healthy prefill worker and any healthy denoise
// worker of the two pools; empty when all agree.
std::string KvLayoutMismatch(const WorkerPool& prefill, const WorkerPool& denoise);

}  // namespace dgserve
