#include "gateway/gateway.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/logging.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/hash.h"
#include "engine/denoise/sampler_params.h"
#include "engine/tokenizer/chat_template.h"
#include "gateway/request_ids.h"
#include "gateway/stop_matcher.h"
#include "service/canvas_template_proto.h"
#include "service/status_convert.h"

namespace dgserve {
namespace {

std::chrono::system_clock::time_point ToChrono(absl::Time t) {
  if (t == absl::InfiniteFuture()) return std::chrono::system_clock::time_point::max();
  return absl::ToChronoTime(t);
}

// Calls TryCancel on the current call's context while `is_cancelled` is true, from a small
// watcher thread (gRPC's blocking reads cannot poll).
class CancelWatcher {
 public:
  explicit CancelWatcher(const std::function<bool()>& is_cancelled)
      : is_cancelled_(is_cancelled), thread_([this] { Run(); }) {}
  ~CancelWatcher() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Watch(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    ctx_ = ctx;
    if (cancelled_ && ctx_) ctx_->TryCancel();
  }
  bool cancelled() const {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

 private:
  void Run() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      if (!cancelled_ && is_cancelled_ && is_cancelled_()) {
        cancelled_ = true;
        if (ctx_) ctx_->TryCancel();
      }
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20));
    }
  }
  const std::function<bool()>& is_cancelled_;
  mutable absl::Mutex mu_;
  bool stop_ = false;
  bool cancelled_ = false;
  grpc::ClientContext* ctx_ = nullptr;
  std::thread thread_;
};

// `message` with the addresses of the request's workers replaced by their roles.
std::string HideWorkers(absl::string_view message, const std::string& prefill,
                        const std::string& denoise) {
  return absl::StrReplaceAll(message,
                             {{prefill, "the prefill worker"}, {denoise, "the denoise worker"}});
}

// The stream state of one sample of a request: stop sequences and max_tokens apply per sample.
struct SampleStream {
  SampleStream(const Tokenizer& tokenizer, const std::vector<std::string>& stop)
      : decoder(tokenizer), matcher(stop) {}
  StreamDecoder decoder;
  StopMatcher matcher;
  int completion = 0, canvases = 0, steps = 0, last_index = 0;
  std::vector<int32_t> all_ids;  // completion tokens so far
  // Every block's token ids, whole. While the completion runs on, these are the raw canvases the
  // worker committed (a block is padded only after a stop token, which ends the completion):
  // what a resume prefills after the prompt.
  std::vector<int32_t> block_ids;
  // The last CanvasStep sent: a resumed canvas's steps up to it are not sent again.
  int sent_step_canvas = -1, sent_step = -1;
  size_t emitted_bytes = 0;      // completion text emitted so far
  // The completion ended at a block by max_tokens, a stop token or a stop sequence: the worker
  // ends this sample there too and its Finished (with the denoise and commit timings) comes
  // next.
  bool awaiting_worker_finish = false;
  bool worker_done = false;  // the worker's Finished of this sample arrived
  bool done = false;         // the completion has ended
  bool finished_sent = false;  // its Finished event went to the client
  std::string finish_reason;
  v1::DenoiseFinished worker_finished;
};

}  // namespace

Gateway::Gateway(ModelConfig config, GenerationConfig generation, Tokenizer tokenizer,
                 GatewayOptions options, WorkerPool* prefill, WorkerPool* denoise,
                 GatewayMetrics* metrics)
    : config_(std::move(config)),
      generation_(std::move(generation)),
      tokenizer_(std::move(tokenizer)),
      options_(std::move(options)),
      prefill_(prefill),
      denoise_(denoise),
      metrics_(metrics),
      admission_(options_.max_concurrent_requests, options_.max_queued_requests,
                 [metrics](int running, int queued) {
                   if (metrics == nullptr) return;
                   metrics->inflight.Set(running);
                   metrics->queued.Set(queued);
                 }) {}

void Gateway::CountRefused(const absl::Status& status) {
  if (metrics_) metrics_->RequestsWithStatus(absl::StatusCodeToString(status.code())).Increment();
}

absl::Status Gateway::CheckAdmission() {
  if (!admission_.Saturated()) return absl::OkStatus();
  absl::Status s = absl::ResourceExhaustedError(absl::StrCat(
      "the gateway is at its limit of ", options_.max_concurrent_requests, " concurrent requests",
      options_.max_queued_requests > 0
          ? absl::StrCat(" and ", options_.max_queued_requests, " queued")
          : std::string(),
      "; retry later"));
  if (metrics_) metrics_->RequestsWithStatus(absl::StatusCodeToString(s.code())).Increment();
  return s;
}

v1::ListModelsResponse Gateway::ListModels() const {
  v1::ListModelsResponse r;
  v1::ModelInfo* m = r.add_models();
  m->set_id(options_.model_id);
  m->set_context_length(config_.max_position_embeddings);
  m->set_canvas_length(config_.canvas_length);
  m->set_vocab_size(config_.vocab_size);
  return r;
}

void Gateway::Drain(absl::Duration grace) {
  SetDraining(true);
  const absl::Time until = absl::Now() + grace;
  while (admission_.running() + admission_.queued() > 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(50));
}

void Gateway::UpdateWorkerGauges() {
  if (!metrics_) return;
  for (WorkerPool* pool : {prefill_, denoise_}) {
    const int healthy = pool->healthy_count();
    metrics_->workers.Add({{"role", pool->role()}, {"state", "healthy"}}).Set(healthy);
    metrics_->workers.Add({{"role", pool->role()}, {"state", "unhealthy"}})
        .Set(pool->total_count() - healthy);
  }
}

bool Gateway::Ready() const {
  return !draining_ && prefill_->healthy_count() > 0 && denoise_->healthy_count() > 0;
}

absl::Status Gateway::CheckApiKey(const std::string& bearer) const {
  if (options_.api_keys.empty()) return absl::OkStatus();
  for (const std::string& k : options_.api_keys) {
    if (!bearer.empty() && bearer == k) return absl::OkStatus();
  }
  return absl::UnauthenticatedError(
      bearer.empty() ? "missing API key: send 'Authorization: Bearer <key>'" : "invalid API key");
}

absl::StatusOr<PreparedRequest> Gateway::Prepare(const v1::GenerateRequest& request) const {
  if (!request.model().empty() && request.model() != options_.model_id) {
    return absl::NotFoundError(absl::StrCat("model '", request.model(),
                                            "' does not exist; this gateway serves '",
                                            options_.model_id, "'"));
  }
  PreparedRequest p;
  const int64_t limit = config_.max_position_embeddings;
  // A prompt must leave at least one position: tokenizing (and the chat template) stop as soon
  // as the prompt has more ids than that, so a huge request costs at most about `limit` tokens
  // of work.
  const size_t budget = size_t(std::max<int64_t>(limit - 1, 0));
  switch (request.input_case()) {
    case v1::GenerateRequest::kText:
      if (request.text().empty()) return absl::InvalidArgumentError("prompt: must not be empty");
      // A prompt is text: control-token strings in it are not control tokens (raw control
      // tokens can be sent as token ids).
      p.prompt = tokenizer_.EncodeText(request.text(), /*add_bos=*/true, budget);
      break;
    case v1::GenerateRequest::kChat: {
      if (request.chat().messages().empty()) {
        return absl::InvalidArgumentError("messages: must not be empty");
      }
      std::vector<ChatMessage> msgs;
      for (const v1::ChatMessage& m : request.chat().messages()) {
        msgs.push_back(ChatMessage{m.role(), m.content()});
      }
      ChatTemplateOptions o;
      o.enable_thinking = request.chat().enable_thinking();
      o.max_tokens = budget;
      absl::StatusOr<std::vector<int32_t>> ids = RenderChat(tokenizer_, msgs, o);
      if (!ids.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("messages: ", ids.status().message()));
      }
      p.prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::kTokenIds:
      if (request.token_ids().ids().empty()) {
        return absl::InvalidArgumentError("prompt: must not be empty");
      }
      for (int32_t id : request.token_ids().ids()) {
        if (id < 0 || id >= config_.vocab_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("prompt: token id ", id, " is outside [0, ", config_.vocab_size, ")"));
        }
      }
      p.prompt.assign(request.token_ids().ids().begin(), request.token_ids().ids().end());
      break;
    default:
      return absl::InvalidArgumentError("prompt: give text, chat messages or token ids");
  }
  if (metrics_ && request.input_case() != v1::GenerateRequest::kTokenIds) {
    metrics_->tokenized_tokens.Increment(double(p.prompt.size()));
  }
  if (request.input_case() != v1::GenerateRequest::kTokenIds && p.prompt.size() > budget) {
    return absl::InvalidArgumentError(absl::StrCat("prompt: more than ", budget,
                                                   " tokens exceed the context limit of ", limit,
                                                   " positions"));
  }
  if (int64_t(p.prompt.size()) >= limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt: ", p.prompt.size(), " tokens exceed the context limit of ", limit, " positions"));
  }
  if (request.max_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens: must be > 0, got ", request.max_tokens()));
  }
  p.max_tokens = request.max_tokens() > 0 ? request.max_tokens() : generation_.max_new_tokens;
  const int C = config_.canvas_length;
  const int64_t canvases = (int64_t(p.max_tokens) + C - 1) / C;
  if (int64_t(p.prompt.size()) + canvases * C > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens: the prompt (", p.prompt.size(), " tokens) plus ", canvases,
                     canvases == 1 ? " canvas of " : " canvases of ", C,
                     " tokens for max_tokens=", p.max_tokens,
                     " exceed the context limit of ", limit, " positions"));
  }
  if (request.stop_size() > options_.max_stop_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("stop: at most ", options_.max_stop_sequences,
                                                   " sequences, got ", request.stop_size()));
  }
  for (const std::string& s : request.stop()) {
    if (s.empty()) return absl::InvalidArgumentError("stop: sequences must not be empty");
    p.stop.push_back(s);
  }
  if (request.n() < 0 || request.n() > options_.max_n) {
    return absl::InvalidArgumentError(absl::StrCat("n: must be between 1 and ", options_.max_n,
                                                   " (the gateway's --max_n), got ",
                                                   request.n()));
  }
  p.n = std::max(1, request.n());
  if (request.has_seed()) {
    p.seed = request.seed();
  } else {
    absl::StatusOr<uint64_t> seed = NewRandomSeed();
    if (!seed.ok()) return seed.status();
    p.seed = *seed;
  }
  SamplerParams sp;
  sp.max_denoising_steps = generation_.max_denoising_steps;
  sp.t_min = generation_.t_min;
  sp.t_max = generation_.t_max;
  sp.entropy_bound = generation_.entropy_bound;
  sp.stability_threshold = generation_.stability_threshold;
  sp.confidence_threshold = generation_.confidence_threshold;
  const v1::DiffusionControls& d = request.diffusion();
  if (d.has_max_denoising_steps()) sp.max_denoising_steps = d.max_denoising_steps();
  if (d.has_t_min()) sp.t_min = d.t_min();
  if (d.has_t_max()) sp.t_max = d.t_max();
  if (d.has_entropy_bound()) sp.entropy_bound = d.entropy_bound();
  if (d.has_stability_threshold()) sp.stability_threshold = d.stability_threshold();
  if (d.has_confidence_threshold()) sp.confidence_threshold = d.confidence_threshold();
  // Unset or true: on; false: zero self-conditioning input at every step (ablation).
  if (d.has_self_conditioning()) sp.self_conditioning = d.self_conditioning();
  if (d.has_t_min() && !d.has_t_max() && std::isfinite(sp.t_min) && sp.t_min >= sp.t_max) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "t_min: must be < t_max (%g, the model's default), got %g", sp.t_max, sp.t_min));
  }
  if (absl::Status s = ValidateSamplerParams(sp); !s.ok()) return s;
  p.sampler.set_max_denoising_steps(sp.max_denoising_steps);
  p.sampler.set_t_min(sp.t_min);
  p.sampler.set_t_max(sp.t_max);
  p.sampler.set_entropy_bound(sp.entropy_bound);
  p.sampler.set_stability_threshold(sp.stability_threshold);
  p.sampler.set_confidence_threshold(sp.confidence_threshold);
  p.sampler.set_zero_self_conditioning(!sp.self_conditioning);
  if (request.stream_options().canvas_step_interval() < 0) {
    return absl::InvalidArgumentError("canvas_step_interval: must be >= 0");
  }
  p.canvas_step_interval = request.stream_options().canvas_step_interval();
  if (request.stream_options().canvas_text() && p.canvas_step_interval == 0) {
    return absl::InvalidArgumentError("canvas_text: requires canvas_step_interval > 0");
  }
  p.canvas_text = request.stream_options().canvas_text();
  if (HasCanvasTemplate(request.canvas_template())) {
    absl::StatusOr<v1::CanvasTemplate> t = ResolveTemplate(request.canvas_template());
    if (!t.ok()) return t.status();
    p.canvas_template = *std::move(t);
  }
  absl::StatusOr<std::string> id = NewRequestId();
  if (!id.ok()) return id.status();
  p.request_id = *std::move(id);
  return p;
}

absl::StatusOr<v1::CanvasTemplate> Gateway::ResolveTemplate(const v1::CanvasTemplate& t) const {
  v1::CanvasTemplate out;
  const bool text_form = !t.text().empty() || !t.hole().empty() || t.allowed_size() > 0;
  if (text_form) {
    if (t.token_ids_size() > 0 || t.holes_size() > 0) {
      return absl::InvalidArgumentError(
          "canvas_template: give either text (with hole, allowed) or token_ids (with holes)");
    }
    if (t.text().empty()) return absl::InvalidArgumentError("canvas_template.text: is empty");
    const std::string marker = t.hole().empty() ? "_" : t.hole();
    // Text outside the vocabulary encodes to <unk>: a template of it would silently lose it.
    const std::optional<int32_t> unk = tokenizer_.PieceToId("<unk>");
    auto has_unk = [&](const std::vector<int32_t>& ids) {
      return unk && std::find(ids.begin(), ids.end(), *unk) != ids.end();
    };
    std::vector<int32_t> allowed;
    for (int i = 0; i < t.allowed_size(); ++i) {
      const std::vector<int32_t> ids = tokenizer_.Encode(t.allowed(i), /*add_bos=*/false);
      if (has_unk(ids)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "canvas_template.allowed[", i, "]: \"", t.allowed(i),
            "\" is not in the model's vocabulary (it encodes to <unk>)"));
      }
      if (ids.size() != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "canvas_template.allowed[", i, "]: \"", t.allowed(i), "\" is ", ids.size(),
            " tokens; each allowed entry must be exactly one token"));
      }
      allowed.push_back(ids[0]);
    }
    std::vector<int> hole_positions;
    std::string_view rest = t.text();
    for (;;) {
      const size_t at = rest.find(marker);
      const std::string_view piece = rest.substr(0, at);
      if (!piece.empty()) {
        const std::vector<int32_t> ids = tokenizer_.Encode(piece, /*add_bos=*/false);
        if (has_unk(ids)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "canvas_template.text: \"", std::string(piece),
              "\" holds characters outside the model's vocabulary (they encode to <unk>)"));
        }
        for (int32_t id : ids) out.add_token_ids(id);
      }
      if (at == std::string_view::npos) break;
      hole_positions.push_back(out.token_ids_size());
      out.add_token_ids(-1);
      rest.remove_prefix(at + marker.size());
    }
    if (out.token_ids_size() > config_.canvas_length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "canvas_template.text: ", out.token_ids_size(),
          " canvas positions (tokens and holes) are longer than the canvas (",
          config_.canvas_length, " tokens)"));
    }
    if (!allowed.empty()) {
      for (int pos : hole_positions) {
        v1::TemplateHole* h = out.add_holes();
        h->set_position(pos);
        h->mutable_allowed_token_ids()->Assign(allowed.begin(), allowed.end());
      }
    }
  } else {
    if (t.token_ids_size() == 0 && t.holes_size() == 0) {
      return absl::InvalidArgumentError(
          "canvas_template: give text (with hole, allowed) or token_ids (with holes)");
    }
    *out.mutable_token_ids() = t.token_ids();
    *out.mutable_holes() = t.holes();
  }
  out.set_every_canvas(t.every_canvas());
  absl::StatusOr<std::shared_ptr<const CanvasTemplate>> checked =
      CanvasTemplateFromProto(out, config_.canvas_length, config_.vocab_size);
  if (!checked.ok()) return checked.status();
  return out;
}

// One request from its first attempt to its Finished events. An attempt has three phases —
// picking the workers and prefilling (the KV goes to the denoise worker), the denoise call, and
// the relay of the denoise stream to the client (stop matching, max_tokens, usage) — followed,
// once every sample has ended, by the flush of held-back text and the Finished events.
class Gateway::RequestRun {
 public:
  RequestRun(Gateway& gateway, const PreparedRequest& req, absl::Time deadline,
             const std::function<bool()>& is_cancelled, const EventCallback& on_event,
             absl::Time start)
      : gw_(gateway),
        req_(req),
        deadline_(deadline),
        is_cancelled_(is_cancelled),
        on_event_(on_event),
        start_(start) {}

  // Runs attempts until one succeeds or fails for good. On UNAVAILABLE before any output the
  // request starts again (at most max_attempts in all) on other workers. On UNAVAILABLE after
  // output (n = 1 only) it resumes (at most max_resumes times): prefill of the prompt and the
  // committed canvases on healthy workers, then denoising from the next canvas with the same
  // seed; what the client already has is not sent again.
  absl::Status Run();

 private:
  // The workers of one attempt, and the id they know it by.
  struct Workers {
    std::string prefill, denoise, attempt_id;
  };

  absl::Status RunAttempt();
  // The request's final error after `failures_.size()` failed attempts (the last is `last`):
  // with more than one, logged in one line with every attempt's cause (worker addresses
  // included) and returned with the earlier attempts' causes appended (without them).
  absl::Status Fail(const absl::Status& last);
  // A fresh client-facing stream (before any output).
  void ResetStream();
  // The committed canvases' raw tokens that a resume prefills after the prompt (empty unless
  // n = 1 and blocks arrived).
  const std::vector<int32_t>& Committed() const;
  // A healthy denoise worker, then a healthy prefill worker (by prompt prefix, for its cache),
  // neither of them failed earlier in this request; and a fresh internal id.
  absl::StatusOr<Workers> PickWorkers() const;
  // Phase 1: prefill on the prefill worker, the KV sent to the denoise worker (held there under
  // a lease until the denoise call claims it). Sets prefill_.
  absl::Status Prefill(const Workers& w, CancelWatcher& watcher);
  // Tells the attempt's denoise worker to drop it (best effort, at most 1 s): KV it holds or
  // is still receiving for the attempt is freed now instead of at the end of its lease.
  void CancelOnDenoiseWorker(const Workers& w) const;
  // Phase 2: the denoise call's request.
  v1::DenoiseRequest MakeDenoiseRequest(const std::string& attempt_id) const;
  // Phases 2–3: calls Denoise and relays its events until every sample has ended (OK), the
  // client went away (CANCELLED), or the call failed.
  absl::Status Denoise(const Workers& w, CancelWatcher& watcher);
  // Relays one step / block event of sample `index`; false when the client went away.
  bool OnStep(int index, const v1::DenoiseStepEvent& step);
  bool OnBlock(int index, const v1::DenoiseBlockEvent& block);
  // Every sample has ended: the prompt's usage counted, and FinishSample for each sample (by
  // index) whose Finished has not been sent.
  absl::Status FinishSamples();
  // Sample `index` has ended: flushes its held-back text, then sends its Finished event with
  // its usage (once), so a choice that ends early is reported when it ends, not when the last
  // one does. False when the client went away.
  bool FinishSample(int index);
  // Sends one event to the client; false (and the denoise call cancelled) when it went away.
  bool Emit(const v1::GenerateEvent& ev);
  void EndSample(SampleStream& s) {
    if (s.done) return;
    s.done = true;
    --open_;
  }

  Gateway& gw_;
  const PreparedRequest& req_;
  const absl::Time deadline_;
  const std::function<bool()>& is_cancelled_;
  const EventCallback& on_event_;
  const absl::Time start_;
  std::set<std::string> bad_prefill_, bad_denoise_;  // failed in this request
  // Why each failed attempt (or resume) failed, for the client (no worker addresses) and for
  // the log (naming the workers); log_cause_ is the current attempt's, set where it fails.
  struct Failure {
    std::string client, log;
  };
  std::vector<Failure> failures_;
  std::string log_cause_;
  bool output_sent_ = false;
  int resumes_ = 0;
  v1::PrefillResponse prefill_;  // the prompt's (the first attempt that reached the client)
  // The client-facing stream of each sample, and how many have not ended yet.
  std::vector<std::unique_ptr<SampleStream>> samples_;
  int open_ = 0;
  bool first_step_ = true, first_block_ = true;
  double first_step_s_ = 0, first_block_s_ = 0;
  bool client_gone_ = false;
  grpc::ClientContext* denoise_ctx_ = nullptr;  // the denoise call in flight, if any
};

absl::Status Gateway::Generate(const v1::GenerateRequest& request, absl::Time deadline,
                               const std::function<bool()>& is_cancelled,
                               const EventCallback& on_event) {
  const absl::Time start = absl::Now();
  auto count = [&](const absl::Status& s) {
    if (metrics_) {
      metrics_->RequestsWithStatus(absl::StatusCodeToString(s.code())).Increment();
      if (s.ok()) metrics_->request_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - start));
    }
    return s;
  };
  if (draining_) return count(absl::UnavailableError("gateway is draining"));
  // Admission comes first: a request beyond the limit is refused before its prompt is
  // tokenized or its chat template rendered (that work is what the limit bounds).
  absl::Duration waited;
  if (absl::Status admitted = admission_.Acquire(deadline, is_cancelled, &waited);
      !admitted.ok()) {
    if (metrics_ && !absl::IsResourceExhausted(admitted)) {
      metrics_->queue_seconds.Observe(absl::ToDoubleSeconds(waited));
    }
    return count(admitted);
  }
  if (metrics_) metrics_->queue_seconds.Observe(absl::ToDoubleSeconds(waited));
  absl::StatusOr<PreparedRequest> prepared = Prepare(request);
  if (!prepared.ok()) {
    admission_.Release();
    return count(prepared.status());
  }
  RequestRun run(*this, *prepared, deadline, is_cancelled, on_event, start);
  const absl::Status status = run.Run();
  admission_.Release();
  return count(status);
}

absl::Status Gateway::RequestRun::Run() {
  int attempts = 0;  // started before any output
  for (;;) {
    if (!output_sent_) {
      ResetStream();
      ++attempts;
    }
    log_cause_.clear();
    const absl::Status status = RunAttempt();
    if (status.ok()) return status;
    failures_.push_back(
        {std::string(status.message()),
         log_cause_.empty() ? std::string(status.message()) : std::move(log_cause_)});
    if (!absl::IsUnavailable(status)) return Fail(status);
    if (absl::Now() >= deadline_ || (is_cancelled_ && is_cancelled_())) return Fail(status);
    if (!output_sent_) {
      if (attempts >= gw_.options_.max_attempts) return Fail(status);
      if (gw_.metrics_) gw_.metrics_->retries.Increment();
      continue;
    }
    // Output was sent. Parallel samples (n > 1) do not resume: the client gets the error.
    if (req_.n != 1 || open_ == 0) return Fail(status);
    SampleStream& s = *samples_[0];
    const int C = gw_.config_.canvas_length;
    if (s.done || s.awaiting_worker_finish || s.completion != int(s.block_ids.size()) ||
        s.block_ids.size() != size_t(s.canvases) * C) {
      return Fail(status);  // not a run of whole raw canvases (cannot happen while it runs on)
    }
    if (s.completion >= req_.max_tokens) {
      // The last block arrived, only the worker's Finished is missing.
      s.finish_reason = "length";
      EndSample(s);
      return FinishSamples();
    }
    if (resumes_ >= gw_.options_.max_resumes) {
      if (gw_.options_.max_resumes == 0) return Fail(status);
      return Fail(absl::UnavailableError(absl::StrCat(
          status.message(), "; gave up after ", resumes_, " resumes (the gateway's --max_resumes)")));
    }
    ++resumes_;
    if (gw_.metrics_) gw_.metrics_->resumes.Increment();
    DGSERVE_LOG_WARNING("request %s: resuming at canvas %d (resume %d of %d) after: %s",
                        req_.request_id, s.canvases, resumes_, gw_.options_.max_resumes,
                        status.message());
  }
}

absl::Status Gateway::RequestRun::Fail(const absl::Status& last) {
  if (failures_.size() <= 1) return last;  // a worker's failure is logged where it happens
  std::string log, earlier;
  for (size_t i = 0; i < failures_.size(); ++i) {
    absl::StrAppend(&log, i > 0 ? "; " : "", "attempt ", i + 1, ": ", failures_[i].log);
    if (i + 1 < failures_.size()) {
      absl::StrAppend(&earlier, i > 0 ? "; " : "", i + 1, ": ", failures_[i].client);
    }
  }
  DGSERVE_LOG_WARNING("request %s failed after %d attempts (%d resumes): %s", req_.request_id,
                      int(failures_.size()), resumes_, log);
  return absl::Status(last.code(), absl::StrCat(last.message(), " (attempt ", failures_.size(),
                                                "; earlier attempts: ", earlier, ")"));
}

void Gateway::RequestRun::ResetStream() {
  samples_.clear();
  for (int i = 0; i < req_.n; ++i) {
    samples_.push_back(std::make_unique<SampleStream>(gw_.tokenizer_, req_.stop));
  }
  open_ = req_.n;
  first_step_ = first_block_ = true;
  first_step_s_ = first_block_s_ = 0;
  client_gone_ = false;
}

const std::vector<int32_t>& Gateway::RequestRun::Committed() const {
  static const std::vector<int32_t> kNone;
  return req_.n == 1 ? samples_[0]->block_ids : kNone;
}

absl::StatusOr<Gateway::RequestRun::Workers> Gateway::RequestRun::PickWorkers() const {
  Workers w;
  const std::optional<std::string> d = gw_.denoise_->Pick(0, bad_denoise_);
  if (!d) {
    return absl::UnavailableError(
        absl::StrCat("no healthy denoise worker (", gw_.denoise_->total_count(), " known)"));
  }
  w.denoise = *d;
  const size_t key_len = std::min<size_t>(req_.prompt.size(), 64);
  const uint64_t key = Fnv1a64(std::string_view(reinterpret_cast<const char*>(req_.prompt.data()),
                                                key_len * sizeof(int32_t))) |
                       1;
  const std::optional<std::string> p = gw_.prefill_->Pick(key, bad_prefill_);
  if (!p) {
    return absl::UnavailableError(
        absl::StrCat("no healthy prefill worker (", gw_.prefill_->total_count(), " known)"));
  }
  w.prefill = *p;
  // The workers know an attempt by an id of its own, not derived from the public request id (a
  // client that knows its id, or guesses another's, cannot address the request inside the
  // cluster), and fresh for every attempt.
  absl::StatusOr<std::string> internal_id = NewInternalId();
  if (!internal_id.ok()) return internal_id.status();
  w.attempt_id = *std::move(internal_id);
  return w;
}

absl::Status Gateway::RequestRun::RunAttempt() {
  absl::StatusOr<Workers> w = PickWorkers();
  if (!w.ok()) return w.status();
  CancelWatcher watcher(is_cancelled_);
  if (absl::Status s = Prefill(*w, watcher); !s.ok()) return s;
  if (gw_.metrics_) {
    gw_.metrics_->prefill_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - start_));
  }
  if (gw_.options_.testing_delay_before_denoise > absl::ZeroDuration()) {
    absl::SleepFor(gw_.options_.testing_delay_before_denoise);
  }
  if (absl::Status s = Denoise(*w, watcher); !s.ok()) {
    // A denoise call that ended by the deadline or the client may never have reached the
    // worker (a deadline that passed as the prefill returned fails the call at once), and then
    // nothing claims the KV the prefill sent: drop it.
    if (absl::IsDeadlineExceeded(s) || absl::IsCancelled(s)) CancelOnDenoiseWorker(*w);
    return s;
  }
  return FinishSamples();
}

absl::Status Gateway::RequestRun::Prefill(const Workers& w, CancelWatcher& watcher) {
  v1::PrefillRequest preq;
  preq.set_request_id(w.attempt_id);
  preq.mutable_tokens()->Assign(req_.prompt.begin(), req_.prompt.end());
  const std::vector<int32_t>& committed = Committed();
  preq.mutable_tokens()->Add(committed.begin(), committed.end());
  preq.set_kv_target(w.denoise);
  preq.set_lease_ms(gw_.options_.kv_lease_ms);
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChrono(deadline_));
  watcher.Watch(&ctx);
  gw_.prefill_->Acquire(w.prefill);
  v1::PrefillResponse response;
  grpc::Status s = v1::PrefillService::NewStub(gw_.prefill_->Channel(w.prefill))
                       ->Prefill(&ctx, preq, &response);
  gw_.prefill_->Release(w.prefill);
  watcher.Watch(nullptr);
  if (s.ok()) {
    if (!output_sent_) prefill_ = response;  // a resume's prefill is not the prompt's usage
    return absl::OkStatus();
  }
  // The KV may already sit on the denoise worker (the transfer can finish after this call
  // gave up).
  CancelOnDenoiseWorker(w);
  if (watcher.cancelled()) return absl::CancelledError("request cancelled by the client");
  absl::Status st = FromGrpcStatus(s);
  if (absl::IsUnavailable(st)) {
    // Either the prefill worker or the transfer to the denoise worker failed.
    if (s.error_message().find("KV transfer to") != std::string::npos) {
      bad_denoise_.insert(w.denoise);
      gw_.denoise_->MarkUnhealthy(w.denoise, std::string(st.message()));
    } else {
      bad_prefill_.insert(w.prefill);
      gw_.prefill_->MarkUnhealthy(w.prefill, std::string(st.message()));
    }
  }
  // Worker addresses are for the log, not for clients.
  log_cause_ = absl::StrCat("prefill on ", w.prefill, " (KV to ", w.denoise, "): ", st.message());
  DGSERVE_LOG_WARNING("request %s: %s", w.attempt_id, log_cause_);
  return absl::Status(st.code(),
                      absl::StrCat("prefill: ", HideWorkers(st.message(), w.prefill, w.denoise)));
}

void Gateway::RequestRun::CancelOnDenoiseWorker(const Workers& w) const {
  grpc::ClientContext cctx;
  cctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::CancelRequest creq;
  creq.set_request_id(w.attempt_id);
  v1::CancelResponse cresp;
  v1::DenoiseService::NewStub(gw_.denoise_->Channel(w.denoise))->Cancel(&cctx, creq, &cresp);
}

v1::DenoiseRequest Gateway::RequestRun::MakeDenoiseRequest(const std::string& attempt_id) const {
  v1::DenoiseRequest dreq;
  dreq.set_request_id(attempt_id);
  // A resume continues after the committed canvases, which are part of its prompt KV.
  const int committed = int(Committed().size());
  dreq.set_prompt_tokens(int(req_.prompt.size()) + committed);
  dreq.set_max_new_tokens(req_.max_tokens - committed);
  dreq.set_first_canvas(committed / gw_.config_.canvas_length);
  dreq.set_seed(req_.seed);
  *dreq.mutable_sampler() = req_.sampler;
  dreq.mutable_stop_token_ids()->Assign(gw_.generation_.stop_token_ids.begin(),
                                        gw_.generation_.stop_token_ids.end());
  dreq.set_pad_token_id(gw_.generation_.pad_token_id);
  // Step 0 and the last step of every canvas always come back (for the TTFT metrics); more
  // only when the client asked for canvas steps.
  dreq.set_canvas_step_interval(req_.canvas_step_interval > 0 ? req_.canvas_step_interval
                                                              : (1 << 30));
  dreq.set_kv_wait_ms(gw_.options_.kv_lease_ms);
  if (req_.canvas_template) *dreq.mutable_canvas_template() = *req_.canvas_template;
  dreq.set_num_samples(req_.n);
  // The worker ends a sample at a stop sequence itself (no further step or commit, finished
  // OK); on a resume it needs the completion so far for a stop sequence spanning the canvases.
  dreq.mutable_stop_sequences()->Assign(req_.stop.begin(), req_.stop.end());
  if (committed > 0) {
    const std::vector<int32_t>& ids = samples_[0]->all_ids;
    dreq.mutable_completion_token_ids()->Assign(ids.begin(), ids.end());
  }
  return dreq;
}

bool Gateway::RequestRun::Emit(const v1::GenerateEvent& ev) {
  output_sent_ = true;
  if (!on_event_(ev)) {
    client_gone_ = true;
    if (denoise_ctx_) denoise_ctx_->TryCancel();
    return false;
  }
  return true;
}

absl::Status Gateway::RequestRun::Denoise(const Workers& w, CancelWatcher& watcher) {
  const v1::DenoiseRequest dreq = MakeDenoiseRequest(w.attempt_id);
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChrono(deadline_));
  // The context goes with this scope: neither the watcher (its thread cancels on the client's
  // behalf) nor Emit may reach it after.
  struct Forget {
    CancelWatcher& watcher;
    grpc::ClientContext*& ctx;
    ~Forget() {
      watcher.Watch(nullptr);
      ctx = nullptr;
    }
  } forget{watcher, denoise_ctx_};
  watcher.Watch(&ctx);
  denoise_ctx_ = &ctx;
  gw_.denoise_->Acquire(w.denoise);
  auto reader = v1::DenoiseService::NewStub(gw_.denoise_->Channel(w.denoise))->Denoise(&ctx, dreq);

  const int n = req_.n;
  absl::Status bad_event;  // the worker named a sample the request does not have
  v1::DenoiseEvent ev;
  while (open_ > 0 && !client_gone_ && reader->Read(&ev)) {
    if (ev.sample() < 0 || ev.sample() >= n) {
      bad_event = absl::InternalError(absl::StrCat("the denoise worker sent an event of sample ",
                                                   ev.sample(), " for a request of ", n));
      break;
    }
    const int index = ev.sample();
    SampleStream& s = *samples_[index];
    if (s.done) continue;  // ended; the worker runs the others on
    if (s.awaiting_worker_finish && !ev.has_finished()) {
      EndSample(s);  // the worker went on with this sample (it should not): stopped below
      continue;
    }
    if (ev.has_step()) {
      OnStep(index, ev.step());
    } else if (ev.has_block()) {
      if (!OnBlock(index, ev.block())) break;
    } else if (ev.has_finished()) {
      s.worker_finished = ev.finished();
      s.worker_done = true;
      if (s.finish_reason.empty()) s.finish_reason = s.worker_finished.finish_reason();
      EndSample(s);
      // Reported now: the other samples may run for many more canvases (or be cut by the
      // deadline).
      if (!FinishSample(index)) break;
    }
  }
  // The stream ended right after a completion's last block: nothing is missing.
  if (!client_gone_ && bad_event.ok()) {
    for (auto& s : samples_) {
      if (s->awaiting_worker_finish) EndSample(*s);
    }
  }
  if (client_gone_) {
    gw_.denoise_->Release(w.denoise);
    return absl::CancelledError("the client went away");
  }
  if (open_ > 0 || !bad_event.ok()) {
    if (!bad_event.ok()) ctx.TryCancel();
    grpc::Status s = reader->Finish();
    gw_.denoise_->Release(w.denoise);
    if (watcher.cancelled()) return absl::CancelledError("request cancelled by the client");
    absl::Status st = bad_event.ok() ? FromGrpcStatus(s) : bad_event;
    if (st.ok()) st = absl::InternalError("denoise stream ended without a result");
    if (absl::IsUnavailable(st)) {
      bad_denoise_.insert(w.denoise);
      gw_.denoise_->MarkUnhealthy(w.denoise, std::string(st.message()));
    }
    log_cause_ = absl::StrCat("denoise on ", w.denoise, ": ", st.message());
    DGSERVE_LOG_WARNING("request %s: %s", w.attempt_id, log_cause_);
    return absl::Status(
        st.code(), absl::StrCat("denoise: ", HideWorkers(st.message(), w.prefill, w.denoise)));
  }
  // Every sample finished (by the worker, a stop token or sequence, or max_tokens): stop the
  // worker if it is still running.
  const bool worker_done = std::all_of(samples_.begin(), samples_.end(),
                                       [](const auto& s) { return s->worker_done; });
  if (!worker_done) ctx.TryCancel();  // a worker that sent every Finished ends its stream itself
  reader->Finish();
  gw_.denoise_->Release(w.denoise);
  return absl::OkStatus();
}

bool Gateway::RequestRun::OnStep(int index, const v1::DenoiseStepEvent& step) {
  if (first_step_) {
    first_step_ = false;
    first_step_s_ = absl::ToDoubleSeconds(absl::Now() - start_);
    if (gw_.metrics_) gw_.metrics_->first_step_seconds.Observe(first_step_s_);
  }
  if (req_.canvas_step_interval <= 0) return true;
  SampleStream& s = *samples_[index];
  if (step.canvas() < s.sent_step_canvas ||
      (step.canvas() == s.sent_step_canvas && step.step() <= s.sent_step)) {
    return true;  // sent before a resume
  }
  s.sent_step_canvas = step.canvas();
  s.sent_step = step.step();
  v1::GenerateEvent out;
  out.set_request_id(req_.request_id);
  out.set_index(index);
  v1::CanvasStep* cs = out.mutable_canvas_step();
  cs->set_canvas(step.canvas());
  cs->set_step(step.step());
  *cs->mutable_token_ids() = step.token_ids();
  if (req_.canvas_text) {
    cs->set_text(gw_.tokenizer_.Decode(
        std::span<const int32_t>(step.token_ids().data(), size_t(step.token_ids_size())),
        /*skip_special=*/true));
  }
  cs->set_accepted(step.accepted());
  cs->set_mean_entropy(step.mean_entropy());
  cs->set_temperature(step.temperature());
  return Emit(out);
}

bool Gateway::RequestRun::OnBlock(int index, const v1::DenoiseBlockEvent& block) {
  SampleStream& s = *samples_[index];
  if (first_block_) {
    first_block_ = false;
    first_block_s_ = absl::ToDoubleSeconds(absl::Now() - start_);
    if (gw_.metrics_) gw_.metrics_->first_block_seconds.Observe(first_block_s_);
  }
  ++s.canvases;
  s.block_ids.insert(s.block_ids.end(), block.token_ids().begin(), block.token_ids().end());
  s.steps += block.steps();
  s.last_index = block.index();
  if (gw_.metrics_) gw_.metrics_->steps_per_canvas.Observe(block.steps());
  v1::GenerateEvent out;
  out.set_request_id(req_.request_id);
  out.set_index(index);
  v1::BlockCommitted* b = out.mutable_block();
  b->set_index(block.index());
  b->set_steps(block.steps());
  // Completion tokens of this block: up to the first stop token, at most max_tokens in
  // all (per sample). Decoded as one piece (as `dgserve generate` streams it), then through
  // the stop sequences; a stop sequence cuts the text, the block's ids stay whole.
  const std::vector<int32_t>& stop_ids = gw_.generation_.stop_token_ids;
  std::vector<int32_t> take;
  for (int32_t id : block.token_ids()) {
    if (s.completion == req_.max_tokens) {
      s.finish_reason = "length";
      break;
    }
    if (std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end()) {
      s.finish_reason = "stop";
      break;
    }
    ++s.completion;
    take.push_back(id);
    b->add_token_ids(id);
  }
  s.all_ids.insert(s.all_ids.end(), take.begin(), take.end());
  StopMatcher::Result r = s.matcher.Push(s.decoder.Push(take));
  std::string text = std::move(r.emit);
  s.emitted_bytes += text.size();
  if (r.stopped) {
    s.finish_reason = "stop";
    // The completion is the shortest prefix of the generated ids whose text covers the emitted
    // text (which ends where the stop sequence begins, possibly in an earlier canvas): a token
    // that holds both returned text and the start of the stop sequence is counted and kept,
    // so usage and ids account for every returned byte; tokens wholly inside or past the stop
    // text are not (as with OpenAI, the stop text is not returned). Ids already streamed in
    // earlier blocks cannot be taken back; usage and the unary response's ids are cut to it.
    size_t lo = 0, hi = s.all_ids.size();
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (gw_.tokenizer_.Decode(std::span<const int32_t>(s.all_ids.data(), mid), true).size() >=
          s.emitted_bytes) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const int keep_total = int(lo);
    const int before_block = s.completion - int(take.size());
    b->mutable_token_ids()->Truncate(std::max(0, keep_total - before_block));
    s.completion = keep_total;
  }
  b->set_text(text);
  if (!Emit(out)) return false;
  // The worker ends the sample at this block too (a stop token, max_tokens, or the stop
  // sequence it matches itself): its Finished, with the denoise and commit timings, comes next.
  // A worker that goes on instead is stopped in Denoise().
  if (!s.finish_reason.empty()) s.awaiting_worker_finish = true;
  return true;
}

absl::Status Gateway::RequestRun::FinishSamples() {
  if (GatewayMetrics* metrics = gw_.metrics_) {
    metrics->prompt_tokens.Increment(double(req_.prompt.size()));
    metrics->cached_prompt_tokens.Increment(prefill_.cached_tokens());
  }
  for (int i = 0; i < req_.n; ++i) {
    if (!FinishSample(i)) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

bool Gateway::RequestRun::FinishSample(int index) {
  SampleStream& s = *samples_[index];
  if (s.finished_sent) return true;
  s.finished_sent = true;
  if (!s.matcher.stopped()) {
    std::string tail = s.matcher.Push(s.decoder.Finish()).emit;
    if (!s.matcher.stopped()) tail += s.matcher.Flush();
    if (!tail.empty()) {
      v1::GenerateEvent out;
      out.set_request_id(req_.request_id);
      out.set_index(index);
      out.mutable_block()->set_index(s.last_index);
      out.mutable_block()->set_text(tail);
      if (!Emit(out)) return false;
    }
  }
  v1::GenerateEvent out;
  out.set_request_id(req_.request_id);
  out.set_index(index);
  v1::Finished* f = out.mutable_finished();
  f->set_finish_reason(s.finish_reason.empty() ? "length" : s.finish_reason);
  v1::Usage* u = f->mutable_usage();
  u->set_prompt_tokens(int(req_.prompt.size()));
  u->set_completion_tokens(s.completion);
  u->set_total_tokens(int(req_.prompt.size()) + s.completion);
  u->set_cached_prompt_tokens(prefill_.cached_tokens());
  u->set_canvases(s.canvases);
  u->set_denoising_steps(s.steps);
  v1::Timings* t = u->mutable_timings();
  t->set_queue_seconds(prefill_.queue_seconds());
  t->set_prefill_seconds(prefill_.prefill_seconds());
  t->set_transfer_seconds(prefill_.transfer_seconds());
  t->set_first_step_seconds(first_step_s_);
  t->set_first_block_seconds(first_block_s_);
  t->set_denoise_seconds(s.worker_finished.denoise_seconds());
  t->set_commit_seconds(s.worker_finished.commit_seconds());
  t->set_total_seconds(absl::ToDoubleSeconds(absl::Now() - start_));
  if (GatewayMetrics* metrics = gw_.metrics_) {
    metrics->completion_tokens.Increment(s.completion);
    metrics->samples.Increment();
  }
  return Emit(out);
}

}  // namespace dgserve
