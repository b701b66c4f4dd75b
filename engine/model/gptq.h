// W4A16 weight quantization (issue 37): the group rule of compressed-tensors' pack-quantized
// int4 format, and GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for
// Generative Pre-trained Transformers", 2022, Algorithm 1), which rounds a Linear's input columns
// one at a time and spreads each column's rounding error over the columns not yet rounded, so as
// to minimise the error of the layer's output ‖X·Wᵀ − X·Qᵀ‖ over calibration inputs X rather than
// that of the weights themselves. H = Σ x·xᵀ over the calibration rows; inputs no row ever reached
// (H_ii = 0) get weight 0; H += λ·mean(diag H)·I (dampening, llm-compressor's dampening_frac);
// U = the upper Cholesky factor of H⁻¹; no activation reordering. A group's scale is taken from
// the weights as updated when its first column is reached, as the reference implementation
// (IST-DASLab gptq.py, and AutoGPTQ without static groups) does, except that this is the unblocked
// form in float64 (every later column updated after each column), so no update lags a block;
// llm-compressor's GPTQModifier instead fixes every group's scale from the original weights
// first. The same algorithm, not the same bits as either.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace dgserve {

// The scale of one W4A16 group (compressed-tensors calculate_qparams, symmetric int4): absmax /
// 7.5 rounded to bf16; an all-zero group (a scale that rounds to 0) takes 1. As bf16 bits.
uint16_t W4a16GroupScale(float absmax);
// The int4 code of weight w at scale s: clamp(rne(w / s), −8, 7).
int W4a16Code(float w, float s);

// Σ x·xᵀ of the inputs of one Linear module over calibration rows (GPTQ's Hessian up to a
// factor): [cols, cols] row-major, float64, symmetric.
struct InputHessian {
  int cols = 0;
  int64_t rows = 0;  // calibration rows accumulated
  std::vector<double> h;
};

struct W4a16Weights {
  std::vector<int8_t> codes;     // [rows, cols], each in [−8, 7]
  std::vector<uint16_t> scales;  // [rows, ceil(cols / group)], bf16 bits
};

// A module's W4A16 weights in compressed-tensors' pack-quantized layout, as dgserve-quantize
// writes them: `weight_packed` [rows, ceil(cols / 8)] int32 words, eight codes q + 8 per word
// (input c in bits 4·(c % 8), pack_to_int32's order), and `weight_scale` [rows, groups] bf16 bits
// (groups = ceil(cols / group)). `gptq`: made by GPTQ (else round-to-nearest).
struct W4a16Packed {
  int rows = 0, cols = 0, group = 0;
  std::vector<uint32_t> packed;
  std::vector<uint16_t> scales;
  bool gptq = false;
};

// Packs rows [row0, row0 + rows) of `w` (a [·, cols] matrix quantized in groups of `group`, as
// QuantizeW4a16Rtn / QuantizeW4a16Gptq return it). Preconditions (the caller's): group ≥ 1 and
// the rows within w.
W4a16Packed PackW4a16(const W4a16Weights& w, int cols, int group, int row0, int rows);

// Round-to-nearest W4A16 of w [rows, cols] (row-major) in groups of `group` inputs (1 ≤ group;
// cols for one group per row): each group's scale from its absmax, each code rounded alone.
W4a16Weights QuantizeW4a16Rtn(std::span<const float> w, int rows, int cols, int group);

// What GPTQ rounds against, once per Hessian (the modules that share an input share it): U, the
// upper Cholesky factor of (H + λ·mean(diag H)·I)⁻¹ with the inputs no row reached set to 1 on the
// diagonal, and those inputs.
struct GptqFactor {
  int cols = 0;
  std::vector<double> u;      // [cols, cols] row-major; U[i][j] for j ≥ i (below: 0)
  std::vector<uint8_t> dead;  // per input: no calibration row reached it (its weight is 0)
};

// Factors `hessian` with dampening λ = `dampening` (0.01: llm-compressor's default), in float64,
// O(cols³), with up to three [cols, cols] working copies beside the Hessian at once. Blocked and
// parallel (OpenMP), each element's operations in the order of the column-by-column form, so the
// factor is bit for bit that form's (gptq_test.cc compares).
// INVALID_ARGUMENT for a Hessian whose size is not cols² or a dampening not in [0, 1e6] (NaN
// included); FAILED_PRECONDITION when the dampened Hessian is not positive definite
// (a larger dampening may help: the message says so).
absl::StatusOr<GptqFactor> FactorGptqHessian(const InputHessian& hessian, double dampening = 0.01);

// GPTQ W4A16 of w [rows, cols] against `factor` (cols must match), in groups of `group` inputs.
// The codes and scales are the format's (each dequantized weight is code · scale).
// 16 rows at a time (each read of U serves them all), tiles in parallel (OpenMP); each row's
// arithmetic is the row-by-row form's, in its order: the same bits.
// INVALID_ARGUMENT for shapes that disagree or a group < 1.
absl::StatusOr<W4a16Weights> QuantizeW4a16Gptq(std::span<const float> w, int rows, int cols,
                                               int group, const GptqFactor& factor);
// The above, also writing to `rounded` (when not null; resized to [rows, cols]) each weight as it
// was rounded: its value after the updates of the columns before it. For tests that compare the
// arithmetic bit for bit.
absl::StatusOr<W4a16Weights> QuantizeW4a16GptqTraced(std::span<const float> w, int rows, int cols,
                                                     int group, const GptqFactor& factor,
                                                     std::vector<double>* rounded);
// FactorGptqHessian, then the above (its errors too).
absl::StatusOr<W4a16Weights> QuantizeW4a16Gptq(std::span<const float> w, int rows, int cols,
                                               int group, const InputHessian& hessian,
                                               double dampening = 0.01);

}  // namespace dgserve
