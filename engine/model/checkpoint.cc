#include "engine/model/checkpoint.h"

#include <cmath>
#include <filesystem>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/system_resources.h"
#include "engine/model/tensor_names.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;

constexpr char kDecoderPrefix[] = "model.decoder.";
constexpr char kEncoderPrefix[] = "model.encoder.language_model.";
constexpr char kLmHead[] = "lm_head.weight";
constexpr size_t kMaxReportedProblems = 8;

// Where a checkpoint tensor goes in ModelWeights: a vector (resized to numel) or a scalar.
struct Destination {
  std::vector<float>* vec = nullptr;
  float* scalar = nullptr;
};

std::unordered_map<std::string, Destination> Destinations(const ModelConfig& c, ModelWeights* w) {
  std::unordered_map<std::string, Destination> d;
  const std::string p = kDecoderPrefix;
  d[p + "embed_tokens.weight"].vec = &w->embed_tokens;
  d[p + "norm.weight"].vec = &w->final_norm;
  d[p + "self_conditioning.pre_norm.weight"].vec = &w->sc_pre_norm;
  d[p + "self_conditioning.gate_proj.weight"].vec = &w->sc_gate_proj;
  d[p + "self_conditioning.up_proj.weight"].vec = &w->sc_up_proj;
  d[p + "self_conditioning.down_proj.weight"].vec = &w->sc_down_proj;
  w->layers.resize(c.num_layers);
  for (int i = 0; i < c.num_layers; ++i) {
    LayerWeights& l = w->layers[i];
    const std::string q = absl::StrCat(p, "layers.", i, ".");
    d[q + "input_layernorm.weight"].vec = &l.input_layernorm;
    d[q + "self_attn.q_proj.weight"].vec = &l.q_proj;
    d[q + "self_attn.k_proj.weight"].vec = &l.k_proj;
    d[q + "self_attn.v_proj.weight"].vec = &l.v_proj;
    d[q + "self_attn.o_proj.weight"].vec = &l.o_proj;
    d[q + "self_attn.q_norm.weight"].vec = &l.q_norm;
    d[q + "self_attn.k_norm.weight"].vec = &l.k_norm;
    d[q + "post_attention_layernorm.weight"].vec = &l.post_attention_layernorm;
    d[q + "pre_feedforward_layernorm.weight"].vec = &l.pre_feedforward_layernorm;
    d[q + "mlp.gate_proj.weight"].vec = &l.mlp_gate_proj;
    d[q + "mlp.up_proj.weight"].vec = &l.mlp_up_proj;
    d[q + "mlp.down_proj.weight"].vec = &l.mlp_down_proj;
    d[q + "post_feedforward_layernorm_1.weight"].vec = &l.post_feedforward_layernorm_1;
    d[q + "router.proj.weight"].vec = &l.router_proj;
    d[q + "router.scale"].vec = &l.router_scale;
    d[q + "router.per_expert_scale"].vec = &l.router_per_expert_scale;
    d[q + "pre_feedforward_layernorm_2.weight"].vec = &l.pre_feedforward_layernorm_2;
    d[q + "experts.gate_up_proj"].vec = &l.experts_gate_up_proj;
    d[q + "experts.down_proj"].vec = &l.experts_down_proj;
    d[q + "post_feedforward_layernorm_2.weight"].vec = &l.post_feedforward_layernorm_2;
    d[q + "post_feedforward_layernorm.weight"].vec = &l.post_feedforward_layernorm;
    d[q + "layer_scalar"].scalar = &l.decoder_layer_scalar;
    d[absl::StrCat(kEncoderPrefix, "layers.", i, ".layer_scalar")].scalar = &l.encoder_layer_scalar;
  }
  return d;
}

// The encoder-tower alias of a `model.decoder.` name ("" when there is none).
std::string EncoderAlias(const std::string& name) {
  if (!absl::StartsWith(name, kDecoderPrefix)) return "";
  return absl::StrCat(kEncoderPrefix, name.substr(sizeof(kDecoderPrefix) - 1));
}

std::string ShapeProblem(const TensorView& v, const std::vector<int64_t>& expected) {
  return absl::StrCat(v.file, ": tensor '", v.name, "' has shape ", ShapeToString(v.shape),
                      " but the config expects ", ShapeToString(expected));
}

}  // namespace

absl::StatusOr<ModelWeights> LoadModelWeights(const ModelConfig& config,
                                              const SafetensorsReader& reader) {
  ModelWeights w;
  std::unordered_map<std::string, Destination> dest = Destinations(config, &w);
  std::vector<std::string> problems;
  std::set<std::string> used;
  std::vector<std::pair<const TensorView*, Destination>> jobs;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    const std::string alias = EncoderAlias(spec.name);
    const TensorView* primary = reader.Find(spec.name);
    const TensorView* secondary = alias.empty() ? nullptr : reader.Find(alias);
    if (primary != nullptr) used.insert(spec.name);
    if (secondary != nullptr) used.insert(alias);
    const TensorView* v = primary != nullptr ? primary : secondary;
    if (v == nullptr) {
      problems.push_back(absl::StrCat(reader.source(), ": tensor '", spec.name, "'",
                                      alias.empty() ? "" : absl::StrCat(" (or '", alias, "')"),
                                      " is missing (expected shape ", ShapeToString(spec.shape),
                                      ")"));
      continue;
    }
    if (v->shape != spec.shape) {
      problems.push_back(ShapeProblem(*v, spec.shape));
      continue;
    }
    // A tied encoder copy next to the decoder tensor is accepted but must have the same shape.
    if (primary != nullptr && secondary != nullptr && secondary->shape != spec.shape) {
      problems.push_back(ShapeProblem(*secondary, spec.shape));
    }
    auto it = dest.find(spec.name);
    if (it == dest.end()) {
      return absl::InternalError(absl::StrCat("no destination for tensor '", spec.name, "'"));
    }
    jobs.emplace_back(v, it->second);
  }
  for (const TensorView& v : reader.tensors()) {
    if (used.count(v.name) != 0 || IsVisionTensor(v.name)) continue;
    if (v.name == kLmHead) {
      const std::vector<int64_t> tied = {config.vocab_size, config.hidden_size};
      if (v.shape != tied) {
        problems.push_back(
            absl::StrCat(ShapeProblem(v, tied), " (lm_head must be tied to embed_tokens)"));
      }
      continue;
    }
    problems.push_back(absl::StrCat(v.file, ": unexpected tensor '", v.name, "' with shape ",
                                    ShapeToString(v.shape),
                                    " (not a DiffusionGemma text tensor for this config)"));
  }
  if (!problems.empty()) {
    const size_t n = problems.size();
    if (n > kMaxReportedProblems) {
      problems.resize(kMaxReportedProblems);
      problems.push_back(absl::StrCat("... and ", n - kMaxReportedProblems, " more"));
    }
    return absl::InvalidArgumentError(absl::StrJoin(problems, "; "));
  }
  for (auto& [view, d] : jobs) {
    float* data = d.scalar;
    if (data == nullptr) {
      d.vec->resize(static_cast<size_t>(view->numel()));
      data = d.vec->data();
    }
    DGSERVE_RETURN_IF_ERROR(ToFloat32(*view, data));
    // NaN or infinite weights would only surface as garbage tokens: name the tensor now.
    const int64_t n = view->numel();
    int64_t bad = n;  // the first non-finite element, n if none
#pragma omp parallel for reduction(min : bad) if (n >= (1 << 20))
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isfinite(data[i])) bad = std::min(bad, i);
    }
    if (bad < n) {
      return absl::InvalidArgumentError(absl::StrCat(
          view->file, ": tensor '", view->name, "' holds a non-finite value (element ", bad, ")"));
    }
  }
  return w;
}

absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  Checkpoint ckpt;
  ckpt.dir = dir;
  const std::string config_path = (fs::path(dir) / "config.json").string();
  DGSERVE_ASSIGN_OR_RETURN(ckpt.config, LoadModelConfig(config_path));
  const fs::path gen = fs::path(dir) / "generation_config.json";
  if (fs::exists(gen, ec)) {
    DGSERVE_ASSIGN_OR_RETURN(ckpt.generation, LoadGenerationConfig(gen.string()));
  }
  // The CPU backend holds every weight as float32: refuse what memory cannot hold.
  int64_t f32_bytes = 0;
  for (const TensorSpec& spec : ExpectedTensors(ckpt.config)) f32_bytes += spec.numel() * 4;
  if (auto available = AvailableMemoryBytes(); available && uint64_t(f32_bytes) > *available) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "loading %s needs %.2f GB of memory (float32 weights) but only %.2f GB are available", dir,
        f32_bytes / 1e9, double(*available) / 1e9));
  }
  DGSERVE_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::OpenDir(dir));
  auto weights = LoadModelWeights(ckpt.config, reader);
  if (!weights.ok()) {
    return absl::Status(weights.status().code(), absl::StrCat(weights.status().message(),
                                                              " [shapes from ", config_path, "]"));
  }
  ckpt.weights = *std::move(weights);
  return ckpt;
}

}  // namespace dgserve
