// Built with -ffp-contract=off (see CMakeLists.txt): the generator must not fuse c + v·a. Every
// step is exact or one float32 rounding (README §2.3), so contraction would not change the bits
// today, but the flag keeps it that way if the formulas ever change.
#include "engine/model/random_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "common/system_resources.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "the safetensors writer emits host-order bf16; a big-endian host needs byte swaps");

constexpr int64_t kParallelMinElements = int64_t{1} << 15;

// The element formula of README §2.3 given the stream key and the family constants.
inline uint16_t Element(uint64_t key, int64_t i, const InitConstants& k) {
  const uint64_t x = SplitMix64(key + static_cast<uint64_t>(i));
  const int32_t q = static_cast<int32_t>(x >> 40) - 8388608;
  const float v = static_cast<float>(q) * 0x1p-23f;
  const float w = k.has_offset ? k.c + v * k.a : v * k.a;
  const uint32_t b = std::bit_cast<uint32_t>(w);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// The shortest decimal that reads back as `f`, as a double, so JSON shows 1e-06 not 9.99e-07.
double JsonFloat(float f) {
  char buf[40];
  for (int precision = 1; precision <= 9; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) return std::strtod(buf, nullptr);
  }
  return f;
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::Status CopyFile(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  if (fs::exists(to, ec) && fs::equivalent(from, to, ec)) return absl::OkStatus();
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot copy ", from.string(), " to ", to.string(), ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t TensorKey(std::string_view name, uint64_t seed) {
  return Fnv1a64(name) ^ (seed * 0x9E3779B97F4A7C15ull);
}

InitConstants FamilyConstants(const TensorSpec& spec) {
  InitConstants k;
  switch (spec.family) {
    case InitFamily::kEmbed:
      k.a = std::sqrt(0.48f);
      break;
    case InitFamily::kLinear: {
      const int64_t fan_in = spec.shape.empty() ? 0 : spec.shape.back();
      k.a = fan_in > 0 ? std::sqrt(3.0f / static_cast<float>(fan_in)) : 0.0f;
      break;
    }
    case InitFamily::kRouter:
      k.a = std::sqrt(3.0f);
      break;
    case InitFamily::kGain:
      k = {0.5f, 1.0f, true};
      break;
    case InitFamily::kQkNorm:
      k = {0.25f, 0.5f, true};
      break;
    case InitFamily::kScalar:
      k = {0.25f, 0.65f, true};
      break;
  }
  return k;
}

uint16_t RandomBf16(const TensorSpec& spec, uint64_t seed, int64_t i) {
  return Element(TensorKey(spec.name, seed), i, FamilyConstants(spec));
}

void FillRandomBf16(const TensorSpec& spec, uint64_t seed, uint16_t* out) {
  const uint64_t key = TensorKey(spec.name, seed);
  const InitConstants k = FamilyConstants(spec);
  const int64_t n = spec.numel();
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) out[i] = Element(key, i, k);
}

std::vector<uint16_t> RandomTensorBf16(const TensorSpec& spec, uint64_t seed) {
  std::vector<uint16_t> out(static_cast<size_t>(spec.numel()));
  FillRandomBf16(spec, seed, out.data());
  return out;
}

std::string ModelConfigToJson(const ModelConfig& c, const std::vector<int32_t>& eos_token_ids) {
  json layer_types = json::array();
  for (LayerType t : c.layer_types) {
    layer_types.push_back(t == LayerType::kFull ? "full_attention" : "sliding_attention");
  }
  json text = {
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"bos_token_id", c.bos_token_id},
      {"dtype", "bfloat16"},
      {"eos_token_id", eos_token_ids.empty() ? 1 : eos_token_ids.front()},
      {"final_logit_softcapping", JsonFloat(c.final_logit_softcapping)},
      {"global_head_dim", c.global_head_dim},
      {"head_dim", c.head_dim},
      {"hidden_activation", "gelu_pytorch_tanh"},
      {"hidden_size", c.hidden_size},
      {"initializer_range", 0.02},
      {"intermediate_size", c.intermediate_size},
      {"layer_types", layer_types},
      {"max_position_embeddings", c.max_position_embeddings},
      {"model_type", "diffusion_gemma_text"},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"num_attention_heads", c.num_heads},
      {"num_experts", c.num_experts},
      {"num_global_key_value_heads", c.num_global_kv_heads},
      {"num_hidden_layers", c.num_layers},
      {"num_key_value_heads", c.num_kv_heads},
      {"pad_token_id", c.pad_token_id},
      {"rms_norm_eps", JsonFloat(c.rms_norm_eps)},
      {"rope_parameters",
       {{"full_attention",
         {{"partial_rotary_factor", JsonFloat(c.partial_rotary_factor_full)},
          {"rope_theta", JsonFloat(c.rope_theta_full)},
          {"rope_type", "proportional"}}},
        {"sliding_attention",
         {{"rope_theta", JsonFloat(c.rope_theta_sliding)}, {"rope_type", "default"}}}}},
      {"sliding_window", c.sliding_window},
      {"tie_word_embeddings", true},
      {"top_k_experts", c.top_k_experts},
      {"use_bidirectional_attention", "vision"},
      {"vocab_size", c.vocab_size},
  };
  json outer = {
      {"architectures", json::array({"DiffusionGemmaForBlockDiffusion"})},
      {"canvas_length", c.canvas_length},
      {"dtype", "bfloat16"},
      {"eos_token_id", eos_token_ids},
      {"model_type", "diffusion_gemma"},
      {"text_config", text},
      {"tie_word_embeddings", true},
  };
  return outer.dump(2) + "\n";
}

std::string GenerationConfigToJson(const GenerationConfig& g) {
  json j = {
      {"confidence_threshold", JsonFloat(g.confidence_threshold)},
      {"eos_token_id", g.stop_token_ids},
      {"max_denoising_steps", g.max_denoising_steps},
      {"max_new_tokens", g.max_new_tokens},
      {"pad_token_id", g.pad_token_id},
      {"sampler_config",
       {{"_cls_name", "EntropyBoundSamplerConfig"}, {"entropy_bound", JsonFloat(g.entropy_bound)}}},
      {"stability_threshold", g.stability_threshold},
      {"t_max", JsonFloat(g.t_max)},
      {"t_min", JsonFloat(g.t_min)},
  };
  return j.dump(2) + "\n";
}

absl::Status CheckWritableDirectory(const std::string& dir) {
  const std::string probe = (fs::path(dir) / ".dgserve-write-probe").string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write to directory ", dir, ": ", std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return absl::OkStatus();
}

absl::Status WriteRandomCheckpoint(const ModelConfig& config, const GenerationConfig& generation,
                                   uint64_t seed, const std::string& out_dir,
                                   const WriteOptions& options) {
  fs::path tokenizer, tokenizer_config;
  if (!options.tokenizer_path.empty()) {
    tokenizer = options.tokenizer_path;
    std::error_code ec;
    if (!fs::is_regular_file(tokenizer, ec)) {
      return absl::NotFoundError(
          absl::StrCat("tokenizer file ", tokenizer.string(), " does not exist"));
    }
    tokenizer_config = tokenizer.parent_path() / "tokenizer_config.json";
    if (!fs::is_regular_file(tokenizer_config, ec)) tokenizer_config.clear();
  }
  // A directory that cannot be made or written to is named with the OS's reason, before the free
  // space is looked at (a file system such as /sys reports none: it was "only 0.00 GB are free").
  std::error_code ec;
  const bool created = fs::create_directories(out_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create directory ", out_dir, ": ", ec.message()));
  }
  if (absl::Status writable = CheckWritableDirectory(out_dir); !writable.ok()) {
    if (created) fs::remove(out_dir, ec);
    return writable;
  }
  // Refuse up front what the disk cannot hold, rather than leave a partial checkpoint behind.
  int64_t total_bytes = 0;
  for (const TensorSpec& spec : ExpectedTensors(config)) total_bytes += spec.numel() * 2;
  if (auto free_bytes = FreeDiskBytes(out_dir);
      free_bytes && uint64_t(total_bytes) + (64u << 20) > *free_bytes) {
    if (created) fs::remove(out_dir, ec);
    return absl::ResourceExhaustedError(
        absl::StrFormat("writing this checkpoint to %s needs %.2f GB of disk (bf16) but only "
                        "%.2f GB are free",
                        out_dir, total_bytes / 1e9, double(*free_bytes) / 1e9));
  }
  std::vector<TensorSource> tensors;
  for (TensorSpec& spec : ExpectedTensors(config)) {
    TensorSource t;
    t.name = spec.name;
    t.dtype = DType::kBF16;
    t.shape = spec.shape;
    t.fill = [spec = std::move(spec), seed](uint8_t* dst) {
      FillRandomBf16(spec, seed, reinterpret_cast<uint16_t*>(dst));
      return absl::OkStatus();
    };
    tensors.push_back(std::move(t));
  }
  SafetensorsWriteOptions st;
  st.max_shard_bytes = options.max_shard_bytes;
  DGSERVE_RETURN_IF_ERROR(WriteSafetensors(out_dir, std::move(tensors), st));
  const fs::path dir(out_dir);
  DGSERVE_RETURN_IF_ERROR(WriteTextFile((dir / "config.json").string(),
                                        ModelConfigToJson(config, options.config_eos_token_ids)));
  DGSERVE_RETURN_IF_ERROR(
      WriteTextFile((dir / "generation_config.json").string(), GenerationConfigToJson(generation)));
  if (!tokenizer.empty()) {
    DGSERVE_RETURN_IF_ERROR(CopyFile(tokenizer, dir / "tokenizer.json"));
    if (!tokenizer_config.empty()) {
      DGSERVE_RETURN_IF_ERROR(CopyFile(tokenizer_config, dir / "tokenizer_config.json"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelDirConfigs> LoadConfigsFromModelDir(const std::string& dir) {
  ModelDirConfigs out;
  DGSERVE_ASSIGN_OR_RETURN(out.config, LoadModelConfig((fs::path(dir) / "config.json").string()));
  const fs::path gen = fs::path(dir) / "generation_config.json";
  std::error_code ec;
  if (fs::exists(gen, ec)) {
    DGSERVE_ASSIGN_OR_RETURN(out.generation, LoadGenerationConfig(gen.string()));
  }
  return out;
}

}  // namespace dgserve
