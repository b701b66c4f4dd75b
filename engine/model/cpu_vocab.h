// The vocabulary-sized work of one denoising step on the CPU (spec §3.1.6, §3.5 step 2,
// §4.2 steps 3–4): LM head, softcap, temperature, softmax, entropy, argmax, inverse-CDF sampling
// and the next step's self-conditioning soft embedding. One pass over the embedding table in
// vocabulary tiles computes each tile's logits (in cache, never a [rows, V] logits buffer), their
// max, exps and sums (online, rescaled as in flash attention); the sample is found from per-tile
// sums and one recomputed tile. The exps are kept ([rows, V] float32) for the soft-embedding
// product, which runs after the pass so that it knows each tile's final mass (sparse product).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/denoise/row_sampler.h"
#include "engine/model/cpu/packed_matrix.h"

namespace dgserve::cpu {

// What one FusedVocabStep skipped: (row, vocabulary tile) pairs of the soft-embedding product.
struct VocabStepStats {
  int64_t tile_rows = 0;          // pairs with a soft embedding to compute (rows × tiles)
  int64_t tile_rows_skipped = 0;  // of them, left out by the sparse product
  int64_t rows_kept_dense = 0;    // rows that had tiles to leave out but whose bound kept them dense
};

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
  // Sparse self-conditioning (see FusedVocabStep): the most probability mass per row that may be
  // left out of the soft embedding; 0 = dense. Needs embed_row_norm_max.
  double sc_skip_mass = 0;
  float embed_row_norm_max = 0;       // max over ids v of ‖E_v‖₂ (EmbeddingRowNormMax)
  VocabStepStats* stats = nullptr;  // optional: what the sparse product skipped
};

// The default of VocabStepArgs::sc_skip_mass in the CPU backend: 2⁻¹² (DGSERVE_DENSE_SC=1 in the
// environment gives 0, the dense product).
double DefaultScSkipMass();

// max over the `rows` rows of a row-major bf16 [rows, dim] table of the row's Euclidean norm,
// rounded up (an upper bound for the sparse product's error bound).
float EmbeddingRowNormMax(const uint16_t* table, int64_t rows, int dim);

// Runs the fused step. Results agree with Softcap + SampleRows + SoftEmbedding on the same
// hidden states up to float rounding (the sample can differ only when u·S falls within rounding
// of a cumulative boundary). Parallel over a fixed number of vocabulary chunks (OpenMP) merged in
// order, and every row's arithmetic is its own (GEMMs with the property of cpu/gemm.h), so a
// row's result depends neither on the thread count nor on the other rows. INTERNAL when a row's
// logits are not finite (NaN or infinite weights, overflow): nothing can be sampled from them.
//
// Sparse self-conditioning (sc_skip_mass = ε > 0; spec §3.5 step 2, issue 11): the soft embedding
// s = scale · Σ_v q_v E_v is vocabulary-sized work, but most tiles of a peaked row carry almost no
// probability. The product runs after the vocabulary pass, when every tile's exact mass q(tile)
// for the row is known; a row leaves tiles out, in vocabulary order, while their total mass
// ε_row ≤ ε (a tile whose exps are all 0 costs nothing). The error is then at most
// B = scale · ε_row · max_v ‖E_v‖₂ in Euclidean norm, and the row keeps its plan only if
// B ≤ 2⁻¹⁰ · (L − B) for the lower bound L = scale · (q_max ‖E_argmax‖ − (1 − q_max) max_v ‖E_v‖)
// of ‖s‖: the omission is below a quarter of the worst change the reference's own bf16 rounding
// of this product (unit roundoff 2⁻⁸ per element) makes. Otherwise the row is computed dense.
// Rows decide on their own data only, so batch invariance holds; a row that leaves nothing out
// gets the dense bits; argmax, entropy, lse and the sample never change (they do not use s).
absl::Status FusedVocabStep(const VocabStepArgs& args);

}  // namespace dgserve::cpu
