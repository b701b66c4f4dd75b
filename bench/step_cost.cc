#include "bench/step_cost.h"

#include <algorithm>
#include <string>

#include "engine/model/tensor_names.h"

namespace dgserve::bench {

double BodyFlops(const ModelConfig& c, int rows, int ctx) {
  const double D = c.hidden_size, I = c.intermediate_size, F = c.moe_intermediate_size;
  double f = 2.0 * rows * 3 * D * I;  // self-conditioning MLP
  for (int l = 0; l < c.num_layers; ++l) {
    const double hd = c.HeadDim(l), nh = c.num_heads, nkv = c.KvHeads(l);
    const double kv_proj = c.IsFull(l) ? nkv * hd : 2 * nkv * hd;
    const int keys = (c.IsFull(l) ? ctx : std::min(ctx, c.sliding_window - 1)) + rows;
    f += 2.0 * rows * D * (nh * hd + kv_proj);      // q, k, v projections
    f += 2.0 * rows * nh * hd * D;                  // o projection
    f += 2.0 * 2 * rows * nh * hd * keys;           // scores and weighted values
    f += 2.0 * rows * 3 * D * I;                    // dense MLP
    f += 2.0 * rows * D * c.num_experts;            // router
    f += 2.0 * rows * c.top_k_experts * 3 * D * F;  // experts
  }
  return f;
}

double Bf16BytesPerStep(const ModelConfig& c) {
  double bytes = 0;
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (spec.shape.size() >= 2) bytes += 2.0 * double(spec.numel());
  }
  return bytes + 2.0 * double(c.vocab_size) * c.hidden_size;
}

double KvBytesPerSequence(const ModelConfig& c, int positions) {
  double b = 0;
  for (int l = 0; l < c.num_layers; ++l) b += 2.0 * 4 * double(c.KvHeads(l)) * c.HeadDim(l);
  return b * positions;
}

double DeviceBytesPerRow(const ModelConfig& c) {
  int qw = 0, kw = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    qw = std::max(qw, c.num_heads * c.HeadDim(l));
    kw = std::max(kw, c.KvHeads(l) * c.HeadDim(l));
  }
  const double D = c.hidden_size, K = c.top_k_experts, F = c.moe_intermediate_size;
  const double floats =
      7 * D + 2.0 * qw + 2.0 * kw + c.num_experts + 2.0 * c.intermediate_size + K * (2 * D + 3 * F);
  return 4 * floats + 2 * K * D + 6.0 * c.vocab_size;
}

PhaseWork StepWork(const ModelConfig& c, int rows_per_canvas, int batch, int ctx) {
  PhaseWork w;
  const double R = double(rows_per_canvas) * batch;
  for (const TensorSpec& s : ExpectedTensors(c)) {
    if (s.shape.size() < 2) continue;
    const double n = double(s.numel());
    if (s.name.find("embed_tokens") != std::string::npos) {
      w.vocab_bytes += 2 * 2 * n;  // LM head and self-conditioning product
      w.vocab_flops += 2 * 2 * R * n;
    } else if (s.name.find(".experts.") != std::string::npos) {
      w.moe_bytes += 2 * n;  // every expert read (canvas · top-k ≥ experts)
    } else if (s.name.find(".router.") != std::string::npos) {
      w.moe_bytes += 4 * n;  // float32 on the device
      w.moe_flops += 2 * R * n;
    } else {
      w.dense_bytes += 2 * n;
      w.dense_flops += 2 * R * n;
    }
  }
  const double D = c.hidden_size, F = c.moe_intermediate_size;
  w.moe_flops += 2 * R * c.top_k_experts * 3 * D * F;
  for (int l = 0; l < c.num_layers; ++l) {
    const int keys = (c.IsFull(l) ? ctx : std::min(ctx, c.sliding_window - 1)) + rows_per_canvas;
    const double hd = c.HeadDim(l), kvw = double(c.KvHeads(l)) * hd;
    w.attn_bytes += double(batch) * keys * kvw * 4 * 2;  // float32 K and V of every canvas
    w.attn_flops += 2.0 * 2 * R * c.num_heads * hd * keys;
  }
  return w;
}

}  // namespace dgserve::bench
