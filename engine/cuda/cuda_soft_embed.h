// The self-conditioning soft embedding of the fused vocabulary pass entirely on the device (spec
// §3.5 step 2, issue 33 item 5): soft[r, :] = embed_scale · Σ_v p_v · E_v without the [rows, V]
// bf16 probability buffer and without a dense GEMM over it.
//
// p_v are FusedSoftmaxProbsBf16's probabilities, the same bits (cuda_vocab_tile.cuh's TileMma and
// ProbBits): each tile's logits are recomputed on the tensor cores, p = bf16(exp(cap·tanh(raw/cap)
// /T − lse)) with lse = results[r].lse, 0 for a masked id, for a tile the sparse plan leaves out
// (FusedVocabArgs::sc_skip_mass) and for every id of a row whose lse is not finite (so such a row
// gets soft = 0, as today's probabilities → cublasGemmEx path). The product P·E runs on the tensor
// cores too (mma.m16n8k16, bf16 P × bf16 E, float32 accumulation).
//
// Summation order, fixed by construction (so a row's result is the same bits alone or in any
// batch, at any slot): the vocabulary's tiles of kFusedVocabTile ids are cut into
// FusedSoftChunks(vocab) chunks of consecutive tiles (a function of the vocabulary only). Per
// chunk, per tile in ascending order: the tile's partial Σ_{v ∈ tile} p_v E_v (one mma chain over
// the tile's 256 ids in ascending k steps of 16, from 0) is added to the chunk's float32
// accumulator (acc ← acc + partial). Then soft = fl(embed_scale · (((acc_0 + acc_1) + acc_2) …)),
// chunks in ascending order. A tile that every row of a 64-row block leaves out is not computed,
// which equals adding the partial +0 of a left-out tile. Against a float64 product of the same
// bf16 probabilities the result differs by float32 rounding only (cuda_soft_embed_test.cc); against
// the CPU (cpu::FusedVocabStep's soft output, float32 exps) by the bf16 rounding of p (2⁻⁹
// relative per id) and, with the sparse plan, the two passes' different tiles (each < 2⁻¹⁰‖s‖).
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "engine/cuda/cuda_vocab.h"

namespace dgserve::cuda {

// The chunks of tiles the soft embedding sums separately (then in ascending order):
// min(⌈vocab/256⌉, 32).
int FusedSoftChunks(int vocab);

// Device scratch (bytes) FusedSoftEmbedding needs: min(rows, 512) × FusedSoftChunks(vocab) × dim
// float32 accumulators (rows are done in slabs of 512, one after another on the stream). At the
// real model (V = 262144, D = 2560): 84 MB for 256 rows, 168 MB from 512 rows up.
size_t FusedSoftEmbeddingScratchBytes(int rows, int vocab, int dim);

// soft: [args.rows, args.dim] float32 (row-major). args: the FusedVocabArgs a FusedVocabStep just
// ran with (hidden, rows, dim, embed, vocab, bf16_input, softcap, temperature, masks; with
// sc_skip_mass set, its scratch holds the sparse plan this reads, so it must not have been reused
// since); results: that step's [rows] results (their lse); embed_scale: bf16(√D); scratch:
// FusedSoftEmbeddingScratchBytes(rows, vocab, dim) bytes of device memory (no alignment beyond
// cudaMalloc's needed; overwritten). Allocates nothing and synchronises nothing: every launch
// (two per slab of 512 rows) is on args.stream, so it can be captured in a CUDA graph. The tile
// kernel takes 59.4 KB of dynamic shared memory (the opt-in attribute is set here, outside any
// stream work).
absl::Status FusedSoftEmbedding(const FusedVocabArgs& args, const VocabRowResult* results,
                                float embed_scale, void* scratch, float* soft);

}  // namespace dgserve::cuda
