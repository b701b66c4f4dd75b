// Small device kernels the CUDA backend (cuda_backend.h) chains between the cuBLAS projections,
// attention and the vocabulary step: embedding gather, residual add / scale, the gated GELU of
// the packed MoE gate_up output, MoE row gather / combine and the self-conditioning
// probabilities. float32 on the device unless marked bf16 (bits in uint16). Every function takes
// device pointers, runs on `stream` (0 = the default stream) and returns INTERNAL naming the
// kernel on a CUDA launch error. Plain C++17 types only (this header is included from .cu files).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/cuda_vocab.h"

namespace dgserve::cuda {

// out[r, :] = bf16→float(table[ids[r], :]) · scale (spec §3.5 step 1 / §3.4: E[c]·bf16(√D)).
// ids: [rows] in [0, V) (checked on the host); table: [V, dim] bf16; out: [rows, dim].
absl::Status EmbedRows(const int32_t* ids, const uint16_t* table, int rows, int dim, float scale,
                       float* out, void* stream = nullptr);

// h[i] += x[i] for n elements (residual add, spec §3.2 step 3).
absl::Status AddInPlace(float* h, const float* x, int64_t n, void* stream = nullptr);

// h[i] = (h[i] + x[i]) · scalar (spec §3.2 steps 6–7: residual add then layer_scalar).
absl::Status AddScale(float* h, const float* x, float scalar, int64_t n, void* stream = nullptr);

// x[i] *= s for n elements.
absl::Status Scale(float* x, int64_t n, float s, void* stream = nullptr);

// x[i] = the product x[i]·s rounded as a GEMM input of the bf16 mode (ActivationBf16Bits:
// a denormal read as zero, then round to nearest even; cpu::RoundActivationToBf16): the router's
// input in the bf16 mode, scaled and rounded in one launch.
absl::Status ScaleAndRoundToBf16(float* x, int64_t n, float s, void* stream = nullptr);

// out[r, i] = gelu_tanh(gu[r, i]) · gu[r, width + i]: the expert MLP activation on the packed
// [rows, 2·width] gate_up output (spec §3.2 step 5, §3.1.3). out: [rows, width].
absl::Status GeluGateRows(const float* gu, int rows, int width, float* out, void* stream = nullptr);

// dst[i, :] = src[idx[i], :] for i < rows (idx[i] < 0: a zero row). src rows of `dim` floats.
absl::Status GatherRows(const float* src, const int32_t* idx, int rows, int dim, float* dst,
                        void* stream = nullptr);

// out[r, d] = Σ_{j<k} weight[r·k + j] · y[slot[r·k + j], d], summed in j order starting from 0
// (slot < 0 skipped): the MoE combine (spec §3.2 step 5), deterministic (no atomics).
// y: [*, dim]; slot, weight: [rows, k]; out: [rows, dim].
absl::Status MoeCombine(const float* y, const int32_t* slot, const float* weight, int rows, int k,
                        int dim, float* out, void* stream = nullptr);

// probs[r, v] = bf16(exp(ℓ[r, v] / T[r] − lse[r])) with ℓ = cap·tanh(raw / cap) (cap ≤ 0: no
// cap) and lse = res[r].lse (VocabStep's log Σ exp(ℓ/T)): the self-conditioning softmax of the
// step (spec §3.5 step 2), ready for the bf16 probabilities × embedding GEMM. A row whose lse
// is not finite gets zeros. raw: [rows, vocab]; temperature: [rows]; probs: [rows, vocab] bf16.
// mask_table, mask_index: the canvas-template masks as VocabStep takes them (nullptr: none); a
// masked-out id gets probability 0.
absl::Status SoftmaxProbsBf16(const float* raw, int rows, int vocab, float softcap,
                              const float* temperature, const VocabRowResult* res, uint16_t* probs,
                              const uint64_t* mask_table = nullptr,
                              const int32_t* mask_index = nullptr, void* stream = nullptr);

// Paged K/V rows (the CUDA backend's device KV block pool, cuda_backend.h): row r of a
// contiguous [rows, width] array is slot s = first_slot + r of a pool
// [num_blocks, block_size, width], pool row block_table[s / block_size] · block_size +
// s % block_size (the paged layout of cuda_attention.h's KvContext). block_table: device int32
// with an entry, inside the pool, for every block the rows touch (not checked on the device).
// INVALID_ARGUMENT for block_size ≤ 0 or first_slot < 0; rows ≤ 0 does nothing.
// CopyRowsToBlocks writes src into the pool; from float32 into a bf16 pool (uint16_t bits) each
// element is rounded to nearest even (ToBf16Bits: cuda::FloatToBf16's bits).
absl::Status CopyRowsToBlocks(const float* src, int64_t rows, int width, const int32_t* block_table,
                              int block_size, int64_t first_slot, float* pool,
                              void* stream = nullptr);
absl::Status CopyRowsToBlocks(const float* src, int64_t rows, int width, const int32_t* block_table,
                              int block_size, int64_t first_slot, uint16_t* pool,
                              void* stream = nullptr);
absl::Status CopyRowsToBlocks(const uint16_t* src, int64_t rows, int width,
                              const int32_t* block_table, int block_size, int64_t first_slot,
                              uint16_t* pool, void* stream = nullptr);
// CopyRowsFromBlocks reads the pool's rows into dst [rows, width] (the same element type).
absl::Status CopyRowsFromBlocks(const float* pool, int64_t rows, int width,
                                const int32_t* block_table, int block_size, int64_t first_slot,
                                float* dst, void* stream = nullptr);
absl::Status CopyRowsFromBlocks(const uint16_t* pool, int64_t rows, int width,
                                const int32_t* block_table, int block_size, int64_t first_slot,
                                uint16_t* dst, void* stream = nullptr);

// Whole blocks of `block_elements` elements from one pool array to another (a K/V block pool
// compacted into smaller arrays: CudaBackend::CompactKvPool): for each i < count,
// to[moves[2i+1] · block_elements + e] = from[moves[2i] · block_elements + e]. moves: device
// int32 (source, destination) pairs, inside both arrays (not checked on the device). One
// launch; count ≤ 0 does nothing.
absl::Status CopyPoolBlocks(const float* from, float* to, const int32_t* moves, int count,
                            int64_t block_elements, void* stream = nullptr);
absl::Status CopyPoolBlocks(const uint16_t* from, uint16_t* to, const int32_t* moves, int count,
                            int64_t block_elements, void* stream = nullptr);

}  // namespace dgserve::cuda
