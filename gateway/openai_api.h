// The OpenAI-compatible wire format of the gateway (design §2): request bodies of
// POST /v1/completions and POST /v1/chat/completions parsed into a v1::GenerateRequest, and the
// JSON of responses, SSE stream chunks and the models list. No I/O here; http_server.cc does the
// HTTP side. Parsing is in openai_api_parse.cc, the response formats in openai_api_format.cc.
//
// Accepted request fields (anything else is an error, never silently ignored):
//   both endpoints:
//     model              string; missing or null → "" (the served model; the core checks it)
//     max_tokens, max_completion_tokens
//                        integer in [1, 1000000]; if both are set they must be equal; neither:
//                        the checkpoint's generation_config.json max_new_tokens (the core's)
//     stream             bool
//     stream_options     {"include_usage": bool, "continuous_usage_stats": bool}; only allowed
//                        with "stream": true. continuous_usage_stats (vLLM's) takes effect only
//                        with include_usage: then every chunk of a choice's text and its finish
//                        chunk carry "usage" with that choice's tokens so far (StreamFormatter)
//     stop               string, or array of at most 4 strings; every string non-empty
//     seed               integer in [0, 2^64)
//     temperature, top_p only null or 1: the diffusion sampler has its own temperature
//                        schedule, controlled by t_min / t_max; any other value is rejected
//     n                  integer >= 0 → request.n (0 = 1): n choices from one prefill, choice
//                        i with seed + i; at most the gateway's --max_n (checked by the core)
//     user               string (accepted and ignored)
//   diffusion extensions (top level; type-checked here, range-checked by the core):
//     max_denoising_steps, stability_threshold   integer (int32)
//     entropy_bound, t_min, t_max, confidence_threshold   number (float)
//     sample_temperature_spread  number; with n > 1, sample i runs t_min and t_max times
//                        1 + spread·i/(n − 1) (best-of-n diversity)
//     self_conditioning  bool; false = the self-conditioning input is zero at every denoising
//                        step (ablation); absent or true = on
//     canvas_step_interval   integer >= 0 → stream_options.canvas_step_interval; > 0 requires
//                            "stream": true (canvas steps exist only in a stream)
//     canvas_text            bool → stream_options.canvas_text; true requires
//                            canvas_step_interval > 0
//   /v1/completions only:
//     prompt             a non-empty string; an array of exactly one non-empty string; an array
//                        of token ids (integers >= 0); or an array of exactly one such array.
//                        Several prompts → error (use n for several choices of one prompt).
//   /v1/chat/completions only:
//     messages           non-empty array of {"role", "content"}; role is system, developer
//                        (→ system), user, assistant or model (Gemma's name, → assistant);
//                        content is a string or an array of {"type": "text", "text": string}
//                        parts (joined with "\n"); any other part type is an error naming
//                        messages[i].content[j].type; OpenAI's optional "name" (a string) is
//                        accepted and not used (the chat template has no place for it)
//     chat_template_kwargs {"enable_thinking": bool}
//
// Tolerated defaults: a key whose value is null is treated as absent (for any key, known or
// not), and these harmless defaults that some client libraries always send are accepted and
// ignored: "logprobs": false, "echo": false, "best_of": 1, "presence_penalty": 0,
// "frequency_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"},
// "top_logprobs": 0, "store": false, "tools": [] and "tool_choice": "none" (no tools). Tool
// calling is not supported: a non-empty tools array, "tool_choice" "auto", "required" or an
// object, and the legacy "functions" / "function_call" (any well-formed value) are refused as
// unsupported fields with the reason; a tools / functions that is not an array, or a
// tool_choice / function_call that is neither a known string nor an object, is refused as a
// wrong type or value ("tools: must be an array of tool objects"). OpenAI's "suffix"
// (insertion) is refused with a pointer to "canvas_template", which is how this server infills.
//
// Every error is INVALID_ARGUMENT with a message that starts with the field's name
// ("max_tokens: must be an integer", "messages[2].content[0].type: ...") or reads
// "unsupported field: <name>" / "malformed JSON: ..."; ErrorParam() extracts the field name for
// the OpenAI error body's `param`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dgserve/v1/generation.pb.h"

namespace dgserve {

// A parsed OpenAI request.
struct OpenAiRequest {
  v1::GenerateRequest request;  // input, max_tokens, stop, seed, diffusion, stream_options
  bool stream = false;          // "stream": true → SSE
  bool include_usage = false;   // stream_options.include_usage: a usage chunk before [DONE]
  // stream_options.continuous_usage_stats with include_usage: usage in every choice's chunk
  // (also in request.stream_options.continuous_usage)
  bool continuous_usage = false;
  bool chat = false;            // parsed from /v1/chat/completions
  std::string model;            // as sent ("" when absent); also in request.model
};

// Parses a POST /v1/completions body. Errors: INVALID_ARGUMENT for malformed JSON, a body that
// is not an object, a field of the wrong type or out of range, a missing or empty prompt,
// several prompts, an unsupported field (see the file comment).
absl::StatusOr<OpenAiRequest> ParseCompletionsRequest(std::string_view body);

// Parses a POST /v1/chat/completions body. Errors as ParseCompletionsRequest, plus missing or
// empty messages, an unsupported role, a non-text content part.
absl::StatusOr<OpenAiRequest> ParseChatCompletionsRequest(std::string_view body);

// The field a parse error names ("max_tokens" for "max_tokens: must be an integer", "logprobs"
// for "unsupported field: logprobs"), or "" when it names none.
std::string ErrorParam(const absl::Status& status);
// `param` of an error from the core (GenerationCore::Generate): ErrorParam of an
// INVALID_ARGUMENT ("max_tokens", "prompt", a sampler field…), with "prompt" named "messages"
// for a chat request; "" for other codes.
std::string CoreErrorParam(const absl::Status& status, bool chat);

// What every response object of one request carries.
struct ResponseContext {
  std::string request_id;  // the core's request id; ids are "cmpl-<id>" / "chatcmpl-<id>"
  std::string model;       // the model id reported back
  int64_t created = 0;     // unix seconds
  bool chat = false;       // chat.completion(.chunk) vs text_completion
};

// Non-streaming /v1/completions response: {"id": "cmpl-…", "object": "text_completion",
// "created", "model", "choices": [{"index": 0, "text", "finish_reason", "logprobs": null}],
// "usage"}. `usage` is {"prompt_tokens", "completion_tokens", "total_tokens",
// "prompt_tokens_details": {"cached_tokens"}, "dgserve": {"cached_prompt_tokens", "canvases",
// "denoising_steps", "timings": {…seconds}}}.
std::string CompletionResponseJson(const ResponseContext& ctx, std::string_view text,
                                   std::string_view finish_reason, const v1::Usage& usage);

// Non-streaming /v1/chat/completions response: as above with "chatcmpl-…", "chat.completion"
// and choices[0].message = {"role": "assistant", "content"}.
std::string ChatCompletionResponseJson(const ResponseContext& ctx, std::string_view content,
                                       std::string_view finish_reason, const v1::Usage& usage);

// A /v1/completions stream chunk: object "text_completion", choices[0] = {"index": `index`,
// "text", "logprobs": null, "finish_reason": null or `finish_reason` when non-empty}. With
// `usage` (continuous usage) also "usage": {"prompt_tokens", "completion_tokens",
// "total_tokens", "prompt_tokens_details": {"cached_tokens"}}.
std::string CompletionChunkJson(const ResponseContext& ctx, std::string_view text,
                                std::string_view finish_reason = {}, int index = 0,
                                const v1::Usage* usage = nullptr);

// A /v1/chat/completions stream chunk: object "chat.completion.chunk", choices[0] = {"index":
// `index`, "delta", "logprobs": null, "finish_reason"}. delta holds "role": "assistant" when
// `with_role` and "content" when `content` is non-empty or `with_role`; {} otherwise. `usage`
// as for CompletionChunkJson.
std::string ChatChunkJson(const ResponseContext& ctx, std::string_view content, bool with_role,
                          std::string_view finish_reason = {}, int index = 0,
                          const v1::Usage* usage = nullptr);

// The usage chunk sent before [DONE] with stream_options.include_usage: "choices": [] and
// "usage" (shape as in CompletionResponseJson). Object type follows ctx.chat.
std::string UsageChunkJson(const ResponseContext& ctx, const v1::Usage& usage);

// A canvas-step chunk (extension): an ordinary chunk whose choice carries no text (chat:
// "delta": {}; completions: "text": "") so that OpenAI clients ignore it, plus
// "dgserve": {"canvas_step": {"canvas", "step", "token_ids", "text", "accepted",
// "mean_entropy", "temperature"}}.
std::string CanvasStepChunkJson(const ResponseContext& ctx, const v1::CanvasStep& step,
                                int index = 0);

// GET /v1/models: {"object": "list", "data": [ModelJson…]}.
std::string ModelsListJson(const v1::ListModelsResponse& models, int64_t created);
// One model: {"id", "object": "model", "created", "owned_by": "dgserve", "context_length",
// "dgserve": {"canvas_length", "vocab_size"}}.
std::string ModelJson(const v1::ModelInfo& model, int64_t created);

// "data: <json>\n\n".
std::string SseEvent(std::string_view json);
// "data: [DONE]\n\n".
std::string SseDone();

// One choice of a non-streaming response.
struct ChoiceResult {
  std::string text;
  std::string finish_reason;
};

// Collects the events of a non-streaming request and renders the response.
class ResponseAccumulator {
 public:
  // Records the request id (first non-empty), appends committed block text to the choice of
  // the event's index, keeps each Finished (usage summed over the choices: AddSampleUsage).
  // Canvas steps are ignored.
  void OnEvent(const v1::GenerateEvent& event);

  bool finished() const { return finished_; }  // a Finished was seen
  const std::string& request_id() const { return request_id_; }
  // Choice 0's text and finish reason.
  const std::string& text() const { return Choice0().text; }
  const std::string& finish_reason() const { return Choice0().finish_reason; }

  // The response JSON (chat or completion by ctx.chat), choices[i] with "index": i.
  // ctx.request_id is replaced by the events' request id when they carried one.
  std::string Json(ResponseContext ctx) const;

 private:
  const ChoiceResult& Choice0() const {
    static const ChoiceResult kNone;
    return choices_.empty() ? kNone : choices_[0];
  }
  std::string request_id_;
  std::vector<ChoiceResult> choices_;
  v1::Usage usage_;
  bool finished_ = false;
};

// Turns the events of a streaming request into SSE frames: canvas-step chunks, one text chunk
// per non-empty committed block (chat: each choice's first chunk carries delta.role), a final
// chunk with finish_reason per choice, the usage chunk (summed over the choices) when
// include_usage after the last choice's, then [DONE] — or an error event. With n > 1 the
// chunks of the choices interleave, each naming its choice's "index". With continuous usage
// every text chunk carries its block's usage (BlockCommitted.usage: that choice's usage so far)
// and every finish chunk its choice's final usage (Finished.usage); canvas-step chunks carry
// none.
class StreamFormatter {
 public:
  // `n`: the request's choices (GenerateRequest.n; 0 = 1). `continuous_usage`: the request's
  // stream_options.continuous_usage (its blocks carry usage).
  StreamFormatter(ResponseContext ctx, bool include_usage, int n = 1,
                  bool continuous_usage = false);

  // SSE frames for one event; "" when the event produces none (an empty block). The first
  // non-empty event request id replaces ctx.request_id.
  std::string OnEvent(const v1::GenerateEvent& event);

  // The frames that close the stream after Generate returned `status`: "data: [DONE]\n\n" when
  // it is OK and every choice's Finished was seen; otherwise one error event `data: {"error": {…}}` (the
  // OpenAI error body), then [DONE] (as vLLM). OK without Finished is reported as INTERNAL.
  std::string OnEnd(const absl::Status& status);

  const ResponseContext& context() const { return ctx_; }
  bool finished() const { return finished_; }

 private:
  ResponseContext ctx_;
  bool include_usage_;
  bool continuous_usage_;
  int n_;
  bool id_adopted_ = false;
  std::vector<bool> role_sent_;  // per choice
  int finished_samples_ = 0;
  v1::Usage usage_;  // of the choices finished so far
  bool finished_ = false;
};

}  // namespace dgserve
