// The prefill worker's scheduler (design §1.2): one engine thread runs chunked prefill — each
// step is one batched encoder pass over chunks of several requests under a token budget —
// reusing KV blocks whose token prefix is already cached, then ships each finished prompt's KV
// to the denoise worker the request names. RPC handlers only enqueue (bounded).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "dgserve/v1/worker.pb.h"
#include "engine/model/backend.h"
#include "kvstore/block_pool.h"
#include "kvstore/transfer.h"
#include "prefill_worker/prefill_metrics.h"
#include "worker/kv_metrics.h"

namespace dgserve {

struct PrefillEngineOptions {
  int chunk_tokens = 512;      // prompt tokens of one request per encoder step at most
  int step_token_budget = 2048;  // prompt tokens of all requests per encoder step at most
  int max_queue = 256;         // requests queued or running at most
  int64_t default_lease_ms = 30000;
  int64_t max_lease_ms = 60000;  // a request's lease_ms above this is clamped to it
  // How long a finished prompt's KV waits for room when the denoise worker refuses it for want
  // of free blocks now (kv::IsKvPoolFull): the KV is kept and pushed again with a backoff
  // (10 ms doubling to 250 ms) until blocks are freed, the request is cancelled or its deadline
  // passes, or this much time went by (then RESOURCE_EXHAUSTED). 0: fails at once.
  int64_t kv_push_wait_ms = 30000;
  // Checks a request's kv_target before it is queued (the allow-list of denoise workers): an
  // error is returned from Submit and nothing is dialled. Empty: every target is accepted.
  std::function<absl::Status(const std::string& target)> check_kv_target;
  // Admission by K/V memory: a queued prompt starts only where the backend's K/V memory holds it
  // whole beside the running prompts, each at its largest chunk
  // (ModelBackend::CheckKvFitsTogether: the CUDA backend's device block pool at its bound), else
  // it and those behind it wait until a prompt ships; alone it always starts. Off: prompts start
  // by the token budget only, and passes the memory refuses run in parts.
  bool admit_by_kv_memory = true;
};

struct PrefillEngineStats {
  int queued = 0;
  int active = 0;  // being encoded
  int transferring = 0;
  // Encoder passes the backend refused with RESOURCE_EXHAUSTED (out of K/V memory: the CUDA
  // backend's device block pool full) and ran in parts, since the engine started.
  int64_t passes_in_parts = 0;
  // Prompts whose KV push found the denoise worker's pool full and waited for room (each
  // counted once, however many times it was pushed again), since the engine started.
  int64_t kv_push_waits = 0;
  // Prompts waiting in the queue because the K/V memory would not hold the first of them beside
  // the running ones (PrefillEngineOptions::admit_by_kv_memory), at the last admission.
  int held_for_kv_memory = 0;
};

class PrefillEngine {
 public:
  using Callback = std::function<void(absl::StatusOr<v1::PrefillResponse>)>;

  // backend and pool must outlive the engine; metrics may be null.
  PrefillEngine(ModelBackend* backend, kv::BlockPool* pool,
                std::unique_ptr<kv::KvTransport> transport, PrefillEngineOptions options,
                PrefillMetrics* metrics, KvMetrics* kv_metrics);
  ~PrefillEngine();  // fails queued requests with UNAVAILABLE, joins the engine thread

  // Queues a prompt. `done` runs exactly once (on the engine or a transport thread) after the
  // KV was acknowledged by the target, or with the error. Synchronous errors (nothing queued,
  // `done` not called): INVALID_ARGUMENT (empty prompt, id out of range, no target),
  // OUT_OF_RANGE (a prompt the host KV pool or the backend's own K/V memory, CheckKvFits, can
  // never hold), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (draining), ALREADY_EXISTS. An
  // encoder pass the backend refuses for want of K/V memory runs again in halves; a prompt that
  // does not fit alone then fails with RESOURCE_EXHAUSTED.
  absl::Status Submit(const v1::PrefillRequest& request, Callback done);
  // Cancels a queued or running prefill (done gets `code`: CANCELLED, or DEADLINE_EXCEEDED
  // when the caller's deadline passed, and the request is recorded so; blocks are freed). A
  // transfer in flight finishes or fails on its own.
  bool Cancel(const std::string& request_id,
              absl::StatusCode code = absl::StatusCode::kCancelled);
  void SetDraining(bool draining) { draining_ = draining; }
  bool draining() const { return draining_; }
  PrefillEngineStats stats() const;
  const std::string& transport_name() const { return transport_name_; }

 private:
  struct Job;
  void Loop();
  void Step(std::vector<std::shared_ptr<Job>>& active);
  // Whether the backend's K/V memory holds `next`'s whole prompt beside the running prompts'
  // (admit_by_kv_memory).
  bool FitsInKvMemoryBeside(const std::vector<std::shared_ptr<Job>>& active, const Job& next) const;
  void Ship(std::shared_ptr<Job> job);
  // One push of the job's KV to its target; a refusal for want of free blocks there schedules
  // another (retries_) while the job's wait allows. `retry`: one from retries_ (its target is
  // in retrying_ until it ends).
  void Push(std::shared_ptr<Job> job, std::shared_ptr<const kv::PagedKvCache> kv, bool retry);
  void EndRetry(const std::string& target);
  // Whether a push the target refused as full is pushed again (then it is scheduled).
  bool ScheduleRetry(const std::shared_ptr<Job>& job,
                     const std::shared_ptr<const kv::PagedKvCache>& kv);
  void Fail(Job& job, absl::Status status);

  ModelBackend* const backend_;
  kv::BlockPool* const pool_;
  std::unique_ptr<kv::KvTransport> transport_;
  const std::string transport_name_;
  const PrefillEngineOptions options_;
  PrefillMetrics* const metrics_;
  KvMetrics* const kv_metrics_;
  std::atomic<bool> draining_{false};
  std::atomic<int> transferring_{0};
  std::atomic<int> active_{0};
  std::atomic<int64_t> passes_in_parts_{0};
  std::atomic<int64_t> kv_push_waits_{0};
  std::atomic<int> held_for_kv_memory_{0};  // PrefillEngineStats::held_for_kv_memory
  // Engine thread only: after a pass refused for want of K/V memory, the most prompts a step
  // takes (its largest part that ran; 0: no limit) until a prompt leaves (shipped or failed).
  int step_limit_ = 0;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<std::string, std::shared_ptr<Job>> all_ ABSL_GUARDED_BY(mu_);
  // Pushes waiting for room on their denoise worker, each pushed again by the engine thread at
  // its time.
  struct Retry {
    absl::Time at;
    std::shared_ptr<Job> job;
    std::shared_ptr<const kv::PagedKvCache> kv;
  };
  std::vector<Retry> retries_ ABSL_GUARDED_BY(mu_);
  // Targets with a retried push in flight: one at a time per target, so that waiting pushes do
  // not each take part of the freed blocks and all fail again (each gets the room in turn).
  std::set<std::string> retrying_ ABSL_GUARDED_BY(mu_);
  int64_t retry_events_ ABSL_GUARDED_BY(mu_) = 0;  // retries scheduled or ended (wakes Loop)
  std::thread thread_;
};

}  // namespace dgserve
