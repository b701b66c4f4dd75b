// DiffusionGemma configuration: config.json (text_config + canvas_length) and
// generation_config.json, parsed and validated (spec §1.1–§1.3).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dgserve {

enum class LayerType { kSliding, kFull };

// The text tower's shape, read from config.json (`text_config`) — never from class defaults.
struct ModelConfig {
  int vocab_size = 0;             // V
  int hidden_size = 0;            // D
  int num_layers = 0;             // L
  int num_heads = 0;              // Hq (same for both layer types)
  int num_kv_heads = 0;           // KV heads in sliding layers
  int num_global_kv_heads = 0;    // KV heads in full layers (K = V: no v_proj)
  int head_dim = 0;               // head dim in sliding layers
  int global_head_dim = 0;        // head dim in full layers
  int intermediate_size = 0;      // dense MLP and self-conditioning MLP width
  int num_experts = 0;            // E
  int top_k_experts = 0;          // k
  int moe_intermediate_size = 0;  // per-expert MLP width
  int sliding_window = 0;         // W (sliding layers see keys q−W < k ≤ q)
  int canvas_length = 0;          // C, the diffusion block length (outer config)
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  float final_logit_softcapping = 30.0f;
  float rope_theta_sliding = 10000.0f;       // default RoPE, all pairs rotate
  float rope_theta_full = 1000000.0f;        // proportional RoPE
  float partial_rotary_factor_full = 0.25f;  // rotated pairs = int(factor·hd_full // 2)
  std::vector<LayerType> layer_types;        // size L
  int32_t pad_token_id = 0;
  int32_t bos_token_id = 2;

  bool IsFull(int layer) const { return layer_types[layer] == LayerType::kFull; }
  int HeadDim(int layer) const { return IsFull(layer) ? global_head_dim : head_dim; }
  int KvHeads(int layer) const { return IsFull(layer) ? num_global_kv_heads : num_kv_heads; }
  // bf16(sqrt(hidden_size)) as float32: the embedding scale HF applies (spec §5.3 trap 1).
  float EmbedScale() const;
  // Number of rotated pairs in full layers: int(partial_rotary_factor · global_head_dim // 2).
  int FullRopeAngles() const;
};

// generation_config.json: defaults for every per-request sampler parameter (spec §1.3).
struct GenerationConfig {
  int max_new_tokens = 256;
  int max_denoising_steps = 48;
  float t_min = 0.4f;
  float t_max = 0.8f;
  float entropy_bound = 0.1f;
  int stability_threshold = 1;
  float confidence_threshold = 0.005f;
  std::vector<int32_t> stop_token_ids = {1, 106, 50};
  int32_t pad_token_id = 0;
};

// Parses and validates the text of a config.json. `source` names the file in error messages.
// Errors: INVALID_ARGUMENT for malformed JSON, a missing/ill-typed field, or an inconsistent
// shape (e.g. layer_types length ≠ num_hidden_layers, heads not a multiple of kv heads, top_k >
// num_experts), naming the file and the field.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& source);
// Reads `path` and parses it with ParseModelConfig. NOT_FOUND if the file cannot be read.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);

// Parses generation_config.json; absent fields keep the HF defaults above. INVALID_ARGUMENT names
// the field when a value is ill-typed or out of range.
absl::StatusOr<GenerationConfig> ParseGenerationConfig(const std::string& json_text,
                                                       const std::string& source);
absl::StatusOr<GenerationConfig> LoadGenerationConfig(const std::string& path);

// Whether a request of `prompt_tokens` prompt tokens and `max_new_tokens` new tokens (whole
// canvases of config.canvas_length) fits the model's context (max_position_embeddings).
// INVALID_ARGUMENT otherwise, naming the prompt when the prompt alone leaves no room for one
// canvas ("prompt: the prompt has N tokens; with one canvas of C tokens they exceed the context
// limit of M positions ..."), else max_new_tokens and how many new tokens fit after this prompt.
absl::Status CheckContextFits(int64_t prompt_tokens, int64_t max_new_tokens,
                              const ModelConfig& config);

// Reads a whole regular file of at most `max_bytes` bytes (more: the first max_bytes are
// returned, so callers can tell). NOT_FOUND for a missing file, INVALID_ARGUMENT for a
// directory or other non-regular file, INTERNAL for a read error; all name the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             size_t max_bytes = size_t(1) << 30);

// Reads input a user names by a path, at most `max_bytes` bytes (more: the first max_bytes are
// returned, so callers can tell; nothing past them is read): "-" is standard input; a regular
// file, or a pipe or other stream (a FIFO, /dev/stdin, bash's <(...) as /dev/fd/N) is read to its
// end. NOT_FOUND for a missing path, INVALID_ARGUMENT for a directory, INTERNAL for a read error;
// all name the path.
absl::StatusOr<std::string> ReadInputToString(const std::string& path, size_t max_bytes);

}  // namespace dgserve
