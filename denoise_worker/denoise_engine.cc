#include "denoise_worker/denoise_engine.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <span>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/limits.h"
#include "common/logging.h"
#include "engine/denoise/sampler_params.h"
#include "engine/generation/sample_run.h"
#include "engine/model/config.h"
#include "kvstore/paged_kv_cache.h"
#include "service/canvas_template_proto.h"
#include "worker/kv_admission.h"
#include "worker/run_in_parts.h"

namespace dgserve {

void DenoiseJob::Push(v1::DenoiseEvent event) {
  absl::MutexLock lock(&mu_);
  if (!final_) events_.push_back(std::move(event));
}

void DenoiseJob::End(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (!final_) final_ = std::move(status);
}

absl::Status DenoiseJob::CancelStatus() const {
  if (cancel_code_ == absl::StatusCode::kDeadlineExceeded) {
    return absl::DeadlineExceededError(absl::StrCat("request ", id(), ": deadline exceeded"));
  }
  return absl::CancelledError(absl::StrCat("request ", id(), " cancelled"));
}

bool DenoiseJob::ended() const {
  absl::MutexLock lock(&mu_);
  return final_.has_value();
}

bool DenoiseJob::Pop(v1::DenoiseEvent* event, std::optional<absl::Status>* final,
                     absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return !events_.empty() || final_.has_value();
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (!events_.empty()) {
    *event = std::move(events_.front());
    events_.pop_front();
    return true;
  }
  if (final_) *final = final_;
  return false;
}

// One sample of a request whose prompt KV has arrived: what the scheduler needs besides the
// sample's canvases (`run`). A request with num_samples = n has n of these, sharing the job and
// the prompt KV's whole blocks.
struct DenoiseEngine::Running {
  std::shared_ptr<DenoiseJob> job;
  int sample = 0;  // 0 .. num_samples − 1; its draws use seed + sample
  // Samples of the job not yet finished (shared by its Running objects; engine thread only).
  std::shared_ptr<int> samples_left;
  bool finished = false;  // this sample sent its Finished (the job may still run others)
  std::unique_ptr<kv::PagedKvCache> kv;
  std::optional<SampleRun> run;  // set in OnKv
  absl::Time kv_ready, admitted, canvas_start;
  double denoise_seconds = 0, commit_seconds = 0;
};

namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// A sample that finished, or whose job ended (error, cancellation): it leaves the batch.
template <typename R>
bool Gone(const std::unique_ptr<R>& r) {
  return r->finished || r->job->ended();
}

// Distinct requests among the running samples.
template <typename R>
int CountJobs(const std::vector<std::unique_ptr<R>>& running) {
  std::unordered_set<const DenoiseJob*> jobs;
  for (const auto& r : running) jobs.insert(r->job.get());
  return int(jobs.size());
}

// num_samples 0 means 1.
int NumSamples(const v1::DenoiseRequest& r) { return std::max(1, r.num_samples()); }

SamplerParams ToSamplerParams(const v1::SamplerSettings& s) {
  SamplerParams p;
  p.max_denoising_steps = s.max_denoising_steps();
  p.t_min = s.t_min();
  p.t_max = s.t_max();
  p.entropy_bound = s.entropy_bound();
  p.stability_threshold = s.stability_threshold();
  p.confidence_threshold = s.confidence_threshold();
  p.self_conditioning = !s.zero_self_conditioning();
  p.sample_temperature_spread = s.sample_temperature_spread();
  return p;
}

absl::Status ValidateRequest(const v1::DenoiseRequest& r, const ModelConfig& c) {
  if (r.request_id().empty()) return absl::InvalidArgumentError("request_id: must not be empty");
  if (r.prompt_tokens() <= 0) {
    return absl::InvalidArgumentError("prompt_tokens: must be > 0");
  }
  if (r.max_new_tokens() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: must be > 0, got ", r.max_new_tokens()));
  }
  if (absl::Status s = CheckContextFits(r.prompt_tokens(), r.max_new_tokens(), c); !s.ok()) {
    return s;
  }
  for (int32_t id : r.stop_token_ids()) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids: ", id, " out of range"));
    }
  }
  if (r.pad_token_id() < 0 || r.pad_token_id() >= c.vocab_size) {
    return absl::InvalidArgumentError("pad_token_id: out of range");
  }
  if (r.canvas_step_interval() < 0) {
    return absl::InvalidArgumentError("canvas_step_interval: must be >= 0");
  }
  if (r.first_canvas() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_canvas: must be >= 0, got ", r.first_canvas()));
  }
  if (int64_t(r.first_canvas()) * c.canvas_length >= r.prompt_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "first_canvas: ", r.first_canvas(), " committed canvases of ", c.canvas_length,
        " tokens do not fit in prompt_tokens=", r.prompt_tokens()));
  }
  if (HasCanvasTemplate(r.canvas_template())) {
    absl::StatusOr<std::shared_ptr<const CanvasTemplate>> t =
        CanvasTemplateFromProto(r.canvas_template(), c.canvas_length, c.vocab_size);
    if (!t.ok()) return t.status();
  }
  if (r.num_samples() < 0 || r.num_samples() > kMaxSamplesPerRequest) {
    return absl::InvalidArgumentError(absl::StrCat("num_samples: must be in [0, ",
                                                   kMaxSamplesPerRequest, "], got ",
                                                   r.num_samples()));
  }
  return ValidateSamplerParams(ToSamplerParams(r.sampler()));
}

// Sample `sample` of request `r` (validated): canvas indices (draws, block indices, template)
// continue after the committed canvases of a resumed request (first_canvas).
SampleSpec MakeSampleSpec(const v1::DenoiseRequest& r, int sample,
                          std::shared_ptr<const CanvasTemplate> canvas_template,
                          const Tokenizer* tokenizer) {
  SampleSpec spec;
  spec.sampler = SampleSamplerParams(ToSamplerParams(r.sampler()), sample, NumSamples(r));
  spec.seed = r.seed() + uint64_t(sample);
  spec.first_canvas = r.first_canvas();
  spec.max_new_tokens = r.max_new_tokens();
  spec.stop_token_ids.assign(r.stop_token_ids().begin(), r.stop_token_ids().end());
  spec.pad_token_id = r.pad_token_id();
  spec.canvas_template = std::move(canvas_template);
  spec.template_every_canvas = r.canvas_template().every_canvas();
  spec.tokenizer = tokenizer;
  spec.stop_sequences.assign(r.stop_sequences().begin(), r.stop_sequences().end());
  spec.completion_before.assign(r.completion_token_ids().begin(), r.completion_token_ids().end());
  return spec;
}

}  // namespace

DenoiseEngine::DenoiseEngine(ModelBackend* backend, kv::BlockPool* pool,
                             kv::KvReceiver* receiver, DenoiseEngineOptions options,
                             DenoiseMetrics* metrics)
    : backend_(backend),
      pool_(pool),
      receiver_(receiver),
      options_(std::move(options)),
      metrics_(metrics),
      thread_([this] { Loop(); }) {}

DenoiseEngine::~DenoiseEngine() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    wake_.SignalAll();
  }
  thread_.join();
  std::vector<std::string> forget;
  std::deque<std::unique_ptr<Running>> ready;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, job] : all_) {
      job->End(absl::UnavailableError("denoise worker shutting down"));
      forget.push_back(id);
    }
    waiting_.clear();
    all_.clear();
    ready.swap(ready_);
  }
  for (const std::string& id : forget) receiver_->Forget(id);
}

void DenoiseEngine::UpdateQueueGauge() {
  // Requests waiting for their KV count as queued as much as those waiting for a batch slot.
  if (metrics_) metrics_->queue_depth.Set(double(waiting_.size() + ready_.size()));
  // Samples dropped from the queue (a cancel, a failed sample's siblings) are held no more.
  held_for_kv_memory_ = std::min(held_for_kv_memory_.load(), int(ready_.size()));
  if (metrics_) metrics_->queued_for_kv_memory.Set(double(held_for_kv_memory_));
}

absl::Status DenoiseEngine::CheckFitsInPool(const v1::DenoiseRequest& r) const {
  const int C = backend_->config().canvas_length;
  const int64_t prompt = r.prompt_tokens();
  const int64_t canvases = (int64_t(r.max_new_tokens()) + C - 1) / C;
  // The K/V memory the backend bounds itself (the CUDA backend's device block pool): one sample
  // on a cache of this pool (its sliding rows kept), its prompt from the host, then its commits
  // of C rows, the last canvas not committed (the samples of a request need not be on the device
  // at once: the engine steps them in parts). The prompt alone first, to name the field.
  const int64_t positions = prompt + std::max<int64_t>(0, canvases - 1) * C;
  const kv::PagedKvCache like(pool_, backend_->config().max_position_embeddings);
  KvPassPlan plan;
  plan.first = prompt;
  plan.positions = prompt;
  plan.pass_tokens = C;
  if (absl::Status s = backend_->CheckKvFits(like, plan); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("prompt_tokens: ", s.message()));
  }
  plan.positions = positions;
  if (absl::Status s = backend_->CheckKvFits(like, plan); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("max_new_tokens: a prompt of ", prompt,
                                               " tokens and ", canvases, " canvases of ", C, " (",
                                               canvases - 1, " committed): ", s.message()));
  }
  const kv::KvLayout& layout = pool_->layout();
  const int full = int(kv::LayerKind::kFull);
  if (layout.layers[full] == 0) return absl::OkStatus();
  const int64_t total = pool_->stats().total[full];
  const int samples = NumSamples(r);
  const int64_t partial = prompt % layout.block_size != 0 ? 1 : 0;
  const int64_t at_arrival = layout.BlocksFor(int(prompt)) + (samples - 1) * partial;
  const int64_t at_last_commit = layout.BlocksFor(int(prompt + (canvases - 1) * C));
  const auto refuse = [&](int64_t blocks, const std::string& what) {
    return absl::OutOfRangeError(absl::StrCat(
        what, " needs ", blocks, " full-attention KV blocks of ", layout.block_size,
        " tokens; this denoise worker's KV pool holds ", total, " in all (--kv_cache_mib)"));
  };
  if (at_arrival > total) {
    return refuse(at_arrival, samples == 1
                                  ? absl::StrCat("prompt_tokens: a prompt of ", prompt, " tokens")
                                  : absl::StrCat("num_samples: a prompt of ", prompt, " tokens in ",
                                                 samples, " samples"));
  }
  if (at_last_commit > total) {
    return refuse(at_last_commit,
                  absl::StrCat("max_new_tokens: a prompt of ", prompt, " tokens and ", canvases,
                               " canvases of ", C, " (", canvases - 1, " committed)"));
  }
  return absl::OkStatus();
}

absl::Status DenoiseEngine::Submit(std::shared_ptr<DenoiseJob> job) {
  absl::Status s = Admit(job);
  // A refused request's KV (the gateway prefills before it asks here, so it has arrived) is freed
  // at once: nothing would claim it before its lease ends, and its blocks would be lost to the
  // requests admitted meanwhile. Not KV another job with the id waits for (a duplicate).
  if (!s.ok() && !absl::IsAlreadyExists(s)) receiver_->Drop(job->id());
  return s;
}

absl::Status DenoiseEngine::Admit(const std::shared_ptr<DenoiseJob>& job) {
  if (draining_) return absl::UnavailableError("denoise worker is draining");
  if (absl::Status s = ValidateRequest(job->request(), backend_->config()); !s.ok()) return s;
  // A request this worker's KV pool can never hold is refused now, as OUT_OF_RANGE (HTTP 400),
  // rather than failing later as RESOURCE_EXHAUSTED (HTTP 429, which clients retry). Counted on
  // the full-attention layers, which keep every position; each is a need at one moment:
  //  - when the prompt's KV arrives: the prompt's blocks, plus a copy of its partial last block
  //    for each further sample (Fork);
  //  - at the last commit of a sample that runs to max_new_tokens: the prompt and every canvas
  //    but the last (which is not committed).
  if (absl::Status s = CheckFitsInPool(job->request()); !s.ok()) return s;
  const std::string id = job->id();
  {
    absl::MutexLock lock(&mu_);
    if (int(all_.size()) >= options_.max_queue + options_.max_batch_canvases) {
      return absl::ResourceExhaustedError(
          absl::StrCat("denoise worker queue is full (", all_.size(), " requests)"));
    }
    if (!all_.emplace(id, job).second) {
      return absl::AlreadyExistsError(absl::StrCat("request ", id, " is already running"));
    }
    waiting_.emplace(id, job);
    UpdateQueueGauge();
  }
  // A caller's wait is a request, not trusted: at most the KV lease bound.
  const int64_t max_wait = std::max<int64_t>(1, options_.max_kv_wait_ms);
  const int64_t asked = job->request().kv_wait_ms();
  const int64_t wait_ms = asked > 0 ? std::min(asked, max_wait) : max_wait;
  receiver_->Expect(id, absl::Now() + absl::Milliseconds(wait_ms),
                    [this, id](absl::StatusOr<std::unique_ptr<kv::PagedKvCache>> kv) {
                      OnKv(id, std::move(kv));
                    });
  return absl::OkStatus();
}

void DenoiseEngine::OnKv(const std::string& id,
                         absl::StatusOr<std::unique_ptr<kv::PagedKvCache>> kv) {
  std::unique_ptr<Running> drop;  // destroyed outside the lock
  absl::MutexLock lock(&mu_);
  // Whatever the outcome, the request has left the KV wait (into ready_, or failed).
  absl::Cleanup gauge = [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS { UpdateQueueGauge(); };
  auto it = waiting_.find(id);
  if (it == waiting_.end()) return;  // cancelled meanwhile; `kv` frees its blocks
  std::shared_ptr<DenoiseJob> job = it->second;
  waiting_.erase(it);
  absl::Status error;
  if (!kv.ok()) {
    error = kv.status();
    if (absl::IsDeadlineExceeded(error)) {
      error = absl::DeadlineExceededError(absl::StrCat(
          "prompt KV for request ", id, " did not arrive in time: ", error.message()));
    }
  } else if ((*kv)->num_tokens() != job->request().prompt_tokens()) {
    error = absl::FailedPreconditionError(
        absl::StrCat("prompt KV for request ", id, " covers ", (*kv)->num_tokens(),
                     " tokens, the request says ", job->request().prompt_tokens()));
  }
  if (!error.ok()) {
    all_.erase(id);
    if (metrics_) {
      metrics_->RequestsWithStatus(absl::StatusCodeToString(error.code())).Increment();
    }
    job->End(error);
    return;
  }
  // Samples 1 .. n−1 share the prompt's whole blocks with sample 0 (copy-on-write of the
  // partial last block only).
  const int n = NumSamples(job->request());
  std::vector<std::unique_ptr<kv::PagedKvCache>> kvs;
  kvs.push_back(*std::move(kv));
  for (int i = 1; i < n; ++i) {
    absl::StatusOr<std::unique_ptr<kv::PagedKvCache>> fork = kvs.front()->Fork();
    if (!fork.ok()) {
      // RESOURCE_EXHAUSTED: no blocks for the copy of the partial block (a transferred cache
      // never has rows held only on a device, Fork's other refusal).
      const absl::StatusCode code = fork.status().code();
      all_.erase(id);
      if (metrics_) metrics_->RequestsWithStatus(absl::StatusCodeToString(code)).Increment();
      job->End(absl::Status(
          code,
          absl::StrCat(
              code == absl::StatusCode::kResourceExhausted ? "no KV blocks" : "cannot fork the KV",
              " for sample ", i, " of request ", id, ": ", fork.status().message())));
      return;  // `kvs` frees the blocks
    }
    kvs.push_back(*std::move(fork));
  }
  const ModelConfig& c = backend_->config();
  const absl::Time kv_ready = absl::Now();
  std::shared_ptr<const CanvasTemplate> canvas_template;  // shared by the samples
  if (HasCanvasTemplate(job->request().canvas_template())) {
    // Validated by Submit, so this cannot fail.
    canvas_template =
        *CanvasTemplateFromProto(job->request().canvas_template(), c.canvas_length, c.vocab_size);
  }
  auto samples_left = std::make_shared<int>(n);
  std::vector<std::unique_ptr<Running>> samples;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<SampleRun> run =
        SampleRun::Create(c, MakeSampleSpec(job->request(), i, canvas_template,
                                            options_.tokenizer ? &*options_.tokenizer : nullptr));
    if (!run.ok()) {  // validated by Submit: cannot happen
      all_.erase(id);
      if (metrics_) {
        metrics_->RequestsWithStatus(absl::StatusCodeToString(run.status().code())).Increment();
      }
      job->End(run.status());
      return;  // `kvs` frees the blocks
    }
    auto r = std::make_unique<Running>();
    r->job = job;
    r->sample = i;
    r->samples_left = samples_left;
    r->kv = std::move(kvs[i]);
    r->run.emplace(*std::move(run));
    r->kv_ready = kv_ready;
    samples.push_back(std::move(r));
  }
  for (auto& r : samples) ready_.push_back(std::move(r));
  if (metrics_) {
    metrics_->kv_wait_seconds.Observe(Seconds(kv_ready - job->created()));
    metrics_->samples.Increment(n);
  }
  wake_.Signal();
}

bool DenoiseEngine::Cancel(const std::string& request_id, absl::StatusCode code) {
  std::vector<std::unique_ptr<Running>> drop;  // every sample of the job still in ready_
  bool forget = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = all_.find(request_id);
    if (it == all_.end()) return false;
    std::shared_ptr<DenoiseJob> job = it->second;
    job->RequestCancel(code);
    if (waiting_.erase(request_id) > 0) {
      UpdateQueueGauge();
      forget = true;
      all_.erase(it);
      job->End(job->CancelStatus());
    } else {
      // Samples already running leave at the next step (cancel_requested); waiting ones now.
      for (auto r = ready_.begin(); r != ready_.end();) {
        if ((*r)->job == job) {
          drop.push_back(std::move(*r));
          r = ready_.erase(r);
        } else {
          ++r;
        }
      }
      if (!drop.empty()) {
        all_.erase(request_id);
        job->End(job->CancelStatus());
        UpdateQueueGauge();
      }
    }
    if (metrics_ && (forget || !drop.empty())) {
      metrics_->RequestsWithStatus(absl::StatusCodeToString(job->CancelStatus().code())).Increment();
    }
    wake_.Signal();
  }
  if (forget) receiver_->Forget(request_id, code);
  return true;
}

DenoiseEngineStats DenoiseEngine::stats() const {
  DenoiseEngineStats s;
  s.active_canvases = active_canvases_;
  s.active_requests = active_requests_;
  s.passes_in_parts = passes_in_parts_;
  s.device_step_limit = device_step_limit_;
  s.held_for_kv_memory = held_for_kv_memory_;
  absl::MutexLock lock(&mu_);
  s.queued = int(waiting_.size() + ready_.size());
  return s;
}

void DenoiseEngine::FinishJob(Running& r, absl::Status status) {
  r.finished = true;
  device_step_limit_ = 0;  // its K/V leaves the device: every canvas may step again
  if (status.ok() && --*r.samples_left > 0) return;  // the job ends with its last sample
  std::vector<std::unique_ptr<Running>> drop;  // destroyed outside the lock
  absl::MutexLock lock(&mu_);
  auto it = all_.find(r.job->id());
  if (it == all_.end() || it->second != r.job) return;  // already ended (error or Cancel)
  if (metrics_) {
    metrics_->RequestsWithStatus(absl::StatusCodeToString(status.code())).Increment();
  }
  r.job->End(std::move(status));
  all_.erase(it);
  // Samples of a failed job that still wait for a batch slot go now.
  for (auto q = ready_.begin(); q != ready_.end();) {
    if ((*q)->job == r.job) {
      drop.push_back(std::move(*q));
      q = ready_.erase(q);
    } else {
      ++q;
    }
  }
  if (!drop.empty()) UpdateQueueGauge();
}

void DenoiseEngine::Loop() {
  std::vector<std::unique_ptr<Running>> running;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || !running.empty() || !ready_.empty();
      };
      mu_.Await(absl::Condition(&has_work));
      if (stop_) break;
      int held = 0;
      while (int(running.size()) < options_.max_batch_canvases && !ready_.empty()) {
        if (!running.empty() && options_.admit_by_kv_memory &&
            !FitsInKvMemoryBeside(running, *ready_.front())) {
          held = int(ready_.size());
          break;
        }
        running.push_back(std::move(ready_.front()));
        ready_.pop_front();
        running.back()->admitted = absl::Now();
      }
      held_for_kv_memory_ = held;
      UpdateQueueGauge();
    }
    active_requests_ = CountJobs(running);
    Iterate(running);
    active_canvases_ = int(running.size());
    active_requests_ = CountJobs(running);
    if (metrics_) metrics_->active_canvases.Set(double(running.size()));
  }
  for (auto& r : running) r->job->End(absl::UnavailableError("denoise worker shutting down"));
  active_canvases_ = 0;
  active_requests_ = 0;
}

bool DenoiseEngine::FitsInKvMemoryBeside(const std::vector<std::unique_ptr<Running>>& running,
                                         const Running& next) const {
  const int64_t C = backend_->config().canvas_length;
  const int64_t host_block = pool_->layout().block_size;
  std::vector<KvSequencePlan> plans;
  std::unordered_set<const DenoiseJob*> jobs;
  const auto add = [&](const Running& r) {
    // A cancelled sample leaves at the next step: its blocks are as good as free.
    if (r.finished || r.job->ended() || r.job->cancel_requested() || !r.run.has_value()) return;
    const int64_t prompt = r.job->request().prompt_tokens();
    KvSequencePlan p;
    p.like = r.kv.get();
    // From the prompt (rows the denoise worker commits stay on the device: the deferred host
    // copy), through its next commit if one may come.
    p.plan.first = prompt;
    p.plan.positions = r.kv->num_tokens() + (r.run->may_commit() ? C : 0);
    p.plan.pass_tokens = C;
    // Another sample of the request came first: the whole blocks of the prompt are its fork's.
    if (!jobs.insert(r.job.get()).second) p.shared_rows = prompt / host_block * host_block;
    plans.push_back(p);
  };
  for (const auto& r : running) add(*r);
  add(next);
  return KvFitsTogether(*backend_, plans);
}

void DenoiseEngine::Iterate(std::vector<std::unique_ptr<Running>>& running) {
  using Phase = SampleRun::Phase;
  // 1. Cancelled requests leave now; their KV blocks go back to the pool.
  std::erase_if(running, [&](std::unique_ptr<Running>& r) {
    if (!r->job->cancel_requested()) return false;
    FinishJob(*r, r->job->CancelStatus());
    return true;
  });
  // 2. Commit passes due (spec §4.1 step 3a), batched into one encoder call.
  CommitCanvases(running);
  std::erase_if(running, Gone<Running>);
  // 3. Samples starting a canvas get a fresh denoiser (spec §4.2 Init).
  for (auto& r : running) {
    if (r->run->phase() != Phase::kStartCanvas) continue;
    if (absl::Status s = r->run->StartCanvas(); !s.ok()) FinishJob(*r, s);
    r->canvas_start = absl::Now();
  }
  std::erase_if(running, Gone<Running>);
  if (running.empty()) return;

  // 4. One batched denoising step over every canvas (each at its own step). A canvas whose
  // template has no holes is done at Init: it takes no pass and is finished below.
  // While the device's K/V memory holds fewer canvases than are running (a step was refused and
  // ran in parts), only the first device_step_limit_ of them step, in admission order; the others
  // wait (their device rows free for the running ones) until a sample ends, rather than every
  // step moving every canvas's K/V out of the device and back.
  std::vector<DenoiseStepInput> batch;
  std::vector<Running*> stepped;  // batch[i]'s sample
  batch.reserve(running.size());
  const size_t limit = device_step_limit_ > 0 ? size_t(device_step_limit_.load()) : running.size();
  for (auto& r : running) {
    if (r->run->phase() != Phase::kDenoising || batch.size() >= limit) continue;
    absl::StatusOr<DenoiseStepInput> in = r->run->StepInput(*r->kv);
    if (!in.ok()) {
      FinishJob(*r, in.status());
      continue;
    }
    batch.push_back(*in);
    stepped.push_back(r.get());
  }
  const absl::Time t0 = absl::Now();
  const PartsRun run =
      RunInParts(std::span<const DenoiseStepInput>(batch),
                 [&](std::span<const DenoiseStepInput> b) { return backend_->DenoiseStep(b); });
  if (run.parts > 0) {
    CountPassInParts("denoising step", batch.size(), run);
    // At most as many canvases as its largest part that ran step until a sample ends.
    if (run.largest > 0) device_step_limit_ = int(run.largest);
  }
  const std::vector<absl::Status>& step_status = run.status;
  const absl::Time t1 = absl::Now();
  if (metrics_ && !batch.empty()) {
    metrics_->step_seconds.Observe(Seconds(t1 - t0));
    metrics_->batch_canvases.Observe(double(batch.size()));
    metrics_->decoder_passes.Increment(double(batch.size()));
  }
  size_t in_batch = 0;  // stepped holds the samples that took this pass in `running`'s order
  for (auto& rp : running) {
    Running& r = *rp;
    if (r.finished) continue;                                    // its StepInput failed
    if (in_batch < stepped.size() && stepped[in_batch] == &r) {  // it took this pass
      const absl::Status& st = step_status[in_batch++];
      if (!st.ok()) {
        // Out of K/V memory even alone (the device's): RESOURCE_EXHAUSTED, as the backend said.
        FinishJob(r, absl::Status(st.code() == absl::StatusCode::kResourceExhausted
                                      ? st.code()
                                      : absl::StatusCode::kInternal,
                                  absl::StrCat("denoising step failed: ", st.message())));
        continue;
      }
      r.denoise_seconds += Seconds(t1 - t0);
      absl::StatusOr<StepOutcome> out = r.run->ApplyStep();
      if (!out.ok()) {
        FinishJob(r, absl::InternalError(std::string(out.status().message())));
        continue;
      }
      ReportStep(r, *out, t1);
    }
    if (r.run->phase() == Phase::kCanvasDone) EndCanvas(r, t1);
  }
  std::erase_if(running, Gone<Running>);
}

void DenoiseEngine::CommitCanvases(std::vector<std::unique_ptr<Running>>& running) {
  const int C = backend_->config().canvas_length;
  std::vector<Running*> committing;
  std::vector<EncodeInput> batch;
  for (auto& r : running) {
    if (r->run->phase() != SampleRun::Phase::kCommit) continue;
    if (absl::Status s = r->kv->Reserve(C); !s.ok()) {
      FinishJob(*r, absl::ResourceExhaustedError(absl::StrCat(
                        "KV cache exhausted while committing canvas ", r->run->canvas() - 1,
                        " of request ", r->job->id(), ": ", s.message())));
      r->job->RequestCancel();  // removed by the caller
      continue;
    }
    committing.push_back(r.get());
    batch.push_back(EncodeInput{r->run->to_commit(), r->kv.get()});
  }
  if (batch.empty()) return;
  const absl::Time t0 = absl::Now();
  const PartsRun run =
      RunInParts(std::span<const EncodeInput>(batch),
                 [&](std::span<const EncodeInput> b) { return backend_->Encode(b); });
  if (run.parts > 0) CountPassInParts("commit pass", batch.size(), run);
  const std::vector<absl::Status>& status = run.status;
  const double secs = Seconds(absl::Now() - t0);
  if (metrics_) metrics_->commit_seconds.Observe(secs);
  for (size_t i = 0; i < committing.size(); ++i) {
    Running* r = committing[i];
    r->commit_seconds += secs;
    const absl::Status done = status[i].ok() ? r->run->CommitDone() : status[i];
    if (!done.ok()) {
      FinishJob(*r, absl::Status(done.code() == absl::StatusCode::kResourceExhausted
                                     ? done.code()
                                     : absl::StatusCode::kInternal,
                                 absl::StrCat("commit pass failed: ", done.message())));
      r->job->RequestCancel();
    }
  }
}

void DenoiseEngine::CountPassInParts(const char* pass, size_t n, const PartsRun& run) {
  ++passes_in_parts_;
  if (metrics_) metrics_->passes_in_parts.Increment();
  DGSERVE_LOG_WARNING(
      "%s of %zu canvases refused (out of K/V memory), run again as %d smaller passes; the "
      "largest that ran took %zu",
      pass, n, run.parts, run.largest);
}

void DenoiseEngine::ReportStep(Running& r, const StepOutcome& out, absl::Time now) {
  if (metrics_) {
    metrics_->accepted_per_step.Observe(double(out.accepted.size()));
    if (r.run->total_steps() == 1) {
      metrics_->first_step_seconds.Observe(Seconds(now - r.job->created()));
    }
  }
  const int k = r.job->request().canvas_step_interval();
  const bool done = r.run->phase() != SampleRun::Phase::kDenoising;
  if (k <= 0 || (out.step % k != 0 && !done)) return;
  v1::DenoiseEvent ev;
  ev.set_sample(r.sample);
  v1::DenoiseStepEvent* st = ev.mutable_step();
  st->set_canvas(r.run->canvas());
  st->set_step(out.step);
  st->mutable_token_ids()->Assign(r.run->argmax().begin(), r.run->argmax().end());
  st->set_accepted(int(out.accepted.size()));
  st->set_mean_entropy(out.mean_entropy);
  st->set_temperature(out.temperature);
  r.job->Push(std::move(ev));
}

void DenoiseEngine::EndCanvas(Running& r, absl::Time now) {
  absl::StatusOr<FinishedCanvas> f = r.run->FinishCanvas();
  if (!f.ok()) {
    FinishJob(r, absl::InternalError(std::string(f.status().message())));
    return;
  }
  if (metrics_) {
    metrics_->steps_per_canvas.Observe(f->steps);
    metrics_->canvas_seconds.Observe(Seconds(now - r.canvas_start));
    metrics_->commit_mean_entropy.Observe(f->mean_entropy);
    metrics_->canvases.Increment();
    metrics_->output_tokens.Increment(double(f->tokens.size()));
  }
  v1::DenoiseEvent ev;
  ev.set_sample(r.sample);
  v1::DenoiseBlockEvent* b = ev.mutable_block();
  b->set_index(f->index);
  b->mutable_token_ids()->Assign(f->tokens.begin(), f->tokens.end());
  b->set_steps(f->steps);
  b->set_stop_token(f->stop_token);
  r.job->Push(std::move(ev));
  if (!f->last) return;  // the raw canvas is committed at the next iteration
  v1::DenoiseEvent fin;
  fin.set_sample(r.sample);
  v1::DenoiseFinished* d = fin.mutable_finished();
  d->set_finish_reason(std::string(r.run->finish_reason()));
  d->set_canvases(r.run->canvas());
  d->set_denoising_steps(r.run->total_steps());
  d->set_kv_wait_seconds(Seconds(r.kv_ready - r.job->created()));
  d->set_queue_seconds(Seconds(r.admitted - r.kv_ready));
  d->set_denoise_seconds(r.denoise_seconds);
  d->set_commit_seconds(r.commit_seconds);
  r.job->Push(std::move(fin));
  FinishJob(r, absl::OkStatus());
}

}  // namespace dgserve
