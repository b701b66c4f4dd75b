// The MoE branch on the device with no host round trip (issue 33 items 3–4; spec §3.2 step 5):
// routing (softmax, top-k, renormalise, × per_expert_scale) and the per-expert grouping
// (offsets, gather, slot) built on the device, then one grouped expert GEMM per projection whose
// row groups are read from device memory. Every launch has a grid sized from host-known
// numbers only (rows, k, experts, widths), so the sequence can be captured in a CUDA graph;
// blocks with no work exit at once.
//
// The pipeline for R token rows, E experts, top-k (N = R·k routed rows, always exactly: every
// row picks k distinct experts):
//   MoeRoute     scores [R, E] → expert [R, k] (ascending id per row), weight [R, k]
//   MoeGroup     → offsets [E+1], gather [N], slot [R, k], slot_weight [N]
//   MoeGateUp    act [N, F] = gelu(x[gather]·W_gateᵀ) ⊙ (x[gather]·W_upᵀ), per expert group
//   MoeDown      y [N, D] = slot_weight ⊙ (act·W_downᵀ), per expert group
//   MoeSum       out [R, D] = Σ_j y[slot[r, j]] in j order (= ascending expert id, as the CPU)
// Accumulation order is fixed by construction: each output of the GEMMs is accumulated in float32
// over the reduction dimension in ascending 16-wide steps (tensor cores) or one index at a time
// (SIMT), with no split-K and nothing that depends on the batch or on which rows share a tile,
// so a row's result never depends on the other rows.
//
// Plain C++17 header (included from .cu files); device pointers throughout; calls run on
// `stream` (0 = the default stream) and return INTERNAL naming the kernel on a launch error.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/cuda_gemm.h"

namespace dgserve::cuda {

// Routing, exactly RouteTopK per row (engine/model/model_math.cc): p = softmax(scores[r])
// (max subtracted, exp, a float32 sum in expert order, then p/sum), the k largest p with ties
// to the lower expert id, w = p / Σ_{top} p (Σ in descending-p order) · per_expert_scale[e].
// The exp is glibc's expf algorithm (exp2f_data table, double evaluation, one rounding), so the
// device gives the CPU's bits except where glibc's own FMA and non-FMA builds could disagree
// (about one input in 10⁸). Outputs per row, sorted by ascending expert id (the order of the
// CPU's MoE accumulation): expert [rows, k], weight [rows, k].
// 1 ≤ k ≤ num_experts ≤ 1024, else INVALID_ARGUMENT; rows = 0 is a no-op.
absl::Status MoeRoute(const float* scores, int rows, int num_experts, int k,
                      const float* per_expert_scale, int32_t* expert, float* weight,
                      void* stream = nullptr);

// Groups the routed rows by expert, as CudaBackend::Moe did on the host: rows routed to expert e
// are gathered rows [offsets[e], offsets[e+1]) in ascending token-row order; gather[n] is the
// token row of gathered row n; slot[r·k + j] = the gathered row of token r's j-th expert;
// slot_weight[n] = weight of gathered row n. offsets: [E+1] (offsets[0] = 0, offsets[E] =
// rows·k); gather, slot_weight: [rows·k]; slot: [rows, k]. One block per expert: each counts the
// choices of lower experts (its offset: the exclusive scan of the per-expert counts) and scatters
// its rows with a block-wide prefix sum (stable, no atomics). expert/weight as MoeRoute gives.
absl::Status MoeGroup(const int32_t* expert, const float* weight, int rows, int num_experts, int k,
                      int32_t* offsets, int32_t* gather, int32_t* slot, float* slot_weight,
                      void* stream = nullptr);

// How the grouped GEMMs multiply. kMma (default): tensor cores, mma.sync m16n8k16 bf16 with
// float32 accumulation (cuda_mma.cuh), 32 rows × 64 weight rows per block, the weights streamed
// through a two-stage cp.async pipeline. kSimt: float32 FFMA from shared-memory tiles, one
// thread per output chain (the first version; kept as a second implementation for the tests).
enum class MoeKernel { kMma, kSimt };

// Gate and up projections of every expert group in one launch, gather fused into the A load:
//   act[n, f] = gelu_tanh(Σ_d a[gather[n], d] · W[e, f, d]) · (Σ_d a[gather[n], d] · W[e, F+f, d])
// for n in [offsets[e], offsets[e+1]). x: [rows, dim] float32; w: [E, 2·width, dim] bf16 (gate
// rows then up rows, the checkpoint's gate_up_proj); act: [rows·k, width].
// `input` (cuda_gemm.h): kBf16 rounds each x to bf16 in the load (HF's bf16 activations; the
// products are then exact). kFloat32 keeps the float32 x: kMma splits it in the load exactly
// into three bf16 terms (hi + mid + lo, as cuda_gemm's kFloat32) and multiplies each by the same
// weight fragments (three times the tensor-core work, the weights still read once); kSimt
// multiplies the float32 x by the widened weight in a fused multiply-add. Either way the CPU
// backend's float32 GEMM up to the order of float32 additions.
absl::Status MoeGateUp(const float* x, const int32_t* gather, const int32_t* offsets,
                       const uint16_t* w, int rows, int k, int num_experts, int dim, int width,
                       GemmInput input, float* act, void* stream = nullptr,
                       MoeKernel kernel = MoeKernel::kMma);

// Down projection of every expert group in one launch, routing weight in the epilogue:
//   y[n, d] = slot_weight[n] · Σ_f a[n, f] · W[e, d, f]   for n in [offsets[e], offsets[e+1])
// act: [rows·k, width] float32 (MoeGateUp's output, converted as `input` says); w: [E, dim,
// width] bf16 (down_proj); y: [rows·k, dim]. The tensor-core path streams the weights with
// 16-byte cp.async when the reduction width is a multiple of 8 (the model's), else with plain
// loads.
absl::Status MoeDown(const float* act, const int32_t* offsets, const float* slot_weight,
                     const uint16_t* w, int rows, int k, int num_experts, int width, int dim,
                     GemmInput input, float* y, void* stream = nullptr,
                     MoeKernel kernel = MoeKernel::kMma);

// W4A16 expert weights in device memory (compressed-tensors `pack-quantized`, int4 symmetric per
// group: engine/model/quant_config.h, engine/cpu/gemm_quant.h) for E experts of `rows` weight
// rows (gate_up: 2·width, gate rows then up rows; down: dim) and `in` inputs each:
//   packed  [E, rows, ceil(in/8)] uint32 — the checkpoint's weight_packed: value 8j+i of a row in
//           bits 4i..4i+3 of word j, stored as q + 8 (q ∈ [−8, 7]); padding nibbles ignored;
//   scales  [E, rows, ceil(in/group)] bf16 bits — the weight_scale of input c's group c / group;
//   group   the group size G along the inputs, a positive multiple of 8 (32, 64, 128, …; the
//           "channel" strategy: in rounded up to a multiple of 8).
// W[e, r, c] = q · s: 4 bits + 16/G bits per weight read (4.5 at G = 32, 4.125 at G = 128,
// against bf16's 16: 3.6× to 3.9× fewer bytes).
struct W4A16Weights {
  const uint32_t* packed = nullptr;
  const uint16_t* scales = nullptr;
  int group = 0;
};

// MoeGateUp / MoeDown (kMma only) with W4A16 weights: each weight chunk is dequantized as the
// CPU's W4A16 GEMM widens it, v = float32(q) · s (exact in float32, s being a bf16 value), while
// it is staged into shared memory, and held there exactly as two bf16 terms (v = hi + lo); the
// tensor cores multiply every activation term by both (twice the bf16 kernel's tensor-core work,
// a quarter of its weight bytes). The products are therefore exactly a · v, the CPU's products
// (cpu::QuantLinear multiplies the float32 x by the same float32 v); only the order of float32
// additions differs, as for bf16 weights. There is no GemmInput: the activations are always taken
// in float32 (MoeGateUp's kFloat32 split), because cpu::QuantLinear takes them in float32 in both
// CPU GEMM modes; rounding them to bf16 in the bf16 mode (as these functions once did) made the
// device run another model than the CPU's, whose divergence a flipped route amplifies (issue 37:
// max |Δlogit| 5.8 on the tiny all-W4A16 checkpoint). INVALID_ARGUMENT for bad shapes, null weight
// pointers or a group size that is not a positive multiple of 8.
absl::Status MoeGateUpW4A16(const float* x, const int32_t* gather, const int32_t* offsets,
                            const W4A16Weights& w, int rows, int k, int num_experts, int dim,
                            int width, float* act, void* stream = nullptr);
absl::Status MoeDownW4A16(const float* act, const int32_t* offsets, const float* slot_weight,
                          const W4A16Weights& w, int rows, int k, int num_experts, int width,
                          int dim, float* y, void* stream = nullptr);

// A dense projection on the grouped GEMM's tensor-core kernel, one group of all rows:
//   y[r, o] = Σ_i x[r, i] · W[o, i]
// x: [rows, in] float32 (converted as `input` says, as MoeDown); w: [out, in] bf16 (row-major, a
// checkpoint's Linear weight); y: [rows, out] float32. Each output is accumulated in ascending
// 16-wide steps of the reduction with no split-K, so a row's bits never depend on `rows` or on
// the other rows: the batch-invariant replacement of cuBLAS for the projections (issue 33 item 7;
// cuBLAS may pick another algorithm, and another addition order, for another row count).
// INVALID_ARGUMENT unless rows ≥ 0 and in, out > 0; rows = 0 is a no-op.
absl::Status DenseLinear(const float* x, const uint16_t* w, int rows, int in, int out,
                         GemmInput input, float* y, void* stream = nullptr);

// DenseLinear with W4A16 weights (issue 37: a W4A16 checkpoint's attention and dense MLP
// projections): y[r, o] = Σ_i x[r, i] · W[o, i], W = q · s the CPU's widened float32 weight, on
// MoeDownW4A16's kernel with one group of all rows (w: one "expert" of `out` rows and `in`
// inputs). The products are exactly cpu::QuantLinear's (float32 activations, no GemmInput: as
// MoeDownW4A16); each output is accumulated in ascending steps of the reduction, so a row's bits
// do not depend on `rows`. INVALID_ARGUMENT unless rows ≥ 0 and in, out > 0, or for bad weights
// (as MoeDownW4A16); rows = 0 is a no-op.
absl::Status DenseLinearW4A16(const float* x, const W4A16Weights& w, int rows, int in, int out,
                              float* y, void* stream = nullptr);

// out[r, d] = Σ_{j<k} y[slot[r·k + j], d], summed from 0.0f in j order (ascending expert id):
// the combine of the weighted expert outputs, in the CPU backend's per-row order.
absl::Status MoeSum(const float* y, const int32_t* slot, int rows, int k, int dim, float* out,
                    void* stream = nullptr);

// y[i] = the exp MoeRoute uses, of x[i] (for tests against the host's std::exp).
absl::Status MoeExp(const float* x, int64_t n, float* y, void* stream = nullptr);

}  // namespace dgserve::cuda
