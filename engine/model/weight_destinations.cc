#include "engine/model/weight_destinations.h"

#include "absl/strings/str_cat.h"

namespace dgserve {

std::unordered_map<std::string, Destination> Destinations(const ModelConfig& c, ModelWeights* w) {
  std::unordered_map<std::string, Destination> d;
  const std::string p = "model.decoder.";
  d[p + "embed_tokens.weight"].embedding = w;
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

}  // namespace dgserve
