#include "engine/model/tensor_names.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dgserve {

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  const int64_t D = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  const int64_t E = c.num_experts, F = c.moe_intermediate_size;
  std::vector<TensorSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, InitFamily f) {
    out.push_back({std::move(name), std::move(shape), f});
  };
  const std::string p = "model.decoder.";
  add(p + "embed_tokens.weight", {V, D}, InitFamily::kEmbed);
  add(p + "norm.weight", {D}, InitFamily::kGain);
  add(p + "self_conditioning.pre_norm.weight", {D}, InitFamily::kGain);
  add(p + "self_conditioning.gate_proj.weight", {I, D}, InitFamily::kLinear);
  add(p + "self_conditioning.up_proj.weight", {I, D}, InitFamily::kLinear);
  add(p + "self_conditioning.down_proj.weight", {D, I}, InitFamily::kLinear);
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string l = absl::StrCat(p, "layers.", i, ".");
    const int64_t hd = c.HeadDim(i), nkv = c.KvHeads(i), nh = c.num_heads;
    add(l + "input_layernorm.weight", {D}, InitFamily::kGain);
    add(l + "self_attn.q_proj.weight", {nh * hd, D}, InitFamily::kLinear);
    add(l + "self_attn.k_proj.weight", {nkv * hd, D}, InitFamily::kLinear);
    if (!c.IsFull(i)) add(l + "self_attn.v_proj.weight", {nkv * hd, D}, InitFamily::kLinear);
    add(l + "self_attn.o_proj.weight", {D, nh * hd}, InitFamily::kLinear);
    add(l + "self_attn.q_norm.weight", {hd}, InitFamily::kQkNorm);
    add(l + "self_attn.k_norm.weight", {hd}, InitFamily::kQkNorm);
    add(l + "post_attention_layernorm.weight", {D}, InitFamily::kGain);
    add(l + "pre_feedforward_layernorm.weight", {D}, InitFamily::kGain);
    add(l + "mlp.gate_proj.weight", {I, D}, InitFamily::kLinear);
    add(l + "mlp.up_proj.weight", {I, D}, InitFamily::kLinear);
    add(l + "mlp.down_proj.weight", {D, I}, InitFamily::kLinear);
    add(l + "post_feedforward_layernorm_1.weight", {D}, InitFamily::kGain);
    add(l + "router.proj.weight", {E, D}, InitFamily::kRouter);
    add(l + "router.scale", {D}, InitFamily::kGain);
    add(l + "router.per_expert_scale", {E}, InitFamily::kGain);
    add(l + "pre_feedforward_layernorm_2.weight", {D}, InitFamily::kGain);
    add(l + "experts.gate_up_proj", {E, 2 * F, D}, InitFamily::kLinear);
    add(l + "experts.down_proj", {E, D, F}, InitFamily::kLinear);
    add(l + "post_feedforward_layernorm_2.weight", {D}, InitFamily::kGain);
    add(l + "post_feedforward_layernorm.weight", {D}, InitFamily::kGain);
    add(l + "layer_scalar", {1}, InitFamily::kScalar);
    add(absl::StrCat("model.encoder.language_model.layers.", i, ".layer_scalar"), {1},
        InitFamily::kScalar);
  }
  std::sort(out.begin(), out.end(),
            [](const TensorSpec& a, const TensorSpec& b) { return a.name < b.name; });
  return out;
}

bool IsVisionTensor(const std::string& name) {
  return absl::StartsWith(name, "model.encoder.vision_tower.") ||
         absl::StartsWith(name, "model.encoder.embed_vision.") ||
         absl::StartsWith(name, "model.vision_tower.") ||
         absl::StartsWith(name, "model.embed_vision.");
}

}  // namespace dgserve
