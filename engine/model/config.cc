#include "engine/model/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status_macros.h"

namespace dgserve {
namespace {

using nlohmann::json;

absl::Status FieldError(const std::string& source, const std::string& field,
                        const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": field '", field, "' ", what));
}

absl::StatusOr<json> ParseJson(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(source, ": malformed JSON"));
  if (!j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  return j;
}

// Reads a required positive integer field.
absl::Status GetInt(const json& obj, const std::string& source, const std::string& field, int* out,
                    bool required = true, int min_value = 1) {
  auto it = obj.find(field);
  if (it == obj.end()) {
    return required ? FieldError(source, field, "is missing") : absl::OkStatus();
  }
  if (!it->is_number_integer()) return FieldError(source, field, "must be an integer");
  int64_t v = it->get<int64_t>();
  if (v < min_value || v > (int64_t{1} << 30)) {
    return FieldError(source, field, absl::StrCat("is out of range: ", v));
  }
  *out = static_cast<int>(v);
  return absl::OkStatus();
}

absl::Status GetFloat(const json& obj, const std::string& source, const std::string& field,
                      float* out, bool required = true) {
  auto it = obj.find(field);
  if (it == obj.end()) {
    return required ? FieldError(source, field, "is missing") : absl::OkStatus();
  }
  if (!it->is_number()) return FieldError(source, field, "must be a number");
  double v = it->get<double>();
  if (!std::isfinite(v)) return FieldError(source, field, "must be finite");
  // A double beyond float's range would become inf (and pass every "> 0" check after it).
  if (std::fabs(v) > std::numeric_limits<float>::max()) {
    return FieldError(source, field, absl::StrCat("is out of range for a float: ", v));
  }
  *out = static_cast<float>(v);
  return absl::OkStatus();
}

}  // namespace

float ModelConfig::EmbedScale() const {
  return RoundToBf16(std::sqrt(static_cast<float>(hidden_size)));
}

int ModelConfig::FullRopeAngles() const {
  return static_cast<int>(partial_rotary_factor_full * global_head_dim) / 2;
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path, size_t max_bytes) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    return absl::NotFoundError(absl::StrCat("cannot open ", path));
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const uintmax_t size = std::filesystem::file_size(path, ec);
  std::string text(ec ? 0 : std::min<uintmax_t>(size, max_bytes), '\0');
  in.read(text.data(), std::streamsize(text.size()));
  if (in.bad()) return absl::InternalError(absl::StrCat("error reading ", path));
  text.resize(size_t(in.gcount()));
  return text;
}

absl::Status CheckContextFits(int64_t prompt_tokens, int64_t max_new_tokens,
                              const ModelConfig& config) {
  const int64_t limit = config.max_position_embeddings, C = config.canvas_length;
  if (prompt_tokens + C > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt: the prompt has ", prompt_tokens, " tokens; with one canvas of ", C,
                     " tokens they exceed the context limit of ", limit,
                     " positions of this model (a prompt may have at most ",
                     std::max<int64_t>(limit - C, 0), " tokens)"));
  }
  const int64_t canvases = (max_new_tokens + C - 1) / C;
  if (prompt_tokens + canvases * C > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: the prompt (", prompt_tokens, " tokens) plus ", canvases,
                     " canvases of ", C, " tokens for max_new_tokens=", max_new_tokens,
                     " exceed the context limit of ", limit, " positions (at most ",
                     (limit - prompt_tokens) / C * C, " new tokens fit after this prompt)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadInputToString(const std::string& path, size_t max_bytes) {
  std::ifstream file;
  std::istream* in = &std::cin;
  const std::string name = path == "-" ? "standard input" : path;
  if (path != "-") {
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::status(path, ec);
    if (!std::filesystem::exists(st)) {
      return absl::NotFoundError(absl::StrCat("cannot open ", path));
    }
    if (std::filesystem::is_directory(st)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is a directory, not a regular file or a pipe"));
    }
    file.open(path, std::ios::binary);
    if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
    in = &file;
  }
  // In chunks: a stream's size is unknown, and at most max_bytes are held.
  std::string text;
  constexpr size_t kChunk = size_t(1) << 16;
  while (text.size() < max_bytes) {
    const size_t at = text.size();
    text.resize(at + std::min(kChunk, max_bytes - at));
    in->read(text.data() + at, std::streamsize(text.size() - at));
    text.resize(at + size_t(in->gcount()));
    if (in->bad()) return absl::InternalError(absl::StrCat("error reading ", name));
    if (in->eof() || in->fail()) break;
  }
  return text;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source) {
  DGSERVE_ASSIGN_OR_RETURN(json root, ParseJson(json_text, source));
  ModelConfig c;
  // The outer config nests the text tower under text_config; a bare text config is accepted too.
  const json* text = &root;
  if (auto it = root.find("text_config"); it != root.end()) {
    if (!it->is_object()) return FieldError(source, "text_config", "must be an object");
    text = &*it;
  }
  if (auto it = text->find("model_type"); it != text->end()) {
    if (!it->is_string() || (it->get<std::string>() != "diffusion_gemma_text" &&
                             it->get<std::string>() != "diffusion_gemma")) {
      return FieldError(source, "text_config.model_type",
                        "must be \"diffusion_gemma_text\" (this server runs DiffusionGemma only)");
    }
  }
  // Another architecture's config is refused rather than loaded as DiffusionGemma.
  if (auto it = root.find("architectures"); it != root.end()) {
    if (!it->is_array() ||
        std::find(it->begin(), it->end(), json("DiffusionGemmaForBlockDiffusion")) == it->end()) {
      return FieldError(
          source, "architectures",
          "must contain \"DiffusionGemmaForBlockDiffusion\" (got " + it->dump() + ")");
    }
  }
  if (auto it = root.find("model_type"); it != root.end() && &root != text) {
    if (*it != "diffusion_gemma") {
      return FieldError(source, "model_type",
                        "must be \"diffusion_gemma\" (got " + it->dump() + ")");
    }
  }
  const json& t = *text;
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "vocab_size", &c.vocab_size));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "hidden_size", &c.hidden_size));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "num_hidden_layers", &c.num_layers));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "num_attention_heads", &c.num_heads));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "num_key_value_heads", &c.num_kv_heads));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "num_global_key_value_heads", &c.num_global_kv_heads));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "head_dim", &c.head_dim));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "global_head_dim", &c.global_head_dim));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "intermediate_size", &c.intermediate_size));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "num_experts", &c.num_experts));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "top_k_experts", &c.top_k_experts));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "moe_intermediate_size", &c.moe_intermediate_size));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "sliding_window", &c.sliding_window));
  c.max_position_embeddings = 262144;
  DGSERVE_RETURN_IF_ERROR(
      GetInt(t, source, "max_position_embeddings", &c.max_position_embeddings, false));
  DGSERVE_RETURN_IF_ERROR(GetFloat(t, source, "rms_norm_eps", &c.rms_norm_eps, false));
  DGSERVE_RETURN_IF_ERROR(
      GetFloat(t, source, "final_logit_softcapping", &c.final_logit_softcapping, false));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "pad_token_id", &c.pad_token_id, false, 0));
  DGSERVE_RETURN_IF_ERROR(GetInt(t, source, "bos_token_id", &c.bos_token_id, false, 0));
  // canvas_length lives in the outer config.
  DGSERVE_RETURN_IF_ERROR(GetInt(root, source, "canvas_length", &c.canvas_length));

  if (auto it = t.find("hidden_activation"); it != t.end()) {
    if (!it->is_string() || it->get<std::string>() != "gelu_pytorch_tanh") {
      return FieldError(source, "hidden_activation", "must be \"gelu_pytorch_tanh\"");
    }
  }
  if (auto it = t.find("attention_bias"); it != t.end() && it->is_boolean() && it->get<bool>()) {
    return FieldError(source, "attention_bias", "must be false (DiffusionGemma has no biases)");
  }

  // layer_types; absent → layer i is full iff (i+1) % 6 == 0 (spec §1.1). HF forces the last
  // layer to be full.
  if (auto it = t.find("layer_types"); it != t.end()) {
    if (!it->is_array()) return FieldError(source, "layer_types", "must be an array");
    if (static_cast<int>(it->size()) != c.num_layers) {
      return FieldError(
          source, "layer_types",
          absl::StrCat("has ", it->size(), " entries but num_hidden_layers is ", c.num_layers));
    }
    for (const json& e : *it) {
      if (e == "sliding_attention") {
        c.layer_types.push_back(LayerType::kSliding);
      } else if (e == "full_attention") {
        c.layer_types.push_back(LayerType::kFull);
      } else {
        return FieldError(source, "layer_types", absl::StrCat("has unknown entry ", e.dump()));
      }
    }
  } else {
    for (int i = 0; i < c.num_layers; ++i) {
      c.layer_types.push_back((i + 1) % 6 == 0 ? LayerType::kFull : LayerType::kSliding);
    }
  }
  c.layer_types.back() = LayerType::kFull;

  // rope_parameters (Gemma 4 layout); defaults are the real checkpoint's values.
  if (auto it = t.find("rope_parameters"); it != t.end()) {
    if (!it->is_object()) return FieldError(source, "rope_parameters", "must be an object");
    if (auto s = it->find("sliding_attention"); s != it->end()) {
      if (auto ty = s->find("rope_type"); ty != s->end() && *ty != "default") {
        return FieldError(source, "rope_parameters.sliding_attention.rope_type",
                          "must be \"default\"");
      }
      DGSERVE_RETURN_IF_ERROR(GetFloat(*s, source, "rope_theta", &c.rope_theta_sliding, false));
    }
    if (auto f = it->find("full_attention"); f != it->end()) {
      if (auto ty = f->find("rope_type"); ty != f->end() && *ty != "proportional") {
        return FieldError(source, "rope_parameters.full_attention.rope_type",
                          "must be \"proportional\"");
      }
      DGSERVE_RETURN_IF_ERROR(GetFloat(*f, source, "rope_theta", &c.rope_theta_full, false));
      DGSERVE_RETURN_IF_ERROR(
          GetFloat(*f, source, "partial_rotary_factor", &c.partial_rotary_factor_full, false));
    }
  }

  // Consistency.
  if (c.num_heads % c.num_kv_heads != 0) {
    return FieldError(
        source, "num_key_value_heads",
        absl::StrCat("(", c.num_kv_heads, ") must divide num_attention_heads (", c.num_heads, ")"));
  }
  if (c.num_heads % c.num_global_kv_heads != 0) {
    return FieldError(source, "num_global_key_value_heads",
                      absl::StrCat("(", c.num_global_kv_heads,
                                   ") must divide num_attention_heads (", c.num_heads, ")"));
  }
  if (c.head_dim % 2 != 0 || c.global_head_dim % 2 != 0) {
    return FieldError(source, "head_dim", "head dims must be even (RoPE pairs)");
  }
  if (c.top_k_experts > c.num_experts) {
    return FieldError(
        source, "top_k_experts",
        absl::StrCat("(", c.top_k_experts, ") exceeds num_experts (", c.num_experts, ")"));
  }
  if (!(c.rms_norm_eps > 0)) return FieldError(source, "rms_norm_eps", "must be > 0");
  if (!(c.final_logit_softcapping > 0)) {
    return FieldError(source, "final_logit_softcapping", "must be > 0");
  }
  if (!(c.partial_rotary_factor_full > 0 && c.partial_rotary_factor_full <= 1)) {
    return FieldError(source, "rope_parameters.full_attention.partial_rotary_factor",
                      "must be in (0, 1]");
  }
  if (!(c.rope_theta_sliding > 1) || !(c.rope_theta_full > 1)) {
    return FieldError(source, "rope_parameters", "rope_theta must be > 1");
  }
  if (c.pad_token_id >= c.vocab_size) {
    return FieldError(source, "pad_token_id", "must be < vocab_size");
  }
  if (c.bos_token_id >= c.vocab_size) {
    return FieldError(source, "bos_token_id", "must be < vocab_size");
  }
  if (c.canvas_length >= c.max_position_embeddings) {
    return FieldError(source, "canvas_length",
                      absl::StrCat("(", c.canvas_length,
                                   ") must be less than "
                                   "max_position_embeddings (",
                                   c.max_position_embeddings,
                                   "): a request needs a prompt token beside its canvas"));
  }
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  DGSERVE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseModelConfig(text, path);
}

absl::StatusOr<GenerationConfig> ParseGenerationConfig(const std::string& json_text,
                                                       const std::string& source) {
  DGSERVE_ASSIGN_OR_RETURN(json j, ParseJson(json_text, source));
  GenerationConfig g;
  DGSERVE_RETURN_IF_ERROR(GetInt(j, source, "max_new_tokens", &g.max_new_tokens, false));
  DGSERVE_RETURN_IF_ERROR(GetInt(j, source, "max_denoising_steps", &g.max_denoising_steps, false));
  DGSERVE_RETURN_IF_ERROR(GetFloat(j, source, "t_min", &g.t_min, false));
  DGSERVE_RETURN_IF_ERROR(GetFloat(j, source, "t_max", &g.t_max, false));
  DGSERVE_RETURN_IF_ERROR(
      GetInt(j, source, "stability_threshold", &g.stability_threshold, false, 0));
  DGSERVE_RETURN_IF_ERROR(
      GetFloat(j, source, "confidence_threshold", &g.confidence_threshold, false));
  DGSERVE_RETURN_IF_ERROR(GetInt(j, source, "pad_token_id", &g.pad_token_id, false, 0));
  if (auto it = j.find("sampler_config"); it != j.end()) {
    if (!it->is_object()) return FieldError(source, "sampler_config", "must be an object");
    if (auto cls = it->find("_cls_name"); cls != it->end() && *cls != "EntropyBoundSamplerConfig") {
      return FieldError(source, "sampler_config._cls_name",
                        "must be \"EntropyBoundSamplerConfig\"");
    }
    DGSERVE_RETURN_IF_ERROR(GetFloat(*it, source, "entropy_bound", &g.entropy_bound, false));
  }
  if (auto it = j.find("eos_token_id"); it != j.end()) {
    g.stop_token_ids.clear();
    // A token id: an integer in [0, 2^31) (non-negative JSON integers are stored unsigned).
    auto is_id = [](const json& e) {
      return e.is_number_unsigned() &&
             e.get<uint64_t>() <= uint64_t(std::numeric_limits<int32_t>::max());
    };
    if (it->is_number_integer()) {
      if (!is_id(*it)) {
        return FieldError(source, "eos_token_id",
                          "must be a token id in [0, 2^31), got " + it->dump());
      }
      g.stop_token_ids.push_back(static_cast<int32_t>(it->get<uint64_t>()));
    } else if (it->is_array()) {
      for (const json& e : *it) {
        if (!is_id(e)) {
          return FieldError(source, "eos_token_id",
                            "must hold token ids in [0, 2^31), got " + e.dump());
        }
        g.stop_token_ids.push_back(static_cast<int32_t>(e.get<uint64_t>()));
      }
    } else {
      return FieldError(source, "eos_token_id", "must be an integer or an array of integers");
    }
  }
  if (!(g.t_min >= 0 && g.t_min < g.t_max)) {
    return FieldError(source, "t_min", "must satisfy 0 <= t_min < t_max");
  }
  if (!(g.entropy_bound > 0))
    return FieldError(source, "sampler_config.entropy_bound", "must be > 0");
  if (!(g.confidence_threshold > 0)) {
    return FieldError(source, "confidence_threshold", "must be > 0");
  }
  return g;
}

absl::StatusOr<GenerationConfig> LoadGenerationConfig(const std::string& path) {
  DGSERVE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseGenerationConfig(text, path);
}

}  // namespace dgserve
