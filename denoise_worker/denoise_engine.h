// The denoise worker's scheduler (design §1.3, §3 "Scheduler"): one engine thread owns the model
// and runs continuous batching — the canvases of all admitted requests go through one batched
// decoder pass per step, each with its own step counter, temperature schedule,
// self-conditioning input and stop state; a request joins when its prompt KV has arrived and
// leaves when it finishes or is cancelled; commit passes of several requests run as one batched
// encoder pass. RPC handlers only enqueue (bounded) and read their request's event queue.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/limits.h"
#include "denoise_worker/denoise_metrics.h"
#include "dgserve/v1/worker.pb.h"
#include "engine/denoise/canvas_state.h"
#include "engine/model/backend.h"
#include "engine/tokenizer/tokenizer.h"
#include "kvstore/block_pool.h"
#include "kvstore/transfer.h"

namespace dgserve {

struct PartsRun;

// One request as the RPC handler and the engine share it. The engine pushes events; the
// handler pops them and writes them to the stream. Thread-safe.
class DenoiseJob {
 public:
  explicit DenoiseJob(v1::DenoiseRequest request)
      : request_(std::move(request)), created_(absl::Now()) {}

  const v1::DenoiseRequest& request() const { return request_; }
  const std::string& id() const { return request_.request_id(); }
  absl::Time created() const { return created_; }

  // Engine side: an event, or the end (OK after the Finished event, or the error).
  void Push(v1::DenoiseEvent event);
  void End(absl::Status status);
  bool ended() const;

  // Handler side: waits up to `timeout` for the next event. Returns true with `*event` set; or
  // false with `*final` set when the job ended and no events remain; or false with `*final`
  // untouched on timeout.
  bool Pop(v1::DenoiseEvent* event, std::optional<absl::Status>* final, absl::Duration timeout);

  // Asks the engine to end the job with `code` (CANCELLED, or DEADLINE_EXCEEDED when its
  // caller's deadline passed); the first request's code stays.
  void RequestCancel(absl::StatusCode code = absl::StatusCode::kCancelled) {
    absl::StatusCode none = absl::StatusCode::kOk;
    cancel_code_.compare_exchange_strong(none, code);
  }
  bool cancel_requested() const { return cancel_code_ != absl::StatusCode::kOk; }
  // The status a cancelled job ends with: "request ID cancelled" or "request ID: deadline
  // exceeded", with the code given to RequestCancel.
  absl::Status CancelStatus() const;

 private:
  const v1::DenoiseRequest request_;
  const absl::Time created_;
  std::atomic<absl::StatusCode> cancel_code_{absl::StatusCode::kOk};
  mutable absl::Mutex mu_;
  std::deque<v1::DenoiseEvent> events_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> final_ ABSL_GUARDED_BY(mu_);
};

struct DenoiseEngineOptions {
  // Canvases in one decoder pass at most. Every sample of a request is one canvas: a request
  // with more samples than free slots is scheduled in parts (its samples join the batch as
  // slots free up, each independent of the others), so it neither exceeds the batch nor waits
  // for the whole batch to empty.
  int max_batch_canvases = 16;
  int max_queue = 256;          // requests waiting for KV or a batch slot, at most
  // How long a request waits for its prompt KV at most (the KV lease bound, the worker's
  // --max_kv_lease_ms): a request's kv_wait_ms is clamped to it, 0 or less means it.
  int64_t max_kv_wait_ms = 60000;
  // Admission by K/V memory: a sample joins the running ones only where the backend's K/V
  // memory holds them all at their next passes (ModelBackend::CheckKvFitsTogether: the CUDA
  // backend's device block pool at its bound), else it waits at the head of the queue (in order:
  // later ones wait behind it) until running samples end; alone it always joins. Off: every
  // sample joins while batch slots are free, and passes the memory refuses run in parts (still the
  // fallback when running sequences outgrow what their admission counted).
  bool admit_by_kv_memory = true;
  std::string model_id;
  // The model's tokenizer: with it the worker matches a request's stop_sequences itself and
  // ends a sample at the canvas whose text holds one (finished OK, "stop", no further step or
  // commit). Without it stop sequences are ignored here (the gateway cancels the sample).
  std::optional<Tokenizer> tokenizer;
};

struct DenoiseEngineStats {
  int active_canvases = 0;
  int queued = 0;         // waiting for KV or for a batch slot
  int active_requests = 0;  // distinct requests among the running canvases
  // Steps and commit passes the backend refused with RESOURCE_EXHAUSTED (out of K/V memory: the
  // CUDA backend's device block pool full) and ran in parts, since the engine started.
  int64_t passes_in_parts = 0;
  // The most canvases a step takes while the device's K/V memory holds no more (the largest part
  // that ran after a refusal; 0: no limit): lifted when a sample ends.
  int device_step_limit = 0;
  // Samples waiting in the queue because the K/V memory would not hold the first of them beside
  // the running ones (DenoiseEngineOptions::admit_by_kv_memory), at the last admission.
  int held_for_kv_memory = 0;
};

class DenoiseEngine {
 public:
  // backend, pool and receiver must outlive the engine; metrics may be null.
  DenoiseEngine(ModelBackend* backend, kv::BlockPool* pool, kv::KvReceiver* receiver,
                DenoiseEngineOptions options, DenoiseMetrics* metrics);
  ~DenoiseEngine();  // cancels everything and joins the engine thread

  // Validates the request (sampler settings, lengths, num_samples in [0, kMaxSamplesPerRequest])
  // and queues it until its prompt KV arrives through the receiver; then its num_samples
  // samples (sample i drawing with seed + i) run on forks of that KV that share its whole
  // blocks. Every event names its sample; each sample ends with its own Finished and the job
  // ends after the last. INVALID_ARGUMENT for a bad request, OUT_OF_RANGE for one the K/V
  // memory can never hold (CheckFitsInPool), RESOURCE_EXHAUSTED when the queue is full,
  // UNAVAILABLE when draining, ALREADY_EXISTS for a duplicate id. A refused request's KV, if it
  // has arrived and nothing else waits for it, is freed (KvReceiver::Drop).
  absl::Status Submit(std::shared_ptr<DenoiseJob> job);
  // Cancels a request (all its samples) wherever it is; its blocks are freed before the next
  // step, and it is recorded with `code` (CANCELLED, or DEADLINE_EXCEEDED when the caller's
  // deadline passed). Returns whether it was known.
  bool Cancel(const std::string& request_id,
              absl::StatusCode code = absl::StatusCode::kCancelled);
  // Stops admitting (Submit → UNAVAILABLE); running requests continue.
  void SetDraining(bool draining) { draining_ = draining; }
  bool draining() const { return draining_; }

  DenoiseEngineStats stats() const;

 private:
  struct Running;
  void OnKv(const std::string& id, absl::StatusOr<std::unique_ptr<kv::PagedKvCache>> kv);
  void Loop();
  // One scheduling iteration over the admitted samples: cancellations, the batched commit
  // pass, canvas starts, one batched denoising step, then events and ended samples.
  // dgserve_denoise_queue_depth = requests waiting for KV + waiting for a batch slot.
  // OUT_OF_RANGE, naming the field, when the pool's full-attention blocks (all of them) can never
  // hold the request (its prompt and samples when the KV arrives, or one sample's prompt and
  // committed canvases at max_new_tokens), or the backend's own K/V memory one sample at its
  // largest (ModelBackend::CheckKvFits: the CUDA backend's device pool at its bound).
  absl::Status CheckFitsInPool(const v1::DenoiseRequest& r) const;
  // Submit's checks and queueing (Submit drops a refused request's KV).
  absl::Status Admit(const std::shared_ptr<DenoiseJob>& job);
  // Whether the backend's K/V memory holds `next` beside the running samples, each at its next
  // passes (admit_by_kv_memory).
  bool FitsInKvMemoryBeside(const std::vector<std::unique_ptr<Running>>& running,
                            const Running& next) const;
  void UpdateQueueGauge() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Iterate(std::vector<std::unique_ptr<Running>>& running);
  // The commit passes due (spec §4.1 step 3a) as one batched encoder pass.
  void CommitCanvases(std::vector<std::unique_ptr<Running>>& running);
  // A pass of `n` inputs that ran in parts (RunInParts): counts it and says so in the log.
  // `pass`: "denoising step" or "commit pass".
  void CountPassInParts(const char* pass, size_t n, const PartsRun& run);
  // After a sample's step: metrics and, every canvas_step_interval steps, its step event.
  void ReportStep(Running& r, const StepOutcome& out, absl::Time now);
  // A sample's canvas is done: its block event, then its Finished when it was the last.
  void EndCanvas(Running& r, absl::Time now);
  // Ends sample `r`: OK ends the job once its last sample is done; an error ends the job (and
  // so its other samples) at once. A job already ended is left as it is.
  void FinishJob(Running& r, absl::Status status);

  ModelBackend* const backend_;
  kv::BlockPool* const pool_;
  kv::KvReceiver* const receiver_;
  const DenoiseEngineOptions options_;
  DenoiseMetrics* const metrics_;
  std::atomic<bool> draining_{false};

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Submitted, waiting for KV.
  std::unordered_map<std::string, std::shared_ptr<DenoiseJob>> waiting_ ABSL_GUARDED_BY(mu_);
  // KV arrived, waiting for a batch slot.
  std::deque<std::unique_ptr<Running>> ready_ ABSL_GUARDED_BY(mu_);
  // All jobs by id (waiting, ready or running), for Cancel.
  std::unordered_map<std::string, std::shared_ptr<DenoiseJob>> all_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> active_canvases_{0};
  std::atomic<int> active_requests_{0};
  std::atomic<int64_t> passes_in_parts_{0};
  // DenoiseEngineStats::device_step_limit: written by the engine thread.
  std::atomic<int> device_step_limit_{0};
  std::atomic<int> held_for_kv_memory_{0};  // DenoiseEngineStats::held_for_kv_memory
  std::thread thread_;
};

}  // namespace dgserve
