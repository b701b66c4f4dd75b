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
