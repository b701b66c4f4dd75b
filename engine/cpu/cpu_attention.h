// The CPU backend's attention core (spec §3.1.5, §3.4, §3.5): one sequence's query rows over its
// visible keys, scale 1.0 (QK-norm replaces 1/√d), softmax in float32, GQA (query head h reads
// KV head h / (heads / kv_heads)).
#pragma once

#include "absl/functional/function_ref.h"
#include "engine/cpu/gemm.h"

namespace dgserve::cpu {

// One call's shape and key visibility. Keys are indexed 0 … keys − 1 in position order.
struct AttentionShape {
  int heads = 0;     // query heads
  int kv_heads = 0;  // a divisor of heads
  int head_dim = 0;
  int rows = 0;  // query rows
  int keys = 0;  // keys (and values) the rows may see
  // causal < 0: bidirectional, every row sees keys [0, keys) (the decoder's canvas). Else causal
  // (the encoder): row r sees keys [lo, hi) with hi = causal + r + 1 (≤ keys) and lo = 0, or
  // max(0, hi − window) when window > 0 (a sliding layer's W keys including its own).
  int causal = -1;
  int window = 0;
  int tile_offset = 0;  // bf16 mode: key j is in running-max tile (j + tile_offset) / 32
};

// out[r, h, :] = Σ_j p_j · v_j over row r's visible keys j, for every row r and query head h.
// q, out: [rows, heads, head_dim] (must not overlap); key_rows(j, &k, &v) points k and v at key
// j's K and V rows, [kv_heads, head_dim] each (called once per key, in any order, from several
// threads).
// input = kFloat32: q, K, V as they are; p = exp(s − m) / Σ exp(s − m) (m: the row's max score),
//   out = Σ p·v (a fixed order: bits independent of the batching and chunking of the caller).
// input = kBf16 (the reference's rounding, spec §5.3 items 4–6): q, K and V are rounded to bf16
//   (RoundToBf16: nearest even) before Q·Kᵀ and P·V; the probabilities are the tensor-core
//   kernels' form (engine/cuda/cuda_attention_tc.cu), tiled as they tile: with m_t the running
//   max of the row's scores over key tiles 0 … t (32 keys; tile of key j: (j + tile_offset) / 32
//   in the shape's key numbering, the first tile cut at the row's first visible key) and m the
//   row's max, P = bf16(exp(s − m_t)) · exp(m_t − m), l = Σ_t exp(m_t − m) · Σ_{j in t}
//   exp(s − m_t) over the unrounded terms, out = (Σ P·v) · (1 / l). Q·Kᵀ's products of bf16
//   values are exact in float32; P·V's are not (P carries exp(m_t − m)). Left different from the
//   kernels: the float32 addition order, the rescale (the kernels scale O and l by
//   exp(m_old − m_new) per tile, here each P by exp(m_t − m)), and contexts past one split-KV
//   split (each split restarts its running max; cpu_backend.cc's top comment).
// Every row's result depends only on its own q and visible keys (a fixed order per row).
void SequenceAttention(const AttentionShape& shape, const float* q,
                       absl::FunctionRef<void(int, const float**, const float**)> key_rows,
                       GemmInput input, float* out);

}  // namespace dgserve::cpu
