// The vocabulary-sized work of one denoising step on the CPU (spec §3.1.6, §3.5 step 2,
// §4.2 steps 3–4): LM head, softcap, temperature, softmax, entropy, argmax, inverse-CDF sampling
// and the next step's self-conditioning soft embedding. One pass over the embedding table in
// vocabulary tiles computes each tile's logits (in cache, never a [rows, V] logits buffer), their
// max, exps and sums (online, rescaled as in flash attention); the sample is found from per-tile
// sums and one recomputed tile. The exps are kept ([rows, V] float32) for the soft-embedding
// product, which runs after the pass so that it knows each tile's final mass (sparse product).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/denoise/row_sampler.h"

namespace dgserve::cpu {

// Vocabulary ids per tile of the pass (and of the sparse product's decisions).
inline constexpr int kVocabTile = 512;

// What one FusedVocabStep skipped: (row, vocabulary tile) pairs of the soft-embedding product.
struct VocabStepStats {
  int64_t tile_rows = 0;          // pairs with a soft embedding to compute (rows × tiles)
  int64_t tile_rows_skipped = 0;  // of them, left out by the sparse product
  int64_t rows_kept_dense = 0;  // rows that had tiles to leave out but whose bound kept them dense
};

// Memory FusedVocabStep keeps from one call to the next, owned by its caller (the CPU backend
// holds one, freed with it): the sparse product's exps, [rows, V] float32 of the largest call so
// far (268 MB at canvas 256 of the real vocabulary). Kept because touching fresh pages every step
// would cost more than the sparse product saves. One call at a time may use it.
struct VocabScratch {
  std::vector<float> exps;
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
  // left out of the soft embedding; 0 = dense. Sparse only with embed_tile_norm_max.
  double sc_skip_mass = 0;
  // [⌈V / kVocabTile⌉] per tile of ids, max_v ‖E_v‖₂ (EmbeddingTileNormMax), or nullptr (dense).
  const float* embed_tile_norm_max = nullptr;
  VocabStepStats* stats = nullptr;  // optional: what the sparse product left out
  // Optional: where the sparse product's exps live between calls; nullptr: a buffer of this call.
  VocabScratch* scratch = nullptr;
  // The GEMMs' input mode (cpu/gemm.h). kBf16: `hidden` rounded to bf16 once for the LM head
  // (tile pass and the sampled tile's recomputation alike), and the soft embedding's exps rounded
  // to bf16 per tile product.
  GemmInput gemm_input = GemmInput::kFloat32;
};

// The sc_skip_mass the CPU backend gives a canvas whose DenoiseStepInput::sparse_sc is set: 2⁻¹²
// (CpuBackendOptions::dense_self_conditioning gives 0, the dense product, for every canvas).
inline constexpr double kDefaultScSkipMass = 0x1p-12;

// Per tile of kVocabTile rows of a row-major bf16 [rows, dim] table, the largest Euclidean norm of
// its rows, rounded up (upper bounds for the sparse product's error bound).
std::vector<float> EmbeddingTileNormMax(const uint16_t* table, int64_t rows, int dim);

// Runs the fused step. Results agree with Softcap + SampleRows + SoftEmbedding on the same
// hidden states up to float rounding (the sample can differ only when u·S falls within rounding
// of a cumulative boundary), and the soft embedding, with the sparse product, by less than
// 2⁻¹⁰ of its norm (below). Parallel over a fixed number of vocabulary chunks (OpenMP) merged in
// order, and every row's arithmetic is its own (GEMMs with the property of cpu/gemm.h), so a
// row's result depends neither on the thread count nor on the other rows. INTERNAL when a row's
// logits are not finite (NaN or infinite weights, overflow): nothing can be sampled from them.
//
// Sparse self-conditioning (sc_skip_mass = ε > 0; spec §3.5 step 2, issue 11): the soft embedding
// s = scale · Σ_v q_v E_v is vocabulary-sized work, but most tiles of a peaked row carry almost no
// probability. The product then runs after the pass from the stored exps ([rows, V] float32, kept
// in args.scratch), when every tile's exact mass q_t for the row is known: greedily in vocabulary
// order, each tile whose mass still fits the row's budget ε is left out. With N_t the tile's max
// ‖E_v‖₂ the omission is at most B = scale · Σ_left-out q_t N_t in Euclidean norm, and a row keeps
// its plan only if B ≤ 2⁻¹⁰ · (L − B) for the lower bound L = scale · (q_max ‖E_argmax‖ −
// Σ_v≠argmax q_v N_t(v)) of ‖s‖: so the omission is below a quarter of the worst change (in norm)
// that the reference's own bf16 rounding of this product (unit roundoff 2⁻⁸) makes. Otherwise,
// or when it would leave out no mass, the row is computed dense. A row's decisions use its own
// numbers only, so batch invariance holds; the replayed accumulation gives a row that leaves
// nothing out the fused dense product's bits; argmax, entropy, lse and the sample never change.
absl::Status FusedVocabStep(const VocabStepArgs& args);

}  // namespace dgserve::cpu
