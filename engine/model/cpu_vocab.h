// The fused vocabulary-sized work of one denoising step on the CPU (spec §3.1.6, §3.5 step 2,
// §4.2 steps 3–4): LM head, softcap, temperature, softmax, entropy, argmax, inverse-CDF sampling
// and the next step's self-conditioning soft embedding, in one pass over the embedding table in
// vocabulary tiles. No [rows, V] buffer is needed: each tile's logits live in cache while its
// probabilities are multiplied into the soft embedding (online softmax with rescaling, as in
// flash attention); the sample is found from per-tile sums and one recomputed tile.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/denoise/row_sampler.h"
#include "engine/model/cpu/packed_matrix.h"

namespace dgserve::cpu {

struct VocabStepArgs {
  const float* hidden = nullptr;  // [rows, D] final-normed hidden states
  int rows = 0;
  const PackedMatrix* lm_head = nullptr;  // [V, D] tied embedding packed for the LM head
  const uint16_t* embed = nullptr;        // [V, D] the same table row-major (bf16 bits)
  int vocab = 0;
  int dim = 0;
  float softcap = 30.0f;               // final_logit_softcapping
  const float* temperature = nullptr;  // [rows] T > 0 per row
  const float* uniforms = nullptr;     // [rows] u in [0, 1) per row (inverse-CDF draw)
  float embed_scale = 1.0f;            // bf16(√D), applied to the soft embedding
  RowResult* out = nullptr;            // [rows] argmax / sampled / entropy / lse (as SampleRow)
  float* soft = nullptr;               // [rows, D] (softmax(ℓ/T)·E)·embed_scale, or nullptr
  float* logits = nullptr;             // [rows, V] softcapped logits, or nullptr (tests)
  // [rows] per-row vocabulary bit masks (bit v of word v/64 ⇔ id v allowed; nullptr = all), or
  // nullptr for none. Masked ids get logit −inf (also in `logits`); a row needs ≥ 1 allowed id.
  const uint64_t* const* masks = nullptr;
};

// Runs the fused step. Results agree with Softcap + SampleRows + SoftEmbedding on the same
// hidden states up to float rounding (the sample can differ only when u·S falls within rounding
// of a cumulative boundary). Parallel over a fixed number of vocabulary chunks (OpenMP) merged in
// order, and every row's arithmetic is its own (GEMMs with the property of cpu/gemm.h), so a
// row's result depends neither on the thread count nor on the other rows. INTERNAL when a row's
// logits are not finite (NaN or infinite weights, overflow): nothing can be sampled from them.
absl::Status FusedVocabStep(const VocabStepArgs& args);

}  // namespace dgserve::cpu
