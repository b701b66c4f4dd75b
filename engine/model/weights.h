// DiffusionGemma weights in the CPU backend's layout: float32, row-major, PyTorch [out, in]
// (y = x·Wᵀ), converted once from the checkpoint's bf16/f16/f32 tensors (spec §2.2).
#pragma once

#include <vector>

namespace dgserve {

// One transformer layer (spec §3.2–§3.3). Sizes: D hidden, hd/nkv the layer's head dim and KV
// heads, nh query heads, I dense width, E experts, F expert width.
struct LayerWeights {
  std::vector<float> input_layernorm;            // [D]
  std::vector<float> q_proj;                     // [nh·hd, D]
  std::vector<float> k_proj;                     // [nkv·hd, D]
  std::vector<float> v_proj;                     // [nkv·hd, D]; empty on full layers (V = rms(k))
  std::vector<float> o_proj;                     // [D, nh·hd]
  std::vector<float> q_norm;                     // [hd]
  std::vector<float> k_norm;                     // [hd]
  std::vector<float> post_attention_layernorm;   // [D]
  std::vector<float> pre_feedforward_layernorm;  // [D]
  std::vector<float> mlp_gate_proj;              // [I, D]
  std::vector<float> mlp_up_proj;                // [I, D]
  std::vector<float> mlp_down_proj;              // [D, I]
  std::vector<float> post_feedforward_layernorm_1;  // [D]
  std::vector<float> router_proj;                   // [E, D]
  std::vector<float> router_scale;                  // [D]
  std::vector<float> router_per_expert_scale;       // [E]
  std::vector<float> pre_feedforward_layernorm_2;   // [D]
  std::vector<float> experts_gate_up_proj;          // [E, 2F, D]: rows 0..F-1 gate, F..2F-1 up
  std::vector<float> experts_down_proj;             // [E, D, F]
  std::vector<float> post_feedforward_layernorm_2;  // [D]
  std::vector<float> post_feedforward_layernorm;    // [D]
  float decoder_layer_scalar = 1.0f;  // model.decoder.layers.i.layer_scalar (decoder passes)
  float encoder_layer_scalar = 1.0f;  // model.encoder.language_model.layers.i.layer_scalar
};

// The whole text tower plus the self-conditioning MLP. The LM head is the embedding (tied).
struct ModelWeights {
  std::vector<float> embed_tokens;   // [V, D]
  std::vector<float> final_norm;     // [D]
  std::vector<float> sc_pre_norm;    // [D]
  std::vector<float> sc_gate_proj;   // [I, D]
  std::vector<float> sc_up_proj;     // [I, D]
  std::vector<float> sc_down_proj;   // [D, I]
  std::vector<LayerWeights> layers;  // [L]
};

}  // namespace dgserve
