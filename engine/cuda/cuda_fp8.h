// FP8 checkpoints on the FP8 tensor cores (issue 37 item 4): compressed-tensors `float-quantized`
// W8A8 "FP8-dynamic" (engine/model/quant_config.h), exactly the format engine/cpu/gemm_quant.h
// defines and the CPU runs:
//   weights  W[r, c] = e4m3(q[r, c]) · s_w[r]  (codes stay 8 bits on the device, one float32
//            scale per output row);
//   inputs   per token (row) at run time, vLLM's dynamic_per_token_scaled_fp8_quant:
//            s_x = max(absmax(x_row) / 448, 1 / (448 · 512)),  x_q = e4m3_rne_sat(x / s_x)
//            (float32 IEEE division, round to nearest even, saturating at ±448: the same bits
//            as cpu::QuantizeRowFp8);
//   outputs  y[i, j] = s_x[i] · (s_w[j] · acc[i, j]),  acc = Σ_k x_q[i, k] · q[j, k]
//            (vLLM's scaled-mm epilogue). Products of two e4m3 values are exact in float32; the
//            device sums them with mma.sync m16n8k32 .e4m3 (cuda_mma.cuh) over k in ascending
//            32-wide steps, so acc differs from the CPU's ascending fma chain only in the order
//            (and, on Hopper, the width) of the float32 additions.
// A row's result depends on that row only: no split-K, nothing that depends on the batch or on
// which rows share a tile (batched = solo, bit for bit).
//
// The grouped expert GEMMs keep MoeGateUp / MoeDown's interface (cuda_moe.h: gather, offsets,
// slot weights; at most `rows` gathered rows per expert, as MoeGroup builds them) and quantize
// their input rows themselves (each block computes its rows' s_x from the whole row), so no
// scratch buffer is needed. Plain C++17 header; device pointers; calls run on `stream` (0 = the
// default stream) and return INTERNAL naming the kernel on a launch error, INVALID_ARGUMENT for
// bad shapes or null weight pointers.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cuda {

// FP8 weights of E matrices of `rows` weight rows and `in` inputs each (E = 1 for a dense
// layer): codes [E, rows, in] e4m3 bytes row-major (the checkpoint's weight), scales [E, rows]
// float32 (its weight_scale). 1 byte + 4/in bytes per weight.
struct Fp8Weights {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
};

// Per-token activation quantization: for each of `rows` rows of x [rows, k] float32,
// scales[r] = s_x and codes[r·k + c] = the e4m3 code of x_q (above), bit for bit
// cpu::QuantizeRowFp8 (codes as common/fp8.h's FloatToE4m3 of its values). rows ≥ 0, k > 0.
absl::Status QuantizeRowsFp8(const float* x, int rows, int k, uint8_t* codes, float* scales,
                             void* stream = nullptr);

// MoeGateUp with FP8 expert weights w [E, 2·width, dim] (gate rows then up rows):
//   gate = s_x · (s_w[f] · acc_f), up = s_x · (s_w[width + f] · acc_{width+f}),
//   act[n, f] = gelu_tanh(gate) · up
// with x's row gather[n] quantized per token. x: [rows, dim]; act: [rows·k, width].
absl::Status MoeGateUpFp8(const float* x, const int32_t* gather, const int32_t* offsets,
                          const Fp8Weights& w, int rows, int k, int num_experts, int dim, int width,
                          float* act, void* stream = nullptr);

// MoeDown with FP8 expert weights w [E, dim, width]:
//   y[n, d] = slot_weight[n] · (s_x[n] · (s_w[d] · acc[n, d]))
// with act's row n quantized per token. act: [rows·k, width]; y: [rows·k, dim].
absl::Status MoeDownFp8(const float* act, const int32_t* offsets, const float* slot_weight,
                        const Fp8Weights& w, int rows, int k, int num_experts, int width, int dim,
                        float* y, void* stream = nullptr);

// A dense FP8 projection on the same kernel (one group of all rows): y[r, o] = s_x[r] · (s_w[o] ·
// acc[r, o]), x: [rows, in] float32, w [1, out, in], y: [rows, out]: cpu::QuantLinear's result
// up to the order of float32 additions. rows ≥ 0 (0 is a no-op), in, out > 0.
absl::Status DenseLinearFp8(const float* x, const Fp8Weights& w, int rows, int in, int out,
                            float* y, void* stream = nullptr);

}  // namespace dgserve::cuda
