// The fused per-row vocabulary step of the sampler on the GPU (spec §3.1.6, §4.2 steps 3–4): raw
// LM-head logits in (the GEMM's float32 [rows, V]), per-row argmax / inverse-CDF sample /
// entropy / log-sum-exp out, optionally bf16(ℓ/T) for the next step's self-conditioning
// (spec §3.5 step 2). One thread block per row, three passes over the row's logits and no
// [rows, V] temporary.
//
// The numerics mirror the CPU path (cpu::Softcap, then SampleRow of engine/denoise/row_sampler.h).
// Softcap: ℓ = cap·(1 − 2/(1 + e^{2·raw/cap})) with the same exp2 polynomial as cpu::Softcap's
// AVX2 path (within 1e-5 of cap·tanh(raw/cap) at cap = 30; bit-identical to the CPU on AVX2
// hosts). Then, as SampleRow: m = max ℓ with the first index on ties;
// k = fl(log2(e)/T); w_i = max(fl(fl(ℓ_i − m)·k), −127); e_i = 2^{w_i} by the same Cephes exp2f
// polynomial and exponent-bit construction (so e_i = 0 exactly when w_i ≤ −126.5);
// S = Σ e_i, H = log S − ln2·(Σ e_i·w_i)/S (clamped at 0), lse = m/T + log S in double;
// u is clamped into [0, 1) (NaN → 0) and the sample is the first id whose running sum of e
// exceeds u·S, or, if rounding leaves no such id, the last id with e > 0 of the segment found.
// Sums are taken in a different order than on the CPU (float lanes per segment, double across),
// so a GPU and a CPU run with the same uniforms pick the same token unless u·S lies within
// rounding of a cumulative boundary; argmax can differ only where the CPU softcap itself differs
// (its non-AVX2 path uses std::tanh) and two logits are within that rounding of each other.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cuda {

// Per-row results, laid out as dgserve::RowResult (engine/denoise/row_sampler.h) so an array can
// be copied into RowResults directly. Units: nats. A row whose logits contain a NaN, whose max is
// not finite or whose temperature is not a finite positive number gets argmax = sampled = −1 and
// entropy = lse = NaN (the CPU path reports INTERNAL for it).
struct VocabRowResult {
  int32_t argmax;
  int32_t sampled;
  float entropy;
  float lse;
};

// Largest vocabulary the kernel accepts.
inline constexpr int kMaxVocab = 1 << 30;

// Runs the fused step for `rows` rows. logits: [rows, vocab] raw float32 LM-head outputs (read
// only); softcap: the final-logit cap (30; ≤ 0 disables it); temperature, uniforms: [rows] float32
// (T > 0, u ∈ [0, 1)); out: [rows] results; z_bf16: [rows, vocab] bf16 bits of fl(ℓ/T) rounded to
// nearest even (as dgserve::FloatToBf16), or nullptr to skip. Canvas templates: mask_index
// [rows] int32 (nullptr: no masks) names each row's mask in mask_table ([n, ⌈vocab/64⌉] uint64,
// bit v of word v/64 set ⇔ id v allowed), −1 for a row without one; a masked-out id gets
// ℓ = −∞ after the softcap (so e = 0, never the argmax or the sample, bf16(ℓ/T) = −∞), as the
// CPU step (engine/cpu/cpu_vocab.cc). A row with every id masked out is a bad row. Launch:
// grid = rows, block = 1024 threads, 17,160 bytes of static shared memory.
absl::Status VocabStep(const float* logits, int rows, int vocab, float softcap,
                       const float* temperature, const float* uniforms, VocabRowResult* out,
                       uint16_t* z_bf16 = nullptr, const uint64_t* mask_table = nullptr,
                       const int32_t* mask_index = nullptr, void* stream = nullptr);

}  // namespace dgserve::cuda

namespace dgserve::cuda {

// The fused vocabulary pass (issue 33 item 5; the CPU's cpu::FusedVocabStep, engine/model/
// cpu_vocab.h, ported): the LM head ℓ_raw = h·Eᵀ is computed in tiles of kFusedVocabTile ids and
// never stored. Kernel 1 (grid: tiles × blocks of kFusedRows rows, 8 warps) computes each
// tile's products on the tensor cores (mma.m16n8k16 through cuda_mma.cuh: bf16 × bf16, float32
// accumulation; the bf16-input mode feeds bf16(h), the float32 mode h's exact three-term split,
// as cuda_gemm.h's two modes) and in its epilogue the softcap, the mask, the tile's max with its
// first argmax, S_t = Σ e and Q_t = Σ e·w relative to the tile's max (VocabStep's exp2
// polynomial and clamps), written to a [rows, tiles] partials buffer. Kernel 2 (one thread per
// row) combines the tiles in ascending order: m, argmax (first index on ties), S = Σ_t 2^{δ_t}·
// S_t and the entropy's Σ e·w = Σ_t 2^{δ_t}(Q_t + δ_t S_t) with δ_t = (m_t − m)·k in float64,
// lse, H, and the tile in which the running sum first exceeds u·S. Kernel 3 (one block per row)
// recomputes that tile's logits for the row (the same products, so the same bits), e = 2^w
// relative to m, and scans it. Results as VocabStep's (same bad-row rule: argmax = sampled = −1,
// entropy = lse = NaN). Against the CPU (cpu::FusedVocabStep, or Softcap + SampleRow on its
// logits): the logits differ by float32 addition order only (the same bf16 inputs or the exact
// split), S and the entropy's sum by rounding (float64 across tiles), so argmax is equal except
// between logits within that rounding (~1e-5 at the softcap), entropy and lse agree to 2e-5
// relative, and the sample is the same id unless u·S lies within ~1e-6·S of a cumulative
// boundary (cuda_vocab_test.cc asserts these bounds). Every row's arithmetic is its own: a row's
// results do not depend on the other rows of the batch or its slot in a block (bit for bit).
// Scratch: [rows, ⌈V/256⌉] partials of 32 bytes (8 MB at 256 rows of the real vocabulary) in
// place of the [rows, V] float32 logits (268 MB).
inline constexpr int kFusedVocabTile = 256;  // ids per tile (one per thread of kernel 1)
inline constexpr int kFusedRows = 64;        // rows per block of kernel 1

struct FusedVocabArgs {
  const float* hidden = nullptr;  // [rows, dim] final-normed hidden states (float32)
  int rows = 0;
  int dim = 0;
  const uint16_t* embed = nullptr;  // [vocab, dim] bf16 tied embedding (the LM head)
  int vocab = 0;
  // The bf16-input mode (GemmInput::kBf16): hidden rounded as ActivationBf16Bits on load;
  // otherwise (GemmInput::kFloat32) its exact three-term bf16 split, three products per k.
  bool bf16_input = false;
  float softcap = 30.0f;                 // ≤ 0: none
  const float* temperature = nullptr;    // [rows]
  const float* uniforms = nullptr;       // [rows]
  VocabRowResult* out = nullptr;         // [rows]
  const uint64_t* mask_table = nullptr;  // as VocabStep's (nullptr: no masks)
  const int32_t* mask_index = nullptr;
  void* scratch = nullptr;  // FusedVocabScratchBytes(rows, vocab) bytes of device memory
  void* stream = nullptr;
  // The sparse self-conditioning product (cpu_vocab.h's bound, at this pass's tiles of 256 ids):
  // [rows] per-row ε, the most probability mass the soft embedding may leave out (0: dense), or
  // nullptr (every row dense). With it FusedVocabStep also plans each row (which tiles its soft
  // embedding leaves out, the plan kept only if its error bound B ≤ 2⁻¹⁰·(L − B) with L ≤ ‖s‖)
  // into the scratch, and FusedSoftmaxProbsBf16 writes probability 0 for the tiles left out (and
  // skips a tile every row of a block leaves out). Needs tile_norm_max and embed_scale.
  const float* sc_skip_mass = nullptr;
  const float* tile_norm_max = nullptr;  // [⌈vocab/256⌉] FusedTileNormMax of embed
  float embed_scale = 1.0f;              // the soft embedding's scale bf16(√D)
};

// out[t] = max over ids v of tile t (kFusedVocabTile ids) of ‖E_v‖₂, rounded up (upper bounds
// for the sparse plan). embed: [vocab, dim] bf16; out: [⌈vocab/256⌉] float.
absl::Status FusedTileNormMax(const uint16_t* embed, int vocab, int dim, float* out,
                              void* stream = nullptr);

// Device scratch (bytes) FusedVocabStep needs for `rows` rows (partials, per-row sampling state
// and the sparse plan's flags).
size_t FusedVocabScratchBytes(int rows, int vocab);

absl::Status FusedVocabStep(const FusedVocabArgs& args);

// The self-conditioning probabilities of a FusedVocabStep's rows without float32 logits: each
// tile's products recomputed (the same bits), then exactly SoftmaxProbsBf16's formula
// (cuda_backend_kernels.h: bf16(exp(cap·tanh(raw/cap)/T − lse)), 0 for a masked id or a row
// whose lse is not finite) with lse = results[r].lse. probs: [rows, vocab] bf16. Uses args'
// hidden, embed, shapes, bf16_input, softcap, temperature, masks and stream.
absl::Status FusedSoftmaxProbsBf16(const FusedVocabArgs& args, const VocabRowResult* results,
                                   uint16_t* probs);

}  // namespace dgserve::cuda
