// OpenAI response formats (openai_api.h): the JSON of completions and chat responses, SSE stream
// chunks (text, canvas steps, usage), the models list, and the two event consumers over them,
// ResponseAccumulator (a unary response) and StreamFormatter (an SSE stream). Request parsing is
// in openai_api_parse.cc.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_convert.h"
#include "gateway/generation_core.h"
#include "gateway/openai_api.h"

namespace dgserve {
namespace {

using json = nlohmann::json;

// The shortest decimal that reads back as `f`, as a double (0.1f → 0.1, not 0.100000001…).
double ShortFloat(float f) {
  if (!std::isfinite(f)) return static_cast<double>(f);
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf) - 1, f);
  if (ec != std::errc()) return static_cast<double>(f);
  *end = '\0';
  return std::strtod(buf, nullptr);
}

std::string Dump(const json& j) {
  // Replace invalid UTF-8 (a canvas text can end inside a character) instead of throwing.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// The OpenAI fields of a usage: a chunk's with continuous usage, and the start of UsageObject.
json ChunkUsageObject(const v1::Usage& u) {
  return json{
      {"prompt_tokens", u.prompt_tokens()},
      {"completion_tokens", u.completion_tokens()},
      {"total_tokens", u.total_tokens()},
      {"prompt_tokens_details", {{"cached_tokens", u.cached_prompt_tokens()}}},
  };
}

json UsageObject(const v1::Usage& u) {
  const v1::Timings& t = u.timings();
  json j = ChunkUsageObject(u);
  j["dgserve"] = {{"cached_prompt_tokens", u.cached_prompt_tokens()},
                  {"canvases", u.canvases()},
                  {"denoising_steps", u.denoising_steps()},
                  {"timings",
                   {{"queue_seconds", t.queue_seconds()},
                    {"prefill_seconds", t.prefill_seconds()},
                    {"transfer_seconds", t.transfer_seconds()},
                    {"first_step_seconds", t.first_step_seconds()},
                    {"first_block_seconds", t.first_block_seconds()},
                    {"denoise_seconds", t.denoise_seconds()},
                    {"commit_seconds", t.commit_seconds()},
                    {"total_seconds", t.total_seconds()}}}};
  return j;
}

json NullOr(std::string_view s) { return s.empty() ? json(nullptr) : json(std::string(s)); }

json Envelope(const ResponseContext& ctx, bool chunk) {
  const char* object =
      ctx.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
  return json{{"id", absl::StrCat(ctx.chat ? "chatcmpl-" : "cmpl-", ctx.request_id)},
              {"object", object},
              {"created", ctx.created},
              {"model", ctx.model}};
}

}  // namespace

namespace {
// A non-streaming response with choices[i] = {"index": i, "text" or "message", …}.
std::string ResponseJson(const ResponseContext& ctx, const std::vector<ChoiceResult>& choices,
                         const v1::Usage& usage) {
  json j = Envelope(ctx, /*chunk=*/false);
  json list = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    json c = {{"index", int(i)}};
    if (ctx.chat) {
      c["message"] = {{"role", "assistant"}, {"content", choices[i].text}};
    } else {
      c["text"] = choices[i].text;
    }
    c["logprobs"] = nullptr;
    c["finish_reason"] = NullOr(choices[i].finish_reason);
    list.push_back(std::move(c));
  }
  j["choices"] = std::move(list);
  j["usage"] = UsageObject(usage);
  return Dump(j);
}
}  // namespace

std::string CompletionResponseJson(const ResponseContext& ctx, std::string_view text,
                                   std::string_view finish_reason, const v1::Usage& usage) {
  ResponseContext c = ctx;
  c.chat = false;
  return ResponseJson(c, {ChoiceResult{std::string(text), std::string(finish_reason)}}, usage);
}

std::string ChatCompletionResponseJson(const ResponseContext& ctx, std::string_view content,
                                       std::string_view finish_reason, const v1::Usage& usage) {
  ResponseContext c = ctx;
  c.chat = true;
  return ResponseJson(c, {ChoiceResult{std::string(content), std::string(finish_reason)}}, usage);
}

std::string CompletionChunkJson(const ResponseContext& ctx, std::string_view text,
                                std::string_view finish_reason, int index, const v1::Usage* usage) {
  ResponseContext c = ctx;
  c.chat = false;
  json j = Envelope(c, /*chunk=*/true);
  j["choices"] = json::array({json{{"index", index},
                                   {"text", std::string(text)},
                                   {"logprobs", nullptr},
                                   {"finish_reason", NullOr(finish_reason)}}});
  if (usage != nullptr) j["usage"] = ChunkUsageObject(*usage);
  return Dump(j);
}

std::string ChatChunkJson(const ResponseContext& ctx, std::string_view content, bool with_role,
                          std::string_view finish_reason, int index, const v1::Usage* usage) {
  ResponseContext c = ctx;
  c.chat = true;
  json j = Envelope(c, /*chunk=*/true);
  json delta = json::object();
  if (with_role) delta["role"] = "assistant";
  if (with_role || !content.empty()) delta["content"] = std::string(content);
  j["choices"] = json::array({json{{"index", index},
                                   {"delta", std::move(delta)},
                                   {"logprobs", nullptr},
                                   {"finish_reason", NullOr(finish_reason)}}});
  if (usage != nullptr) j["usage"] = ChunkUsageObject(*usage);
  return Dump(j);
}

std::string UsageChunkJson(const ResponseContext& ctx, const v1::Usage& usage) {
  json j = Envelope(ctx, /*chunk=*/true);
  j["choices"] = json::array();
  j["usage"] = UsageObject(usage);
  return Dump(j);
}

std::string CanvasStepChunkJson(const ResponseContext& ctx, const v1::CanvasStep& step, int index) {
  json j = Envelope(ctx, /*chunk=*/true);
  json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", nullptr}};
  if (ctx.chat) {
    choice["delta"] = json::object();
  } else {
    choice["text"] = "";
  }
  j["choices"] = json::array({std::move(choice)});
  json ids = json::array();
  for (int32_t id : step.token_ids()) ids.push_back(id);
  j["dgserve"] = {{"canvas_step",
                   {{"canvas", step.canvas()},
                    {"step", step.step()},
                    {"token_ids", std::move(ids)},
                    {"text", step.text()},
                    {"accepted", step.accepted()},
                    {"mean_entropy", ShortFloat(step.mean_entropy())},
                    {"temperature", ShortFloat(step.temperature())}}}};
  return Dump(j);
}

namespace {
json ModelObject(const v1::ModelInfo& m, int64_t created) {
  return json{{"id", m.id()},
              {"object", "model"},
              {"created", created},
              {"owned_by", "dgserve"},
              {"context_length", m.context_length()},
              {"dgserve", {{"canvas_length", m.canvas_length()}, {"vocab_size", m.vocab_size()}}}};
}
}  // namespace

std::string ModelsListJson(const v1::ListModelsResponse& models, int64_t created) {
  json data = json::array();
  for (const v1::ModelInfo& m : models.models()) data.push_back(ModelObject(m, created));
  return Dump(json{{"object", "list"}, {"data", std::move(data)}});
}

std::string ModelJson(const v1::ModelInfo& model, int64_t created) {
  return Dump(ModelObject(model, created));
}

std::string SseEvent(std::string_view json_text) {
  return absl::StrCat("data: ", std::string(json_text), "\n\n");
}

std::string SseDone() { return "data: [DONE]\n\n"; }

void ResponseAccumulator::OnEvent(const v1::GenerateEvent& event) {
  if (request_id_.empty() && !event.request_id().empty()) request_id_ = event.request_id();
  const size_t index = size_t(std::max(0, event.index()));
  if (event.event_case() == v1::GenerateEvent::kBlock ||
      event.event_case() == v1::GenerateEvent::kFinished) {
    if (choices_.size() <= index) choices_.resize(index + 1);
  }
  switch (event.event_case()) {
    case v1::GenerateEvent::kBlock: choices_[index].text += event.block().text(); break;
    case v1::GenerateEvent::kFinished:
      choices_[index].finish_reason = event.finished().finish_reason();
      if (finished_) {
        AddSampleUsage(event.finished().usage(), &usage_);
      } else {
        usage_ = event.finished().usage();
      }
      finished_ = true;
      break;
    default: break;
  }
}

std::string ResponseAccumulator::Json(ResponseContext ctx) const {
  if (!request_id_.empty()) ctx.request_id = request_id_;
  if (choices_.empty()) return ResponseJson(ctx, {ChoiceResult{}}, usage_);
  return ResponseJson(ctx, choices_, usage_);
}

StreamFormatter::StreamFormatter(ResponseContext ctx, bool include_usage, int n,
                                 bool continuous_usage)
    : ctx_(std::move(ctx)),
      include_usage_(include_usage),
      continuous_usage_(continuous_usage),
      n_(std::max(1, n)),
      role_sent_(size_t(n_), false) {}

std::string StreamFormatter::OnEvent(const v1::GenerateEvent& event) {
  if (!event.request_id().empty() && !id_adopted_) {
    ctx_.request_id = event.request_id();
    id_adopted_ = true;
  }
  const int index = event.index();
  if (index < 0 || index >= n_) return "";  // not a choice of this request
  switch (event.event_case()) {
    case v1::GenerateEvent::kCanvasStep:
      return SseEvent(CanvasStepChunkJson(ctx_, event.canvas_step(), index));
    case v1::GenerateEvent::kBlock: {
      const std::string& text = event.block().text();
      if (text.empty()) return "";
      const v1::Usage* usage = continuous_usage_ ? &event.block().usage() : nullptr;
      if (!ctx_.chat) return SseEvent(CompletionChunkJson(ctx_, text, {}, index, usage));
      const bool with_role = !role_sent_[index];
      role_sent_[index] = true;
      return SseEvent(ChatChunkJson(ctx_, text, with_role, {}, index, usage));
    }
    case v1::GenerateEvent::kFinished: {
      const std::string& reason = event.finished().finish_reason();
      // With continuous usage the finish chunk carries the choice's final usage.
      const v1::Usage* usage = continuous_usage_ ? &event.finished().usage() : nullptr;
      std::string out;
      if (ctx_.chat) {
        const bool with_role = !role_sent_[index];
        role_sent_[index] = true;
        out = SseEvent(
            ChatChunkJson(ctx_, "", with_role, reason.empty() ? "stop" : reason, index, usage));
      } else {
        out =
            SseEvent(CompletionChunkJson(ctx_, "", reason.empty() ? "stop" : reason, index, usage));
      }
      if (finished_samples_ == 0) {
        usage_ = event.finished().usage();
      } else {
        AddSampleUsage(event.finished().usage(), &usage_);
      }
      // The usage chunk (all samples together) follows the last choice's finish chunk.
      if (++finished_samples_ == n_) {
        finished_ = true;
        if (include_usage_) out += SseEvent(UsageChunkJson(ctx_, usage_));
      }
      return out;
    }
    default: return "";
  }
}

std::string StreamFormatter::OnEnd(const absl::Status& status) {
  if (status.ok() && finished_) return SseDone();
  absl::Status error = status.ok() ? absl::InternalError(
                                         "the stream ended without a finish "
                                         "event")
                                   : status;
  // As an HTTP error response would name it: a request field for INVALID_ARGUMENT only (a
  // deadline's "denoise: …" names no field).
  // Then [DONE], as vLLM ends every stream: a client that waits for it is not left waiting.
  return SseEvent(OpenAiErrorBody(error, CoreErrorParam(error, ctx_.chat))) + SseDone();
}

}  // namespace dgserve
