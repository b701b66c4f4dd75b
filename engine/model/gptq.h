// W4A16 weight quantization (issue 37): the group rule of compressed-tensors' pack-quantized
// int4 format, and GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for
// Generative Pre-trained Transformers", 2022, Algorithm 1), which rounds a Linear's input columns
// one at a time and spreads each column's rounding error over the columns not yet rounded, so as
// to minimise the error of the layer's output ‖X·Wᵀ − X·Qᵀ‖ over calibration inputs X rather than
// that of the weights themselves. As llm-compressor's GPTQModifier (quantize_weight in
// src/llmcompressor/modifiers/quantization/gptq/gptq_quantize.py) with actorder off: H = Σ x·xᵀ
// over the calibration rows; inputs no row ever reached (H_ii = 0) get weight 0; H += λ·mean(diag
// H)·I (dampening); U = the upper Cholesky factor of H⁻¹; a group's scale is taken from the
// weights as updated when its first column is reached. Unlike llm-compressor this is the
// unblocked form (every later column updated after each column, in float64), so the updates of a
// block reach its groups' scales at once; the result is the same algorithm, not the same bits.
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

// Round-to-nearest W4A16 of w [rows, cols] (row-major) in groups of `group` inputs (1 ≤ group;
// cols for one group per row): each group's scale from its absmax, each code rounded alone.
W4a16Weights QuantizeW4a16Rtn(std::span<const float> w, int rows, int cols, int group);

// GPTQ W4A16 of w [rows, cols] against `hessian` (cols must match), in groups of `group` inputs,
// dampening λ = `dampening` (llm-compressor's dampening_frac, 0.01 by default). The codes and
// scales are the format's (each dequantized weight is code · scale). INVALID_ARGUMENT for shapes
// that disagree, a group < 1 or a dampening < 0; FAILED_PRECONDITION when the dampened Hessian is
// not positive definite (a larger dampening may help: the message says so).
absl::StatusOr<W4a16Weights> QuantizeW4a16Gptq(std::span<const float> w, int rows, int cols,
                                               int group, const InputHessian& hessian,
                                               double dampening = 0.01);

}  // namespace dgserve
