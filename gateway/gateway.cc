#include "gateway/gateway.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/excerpt.h"
#include "common/hash.h"
#include "common/logging.h"
#include "common/status_convert.h"
#include "engine/denoise/sampler_params.h"
#include "engine/generation/stop_matcher.h"
#include "engine/tokenizer/chat_template.h"
#include "gateway/request_ids.h"
#include "gateway/request_run.h"
#include "service/canvas_template_proto.h"
#include "service/internal_auth.h"

namespace dgserve {

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
  // A draining gateway says so (503), even while its slots and queue are full (it said 429).
  if (draining_) {
    const absl::Status s = absl::UnavailableError("gateway is draining");
    CountRefused(s);
    return s;
  }
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
  return !draining_ && prefill_->healthy_count() > 0 && denoise_->healthy_count() > 0 &&
         LayoutMismatch().empty();
}

std::string Gateway::LayoutMismatch() const {
  std::string m = KvLayoutMismatch(*prefill_, *denoise_);
  absl::MutexLock lock(&mismatch_mu_);
  if (m != logged_mismatch_) {
    if (!m.empty()) DGSERVE_LOG_WARNING("not ready: %s", m);
    logged_mismatch_ = m;
  }
  return m;
}

std::string Gateway::NotReadyReason() const {
  for (WorkerPool* pool : {prefill_, denoise_}) {
    if (pool->healthy_count() == 0) {
      return absl::StrCat("no healthy ", pool->role(), " worker (", pool->total_count(), " known)");
    }
  }
  return LayoutMismatch();
}

absl::Status Gateway::CheckApiKey(const std::string& bearer) const {
  if (options_.api_keys.empty()) return absl::OkStatus();
  // Every key compared in constant time (as the gRPC interceptor's ApiKeyCheck): how long the
  // refusal took must not tell how much of a key a guess got right.
  bool ok = false;
  for (const std::string& k : options_.api_keys)
    ok |= !bearer.empty() && ConstantTimeEquals(bearer, k);
  if (ok) return absl::OkStatus();
  return absl::UnauthenticatedError(
      bearer.empty() ? "missing API key: send 'Authorization: Bearer <key>'" : "invalid API key");
}

absl::StatusOr<PreparedRequest> Gateway::Prepare(const v1::GenerateRequest& request) const {
  if (!request.model().empty() && request.model() != options_.model_id) {
    return absl::NotFoundError(absl::StrCat("model ", QuotedExcerpt(request.model()),
                                            " does not exist; this gateway serves \"",
                                            options_.model_id, "\""));
  }
  PreparedRequest p;
  const int64_t limit = config_.max_position_embeddings;
  // A prompt must leave room for one canvas: tokenizing (and the chat template) stop as soon as
  // the prompt has more ids than that, so a huge request costs at most about `limit` tokens of
  // work.
  const int C = config_.canvas_length;
  const int64_t context_budget = std::max<int64_t>(limit - C, 0);
  // --max_prompt_tokens, when it binds before the context limit does.
  const bool gateway_bound =
      options_.max_prompt_tokens > 0 && options_.max_prompt_tokens < context_budget;
  const size_t budget = size_t(gateway_bound ? options_.max_prompt_tokens : context_budget);
  // A chat's prompt is its messages (the HTTP param is "messages" too).
  const char* const input =
      request.input_case() == v1::GenerateRequest::kChat ? "messages" : "prompt";
  auto too_long = [&](std::string_view size) {
    if (gateway_bound) {
      return absl::InvalidArgumentError(absl::StrCat(
          input, ": ", std::string(size), " tokens exceed the context limit of this gateway: ",
          "a prompt may have at most ", budget, " tokens (--max_prompt_tokens)"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        input, ": ", std::string(size), " tokens and one canvas of ", C,
        " tokens exceed the context limit of ", limit, " positions (a prompt may have at most ",
        budget, " tokens)"));
  };
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
  if (p.prompt.size() > budget) {
    // Text and chat prompts were tokenized only up to budget + 1 ids.
    return too_long(request.input_case() == v1::GenerateRequest::kTokenIds
                        ? absl::StrCat(p.prompt.size())
                        : absl::StrCat("more than ", budget));
  }
  if (request.max_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens: must be > 0, got ", request.max_tokens()));
  }
  p.max_tokens = request.max_tokens() > 0 ? request.max_tokens() : generation_.max_new_tokens;
  const int64_t canvases = (int64_t(p.max_tokens) + C - 1) / C;
  if (int64_t(p.prompt.size()) + canvases * C > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens: the prompt (", p.prompt.size(), " tokens) plus ", canvases,
                     " canvases of ", C,  // ≥ 2: one canvas fits (checked above)
                     " tokens for max_tokens=", p.max_tokens,
                     " exceed the context limit of ", limit, " positions"));
  }
  if (request.stop_size() > options_.max_stop_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("stop: at most ", options_.max_stop_sequences,
                                                   " sequences, got ", request.stop_size()));
  }
  for (const std::string& s : request.stop()) {
    if (s.empty()) return absl::InvalidArgumentError("stop: sequences must not be empty");
    // A stop sequence holds back that much streamed text and is matched on both the gateway
    // and the denoise worker: bounded, as its count is.
    if (s.size() > kMaxStopSequenceBytes) {
      return absl::InvalidArgumentError(absl::StrCat("stop: a sequence of ", s.size(),
                                                     " bytes; at most ", kMaxStopSequenceBytes));
    }
    p.stop.push_back(s);
  }
  if (request.n() < 0 || request.n() > options_.max_n) {
    return absl::InvalidArgumentError(absl::StrCat("n: must be between 1 and ", options_.max_n,
                                                   " (the gateway's --max_n; 0 means 1), got ",
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
  if (d.has_sample_temperature_spread()) {
    sp.sample_temperature_spread = d.sample_temperature_spread();
  }
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
  p.sampler.set_sample_temperature_spread(sp.sample_temperature_spread);
  if (request.stream_options().canvas_step_interval() < 0) {
    return absl::InvalidArgumentError("canvas_step_interval: must be >= 0");
  }
  p.canvas_step_interval = request.stream_options().canvas_step_interval();
  if (request.stream_options().canvas_text() && p.canvas_step_interval == 0) {
    return absl::InvalidArgumentError("canvas_text: requires canvas_step_interval > 0");
  }
  p.canvas_text = request.stream_options().canvas_text();
  p.continuous_usage = request.stream_options().continuous_usage();
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
      // Budget 1: a huge entry costs two ids of work.
      const std::vector<int32_t> ids = tokenizer_.Encode(t.allowed(i), /*add_bos=*/false, 1);
      if (has_unk(ids)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "canvas_template.allowed[", i, "]: ", QuotedExcerpt(t.allowed(i)),
            " is not in the model's vocabulary (it encodes to <unk>)"));
      }
      if (ids.size() != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "canvas_template.allowed[", i, "]: ", QuotedExcerpt(t.allowed(i)), " is ",
            ids.empty() ? "no token" : "more than one token",
            "; each allowed entry must be exactly one token"));
      }
      allowed.push_back(ids[0]);
    }
    std::vector<int> hole_positions;
    std::string_view rest = t.text();
    for (;;) {
      const size_t at = rest.find(marker);
      const std::string_view piece = rest.substr(0, at);
      if (!piece.empty()) {
        // Within the canvas and one position more: a huge text costs about a canvas of work.
        const size_t room = size_t(std::max(config_.canvas_length + 1 - out.token_ids_size(), 0));
        const std::vector<int32_t> ids = tokenizer_.Encode(piece, /*add_bos=*/false, room);
        if (has_unk(ids)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "canvas_template.text: ", QuotedExcerpt(piece),
              " holds characters outside the model's vocabulary (they encode to <unk>)"));
        }
        for (int32_t id : ids) out.add_token_ids(id);
      }
      if (at == std::string_view::npos || out.token_ids_size() > config_.canvas_length) break;
      hole_positions.push_back(out.token_ids_size());
      out.add_token_ids(-1);
      rest.remove_prefix(at + marker.size());
    }
    if (out.token_ids_size() > config_.canvas_length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "canvas_template.text: its tokens and holes are longer than the canvas (",
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
                               const EventCallback& on_event,
                               const AcceptedCallback& on_accepted) {
  const absl::Time start = absl::Now();
  auto count = [&](const absl::Status& s) {
    if (metrics_) {
      // A gRPC client whose deadline passed ends the call, which reads here as a cancellation.
      const absl::StatusCode code = CancelledAtDeadline(s, deadline, absl::Now()).code();
      metrics_->RequestsWithStatus(absl::StatusCodeToString(code)).Increment();
      if (s.ok()) metrics_->request_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - start));
    }
    return s;
  };
  if (draining_) return count(absl::UnavailableError("gateway is draining"));
  // Admission comes first: a request beyond the limit is refused before its prompt is
  // tokenized or its chat template rendered (that work is what the limit bounds). A request that
  // must wait for a slot is prepared (validated, tokenized) as it joins the queue: a bad one is
  // answered at once, and a good one is accepted there (its front end sends the response head and
  // keep-alives while it waits).
  std::optional<absl::StatusOr<PreparedRequest>> prepared;
  auto prepare = [&]() -> absl::Status {
    prepared = Prepare(request);
    if (!prepared->ok()) return prepared->status();
    if (on_accepted) on_accepted((*prepared)->request_id);
    return absl::OkStatus();
  };
  absl::Duration waited;
  if (absl::Status admitted = admission_.Acquire(deadline, is_cancelled, &waited, prepare);
      !admitted.ok()) {
    const bool refused_unqueued = absl::IsResourceExhausted(admitted) && !prepared.has_value();
    const bool invalid = prepared.has_value() && !prepared->ok();
    if (metrics_ && !refused_unqueued && !invalid) {
      metrics_->queue_seconds.Observe(absl::ToDoubleSeconds(waited));
    }
    return count(admitted);
  }
  if (metrics_) metrics_->queue_seconds.Observe(absl::ToDoubleSeconds(waited));
  if (!prepared.has_value()) {
    if (absl::Status s = prepare(); !s.ok()) {
      admission_.Release();
      return count(s);
    }
  }
  RequestRun run(*this, **prepared, deadline, is_cancelled, on_event, start, waited);
  const absl::Status status = run.Run();
  admission_.Release();
  return count(status);
}

}  // namespace dgserve
