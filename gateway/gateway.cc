#include "gateway/gateway.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/logging.h"
#include "absl/synchronization/mutex.h"
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
  size_t emitted_bytes = 0;      // completion text emitted so far
  // The completion ended at a block by max_tokens or a stop token: the worker ends this
  // sample there too and its Finished (with the denoise and commit timings) comes next.
  bool awaiting_worker_finish = false;
  bool worker_done = false;  // the worker's Finished of this sample arrived
  bool done = false;         // the completion has ended
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
  switch (request.input_case()) {
    case v1::GenerateRequest::kText:
      if (request.text().empty()) return absl::InvalidArgumentError("prompt: must not be empty");
      // A prompt is text: control-token strings in it are not control tokens (raw control
      // tokens can be sent as token ids).
      p.prompt = tokenizer_.EncodeText(request.text(), /*add_bos=*/true);
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
  const int64_t limit = config_.max_position_embeddings;
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
                     " canvases of ", C, " tokens for max_tokens=", p.max_tokens,
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
  absl::StatusOr<PreparedRequest> prepared = Prepare(request);
  if (!prepared.ok()) return count(prepared.status());
  absl::Duration waited;
  if (absl::Status admitted = admission_.Acquire(deadline, is_cancelled, &waited);
      !admitted.ok()) {
    if (metrics_ && !absl::IsResourceExhausted(admitted)) {
      metrics_->queue_seconds.Observe(absl::ToDoubleSeconds(waited));
    }
    return count(admitted);
  }
  if (metrics_) metrics_->queue_seconds.Observe(absl::ToDoubleSeconds(waited));
  std::set<std::string> bad_prefill, bad_denoise;
  bool output_sent = false;
  absl::Status status;
  for (int attempt = 0; attempt < options_.max_attempts; ++attempt) {
    if (attempt > 0 && metrics_) metrics_->retries.Increment();
    status = RunAttempt(*prepared, deadline, is_cancelled, on_event, &bad_prefill, &bad_denoise,
                        &output_sent, start);
    if (status.ok() || !absl::IsUnavailable(status) || output_sent) break;
    if (absl::Now() >= deadline || (is_cancelled && is_cancelled())) break;
  }
  admission_.Release();
  return count(status);
}

absl::Status Gateway::RunAttempt(const PreparedRequest& req, absl::Time deadline,
                                 const std::function<bool()>& is_cancelled,
                                 const EventCallback& on_event, std::set<std::string>* bad_prefill,
                                 std::set<std::string>* bad_denoise, bool* output_sent,
                                 absl::Time start) {
  const std::optional<std::string> d = denoise_->Pick(0, *bad_denoise);
  if (!d) {
    return absl::UnavailableError(
        absl::StrCat("no healthy denoise worker (", denoise_->total_count(), " known)"));
  }
  const size_t key_len = std::min<size_t>(req.prompt.size(), 64);
  const uint64_t key = Fnv1a64(std::string_view(reinterpret_cast<const char*>(req.prompt.data()),
                                                key_len * sizeof(int32_t))) |
                       1;
  const std::optional<std::string> p = prefill_->Pick(key, *bad_prefill);
  if (!p) {
    return absl::UnavailableError(
        absl::StrCat("no healthy prefill worker (", prefill_->total_count(), " known)"));
  }
  // The workers know an attempt by an id of its own, not derived from the public request id (a
  // client that knows its id, or guesses another's, cannot address the request inside the
  // cluster), and fresh for every attempt.
  absl::StatusOr<std::string> internal_id = NewInternalId();
  if (!internal_id.ok()) return internal_id.status();
  const std::string attempt_id = *std::move(internal_id);
  CancelWatcher watcher(is_cancelled);

  // 1. Prefill on P; the KV goes to D (held there under a lease until the denoise call claims
  //    it).
  v1::PrefillResponse prefill;
  {
    v1::PrefillRequest preq;
    preq.set_request_id(attempt_id);
    preq.mutable_tokens()->Assign(req.prompt.begin(), req.prompt.end());
    preq.set_kv_target(*d);
    preq.set_lease_ms(options_.kv_lease_ms);
    grpc::ClientContext ctx;
    ctx.set_deadline(ToChrono(deadline));
    watcher.Watch(&ctx);
    prefill_->Acquire(*p);
    grpc::Status s =
        v1::PrefillService::NewStub(prefill_->Channel(*p))->Prefill(&ctx, preq, &prefill);
    prefill_->Release(*p);
    watcher.Watch(nullptr);
    if (!s.ok()) {
      // The KV may already sit on the denoise worker (the transfer can finish after this call
      // gave up): tell it to drop it now instead of at the end of its lease.
      {
        grpc::ClientContext cctx;
        cctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
        v1::CancelRequest creq;
        creq.set_request_id(attempt_id);
        v1::CancelResponse cresp;
        v1::DenoiseService::NewStub(denoise_->Channel(*d))->Cancel(&cctx, creq, &cresp);
      }
      if (watcher.cancelled()) return absl::CancelledError("request cancelled by the client");
      absl::Status st = FromGrpcStatus(s);
      if (absl::IsUnavailable(st)) {
        // Either the prefill worker or the transfer to the denoise worker failed.
        if (s.error_message().find("KV transfer to") != std::string::npos) {
          bad_denoise->insert(*d);
          denoise_->MarkUnhealthy(*d);
        } else {
          bad_prefill->insert(*p);
          prefill_->MarkUnhealthy(*p);
        }
      }
      // Worker addresses are for the log, not for clients.
      DGSERVE_LOG_WARNING("request %s: prefill on %s (KV to %s): %s", attempt_id, *p, *d,
                          st.message());
      return absl::Status(st.code(), absl::StrCat("prefill: ", HideWorkers(st.message(), *p, *d)));
    }
  }
  if (metrics_) {
    metrics_->prefill_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  }

  // 2. Denoise on D, streaming its events to the client.
  v1::DenoiseRequest dreq;
  dreq.set_request_id(attempt_id);
  dreq.set_prompt_tokens(int(req.prompt.size()));
  dreq.set_max_new_tokens(req.max_tokens);
  dreq.set_seed(req.seed);
  *dreq.mutable_sampler() = req.sampler;
  dreq.mutable_stop_token_ids()->Assign(generation_.stop_token_ids.begin(),
                                        generation_.stop_token_ids.end());
  dreq.set_pad_token_id(generation_.pad_token_id);
  // Step 0 and the last step of every canvas always come back (for the TTFT metrics); more
  // only when the client asked for canvas steps.
  dreq.set_canvas_step_interval(req.canvas_step_interval > 0 ? req.canvas_step_interval
                                                             : (1 << 30));
  dreq.set_kv_wait_ms(options_.kv_lease_ms);
  if (req.canvas_template) *dreq.mutable_canvas_template() = *req.canvas_template;
  dreq.set_num_samples(req.n);
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChrono(deadline));
  watcher.Watch(&ctx);
  denoise_->Acquire(*d);
  auto reader = v1::DenoiseService::NewStub(denoise_->Channel(*d))->Denoise(&ctx, dreq);

  const int n = req.n;
  std::vector<std::unique_ptr<SampleStream>> samples;
  for (int i = 0; i < n; ++i) {
    samples.push_back(std::make_unique<SampleStream>(tokenizer_, req.stop));
  }
  const std::vector<int32_t>& stop_ids = generation_.stop_token_ids;
  int open = n;  // samples whose completion has not ended yet
  bool first_step = true, first_block = true, client_gone = false;
  double first_step_s = 0, first_block_s = 0;
  absl::Status bad_event;  // the worker named a sample the request does not have
  auto emit = [&](const v1::GenerateEvent& ev) {
    *output_sent = true;
    if (!on_event(ev)) {
      client_gone = true;
      ctx.TryCancel();
      return false;
    }
    return true;
  };
  auto end_sample = [&](SampleStream& s) {
    if (s.done) return;
    s.done = true;
    --open;
  };

  v1::DenoiseEvent ev;
  while (open > 0 && !client_gone && reader->Read(&ev)) {
    if (ev.sample() < 0 || ev.sample() >= n) {
      bad_event = absl::InternalError(absl::StrCat("the denoise worker sent an event of sample ",
                                                   ev.sample(), " for a request of ", n));
      break;
    }
    const int index = ev.sample();
    SampleStream& s = *samples[index];
    if (s.done) continue;  // ended here by a stop sequence; the worker runs the others on
    if (s.awaiting_worker_finish && !ev.has_finished()) {
      end_sample(s);  // the worker went on with this sample (it should not): stopped below
      continue;
    }
    if (ev.has_step()) {
      if (first_step) {
        first_step = false;
        first_step_s = absl::ToDoubleSeconds(absl::Now() - start);
        if (metrics_) metrics_->first_step_seconds.Observe(first_step_s);
      }
      if (req.canvas_step_interval <= 0) continue;
      v1::GenerateEvent out;
      out.set_request_id(req.request_id);
      out.set_index(index);
      v1::CanvasStep* cs = out.mutable_canvas_step();
      cs->set_canvas(ev.step().canvas());
      cs->set_step(ev.step().step());
      *cs->mutable_token_ids() = ev.step().token_ids();
      if (req.canvas_text) {
        cs->set_text(tokenizer_.Decode(std::span<const int32_t>(ev.step().token_ids().data(),
                                                                size_t(ev.step().token_ids_size())),
                                       /*skip_special=*/true));
      }
      cs->set_accepted(ev.step().accepted());
      cs->set_mean_entropy(ev.step().mean_entropy());
      cs->set_temperature(ev.step().temperature());
      emit(out);
    } else if (ev.has_block()) {
      if (first_block) {
        first_block = false;
        first_block_s = absl::ToDoubleSeconds(absl::Now() - start);
        if (metrics_) metrics_->first_block_seconds.Observe(first_block_s);
      }
      ++s.canvases;
      s.steps += ev.block().steps();
      s.last_index = ev.block().index();
      if (metrics_) metrics_->steps_per_canvas.Observe(ev.block().steps());
      v1::GenerateEvent out;
      out.set_request_id(req.request_id);
      out.set_index(index);
      v1::BlockCommitted* b = out.mutable_block();
      b->set_index(ev.block().index());
      b->set_steps(ev.block().steps());
      // Completion tokens of this block: up to the first stop token, at most max_tokens in
      // all (per sample). Decoded as one piece (as `dgserve generate` streams it), then through
      // the stop sequences; a stop sequence cuts the text, the block's ids stay whole.
      std::vector<int32_t> take;
      for (int32_t id : ev.block().token_ids()) {
        if (s.completion == req.max_tokens) {
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
        // A stop sequence ends the completion at the token in which it begins (possibly in an
        // earlier canvas): the smallest prefix of the completion whose text reaches past the
        // emitted text. Ids already streamed in earlier blocks cannot be taken back; usage and
        // the unary response's ids are cut to this count.
        size_t lo = 0, hi = s.all_ids.size();
        while (lo < hi) {
          const size_t mid = (lo + hi) / 2;
          if (tokenizer_.Decode(std::span<const int32_t>(s.all_ids.data(), mid), true).size() >
              s.emitted_bytes) {
            hi = mid;
          } else {
            lo = mid + 1;
          }
        }
        const int keep_total = int(std::min(lo, s.all_ids.size()));
        const int before_block = s.completion - int(take.size());
        b->mutable_token_ids()->Truncate(std::max(0, keep_total - before_block));
        s.completion = keep_total;
      }
      b->set_text(text);
      if (!emit(out)) break;
      if (!s.finish_reason.empty()) {
        // A stop sequence is the gateway's own: the worker would go on with this sample (it
        // is stopped once every sample has ended); otherwise its Finished comes next.
        if (r.stopped) {
          end_sample(s);
        } else {
          s.awaiting_worker_finish = true;
        }
      }
    } else if (ev.has_finished()) {
      s.worker_finished = ev.finished();
      s.worker_done = true;
      if (s.finish_reason.empty()) s.finish_reason = s.worker_finished.finish_reason();
      end_sample(s);
    }
  }
  // The stream ended right after a completion's last block: nothing is missing.
  if (!client_gone && bad_event.ok()) {
    for (auto& s : samples) {
      if (s->awaiting_worker_finish) end_sample(*s);
    }
  }
  if (client_gone) {
    denoise_->Release(*d);
    return absl::CancelledError("the client went away");
  }
  if (open > 0 || !bad_event.ok()) {
    if (!bad_event.ok()) ctx.TryCancel();
    grpc::Status s = reader->Finish();
    denoise_->Release(*d);
    if (watcher.cancelled()) return absl::CancelledError("request cancelled by the client");
    absl::Status st = bad_event.ok() ? FromGrpcStatus(s) : bad_event;
    if (st.ok()) st = absl::InternalError("denoise stream ended without a result");
    if (absl::IsUnavailable(st)) {
      bad_denoise->insert(*d);
      denoise_->MarkUnhealthy(*d);
    }
    DGSERVE_LOG_WARNING("request %s: denoise on %s: %s", attempt_id, *d, st.message());
    return absl::Status(st.code(), absl::StrCat("denoise: ", HideWorkers(st.message(), *p, *d)));
  }
  // Every sample finished (by the worker, a stop token or sequence, or max_tokens): stop the
  // worker if it is still running, then per sample (by index) flush held-back text and report
  // its usage; the Finished events come last.
  const bool worker_done = std::all_of(samples.begin(), samples.end(),
                                       [](const auto& s) { return s->worker_done; });
  if (!worker_done) ctx.TryCancel();  // a worker that sent every Finished ends its stream itself
  reader->Finish();
  denoise_->Release(*d);
  if (metrics_) {
    metrics_->prompt_tokens.Increment(double(req.prompt.size()));
    metrics_->cached_prompt_tokens.Increment(prefill.cached_tokens());
  }
  for (int i = 0; i < n; ++i) {
    SampleStream& s = *samples[i];
    if (!s.matcher.stopped()) {
      std::string tail = s.matcher.Push(s.decoder.Finish()).emit;
      if (!s.matcher.stopped()) tail += s.matcher.Flush();
      if (!tail.empty()) {
        v1::GenerateEvent out;
        out.set_request_id(req.request_id);
        out.set_index(i);
        out.mutable_block()->set_index(s.last_index);
        out.mutable_block()->set_text(tail);
        if (!emit(out)) return absl::CancelledError("the client went away");
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    const SampleStream& s = *samples[i];
    v1::GenerateEvent out;
    out.set_request_id(req.request_id);
    out.set_index(i);
    v1::Finished* f = out.mutable_finished();
    f->set_finish_reason(s.finish_reason.empty() ? "length" : s.finish_reason);
    v1::Usage* u = f->mutable_usage();
    u->set_prompt_tokens(int(req.prompt.size()));
    u->set_completion_tokens(s.completion);
    u->set_total_tokens(int(req.prompt.size()) + s.completion);
    u->set_cached_prompt_tokens(prefill.cached_tokens());
    u->set_canvases(s.canvases);
    u->set_denoising_steps(s.steps);
    v1::Timings* t = u->mutable_timings();
    t->set_queue_seconds(prefill.queue_seconds());
    t->set_prefill_seconds(prefill.prefill_seconds());
    t->set_transfer_seconds(prefill.transfer_seconds());
    t->set_first_step_seconds(first_step_s);
    t->set_first_block_seconds(first_block_s);
    t->set_denoise_seconds(s.worker_finished.denoise_seconds());
    t->set_commit_seconds(s.worker_finished.commit_seconds());
    t->set_total_seconds(absl::ToDoubleSeconds(absl::Now() - start));
    if (metrics_) {
      metrics_->completion_tokens.Increment(s.completion);
      metrics_->samples.Increment();
    }
    if (!emit(out)) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

}  // namespace dgserve
