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
#include <vector>

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
  int inflight = 0;  // requests this gateway has sent and not finished
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

  // Chooses an endpoint among the healthy, not excluded ones; nullopt when there is none.
  // Prefill: rendezvous hash of `affinity_key` (the first block of prompt tokens) unless that
  // endpoint's queue is much longer than the shortest; denoise (`affinity_key` 0): fewest
  // (active canvases + queued + in-flight) per batch slot, then most free full KV blocks.
  std::optional<std::string> Pick(uint64_t affinity_key, const std::set<std::string>& exclude);
  std::shared_ptr<grpc::Channel> Channel(const std::string& address);
  // Book-keeping of this gateway's in-flight requests per endpoint (for load between polls).
  void Acquire(const std::string& address);
  void Release(const std::string& address);
  // Marks an endpoint unhealthy at once (a call to it failed with UNAVAILABLE: `cause`). The
  // change is logged once, naming the worker and the cause, as the polls log theirs: a worker
  // already unhealthy is not logged again.
  void MarkUnhealthy(const std::string& address, const std::string& cause);

  int healthy_count() const;
  int total_count() const;
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
  absl::Time last_resolve_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::atomic<bool> stop_{false};
  absl::Duration interval_;
  std::thread thread_;
};

}  // namespace dgserve
