// The tile machinery shared by the kernels of the fused vocabulary pass (cuda_vocab.cu) and the
// soft embedding that recomputes its tiles (cuda_soft_embed.cu): the tile shapes, the tensor-core
// products of one tile's logits (TileMma), the canvas masks and SoftmaxProbsBf16's probability
// formula. Kernels that include it compute a row's logits, and so its probabilities, to the same
// bits whichever kernel, block or slot the row is in. Device code only; include from .cu files.
#pragma once

#include <cstdint>

#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_mma.cuh"
#include "engine/cuda/cuda_vocab.h"

namespace dgserve::cuda::vocab_tile {

inline constexpr int kFT = kFusedVocabTile;  // ids per tile = threads of the tile kernels
inline constexpr int kFR = kFusedRows;       // rows per block of the tile kernels
inline constexpr int kFK = 32;               // k (hidden) columns staged in shared memory per step
inline constexpr int kFWarps = kFT / 32;

inline int FusedTiles(int vocab) { return (vocab + kFT - 1) / kFT; }

// Shared memory of the tile kernels: one k chunk of the block's hidden rows (one bf16 term) and
// of the tile's table rows ([id][k], k contiguous: B n-major for ldmatrix), the latter reused for
// 16 rows of float32 results once the products are done. Rows of kPadK bf16 (80 bytes): 16-byte
// aligned ldmatrix rows.
inline constexpr int kPadK = kFK + 8;
inline constexpr int kMi = kFR / 16;  // 16-row fragments per block
inline constexpr int kNj = 4;         // 8-id fragments per warp (32 ids)
struct alignas(16) TileSmem {
  uint16_t as[kFR][kPadK];
  union {
    uint16_t bs[kFT][kPadK];
    float ls[16][kFT + 4];
  } u;
};

// d[mi][nj] = the block's raw logits h·Eᵀ for rows row0 + 16·mi + (0…15) and ids v0 + 32·warp +
// 8·nj + (0…7), as mma.m16n8k16 C fragments: bf16 × bf16 products on the tensor cores, float32
// accumulation. The bf16-input mode feeds bf16(h) (ActivationBf16Bits); otherwise h's exact
// three-term split, lo, mid then hi into the same accumulators per k chunk (as the cuBLAS split
// of cuda_gemm.h). Fragments of rows ≥ nrows are skipped (their values are unused). A row's
// accumulators depend on its own hidden state and the table only, whichever slot it has, so its
// logits are the same bits in every kernel and in any batch.
__device__ __forceinline__ void TileMma(const float* __restrict__ hidden, int row0, int nrows,
                                        int dim, const uint16_t* __restrict__ embed, int v0,
                                        int vocab, bool bf16_input, TileSmem* sm,
                                        float d[kMi][kNj][4]) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
    for (int nj = 0; nj < kNj; ++nj) {
#pragma unroll
      for (int i = 0; i < 4; ++i) d[mi][nj][i] = 0.0f;
    }
  }
  const int terms = bf16_input ? 1 : 3;
  for (int k0 = 0; k0 < dim; k0 += kFK) {
    const int kn = min(kFK, dim - k0);
    for (int i = tid; i < kFT * kFK; i += kFT) {
      const int j = i / kFK, kk = i % kFK, v = v0 + j;
      sm->u.bs[j][kk] = v < vocab && kk < kn ? embed[int64_t(v) * dim + k0 + kk] : uint16_t(0);
    }
    const int steps = (kn + 15) / 16;
    for (int term = terms - 1; term >= 0; --term) {
      for (int i = tid; i < kFR * kFK; i += kFT) {
        const int r = i / kFK, kk = i % kFK;
        uint16_t h = 0;
        if (r < nrows && kk < kn) {
          const float x = hidden[int64_t(row0 + r) * dim + k0 + kk];
          h = bf16_input ? ActivationBf16Bits(x) : SplitTermBits(x, term);
        }
        sm->as[r][kk] = h;
      }
      __syncthreads();
      for (int st = 0; st < steps; ++st) {
        uint32_t b[kNj][2];
#pragma unroll
        for (int nj = 0; nj < kNj; ++nj) {
          mma::LdMatrixX2(b[nj],
                          &sm->u.bs[warp * 32 + nj * 8 + lane % 8][st * 16 + ((lane / 8) % 2) * 8]);
        }
#pragma unroll
        for (int mi = 0; mi < kMi; ++mi) {
          if (mi * 16 >= nrows) continue;  // uniform over the block
          uint32_t a[4];
          mma::LdMatrixX4(a, &sm->as[mi * 16 + lane % 16][st * 16 + (lane / 16) * 8]);
#pragma unroll
          for (int nj = 0; nj < kNj; ++nj) mma::MmaBf16M16N8K16(d[mi][nj], a, b[nj]);
        }
      }
      __syncthreads();
    }
  }
}

__device__ __forceinline__ const uint64_t* RowMask(const uint64_t* table, const int32_t* index,
                                                   int row, int vocab) {
  const int mi = index != nullptr ? index[row] : -1;
  return mi >= 0 ? table + int64_t(mi) * ((int64_t(vocab) + 63) / 64) : nullptr;
}

// SoftmaxProbsBf16's probability (cuda_backend_kernels.h) of one id from its recomputed raw logit:
// bf16(exp(cap·tanh(raw/cap)·(1/T) − lse)), 0 for an id that is not `kept` (masked out, or left
// out by the sparse plan) or a row whose lse is not finite. FusedSoftmaxProbsBf16 and
// FusedSoftEmbedding both call this, so their probabilities are the same bits.
__device__ __forceinline__ uint16_t ProbBits(float raw, float softcap, float inv_t, float lse,
                                             bool kept) {
  float l = raw;
  if (softcap > 0) l = softcap * tanhf(l / softcap);
  return isfinite(lse) && kept ? ToBf16Bits(expf(l * inv_t - lse)) : uint16_t(0);
}

// The sparse plan's [rows, ⌈vocab/256⌉] flags (1: the row's soft embedding leaves the tile out) in
// a FusedVocabStep's scratch; only written when args.sc_skip_mass is set (cuda_vocab.cu).
uint8_t* FusedSkipFlags(const FusedVocabArgs& args);

}  // namespace dgserve::cuda::vocab_tile
