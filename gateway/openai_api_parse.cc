// OpenAI request bodies (openai_api.h): POST /v1/completions and /v1/chat/completions parsed
// into an OpenAiRequest (a v1::GenerateRequest and the stream options), each field checked with
// the errors of json_fields.h; ErrorParam / CoreErrorParam, the `param` of an error response.
// The response and SSE formats are in openai_api_format.cc.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/excerpt.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "gateway/json_fields.h"
#include "gateway/openai_api.h"

namespace dgserve {
namespace {

using json = nlohmann::json;
using json_fields::GetBool;
using json_fields::GetFloat;
using json_fields::GetInt32;
using json_fields::GetIntIn;
using json_fields::GetString;
using json_fields::Invalid;
using json_fields::ReadWhole;
using json_fields::Unsupported;
using json_fields::WholeNumber;

constexpr int64_t kMaxTokensLimit = kMaxTokensPerRequest;  // common/limits.h
constexpr size_t kMaxStops = 4;

// The harmless defaults of the file comment: accepted and ignored.
bool IsToleratedDefault(const std::string& key, const json& v) {
  if (v.is_null()) return true;
  if ((key == "logprobs" || key == "echo") && v.is_boolean()) return !v.get<bool>();
  if (key == "best_of") {
    const WholeNumber w = ReadWhole(v);
    return w.kind == WholeNumber::kValue && w.value == 1;
  }
  if ((key == "presence_penalty" || key == "frequency_penalty") && v.is_number()) {
    return v.get<double>() == 0.0;
  }
  if (key == "logit_bias" && v.is_object()) return v.empty();
  // OpenAI's own defaults, which ask for nothing: plain text output, no alternatives per token,
  // not stored.
  if (key == "response_format" && v.is_object()) {
    return v.size() == 1 && v.contains("type") && v["type"] == "text";
  }
  if (key == "top_logprobs") {
    const WholeNumber w = ReadWhole(v);
    return w.kind == WholeNumber::kValue && w.value == 0;
  }
  if (key == "store" && v.is_boolean()) return !v.get<bool>();
  return false;
}

// Tool calling is not supported. What clients without tools send ("tools": [], "tool_choice":
// "none") asks for nothing and is accepted; a value of the wrong type or an unknown choice is
// named as such, as any other field's is ("tools: must be an array ..."); a well-formed request
// for tools is refused as unsupported ("unsupported field: tools (tool calling is not ...)").
// `key` is tools, tool_choice, or the legacy functions / function_call (refused when well formed,
// even empty: OpenAI replaced them with tools).
absl::Status CheckNoTools(const std::string& key, const json& v) {
  if (key == "tools" || key == "functions") {
    if (!v.is_array()) {
      return Invalid(key, key == "tools" ? "must be an array of tool objects"
                                         : "must be an array of function objects");
    }
    if (key == "tools" && v.empty()) return absl::OkStatus();
    return Unsupported(key, key == "tools"
                                ? "tool calling is not supported; only [] is accepted"
                                : "function calling, the legacy form of tools, is not supported");
  }
  const bool legacy = key == "function_call";
  // What a tool choice may be (OpenAI's API); legacy function_call has no "required".
  const std::string kForms = legacy
                                 ? R"("none", "auto" or an object naming a function)"
                                 : R"("none", "auto", "required" or an object naming a function)";
  if (!v.is_string() && !v.is_object()) return Invalid(key, absl::StrCat("must be ", kForms));
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s == "none" && !legacy) return absl::OkStatus();
    if (s != "none" && s != "auto" && (legacy || s != "required")) {
      return Invalid(key, absl::StrCat("must be ", kForms, " (got ", QuotedExcerpt(s), ")"));
    }
  }
  return Unsupported(key, legacy ? "function calling, the legacy form of tools, is not supported"
                                 : "tool calling is not supported; only \"none\" is accepted");
}

absl::Status ParseStop(const json& v, v1::GenerateRequest* req) {
  if (v.is_string()) {
    if (v.get<std::string>().empty()) return Invalid("stop", "must not be empty");
    req->add_stop(v.get<std::string>());
    return absl::OkStatus();
  }
  if (!v.is_array()) return Invalid("stop", "must be a string or an array of strings");
  if (v.size() > kMaxStops) {
    return Invalid("stop", absl::StrCat("at most ", kMaxStops, " stop sequences are supported"));
  }
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string field = absl::StrCat("stop[", i, "]");
    if (!v[i].is_string()) return Invalid(field, "must be a string");
    if (v[i].get<std::string>().empty()) return Invalid(field, "must not be empty");
    req->add_stop(v[i].get<std::string>());
  }
  return absl::OkStatus();
}

absl::Status ParseTokenIds(const json& arr, std::string_view field, v1::GenerateRequest* req) {
  v1::TokenIds* ids = req->mutable_token_ids();
  // One allocation for the ids (a 2M-token prompt doubled its way up), and no field name made
  // for an id that is fine.
  ids->mutable_ids()->Reserve(int(std::min<size_t>(arr.size(), std::numeric_limits<int>::max())));
  for (size_t i = 0; i < arr.size(); ++i) {
    if (arr[i].is_number_unsigned() &&
        arr[i].get<uint64_t>() <= uint64_t(std::numeric_limits<int32_t>::max())) {
      ids->add_ids(int32_t(arr[i].get<uint64_t>()));
      continue;
    }
    const std::string name = absl::StrCat(std::string(field), "[", i, "]");
    if (ReadWhole(arr[i]).kind == WholeNumber::kNotWhole) {
      return Invalid(name,
                     "must be an integer token id (an array prompt is one string, one array of "
                     "token ids, or token ids)");
    }
    absl::StatusOr<int64_t> id =
        GetIntIn(arr[i], name, 0, std::numeric_limits<int32_t>::max(), "a token id in [0, 2^31)");
    if (!id.ok()) return id.status();
    ids->add_ids(int32_t(*id));
  }
  return absl::OkStatus();
}

absl::Status ParsePrompt(const json& v, v1::GenerateRequest* req) {
  constexpr std::string_view kSeveral =
      "several prompts in one request are not supported; send one request per prompt (n asks "
      "for several choices of one prompt)";
  if (v.is_string()) {
    if (v.get<std::string>().empty()) return Invalid("prompt", "must not be empty");
    req->set_text(v.get<std::string>());
    return absl::OkStatus();
  }
  if (!v.is_array()) {
    return Invalid("prompt", "must be a string, an array of one string, or an array of token ids");
  }
  if (v.empty()) return Invalid("prompt", "must not be empty");
  // Every element has the first one's type (strings, token-id arrays, or token ids; a first
  // element of another type is named by ParseTokenIds below).
  const bool known_kind = v[0].is_string() || v[0].is_array() || v[0].is_number();
  for (size_t i = 1; known_kind && i < v.size(); ++i) {
    if (v[i].type() != v[0].type() && !(v[i].is_number() && v[0].is_number())) {
      return Invalid(absl::StrCat("prompt[", i, "]"),
                     absl::StrCat("must be ",
                                  v[0].is_string()  ? "a string, as prompt[0] is"
                                  : v[0].is_array() ? "an array of token ids, as prompt[0] is"
                                                    : "a token id, as prompt[0] is",
                                  " (an array prompt is one string, one array of token ids, or "
                                  "token ids)"));
    }
  }
  if (v[0].is_string()) {
    if (v.size() > 1) return Invalid("prompt", kSeveral);
    if (v[0].get<std::string>().empty()) return Invalid("prompt", "must not be empty");
    req->set_text(v[0].get<std::string>());
    return absl::OkStatus();
  }
  if (v[0].is_array()) {
    if (v.size() > 1) return Invalid("prompt", kSeveral);
    if (v[0].empty()) return Invalid("prompt", "must not be empty");
    return ParseTokenIds(v[0], "prompt[0]", req);
  }
  return ParseTokenIds(v, "prompt", req);
}

absl::StatusOr<std::string> ParseContent(const json& v, const std::string& field) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) return Invalid(field, "must be a string or an array of text parts");
  if (v.empty()) return Invalid(field, "must not be an empty array");
  std::vector<std::string> texts;
  for (size_t j = 0; j < v.size(); ++j) {
    const std::string part = absl::StrCat(field, "[", j, "]");
    const json& p = v[j];
    if (!p.is_object()) return Invalid(part, "must be an object");
    auto type = p.find("type");
    if (type == p.end() || type->is_null()) return Invalid(part + ".type", "required");
    if (!type->is_string()) return Invalid(part + ".type", "must be a string");
    if (type->get<std::string>() != "text") {
      return Invalid(part + ".type",
                     absl::StrCat("unsupported content part type '", type->get<std::string>(),
                                  "' (only \"text\" parts are supported)"));
    }
    std::string text;
    bool has_text = false;
    for (auto it = p.begin(); it != p.end(); ++it) {
      if (it.key() == "type" || it.value().is_null()) continue;  // null = absent
      if (it.key() == "text") {
        DGSERVE_ASSIGN_OR_RETURN(text, GetString(it.value(), part + ".text"));
        has_text = true;
      } else {
        return Unsupported(absl::StrCat(part, ".", it.key()));
      }
    }
    if (!has_text) return Invalid(part + ".text", "required");
    texts.push_back(std::move(text));
  }
  return absl::StrJoin(texts, "\n");
}

absl::Status ParseMessages(const json& v, v1::GenerateRequest* req) {
  if (!v.is_array()) return Invalid("messages", "must be an array");
  if (v.empty()) return Invalid("messages", "must not be empty");
  v1::ChatInput* chat = req->mutable_chat();
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string field = absl::StrCat("messages[", i, "]");
    const json& m = v[i];
    if (!m.is_object()) return Invalid(field, "must be an object");
    std::string role, content;
    bool has_role = false, has_content = false;
    for (auto it = m.begin(); it != m.end(); ++it) {
      const std::string& key = it.key();
      if (key == "role") {
        if (it.value().is_null()) continue;
        DGSERVE_ASSIGN_OR_RETURN(role, GetString(it.value(), field + ".role"));
        has_role = true;
      } else if (key == "content") {
        if (it.value().is_null()) continue;
        DGSERVE_ASSIGN_OR_RETURN(content, ParseContent(it.value(), field + ".content"));
        has_content = true;
      } else if (key == "name") {
        // OpenAI's participant name: accepted (a string) and not used, as by vLLM, whose
        // Gemma chat template does not render it either.
        if (it.value().is_null()) continue;
        DGSERVE_RETURN_IF_ERROR(GetString(it.value(), field + ".name").status());
      } else if (!it.value().is_null()) {
        return Unsupported(absl::StrCat(field, ".", key));
      }
    }
    if (!has_role) return Invalid(field + ".role", "required");
    if (role == "developer") role = "system";
    if (role == "model") role = "assistant";  // Gemma's name; the template renders both as model
    if (role != "system" && role != "user" && role != "assistant") {
      return Invalid(field + ".role",
                     absl::StrCat("unsupported role ", QuotedExcerpt(role),
                                  " (supported: system, developer, user, assistant, model)"));
    }
    if (!has_content) return Invalid(field + ".content", "required");
    v1::ChatMessage* msg = chat->add_messages();
    msg->set_role(role);
    msg->set_content(std::move(content));
  }
  return absl::OkStatus();
}

absl::Status ParseStreamOptions(const json& v, OpenAiRequest* out) {
  if (!v.is_object()) return Invalid("stream_options", "must be an object");
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.value().is_null()) continue;
    if (it.key() == "include_usage") {
      DGSERVE_ASSIGN_OR_RETURN(out->include_usage,
                               GetBool(it.value(), "stream_options.include_usage"));
    } else if (it.key() == "continuous_usage_stats") {
      DGSERVE_ASSIGN_OR_RETURN(out->continuous_usage,
                               GetBool(it.value(), "stream_options.continuous_usage_stats"));
    } else {
      return Unsupported(absl::StrCat("stream_options.", it.key()));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseChatTemplateKwargs(const json& v, bool* enable_thinking) {
  if (!v.is_object()) return Invalid("chat_template_kwargs", "must be an object");
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.value().is_null()) continue;
    if (it.key() == "enable_thinking") {
      DGSERVE_ASSIGN_OR_RETURN(*enable_thinking,
                               GetBool(it.value(), "chat_template_kwargs.enable_thinking"));
    } else {
      return Unsupported(absl::StrCat("chat_template_kwargs.", it.key()));
    }
  }
  return absl::OkStatus();
}

// The infilling extension "canvas_template" (README "Infilling"): the text form {"text",
// "hole", "allowed"} or the token form {"token_ids", "holes": [{"position",
// "allowed_token_ids"}]}, plus "every_canvas". The gateway tokenizes and validates it.
absl::Status ParseCanvasTemplate(const json& v, v1::GenerateRequest* req) {
  const std::string kField = "canvas_template";
  if (!v.is_object()) return Invalid(kField, "must be an object");
  v1::CanvasTemplate* t = req->mutable_canvas_template();
  auto int_array = [](const json& a, const std::string& field,
                      google::protobuf::RepeatedField<int32_t>* out) -> absl::Status {
    if (!a.is_array()) return Invalid(field, "must be an array of integers");
    for (size_t i = 0; i < a.size(); ++i) {
      absl::StatusOr<int32_t> id = GetInt32(a[i], absl::StrCat(field, "[", i, "]"));
      if (!id.ok()) return id.status();
      out->Add(*id);
    }
    return absl::OkStatus();
  };
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string field = absl::StrCat(kField, ".", std::string(it.key()));
    const json& x = it.value();
    if (x.is_null()) continue;
    if (it.key() == "text") {
      DGSERVE_ASSIGN_OR_RETURN(*t->mutable_text(), GetString(x, field));
      if (t->text().empty()) return Invalid(field, "must not be empty");
    } else if (it.key() == "hole") {
      DGSERVE_ASSIGN_OR_RETURN(*t->mutable_hole(), GetString(x, field));
      if (t->hole().empty()) return Invalid(field, "must not be empty");
    } else if (it.key() == "allowed") {
      if (!x.is_array() || x.empty()) return Invalid(field, "must be a non-empty array of strings");
      for (size_t i = 0; i < x.size(); ++i) {
        DGSERVE_ASSIGN_OR_RETURN(*t->add_allowed(),
                                 GetString(x[i], absl::StrCat(field, "[", i, "]")));
      }
    } else if (it.key() == "token_ids") {
      if (x.is_array() && x.empty()) return Invalid(field, "must not be empty");
      DGSERVE_RETURN_IF_ERROR(int_array(x, field, t->mutable_token_ids()));
    } else if (it.key() == "holes") {
      if (!x.is_array()) return Invalid(field, "must be an array of objects");
      for (size_t i = 0; i < x.size(); ++i) {
        const std::string hf = absl::StrCat(field, "[", i, "]");
        if (!x[i].is_object()) return Invalid(hf, "must be an object");
        v1::TemplateHole* h = t->add_holes();
        bool has_position = false;
        for (auto hit = x[i].begin(); hit != x[i].end(); ++hit) {
          const std::string f = absl::StrCat(hf, ".", std::string(hit.key()));
          if (hit.value().is_null()) continue;  // null = absent, as everywhere else
          if (hit.key() == "position") {
            int32_t pos = 0;
            DGSERVE_ASSIGN_OR_RETURN(pos, GetInt32(hit.value(), f));
            h->set_position(pos);
            has_position = true;
          } else if (hit.key() == "allowed_token_ids") {
            DGSERVE_RETURN_IF_ERROR(int_array(hit.value(), f, h->mutable_allowed_token_ids()));
          } else {
            return Unsupported(f);
          }
        }
        if (!has_position) return Invalid(hf + ".position", "required");
        if (h->allowed_token_ids_size() == 0) {
          return Invalid(hf + ".allowed_token_ids", "required (a non-empty array)");
        }
      }
    } else if (it.key() == "every_canvas") {
      bool every = false;
      DGSERVE_ASSIGN_OR_RETURN(every, GetBool(x, field));
      t->set_every_canvas(every);
    } else {
      return Unsupported(field);
    }
  }
  if (t->text().empty() && t->token_ids_size() == 0 && t->holes_size() == 0) {
    return Invalid(kField, "give \"text\" (with \"hole\", \"allowed\") or \"token_ids\"");
  }
  return absl::OkStatus();
}

absl::StatusOr<OpenAiRequest> ParseUnguarded(std::string_view body, bool chat) {
  json root;
  DGSERVE_RETURN_IF_ERROR(json_fields::ParseJsonObject(body, &root));
  OpenAiRequest out;
  out.chat = chat;
  v1::GenerateRequest& req = out.request;
  v1::DiffusionControls* dc = req.mutable_diffusion();
  bool has_input = false;
  bool has_stream_options = false;
  bool canvas_text = false;
  int64_t canvas_interval = 0;
  int64_t max_tokens = 0, max_completion_tokens = 0;
  // enable_thinking arrives before or after messages; keep it and apply at the end.
  bool enable_thinking = false;

  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& key = it.key();
    json& v = it.value();
    if (v.is_null()) continue;  // null = absent, for every key
    if (key == "model") {
      DGSERVE_ASSIGN_OR_RETURN(out.model, GetString(v, key));
    } else if (key == "prompt" && !chat) {
      DGSERVE_RETURN_IF_ERROR(ParsePrompt(v, &req));
      v = nullptr;  // read: its parsed JSON (16 bytes and more a token id) goes now
      has_input = true;
    } else if (key == "messages" && chat) {
      DGSERVE_RETURN_IF_ERROR(ParseMessages(v, &req));
      has_input = true;
    } else if (key == "chat_template_kwargs" && chat) {
      DGSERVE_RETURN_IF_ERROR(ParseChatTemplateKwargs(v, &enable_thinking));
    } else if (key == "max_tokens" || key == "max_completion_tokens") {
      int64_t n = 0;
      DGSERVE_ASSIGN_OR_RETURN(
          n, GetIntIn(v, key, 1, kMaxTokensLimit, absl::StrCat("between 1 and ", kMaxTokensLimit)));
      (key == "max_tokens" ? max_tokens : max_completion_tokens) = n;
    } else if (key == "stream") {
      DGSERVE_ASSIGN_OR_RETURN(out.stream, GetBool(v, key));
    } else if (key == "stream_options") {
      DGSERVE_RETURN_IF_ERROR(ParseStreamOptions(v, &out));
      has_stream_options = true;
    } else if (key == "stop") {
      DGSERVE_RETURN_IF_ERROR(ParseStop(v, &req));
    } else if (key == "seed") {
      uint64_t seed = 0;
      DGSERVE_ASSIGN_OR_RETURN(seed, json_fields::GetUint64(v, key));
      req.set_seed(seed);
    } else if (key == "temperature" || key == "top_p") {
      if (!v.is_number()) return Invalid(key, "must be a number");
      if (v.get<double>() != 1.0) {
        return Invalid(key,
                       "not supported (only null or 1): the diffusion sampler has its own "
                       "temperature schedule; set t_min and t_max instead");
      }
    } else if (key == "n") {
      const WholeNumber w = ReadWhole(v);
      if (w.kind == WholeNumber::kNotWhole) return Invalid(key, "must be an integer");
      if (w.kind == WholeNumber::kBelowInt64 || (w.kind == WholeNumber::kValue && w.value < 0)) {
        return Invalid(key, absl::StrCat("must be >= 1 (the number of choices; 0 or null = 1; got ",
                                         v.dump(), ")"));
      }
      if (w.kind == WholeNumber::kAboveInt64 || w.value > std::numeric_limits<int32_t>::max()) {
        return Invalid(
            key, absl::StrCat("too large (", v.dump(), "): at most the gateway's --max_n choices"));
      }
      req.set_n(int32_t(w.value));  // 0 = 1; the upper bound (--max_n) is the core's
    } else if (key == "user") {
      std::string ignored;
      DGSERVE_ASSIGN_OR_RETURN(ignored, GetString(v, key));
    } else if (key == "max_denoising_steps") {
      int32_t i = 0;
      DGSERVE_ASSIGN_OR_RETURN(i, GetInt32(v, key));
      dc->set_max_denoising_steps(i);
    } else if (key == "stability_threshold") {
      int32_t i = 0;
      DGSERVE_ASSIGN_OR_RETURN(i, GetInt32(v, key));
      dc->set_stability_threshold(i);
    } else if (key == "entropy_bound") {
      float f = 0;
      DGSERVE_ASSIGN_OR_RETURN(f, GetFloat(v, key));
      dc->set_entropy_bound(f);
    } else if (key == "t_min") {
      float f = 0;
      DGSERVE_ASSIGN_OR_RETURN(f, GetFloat(v, key));
      dc->set_t_min(f);
    } else if (key == "t_max") {
      float f = 0;
      DGSERVE_ASSIGN_OR_RETURN(f, GetFloat(v, key));
      dc->set_t_max(f);
    } else if (key == "sample_temperature_spread") {
      float f = 0;
      DGSERVE_ASSIGN_OR_RETURN(f, GetFloat(v, key));
      dc->set_sample_temperature_spread(f);
    } else if (key == "confidence_threshold") {
      float f = 0;
      DGSERVE_ASSIGN_OR_RETURN(f, GetFloat(v, key));
      dc->set_confidence_threshold(f);
    } else if (key == "self_conditioning") {
      bool on = true;
      DGSERVE_ASSIGN_OR_RETURN(on, GetBool(v, key));
      dc->set_self_conditioning(on);
    } else if (key == "canvas_step_interval") {
      DGSERVE_ASSIGN_OR_RETURN(
          canvas_interval,
          GetIntIn(v, key, 0, std::numeric_limits<int32_t>::max(), "an integer in [0, 2^31)"));
    } else if (key == "canvas_text") {
      DGSERVE_ASSIGN_OR_RETURN(canvas_text, GetBool(v, key));
    } else if (key == "canvas_template") {
      DGSERVE_RETURN_IF_ERROR(ParseCanvasTemplate(v, &req));
    } else if (key == "tools" || key == "tool_choice" || key == "functions" ||
               key == "function_call") {
      DGSERVE_RETURN_IF_ERROR(CheckNoTools(key, v));
    } else if (IsToleratedDefault(key, v)) {
      continue;
    } else if (key == "messages") {
      return Unsupported(key, "this endpoint takes a prompt; use /v1/chat/completions");
    } else if (key == "prompt") {
      return Unsupported(key, "this endpoint takes messages; use /v1/completions");
    } else if (key == "suffix") {
      // OpenAI's insertion: here infilling is a canvas template (README "Infilling").
      return Unsupported(key,
                         "for infilling give \"canvas_template\": fixed text with holes the model "
                         "fills, README \"Infilling\"");
    } else {
      return Unsupported(key);
    }
  }

  if (!has_input) return Invalid(chat ? "messages" : "prompt", "required");
  if (chat && enable_thinking) req.mutable_chat()->set_enable_thinking(true);
  if (max_tokens != 0 && max_completion_tokens != 0 && max_tokens != max_completion_tokens) {
    return Invalid("max_completion_tokens", "differs from max_tokens; set only one of them");
  }
  req.set_max_tokens(static_cast<int32_t>(max_tokens != 0 ? max_tokens : max_completion_tokens));
  if (has_stream_options && !out.stream) {
    return Invalid("stream_options", "only allowed when stream is true");
  }
  if (canvas_interval > 0 && !out.stream) {
    return Invalid("canvas_step_interval", "canvas steps are only sent when stream is true");
  }
  if (canvas_text && canvas_interval == 0) {
    return Invalid("canvas_text", "requires canvas_step_interval > 0");
  }
  req.mutable_stream_options()->set_canvas_step_interval(static_cast<int32_t>(canvas_interval));
  req.mutable_stream_options()->set_canvas_text(canvas_text);
  // As vLLM: usage in every chunk only when the usage chunk is asked for too.
  out.continuous_usage = out.continuous_usage && out.include_usage;
  req.mutable_stream_options()->set_continuous_usage(out.continuous_usage);
  req.set_model(out.model);
  return out;
}

// Every JSON exception is a client error: the request is malformed (a value of a type or size
// the checks above did not foresee), never a 500 and never an exception escaping to the HTTP
// server.
absl::StatusOr<OpenAiRequest> Parse(std::string_view body, bool chat) {
  try {
    return ParseUnguarded(body, chat);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("malformed JSON: ", e.what()));
  }
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseCompletionsRequest(std::string_view body) {
  return Parse(body, /*chat=*/false);
}

absl::StatusOr<OpenAiRequest> ParseChatCompletionsRequest(std::string_view body) {
  return Parse(body, /*chat=*/true);
}

std::string ErrorParam(const absl::Status& status) {
  if (std::string field = json_fields::FieldOf(status); !field.empty()) return field;
  const std::string message(status.message());
  std::string_view msg = message;
  constexpr std::string_view kUnsupported = "unsupported field: ";
  if (msg.substr(0, kUnsupported.size()) == kUnsupported) {
    std::string_view rest = msg.substr(kUnsupported.size());
    return std::string(rest.substr(0, rest.find(' ')));
  }
  // Sampler range errors start with the field's name ("t_max must be ...").
  for (std::string_view field :
       {"max_denoising_steps", "entropy_bound", "t_min", "t_max", "sample_temperature_spread",
        "confidence_threshold", "stability_threshold"}) {
    if (msg.size() > field.size() && msg.substr(0, field.size()) == field &&
        (msg[field.size()] == ' ' || msg[field.size()] == ':')) {
      return std::string(field);
    }
  }
  const size_t colon = msg.find(": ");
  if (colon == std::string_view::npos || colon == 0) return "";
  std::string_view head = msg.substr(0, colon);
  if (head.find(' ') != std::string_view::npos) return "";
  return std::string(head);
}

std::string CoreErrorParam(const absl::Status& status, bool chat) {
  if (!absl::IsInvalidArgument(status)) return "";
  std::string param = ErrorParam(status);
  if (chat && param == "prompt") param = "messages";
  return param;
}

}  // namespace dgserve
