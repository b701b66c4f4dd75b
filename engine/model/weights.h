// DiffusionGemma weights in the CPU backend's layout (spec §2.2): every matrix in bfloat16, as in
// the checkpoint, packed once at load into the GEMM's panel layout (cpu::PackedMatrix, PyTorch
// [out, in]: y = x·Wᵀ); norms, scales and scalars in float32. F16/F32 checkpoint matrices are
// rounded to bf16 (nearest even) at load; bf16 ones are kept bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/cpu/packed_matrix.h"
#include "engine/model/quant_config.h"

namespace dgserve {

// One transformer layer (spec §3.2–§3.3). Sizes: D hidden, hd/nkv the layer's head dim and KV
// heads, nh query heads, I dense width, E experts, F expert width.
struct LayerWeights {
  std::vector<float> input_layernorm;            // [D]
  cpu::PackedMatrix q_proj;                      // [nh·hd, D]
  cpu::PackedMatrix k_proj;                      // [nkv·hd, D]
  cpu::PackedMatrix v_proj;                      // [nkv·hd, D]; empty on full layers (V = rms(k))
  cpu::PackedMatrix o_proj;                      // [D, nh·hd]
  std::vector<float> q_norm;                     // [hd]
  std::vector<float> k_norm;                     // [hd]
  std::vector<float> post_attention_layernorm;   // [D]
  std::vector<float> pre_feedforward_layernorm;  // [D]
  cpu::PackedMatrix mlp_gate_proj;               // [I, D]
  cpu::PackedMatrix mlp_up_proj;                 // [I, D]
  cpu::PackedMatrix mlp_down_proj;               // [D, I]
  std::vector<float> post_feedforward_layernorm_1;      // [D]
  cpu::PackedMatrix router_proj;                        // [E, D]
  std::vector<float> router_scale;                      // [D]
  std::vector<float> router_per_expert_scale;           // [E]
  std::vector<float> pre_feedforward_layernorm_2;       // [D]
  std::vector<cpu::PackedMatrix> experts_gate_up_proj;  // E × [2F, D]: rows 0..F-1 gate, F..2F-1 up
  std::vector<cpu::PackedMatrix> experts_down_proj;     // E × [D, F]
  std::vector<float> post_feedforward_layernorm_2;      // [D]
  std::vector<float> post_feedforward_layernorm;        // [D]
  float decoder_layer_scalar = 1.0f;  // model.decoder.layers.i.layer_scalar (decoder passes)
  float encoder_layer_scalar = 1.0f;  // model.encoder.language_model.layers.i.layer_scalar
};

// The whole text tower plus the self-conditioning MLP. The LM head is the embedding (tied), held
// twice: row-major for lookups and the soft embedding (p·E), packed for the LM head (h·Eᵀ).
struct ModelWeights {
  std::vector<uint16_t> embed_tokens;  // [V, D] bf16 bits, row-major (lookups, soft embedding)
  cpu::PackedMatrix lm_head;           // the same table packed for the LM head GEMM (tied)
  std::vector<float> final_norm;       // [D]
  std::vector<float> sc_pre_norm;      // [D]
  cpu::PackedMatrix sc_gate_proj;      // [I, D]
  cpu::PackedMatrix sc_up_proj;        // [I, D]
  cpu::PackedMatrix sc_down_proj;      // [D, I]
  std::vector<LayerWeights> layers;    // [L]
  // Issue 37: the checkpoint's weight format. Quantized checkpoints hold some PackedMatrix
  // entries quantized (PackedMatrix::quant()); the CPU backend runs every format, the CUDA
  // backend FP8 and NVFP4 (engine/model/backend_select.cc says which it refuses).
  WeightFormat format = WeightFormat::kBf16;
};

}  // namespace dgserve
