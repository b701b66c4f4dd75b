// NVFP4 weights (W4A4; weight-only NVFP4A16 below) on the CUDA backend, dequantized on Hopper
// (issue 37 item 4): sm_90 has no FP4 tensor cores, so the e2m1 weights stay 4-bit in device memory
// (4.5 bits per weight with their e4m3 block scales) and are widened to bf16 while staged into
// shared memory; the activations are quantized to NVFP4 in the A load; both run on the bf16
// mma.sync of cuda_mma.cuh. The format, and the CPU code these kernels reproduce, are in
// engine/cpu/gemm_quant.h (kNvfp4):
//   sx_b = e4m3_rne_sat(g · (absmax(x_b) · (1/6)));  o_b = sx_b ≠ 0 ? 1 / (sx_b · (1/g)) : 0
//   x_q  = e2m1_rne_sat(x · o_b);  y[i, j] = alpha[j] · Σ_k (e2m1(x_q) · sx) · (e2m1(q) · sw)
//
// Why one bf16 mma term per product gives the CPU's exact products: an e2m1 value (0, 0.5, 1,
// 1.5, 2, 3, 4, 6) has at most 2 significant bits and an e4m3 value at most 4 (its subnormals
// m · 2⁻⁹ fewer), so a dequantized factor e2m1 · e4m3 has at most 6 significant bits, and its
// magnitude lies in [0.5 · 2⁻⁹, 6 · 448] = [2⁻¹⁰, 2688], far inside bf16's normal range
// [2⁻¹²⁶, 3.4 · 10³⁸] (8 significant bits): every factor, weight or activation, is EXACTLY a bf16
// value. The product of two bf16 values (≤ 16 significant bits, magnitude ≥ 2⁻²⁰) is exact in
// float32, so each tensor-core product is the CPU's exact product; only the order of the float32
// additions differs (as for every GPU GEMM here). alpha = input_scale · weight_scale_2 (per weight
// row, cpu::QuantMatrix::RowScale) is applied in the epilogue, y = alpha · acc, as the CPU does.
//
// Weight-only NVFP4 (NVFP4A16, Nvfp4Weights::weight_only; cpu::QuantMatrix::FromNvfp4WeightOnly):
// the same weights and kernels, but the float32 activations are not quantized:
//   y[i, j] = alpha[j] · Σ_k x · (e2m1(q) · sw),  alpha = weight_scale_2 (input_scale 1)
// The A load splits each float32 activation exactly into three bf16 terms x = hi + mid + lo
// (SplitTermBits, cuda_bf16.cuh, as the W4A16 and float32-mode GEMMs of cuda_moe.cu) kept as three
// A tiles, each multiplied by the same weight fragment: the weight e2m1 · sw is one exact bf16
// value (above), each term · weight is exact in float32, and the three products sum to the CPU's
// exact x · W (float32 additions in another order). Three mma per product instead of one.
//
// Plain C++17 header (included from .cu files); device pointers throughout; calls run on `stream`
// (0 = the default stream) and return INTERNAL naming the kernel on a launch error.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cuda {

// NVFP4 weights of E experts (E = 1 for a dense layer), each [rows, in] with in a multiple of 16,
// in device memory:
//   codes         [E, rows, in/8] uint32 — input c of a row in bits 4·(c%8) … 4·(c%8)+3 of word
//                 c/8 (the checkpoint's byte order: element 2i in the low nibble of byte i), an
//                 e2m1 code 0..15 (bit 3 the sign);
//   block_scales  [E, rows, in/16] float8_e4m3fn codes — the scale sw of inputs 16b … 16b+15;
//   alpha         [E, rows] float32 — input_scale · weight_scale_2 of the row's module;
//   input_global  [E] float32 — each expert's activation quantization g (1 / input_scale for
//                 ModelOpt; compressed-tensors' input_global_scale); unused (may be null) when
//                 weight_only;
//   weight_only   NVFP4A16: the activations stay float32 (see above) and alpha is
//                 weight_scale_2 alone (cpu::QuantMatrix::RowScale of a weight-only matrix).
// 4 + 8/16 = 4.5 bits per weight read, against bf16's 16.
struct Nvfp4Weights {
  const uint32_t* codes = nullptr;
  const uint8_t* block_scales = nullptr;
  const float* alpha = nullptr;
  const float* input_global = nullptr;
  bool weight_only = false;
};

// The activation quantization alone (item 1 of the task; the GEMMs below run the same device code
// in their A load): q[r, c] = e2m1(x_q[r, c]) · sx[r, c/16] as bf16 bits (exact, see above), for
// x [rows, in] float32, in a positive multiple of 16, g > 0 finite. Bit for bit
// cpu::QuantizeRowNvfp4Global(x_row, in, g, q_row) (its float32 outputs are these bf16 values).
// INVALID_ARGUMENT for bad shapes or g; rows = 0 is a no-op.
absl::Status QuantizeNvfp4Activations(const float* x, int rows, int in, float g, uint16_t* q,
                                      void* stream = nullptr);

// Gate and up projections of every expert group, as MoeGateUp (cuda_moe.h) with NVFP4 weights
// w [E, 2·width, dim] (gate rows then up rows; one g per expert, as the CPU's fused gate_up
// matrix has one activation quantization):
//   act[n, f] = gelu_tanh(alpha_g · Σ_d a · W_g) · (alpha_u · Σ_d a · W_u),  a =
//   NVFP4(x[gather[n]])  (weight-only: a = x[gather[n]], float32)
// x: [rows, dim] float32; act: [rows·k, width]. The activation is quantized with the group's
// expert's g, as the CPU quantizes the rows it gathers for that expert; there is no GemmInput:
// the format fixes the activations (the CPU's QuantLinear ignores the input mode too).
// INVALID_ARGUMENT for bad shapes (dim not a multiple of 16) or null weight pointers (g only
// when not weight-only).
absl::Status MoeGateUpNvfp4(const float* x, const int32_t* gather, const int32_t* offsets,
                            const Nvfp4Weights& w, int rows, int k, int num_experts, int dim,
                            int width, float* act, void* stream = nullptr);

// Down projection, as MoeDown with NVFP4 weights w [E, dim, width] (width a multiple of 16):
//   y[n, d] = slot_weight[n] · (alpha[e, d] · Σ_f a[n, f] · W[e, d, f]),  a = NVFP4(act[n])
// (weight-only: a = act[n])
// (the CPU: alpha · acc from QuantLinear, then × the routing weight). act: [rows·k, width].
absl::Status MoeDownNvfp4(const float* act, const int32_t* offsets, const float* slot_weight,
                          const Nvfp4Weights& w, int rows, int k, int num_experts, int width,
                          int dim, float* y, void* stream = nullptr);

// A dense NVFP4 layer on the same kernel with one group (E = 1 in `w`):
//   y[r, o] = alpha[o] · Σ_i NVFP4(x[r])_i · W[o, i]  (weight-only: x[r]_i)
// x: [rows, in] float32, in a multiple of 16; y: [rows, out]. Each output is accumulated in
// ascending 16-wide steps with no split-K: a row's bits never depend on `rows` or the other rows.
absl::Status DenseLinearNvfp4(const float* x, const Nvfp4Weights& w, int rows, int in, int out,
                              float* y, void* stream = nullptr);

}  // namespace dgserve::cuda
