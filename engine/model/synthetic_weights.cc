#include "engine/model/synthetic_weights.h"

#include <stdexcept>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "engine/model/random_checkpoint.h"

namespace dgserve {
namespace {

// Where a tensor goes (as checkpoint.cc's Destinations; synthetic_weights_test checks the two
// agree by comparing with a loaded checkpoint).
struct Dest {
  std::vector<float>* vec = nullptr;
  float* scalar = nullptr;
  cpu::PackedMatrix* matrix = nullptr;
  std::vector<cpu::PackedMatrix>* experts = nullptr;
  bool embedding = false;
};

std::unordered_map<std::string, Dest> Destinations(const ModelConfig& c, ModelWeights* w) {
  std::unordered_map<std::string, Dest> d;
  const std::string p = "model.decoder.";
  d[p + "embed_tokens.weight"].embedding = true;
  d[p + "norm.weight"].vec = &w->final_norm;
  d[p + "self_conditioning.pre_norm.weight"].vec = &w->sc_pre_norm;
  d[p + "self_conditioning.gate_proj.weight"].matrix = &w->sc_gate_proj;
  d[p + "self_conditioning.up_proj.weight"].matrix = &w->sc_up_proj;
  d[p + "self_conditioning.down_proj.weight"].matrix = &w->sc_down_proj;
  w->layers.resize(c.num_layers);
  for (int i = 0; i < c.num_layers; ++i) {
    LayerWeights& l = w->layers[i];
    const std::string q = absl::StrCat(p, "layers.", i, ".");
    d[q + "input_layernorm.weight"].vec = &l.input_layernorm;
    d[q + "self_attn.q_proj.weight"].matrix = &l.q_proj;
    d[q + "self_attn.k_proj.weight"].matrix = &l.k_proj;
    d[q + "self_attn.v_proj.weight"].matrix = &l.v_proj;
    d[q + "self_attn.o_proj.weight"].matrix = &l.o_proj;
    d[q + "self_attn.q_norm.weight"].vec = &l.q_norm;
    d[q + "self_attn.k_norm.weight"].vec = &l.k_norm;
    d[q + "post_attention_layernorm.weight"].vec = &l.post_attention_layernorm;
    d[q + "pre_feedforward_layernorm.weight"].vec = &l.pre_feedforward_layernorm;
    d[q + "mlp.gate_proj.weight"].matrix = &l.mlp_gate_proj;
    d[q + "mlp.up_proj.weight"].matrix = &l.mlp_up_proj;
    d[q + "mlp.down_proj.weight"].matrix = &l.mlp_down_proj;
    d[q + "post_feedforward_layernorm_1.weight"].vec = &l.post_feedforward_layernorm_1;
    d[q + "router.proj.weight"].matrix = &l.router_proj;
    d[q + "router.scale"].vec = &l.router_scale;
    d[q + "router.per_expert_scale"].vec = &l.router_per_expert_scale;
    d[q + "pre_feedforward_layernorm_2.weight"].vec = &l.pre_feedforward_layernorm_2;
    d[q + "experts.gate_up_proj"].experts = &l.experts_gate_up_proj;
    d[q + "experts.down_proj"].experts = &l.experts_down_proj;
    d[q + "post_feedforward_layernorm_2.weight"].vec = &l.post_feedforward_layernorm_2;
    d[q + "post_feedforward_layernorm.weight"].vec = &l.post_feedforward_layernorm;
    d[q + "layer_scalar"].scalar = &l.decoder_layer_scalar;
    d[absl::StrCat("model.encoder.language_model.layers.", i, ".layer_scalar")].scalar =
        &l.encoder_layer_scalar;
  }
  return d;
}

}  // namespace

std::vector<TensorSpec> SyntheticMatrixSpecs(const ModelConfig& config) {
  std::vector<TensorSpec> out;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    if (spec.shape.size() >= 2) out.push_back(spec);
  }
  return out;
}

ModelWeights SyntheticModelWeights(const ModelConfig& config, uint64_t seed, bool matrices) {
  ModelWeights w;
  const std::unordered_map<std::string, Dest> dest = Destinations(config, &w);
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    auto it = dest.find(spec.name);
    if (it == dest.end()) {
      throw std::logic_error(absl::StrCat("SyntheticModelWeights: no destination for ", spec.name));
    }
    const Dest& d = it->second;
    if (d.vec != nullptr || d.scalar != nullptr) {
      const int64_t n = spec.numel();
      std::vector<float> f(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) f[i] = Bf16ToFloat(RandomBf16(spec, seed, i));
      if (d.scalar != nullptr) {
        *d.scalar = n > 0 ? f[0] : 0.0f;
      } else {
        *d.vec = std::move(f);
      }
      continue;
    }
    if (!matrices) continue;
    std::vector<uint16_t> bits = RandomTensorBf16(spec, seed);
    if (d.experts != nullptr) {
      const int experts = int(spec.shape[0]), rows = int(spec.shape[1]), cols = int(spec.shape[2]);
      d.experts->clear();
      for (int e = 0; e < experts; ++e) {
        d.experts->push_back(
            cpu::PackedMatrix::FromBf16(bits.data() + size_t(e) * rows * cols, rows, cols));
      }
    } else if (d.embedding) {
      w.lm_head = cpu::PackedMatrix::FromBf16(bits.data(), int(spec.shape[0]), int(spec.shape[1]));
      w.embed_tokens = std::move(bits);
    } else {
      *d.matrix = cpu::PackedMatrix::FromBf16(bits.data(), int(spec.shape[0]), int(spec.shape[1]));
    }
  }
  return w;
}

}  // namespace dgserve
