#include "prefill_worker/prefill_engine.h"

#include <algorithm>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "kvstore/paged_kv_cache.h"
#include "kvstore/transport_selection.h"
#include "worker/kv_admission.h"
#include "worker/run_in_parts.h"

namespace dgserve {

struct PrefillEngine::Job {
  v1::PrefillRequest request;
  Callback done;
  absl::Time created;
  absl::Time started;  // first encoder step (or ship, when fully cached)
  std::shared_ptr<kv::PagedKvCache> kv;
  int cached_tokens = 0;
  std::atomic<bool> cancelled{false};
  // Why Cancel cancelled it (the first Cancel's code); OK until then, and for the engine's own
  // cancellations.
  std::atomic<absl::StatusCode> cancel_code{absl::StatusCode::kOk};
  // The status a job cancelled by Cancel ends with.
  absl::Status CancelStatus() const {
    const std::string& id = request.request_id();
    return cancel_code == absl::StatusCode::kDeadlineExceeded
               ? absl::DeadlineExceededError(absl::StrCat("prefill of ", id, ": deadline exceeded"))
               : absl::CancelledError(absl::StrCat("prefill of ", id, " cancelled"));
  }
  std::atomic<bool> finished{false};
  double encode_seconds = 0;
  // Its KV push (Ship): when it began, and while the target's pool is full, until when it
  // waits for room (InfinitePast: it has not waited) and the delay before the next push.
  absl::Time ship_started;
  absl::Time wait_until = absl::InfinitePast();
  absl::Duration backoff = absl::ZeroDuration();

  void Complete(absl::StatusOr<v1::PrefillResponse> r) {
    if (finished.exchange(true)) return;
    done(std::move(r));
  }
};

PrefillEngine::PrefillEngine(ModelBackend* backend, kv::BlockPool* pool,
                             std::unique_ptr<kv::KvTransport> transport,
                             PrefillEngineOptions options, PrefillMetrics* metrics,
                             KvMetrics* kv_metrics)
    : backend_(backend),
      pool_(pool),
      transport_(std::move(transport)),
      transport_name_(transport_->name()),
      options_(options),
      metrics_(metrics),
      kv_metrics_(kv_metrics),
      thread_([this] { Loop(); }) {}

PrefillEngine::~PrefillEngine() {
  std::vector<std::shared_ptr<Job>> left;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, job] : all_) left.push_back(job);
    all_.clear();
    queue_.clear();
    retries_.clear();
    retrying_.clear();
  }
  for (auto& job : left) job->Complete(absl::UnavailableError("prefill worker shutting down"));
}

absl::Status PrefillEngine::Submit(const v1::PrefillRequest& request, Callback done) {
  if (draining_) return absl::UnavailableError("prefill worker is draining");
  const ModelConfig& c = backend_->config();
  if (request.request_id().empty()) {
    return absl::InvalidArgumentError("request_id: must not be empty");
  }
  if (request.tokens().empty()) return absl::InvalidArgumentError("tokens: must not be empty");
  if (request.tokens_size() > c.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: ", request.tokens_size(), " exceed the context limit of ",
                     c.max_position_embeddings));
  }
  for (int32_t id : request.tokens()) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens: id ", id, " is outside [0, ", c.vocab_size, ")"));
    }
  }
  if (request.lease_ms() < 0) {
    return absl::InvalidArgumentError("lease_ms: must be >= 0 (0: the worker's default)");
  }
  // A prompt the KV pool can never hold is refused now, as OUT_OF_RANGE (HTTP 400), rather than
  // failing in its first step as RESOURCE_EXHAUSTED (HTTP 429, which clients retry): the full
  // layers keep every position, the sliding ones at least the first chunk's.
  {
    const kv::KvLayout& layout = pool_->layout();
    const kv::PoolStats stats = pool_->stats();
    const int n = request.tokens_size();
    const struct {
      int index;
      int tokens;
      const char* what;
    } needs[] = {
        {int(kv::LayerKind::kFull), n, "full-attention"},
        {int(kv::LayerKind::kSliding), std::min(n, options_.chunk_tokens), "sliding-window"}};
    for (const auto& need : needs) {
      if (layout.layers[need.index] == 0) continue;
      const int blocks = layout.BlocksFor(need.tokens);
      if (blocks > stats.total[need.index]) {
        return absl::OutOfRangeError(absl::StrCat(
            "tokens: a prompt of ", n, " tokens needs ", blocks, " ", need.what, " KV blocks of ",
            layout.block_size, " tokens; this prefill worker's KV pool holds ",
            stats.total[need.index], " in all (--kv_cache_mib)"));
      }
    }
  }
  // The same against the K/V memory the backend bounds itself (the CUDA backend's device pool):
  // the prompt's chunks on a cache of this pool (its sliding rows kept), none cached.
  {
    const kv::PagedKvCache like(pool_, c.max_position_embeddings);
    KvPassPlan plan;
    plan.positions = request.tokens_size();
    plan.pass_tokens = options_.chunk_tokens;
    if (absl::Status s = backend_->CheckKvFits(like, plan); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("tokens: ", s.message()));
    }
  }
  if (request.kv_target().empty()) {
    return absl::InvalidArgumentError("kv_target: must name the denoise worker");
  }
  if (options_.check_kv_target) {
    if (absl::Status s = options_.check_kv_target(request.kv_target()); !s.ok()) return s;
  }
  auto job = std::make_shared<Job>();
  job->request = request;
  job->done = std::move(done);
  job->created = absl::Now();
  absl::MutexLock lock(&mu_);
  if (int(all_.size()) >= options_.max_queue) {
    return absl::ResourceExhaustedError(
        absl::StrCat("prefill worker queue is full (", all_.size(), " requests)"));
  }
  if (!all_.emplace(request.request_id(), job).second) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request.request_id(), " is already being prefilled"));
  }
  queue_.push_back(job);
  if (metrics_) metrics_->queue_depth.Set(double(all_.size()));
  return absl::OkStatus();
}

bool PrefillEngine::Cancel(const std::string& request_id, absl::StatusCode code) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = all_.find(request_id);
    if (it == all_.end()) return false;
    job = it->second;
  }
  absl::StatusCode none = absl::StatusCode::kOk;
  job->cancel_code.compare_exchange_strong(none, code);  // the first reason stays
  job->cancelled = true;
  return true;
}

PrefillEngineStats PrefillEngine::stats() const {
  PrefillEngineStats s;
  s.active = active_;
  s.transferring = transferring_;
  s.passes_in_parts = passes_in_parts_;
  s.held_for_kv_memory = held_for_kv_memory_;
  s.kv_push_waits = kv_push_waits_;
  absl::MutexLock lock(&mu_);
  s.queued = int(queue_.size());
  s.transferring += int(retries_.size());  // waiting for room on their target
  return s;
}

void PrefillEngine::Fail(Job& job, absl::Status status) {
  if (metrics_) {
    metrics_->RequestsWithStatus(absl::StatusCodeToString(status.code())).Increment();
  }
  job.kv.reset();
  {
    absl::MutexLock lock(&mu_);
    all_.erase(job.request.request_id());
    if (metrics_) metrics_->queue_depth.Set(double(all_.size()));
  }
  job.Complete(std::move(status));
}

void PrefillEngine::Loop() {
  std::vector<std::shared_ptr<Job>> active;
  for (;;) {
    std::vector<Retry> due;  // pushes to retry now
    {
      absl::MutexLock lock(&mu_);
      // Wait for a prompt, or for the first retry's time.
      while (!stop_ && active.empty() && queue_.empty()) {
        absl::Time next = absl::InfiniteFuture();
        for (const Retry& r : retries_) {
          if (!retrying_.contains(r.job->request.kv_target())) next = std::min(next, r.at);
        }
        if (next <= absl::Now()) break;
        const int64_t events = retry_events_;
        auto woken = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return stop_ || !queue_.empty() || retry_events_ != events;
        };
        mu_.AwaitWithDeadline(absl::Condition(&woken), next);
      }
      if (stop_) break;
      const absl::Time now = absl::Now();
      std::erase_if(retries_, [&](Retry& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (r.at > now || !retrying_.insert(r.job->request.kv_target()).second) return false;
        due.push_back(std::move(r));
        return true;
      });
      // Admit in arrival order while the step's token budget is not yet spoken for.
      int planned = 0;
      for (auto& j : active) {
        planned += std::min<int>(options_.chunk_tokens,
                                 j->request.tokens_size() - j->kv->num_tokens());
      }
      // Cancelled prompts leave the queue at once, wherever they wait (the next step drops them
      // and replies), not when they reach its head: nothing of theirs is counted.
      std::erase_if(queue_, [&](const std::shared_ptr<Job>& j) {
        const bool cancelled = j->cancelled;  // read once: set from other threads
        if (cancelled) active.push_back(j);
        return cancelled;
      });
      int held = 0;
      while (!queue_.empty() && planned < options_.step_token_budget) {
        // And while the backend's K/V memory holds every running prompt and this one whole.
        if (!active.empty() && options_.admit_by_kv_memory && !queue_.front()->cancelled &&
            !FitsInKvMemoryBeside(active, *queue_.front())) {
          held = int(queue_.size());
          break;
        }
        active.push_back(queue_.front());
        queue_.pop_front();
        planned += options_.chunk_tokens;
      }
      held_for_kv_memory_ = held;
      if (metrics_) metrics_->queued_for_kv_memory.Set(double(held));
    }
    for (Retry& r : due) {
      if (r.job->cancelled) {
        EndRetry(r.job->request.kv_target());
        Fail(*r.job, r.job->CancelStatus());
      } else {
        Push(std::move(r.job), std::move(r.kv), /*retry=*/true);
      }
    }
    due.clear();
    // New jobs: look up the prefix cache and set up their KV.
    for (auto& j : active) {
      if (j->kv || j->cancelled) continue;  // a cancelled one leaves in Step without its KV
      j->started = absl::Now();
      const auto& t = j->request.tokens();
      const std::span<const int32_t> tokens(t.data(), size_t(t.size()));
      // A hit is used at any KV block boundary: the encoder computes every prompt row's KV bit for
      // bit whatever the chunks and the batch (engine/cpu/cpu_backend.cc), so a cached prompt
      // gets the tokens of a cold one.
      kv::PrefixMatch match = pool_->MatchPrefix(tokens);
      j->cached_tokens = match.num_tokens;
      j->kv = std::shared_ptr<kv::PagedKvCache>(
          kv::PagedKvCache::FromPrefix(pool_, std::move(match), int(tokens.size())));
    }
    active_ = int(active.size());
    Step(active);
    active_ = int(active.size());
  }
}

bool PrefillEngine::FitsInKvMemoryBeside(const std::vector<std::shared_ptr<Job>>& active,
                                         const Job& next) const {
  // A prompt not yet looked up in the prefix cache: as a cold one on a cache of this pool.
  const kv::PagedKvCache cold(pool_, backend_->config().max_position_embeddings);
  std::vector<KvSequencePlan> plans;
  const auto add = [&](const Job& j) {
    KvSequencePlan p;
    p.like = j.kv != nullptr ? static_cast<const KvCache*>(j.kv.get()) : &cold;
    p.plan.first = j.kv != nullptr ? j.cached_tokens : 0;
    p.plan.positions = j.request.tokens_size();
    p.plan.pass_tokens = options_.chunk_tokens;
    plans.push_back(p);
  };
  for (const auto& j : active) {
    if (!j->cancelled && !j->finished) add(*j);
  }
  add(next);
  return KvFitsTogether(*backend_, plans);
}

void PrefillEngine::Step(std::vector<std::shared_ptr<Job>>& active) {
  // Cancelled jobs leave; finished ones ship.
  std::vector<std::shared_ptr<Job>> ship;
  const size_t before = active.size();
  std::erase_if(active, [&](std::shared_ptr<Job>& j) {
    if (j->cancelled) {
      Fail(*j, j->CancelStatus());
      return true;
    }
    if (j->kv->num_tokens() == j->request.tokens_size()) {
      ship.push_back(j);
      return true;
    }
    return false;
  });
  for (auto& j : ship) Ship(j);
  if (active.size() < before) step_limit_ = 0;  // a prompt left: its device memory is free
  if (active.empty()) return;

  // One encoder step: a chunk of each running prompt, within the token budget.
  std::vector<EncodeInput> batch;
  std::vector<Job*> in_batch;
  int budget = options_.step_token_budget;
  for (auto& j : active) {
    // After a refused pass, at most as many prompts as its largest part that ran (in admission
    // order), so overlapping prompts do not swap each other off the device at every chunk.
    if (step_limit_ > 0 && int(batch.size()) >= step_limit_) break;
    const int done = j->kv->num_tokens();
    // The next chunk of this request, if the step still has room for it.
    const int n = std::min(options_.chunk_tokens, j->request.tokens_size() - done);
    if (n > budget) continue;
    budget -= n;
    batch.push_back(EncodeInput{
        std::span<const int32_t>(j->request.tokens().data() + done, size_t(n)), j->kv.get()});
    in_batch.push_back(j.get());
    if (metrics_) metrics_->chunk_tokens.Observe(n);
  }
  const int step_tokens = options_.step_token_budget - budget;
  const absl::Time t0 = absl::Now();
  // Refused for want of K/V memory (the CUDA backend's device pool at its bound): in halves.
  const PartsRun run =
      RunInParts(std::span<const EncodeInput>(batch),
                 [&](std::span<const EncodeInput> b) { return backend_->Encode(b); });
  if (run.parts > 0) {
    ++passes_in_parts_;
    if (metrics_) metrics_->passes_in_parts.Increment();
    if (run.largest > 0) step_limit_ = int(run.largest);
    DGSERVE_LOG_WARNING(
        "encoder pass of %zu prompts refused (out of K/V memory), run again as %d smaller "
        "passes; the largest that ran took %zu",
        batch.size(), run.parts, run.largest);
  }
  const std::vector<absl::Status>& status = run.status;
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  int computed = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (status[i].ok()) computed += int(batch[i].tokens.size());
  }
  if (metrics_) {
    metrics_->step_seconds.Observe(secs);
    metrics_->step_tokens.Observe(step_tokens);
    metrics_->computed_tokens.Increment(computed);
    if (secs > 0 && computed > 0) metrics_->tokens_per_second.Set(computed / secs);
  }
  for (Job* j : in_batch) j->encode_seconds += secs;
  // A failed pass: which of its caches advanced is not known, so each of its requests fails
  // (a part that ran is unaffected). RESOURCE_EXHAUSTED: a prompt that did not fit even alone.
  bool failed = false;
  for (size_t i = 0; i < in_batch.size(); ++i) {
    const absl::Status& st = status[i];
    if (st.ok()) continue;
    Job* j = in_batch[i];
    j->cancelled = true;  // leaves at the next step
    failed = true;
    if (absl::IsResourceExhausted(st)) {
      Fail(*j,
           absl::ResourceExhaustedError(absl::StrCat("prefill KV cache exhausted for request ",
                                                     j->request.request_id(), ": ", st.message())));
    } else {
      Fail(*j, absl::InternalError(absl::StrCat("encoder pass failed: ", st.message())));
    }
  }
  if (failed) {
    std::erase_if(active, [](std::shared_ptr<Job>& j) { return j->finished.load(); });
    step_limit_ = 0;  // they left: their device memory is free
  }
}

void PrefillEngine::Ship(std::shared_ptr<Job> job) {
  const auto& t = job->request.tokens();
  // A device backend may hold the prompt's newest K/V rows in device memory only: they reach the
  // host blocks before the blocks are indexed for reuse and sent.
  if (absl::Status st = backend_->SyncKvToHost(*job->kv); !st.ok()) {
    Fail(*job,
         absl::Status(st.code(), absl::StrCat("prompt K/V to the host failed for request ",
                                              job->request.request_id(), ": ", st.message())));
    return;
  }
  pool_->InsertPrefix(std::span<const int32_t>(t.data(), size_t(t.size())), job->kv->table());
  job->ship_started = absl::Now();
  std::shared_ptr<const kv::PagedKvCache> kv = job->kv;
  job->kv.reset();
  Push(std::move(job), std::move(kv), /*retry=*/false);
}

void PrefillEngine::EndRetry(const std::string& target) {
  absl::MutexLock lock(&mu_);
  retrying_.erase(target);
  ++retry_events_;
}

bool PrefillEngine::ScheduleRetry(const std::shared_ptr<Job>& job,
                                  const std::shared_ptr<const kv::PagedKvCache>& kv) {
  if (options_.kv_push_wait_ms <= 0 || job->cancelled) return false;
  const absl::Time now = absl::Now();
  if (job->wait_until == absl::InfinitePast()) {
    job->wait_until = now + absl::Milliseconds(options_.kv_push_wait_ms);
    job->backoff = absl::Milliseconds(10);
    ++kv_push_waits_;
    if (metrics_) metrics_->kv_push_waits.Increment();
    DGSERVE_LOG_INFO(
        "request %s: the KV pool of %s is full; the KV waits for room (at most %lld ms)",
        job->request.request_id(), job->request.kv_target(),
        static_cast<long long>(options_.kv_push_wait_ms));
  } else {
    job->backoff = std::min(job->backoff * 2, absl::Milliseconds(250));
  }
  if (now >= job->wait_until) return false;
  absl::MutexLock lock(&mu_);
  if (stop_) return false;
  retries_.push_back(Retry{std::min(now + job->backoff, job->wait_until), job, kv});
  ++retry_events_;
  return true;
}

void PrefillEngine::Push(std::shared_ptr<Job> job, std::shared_ptr<const kv::PagedKvCache> kv,
                         bool retry) {
  const absl::Time t0 = job->ship_started;
  const int64_t lease =
      std::min(job->request.lease_ms() > 0 ? job->request.lease_ms() : options_.default_lease_ms,
               options_.max_lease_ms);
  ++transferring_;
  const std::string target = job->request.kv_target();
  const std::string id = job->request.request_id();
  transport_->Send(
      target, id, kv, lease,
      [this, job, kv, t0, retry, target](absl::StatusOr<kv::TransferResult> result) mutable {
        --transferring_;
        if (retry) EndRetry(target);
        // Kept for another push, else released before the request ends (the transport may
        // destroy this callback later, when the pool may be gone).
        std::shared_ptr<const kv::PagedKvCache> keep = std::move(kv);
        if (!result.ok()) {
          // A request the client cancelled or let expire is not a transfer failure.
          const absl::Status& st = result.status();
          const bool client_ended =
              job->cancelled || absl::IsCancelled(st) || absl::IsDeadlineExceeded(st);
          // The target's pool is full now: its blocks free as its requests finish, so the KV
          // (kept here) is pushed again, never in part (the refused push freed what it took).
          const bool pool_full = !client_ended && kv::IsKvPoolFull(st);
          if (pool_full && ScheduleRetry(job, keep)) return;
          keep.reset();
          if (kv_metrics_ && !client_ended) {
            kv_metrics_->RecordTransferFailure(kv::FailedKvTransport(st, transport_name_));
          }
          // The cause once (each transfer layer names the request and target in front of it).
          std::string cause = kv::TransferFailureCause(st.message());
          if (pool_full) {
            absl::string_view rest = cause;
            absl::ConsumePrefix(&rest, kv::kKvPoolFull);
            cause = job->wait_until == absl::InfinitePast()
                        ? absl::StrCat("denoise worker KV cache full: ", rest)
                        : absl::StrCat("denoise worker KV cache still full after waiting ",
                                       options_.kv_push_wait_ms, " ms (--kv_push_wait_ms): ", rest);
          } else if (kv::IsKvPushLimit(st)) {
            // Not retried: the limit keeps an unresponsive target from holding this worker's
            // KV pool (its pushes run until their lease ends); the client may retry (429).
            absl::string_view rest = cause;
            absl::ConsumePrefix(&rest, kv::kKvPushLimit);
            cause = absl::StrCat(
                "this prefill worker's limit of KV pushes to one target "
                "(--max_kv_pushes_per_target): ",
                rest);
          }
          // Recorded as the client's end when the client ended it (the transfer may have been
          // cut for that reason before this worker's own call noticed).
          Fail(*job, absl::Status(job->cancelled ? job->CancelStatus().code() : st.code(),
                                  absl::StrCat("KV transfer to ", job->request.kv_target(),
                                               " failed: ", cause)));
          return;
        }
        keep.reset();
        // The transport that moved the bytes (a routing transport names it per transfer).
        const std::string used =
            result->transport.empty() ? transport_name_ : result->transport;
        if (kv_metrics_) kv_metrics_->RecordTransfer(used, result->bytes, result->seconds);
        v1::PrefillResponse r;
        r.set_prompt_tokens(job->request.tokens_size());
        r.set_cached_tokens(job->cached_tokens);
        r.set_queue_seconds(absl::ToDoubleSeconds(job->started - job->created));
        r.set_prefill_seconds(job->encode_seconds);
        r.set_transfer_seconds(absl::ToDoubleSeconds(absl::Now() - t0));
        r.set_transfer_bytes(result->bytes);
        r.set_transport(used);
        // Cached tokens count once the prefill that reused them is served (a failed or
        // cancelled one reused nothing for anyone).
        if (kv_metrics_) kv_metrics_->RecordPrefixHit(job->cached_tokens);
        if (metrics_) {
          metrics_->cached_tokens.Increment(double(job->cached_tokens));
          metrics_->RequestsWithStatus("OK").Increment();
          metrics_->request_seconds.Observe(absl::ToDoubleSeconds(t0 - job->created));
        }
        {
          absl::MutexLock lock(&mu_);
          all_.erase(job->request.request_id());
          if (metrics_) metrics_->queue_depth.Set(double(all_.size()));
        }
        job->Complete(std::move(r));
      });
}

}  // namespace dgserve
