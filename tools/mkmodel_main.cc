// dgserve-mkmodel: writes a deterministic random DiffusionGemma checkpoint (golden README §2.3)
// in the HF layout: config.json, generation_config.json, model.safetensors (or shards + index),
// and optionally the tokenizer files.
//
//   dgserve-mkmodel --out DIR --config golden/tiny-g3/config.json --seed 3
//   dgserve-mkmodel --out DIR --vocab_size 512 --hidden_size 64 --layer_types SSFSSF ...
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/status_macros.h"
#include "engine/model/config.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/tensor_names.h"
#include "engine/tokenizer/tokenizer.h"

ABSL_FLAG(std::string, out, "", "output checkpoint directory (required; created if needed)");
ABSL_FLAG(uint64_t, seed, 0, "generator seed (the golden models use 512 and 3)");
ABSL_FLAG(std::string, config, "", "config.json to take the shape from");
ABSL_FLAG(std::string, config_json, "", "config as JSON text (same format as config.json)");
ABSL_FLAG(std::optional<int32_t>, vocab_size, std::nullopt,
          "vocabulary size (default: from --config, else the tiny-v512 shape)");
ABSL_FLAG(std::optional<int32_t>, hidden_size, std::nullopt, "hidden size");
ABSL_FLAG(std::optional<int32_t>, num_layers, std::nullopt, "number of layers (num_hidden_layers)");
ABSL_FLAG(std::optional<int32_t>, num_heads, std::nullopt, "query heads");
ABSL_FLAG(std::optional<int32_t>, num_kv_heads, std::nullopt, "KV heads of sliding layers");
ABSL_FLAG(std::optional<int32_t>, num_global_kv_heads, std::nullopt, "KV heads of full layers");
ABSL_FLAG(std::optional<int32_t>, head_dim, std::nullopt, "head dim of sliding layers");
ABSL_FLAG(std::optional<int32_t>, global_head_dim, std::nullopt, "head dim of full layers");
ABSL_FLAG(std::optional<int32_t>, intermediate_size, std::nullopt,
          "dense / self-conditioning MLP width");
ABSL_FLAG(std::optional<int32_t>, num_experts, std::nullopt, "MoE experts");
ABSL_FLAG(std::optional<int32_t>, top_k, std::nullopt, "experts per token (top_k_experts)");
ABSL_FLAG(std::optional<int32_t>, moe_intermediate_size, std::nullopt, "per-expert MLP width");
ABSL_FLAG(std::optional<int32_t>, sliding_window, std::nullopt, "sliding window");
ABSL_FLAG(std::optional<int32_t>, canvas_length, std::nullopt, "diffusion canvas length");
ABSL_FLAG(std::string, layer_types, "",
          "one letter per layer, S = sliding_attention, F = full_attention (e.g. SSFSSF); sets "
          "num_layers when that is not given");
ABSL_FLAG(std::string, generation_config, "",
          "generation_config.json to copy (default: the one next to --config if any, else "
          "defaults with max_new_tokens = canvas_length)");
ABSL_FLAG(std::string, tokenizer, "",
          "tokenizer.json to copy in (tokenizer_config.json next to it is copied too)");
ABSL_FLAG(int64_t, max_shard_bytes, dgserve::kDefaultMaxShardBytes,
          "shard the weights above this many bytes (HF default 5 GB)");

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The shape used when neither --config nor --config_json is given: tiny-v512 (golden §2.1).
ModelConfig DefaultShape() {
  ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 64;
  c.num_layers = 6;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.num_global_kv_heads = 1;
  c.head_dim = 16;
  c.global_head_dim = 32;
  c.intermediate_size = 48;
  c.num_experts = 8;
  c.top_k_experts = 2;
  c.moe_intermediate_size = 24;
  c.sliding_window = 8;
  c.canvas_length = 16;
  c.max_position_embeddings = 262144;
  const LayerType S = LayerType::kSliding, F = LayerType::kFull;
  c.layer_types = {S, S, F, S, S, F};
  return c;
}

// Applies the shape flags to a config.json object.
absl::Status ApplyShapeFlags(json* root) {
  if (root->contains("text_config") && !(*root)["text_config"].is_object()) {
    return absl::InvalidArgumentError("field 'text_config' must be an object");
  }
  json& text = root->contains("text_config") ? (*root)["text_config"] : *root;
  struct ShapeFlag {
    const absl::Flag<std::optional<int32_t>>* flag;
    const char* flag_name;
    const char* key;  // config.json field
  };
  const ShapeFlag fields[] = {
      {&FLAGS_vocab_size, "vocab_size", "vocab_size"},
      {&FLAGS_hidden_size, "hidden_size", "hidden_size"},
      {&FLAGS_num_layers, "num_layers", "num_hidden_layers"},
      {&FLAGS_num_heads, "num_heads", "num_attention_heads"},
      {&FLAGS_num_kv_heads, "num_kv_heads", "num_key_value_heads"},
      {&FLAGS_num_global_kv_heads, "num_global_kv_heads", "num_global_key_value_heads"},
      {&FLAGS_head_dim, "head_dim", "head_dim"},
      {&FLAGS_global_head_dim, "global_head_dim", "global_head_dim"},
      {&FLAGS_intermediate_size, "intermediate_size", "intermediate_size"},
      {&FLAGS_num_experts, "num_experts", "num_experts"},
      {&FLAGS_top_k, "top_k", "top_k_experts"},
      {&FLAGS_moe_intermediate_size, "moe_intermediate_size", "moe_intermediate_size"},
      {&FLAGS_sliding_window, "sliding_window", "sliding_window"},
  };
  for (const ShapeFlag& f : fields) {
    if (const std::optional<int32_t> v = absl::GetFlag(*f.flag)) {
      if (*v <= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", f.flag_name, " must be > 0, got ", *v));
      }
      text[f.key] = *v;
    }
  }
  if (const std::optional<int32_t> c = absl::GetFlag(FLAGS_canvas_length)) {
    if (*c <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--canvas_length must be > 0, got ", *c));
    }
    (*root)["canvas_length"] = *c;
  }
  const std::string letters = absl::GetFlag(FLAGS_layer_types);
  if (!letters.empty()) {
    json types = json::array();
    for (char ch : letters) {
      if (ch == 'S' || ch == 's') {
        types.push_back("sliding_attention");
      } else if (ch == 'F' || ch == 'f') {
        types.push_back("full_attention");
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("--layer_types: '", std::string(1, ch), "' is not S or F"));
      }
    }
    text["layer_types"] = types;
    if (!absl::GetFlag(FLAGS_num_layers)) text["num_hidden_layers"] = types.size();
  } else if (absl::GetFlag(FLAGS_num_layers)) {
    text.erase("layer_types");  // the default pattern: every 6th layer and the last are full
  }
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("--out DIR is required");
  const std::string config_path = absl::GetFlag(FLAGS_config);
  const std::string config_text = absl::GetFlag(FLAGS_config_json);
  if (!config_path.empty() && !config_text.empty()) {
    return absl::InvalidArgumentError("give --config or --config_json, not both");
  }
  std::string source = "shape flags";
  std::string text = ModelConfigToJson(DefaultShape());
  if (!config_path.empty()) {
    absl::StatusOr<std::string> read = ReadFileToString(config_path);
    if (!read.ok()) {  // named by its flag, as --generation_config and --tokenizer are
      return absl::Status(read.status().code(),
                          absl::StrCat("--config: ", read.status().message()));
    }
    text = *std::move(read);
    source = config_path;
  } else if (!config_text.empty()) {
    text = config_text;
    source = "--config_json";
  }
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": malformed JSON"));
  }
  DGSERVE_RETURN_IF_ERROR(ApplyShapeFlags(&root));
  DGSERVE_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(root.dump(), source));

  WriteOptions options;
  options.tokenizer_path = absl::GetFlag(FLAGS_tokenizer);
  options.max_shard_bytes = absl::GetFlag(FLAGS_max_shard_bytes);
  if (options.max_shard_bytes <= 0) {
    return absl::InvalidArgumentError("--max_shard_bytes must be positive");
  }
  if (auto eos = root.find("eos_token_id"); eos != root.end()) {  // keep the source's outer ids
    options.config_eos_token_ids.clear();
    for (const json& id : eos->is_array() ? *eos : json::array({*eos})) {
      if (!id.is_number_integer()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": field 'eos_token_id' must hold integers"));
      }
      options.config_eos_token_ids.push_back(id.get<int32_t>());
    }
  }

  std::string gen_path = absl::GetFlag(FLAGS_generation_config);
  std::error_code ec;
  if (gen_path.empty() && !config_path.empty()) {
    const fs::path next = fs::path(config_path).parent_path() / "generation_config.json";
    if (fs::exists(next, ec)) gen_path = next.string();
  }
  GenerationConfig generation;
  generation.max_new_tokens = config.canvas_length;
  if (!gen_path.empty()) {
    absl::StatusOr<GenerationConfig> loaded = LoadGenerationConfig(gen_path);
    if (!loaded.ok()) {  // the flag's file, or the one found next to --config
      return absl::Status(loaded.status().code(),
                          absl::StrCat(absl::GetFlag(FLAGS_generation_config).empty()
                                           ? "the generation_config.json next to --config: "
                                           : "--generation_config: ",
                                       loaded.status().message()));
    }
    generation = *std::move(loaded);
  }
  // A tokenizer the servers could not load is refused before anything is written.
  if (!options.tokenizer_path.empty()) {
    if (absl::StatusOr<Tokenizer> t = Tokenizer::Load(options.tokenizer_path); !t.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tokenizer ", options.tokenizer_path,
                                                     ": not a usable tokenizer.json (",
                                                     t.status().message(), ")"));
    }
  }

  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const auto start = std::chrono::steady_clock::now();
  DGSERVE_RETURN_IF_ERROR(WriteRandomCheckpoint(config, generation, seed, out, options));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int64_t params = 0;
  const std::vector<TensorSpec> specs = ExpectedTensors(config);
  for (const TensorSpec& s : specs) params += s.numel();
  std::printf(
      "wrote %s: %zu tensors, %lld parameters (%lld bytes bf16), seed %llu, %s%s in %.2f s\n",
      out.c_str(), specs.size(), static_cast<long long>(params), static_cast<long long>(params * 2),
      static_cast<unsigned long long>(seed),
      fs::exists(fs::path(out) / "model.safetensors.index.json", ec) ? "sharded" : "single file",
      gen_path.empty() ? "" : absl::StrCat(", generation config from ", gen_path).c_str(), seconds);
  return absl::OkStatus();
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  // Nothing in Run should throw; a bad_alloc on an absurd shape must not crash the tool.
  return dgserve::RunFlagsOnlyTool(
      argc, argv, "dgserve-mkmodel",
      "Writes a deterministic random DiffusionGemma checkpoint (golden README §2.3).\n"
      "  dgserve-mkmodel --out DIR [--seed N] [--config FILE | --config_json TEXT] [shape flags]\n"
      "                  [--generation_config FILE] [--tokenizer tokenizer.json] "
      "[--max_shard_bytes N]",
      "tools/mkmodel_main.cc", dgserve::Run);
}
