#include "engine/cuda/cuda_soft_embed.h"

#include <algorithm>
#include <string>

#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_mma.cuh"
#include "engine/cuda/cuda_vocab_tile.cuh"

namespace dgserve::cuda {
namespace {

using vocab_tile::FusedTiles;
using vocab_tile::kFK;
using vocab_tile::kFR;
using vocab_tile::kFT;
using vocab_tile::kMi;
using vocab_tile::kNj;
using vocab_tile::ProbBits;
using vocab_tile::RowMask;
using vocab_tile::TileMma;
using vocab_tile::TileSmem;

constexpr int kSoftChunks = 32;     // most chunks of tiles summed separately
constexpr int kSoftSlabRows = 512;  // rows per launch pair (bounds the scratch); a multiple of kFR
constexpr int kPadP = kFT + 8;      // bf16 per probability row: 528 bytes, 16-byte aligned rows
static_assert(kSoftSlabRows % kFR == 0);

// Dynamic shared memory of SoftTileKernel. t: TileMma's staging (its table chunk buffer then
// holds kFK columns of the tile's table rows, [id][column], for the product); p: the block's
// probabilities of one tile, [row][id] (A of the product, row-major); per row its lse, 1/T, mask
// and whether it keeps the current tile.
struct alignas(16) SoftSmem {
  TileSmem t;
  uint16_t p[kFR][kPadP];
  const uint64_t* mask[kFR];
  float lse[kFR];
  float inv_t[kFR];
  int32_t keep[kFR];
};

__host__ __device__ __forceinline__ int ChunkTileBegin(int tiles, int chunks, int chunk) {
  return int(int64_t(tiles) * chunk / chunks);
}

// Grid: (chunk, block of kFR rows of the slab), kFT threads. acc: [chunks, slab_rows, dim].
// For each tile of the chunk, ascending: the block's logits (TileMma), their probabilities
// (ProbBits) into sm.p, then per kFK-column slice of the table the partial P·E_tile[:, slice]
// (warp w: rows 16·(w/2) …, columns 16·(w%2) … of the slice, two 8-column fragments, 16 k steps
// over the tile's ids) added to the accumulators; each accumulator element belongs to one thread.
// One block per SM by registers (sm_90: 150 and no spills; a cap of 128 spilled).
__global__ void __launch_bounds__(kFT, 1)
    SoftTileKernel(FusedVocabArgs a, const VocabRowResult* __restrict__ res,
                   const uint8_t* __restrict__ skip, int tiles, int chunks, int slab0,
                   int slab_rows, float* __restrict__ acc) {
  SoftSmem& sm = *DynamicShared<SoftSmem>();
  const int chunk = blockIdx.x, rb0 = blockIdx.y * kFR, row0 = slab0 + rb0;
  const int nrows = min(kFR, slab_rows - rb0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int dim = a.dim;
  float* blk = acc + (int64_t(chunk) * slab_rows + rb0) * dim;  // [nrows, dim]
  for (int64_t i = tid; i < int64_t(nrows) * dim; i += kFT) blk[i] = 0.0f;
  if (tid < kFR) {
    const bool live = tid < nrows;
    sm.mask[tid] = live ? RowMask(a.mask_table, a.mask_index, row0 + tid, a.vocab) : nullptr;
    sm.lse[tid] = live ? res[row0 + tid].lse : 0.0f;
    sm.inv_t[tid] = live ? 1.0f / a.temperature[row0 + tid] : 0.0f;
  }
  const int tile_end = ChunkTileBegin(tiles, chunks, chunk + 1);
  for (int tile = ChunkTileBegin(tiles, chunks, chunk); tile < tile_end; ++tile) {
    const int v0 = tile * kFT;
    // The sparse plan: a row that leaves the tile out gets probability 0 there; a tile every row
    // of the block leaves out is not computed (its partial would be +0 for every row).
    const bool kept =
        tid < nrows && (skip == nullptr || skip[int64_t(row0 + tid) * tiles + tile] == 0);
    if (tid < kFR) sm.keep[tid] = kept ? 1 : 0;
    if (__syncthreads_or(kept) == 0) continue;  // also: the previous tile's smem is no longer read
    float d[kMi][kNj][4];
    TileMma(a.hidden, row0, nrows, dim, a.embed, v0, a.vocab, a.bf16_input, &sm.t, d);
    // Probabilities from the C fragments (row 16·mi + g (+8), id 32·warp + 8·nj + 2·t4 (+1)).
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
      for (int nj = 0; nj < kNj; ++nj) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = mi * 16 + g + (i >= 2 ? 8 : 0);
          const int j = warp * 32 + nj * 8 + 2 * t4 + (i & 1), v = v0 + j;
          uint16_t pb = 0;
          if (r < nrows && v < a.vocab && sm.keep[r] != 0) {
            const uint64_t* mask = sm.mask[r];
            const bool allowed = mask == nullptr || ((mask[v >> 6] >> (v & 63)) & 1u) != 0;
            pb = ProbBits(d[mi][nj][i], a.softcap, sm.inv_t[r], sm.lse[r], allowed);
          }
          sm.p[r][j] = pb;
        }
      }
    }
    const int mi = warp / 2, nj0 = (warp % 2) * 2;
    for (int c0 = 0; c0 < dim; c0 += kFK) {
      const int cn = min(kFK, dim - c0);
      for (int i = tid; i < kFT * kFK; i += kFT) {
        const int j = i / kFK, c = i % kFK, v = v0 + j;
        sm.t.u.bs[j][c] = v < a.vocab && c < cn ? a.embed[int64_t(v) * dim + c0 + c] : uint16_t(0);
      }
      __syncthreads();        // the slice (and, the first time, sm.p) written
      if (mi * 16 < nrows) {  // uniform over the warp
        float o[2][4] = {};
#pragma unroll 4
        for (int ks = 0; ks < kFT / 16; ++ks) {
          uint32_t af[4];
          mma::LdMatrixX4(af, &sm.p[mi * 16 + lane % 16][ks * 16 + (lane / 16) * 8]);
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            uint32_t bf[2];
            mma::LdMatrixX2Trans(bf, &sm.t.u.bs[ks * 16 + lane % 16][(nj0 + n) * 8]);
            mma::MmaBf16M16N8K16(o[n], af, bf);
          }
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = mi * 16 + g + (i >= 2 ? 8 : 0);
            const int c = (nj0 + n) * 8 + 2 * t4 + (i & 1);
            if (r < nrows && c < cn) {
              float* x = blk + int64_t(r) * dim + c0 + c;
              *x = __fadd_rn(*x, o[n][i]);
            }
          }
        }
      }
      __syncthreads();  // the slice is no longer read
    }
  }
}

// soft[i] = fl(scale · (((acc_0[i] + acc_1[i]) + …))), chunks ascending; acc: [chunks, n].
__global__ void SoftCombineKernel(const float* __restrict__ acc, int chunks, int64_t n, float scale,
                                  float* __restrict__ soft) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float s = acc[i];
  for (int c = 1; c < chunks; ++c) s = __fadd_rn(s, acc[c * n + i]);
  soft[i] = __fmul_rn(scale, s);
}

absl::Status Status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string("FusedSoftEmbedding: ") + what + ": " +
                             cudaGetErrorString(e));
}

// The tile kernel's dynamic shared memory above 48 KB needs the opt-in attribute.
absl::Status AllowShared(size_t bytes) {
  int device = 0, optin = 0;
  if (absl::Status st = Status(cudaGetDevice(&device), "cudaGetDevice"); !st.ok()) return st;
  if (absl::Status st =
          Status(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                 "cudaDeviceGetAttribute");
      !st.ok()) {
    return st;
  }
  if (size_t(optin) < bytes) {
    return absl::InternalError("FusedSoftEmbedding: needs " + std::to_string(bytes) +
                               " bytes of shared memory per block, the device allows " +
                               std::to_string(optin));
  }
  return Status(
      cudaFuncSetAttribute(SoftTileKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
      "cudaFuncSetAttribute");
}

}  // namespace

int FusedSoftChunks(int vocab) { return vocab <= 0 ? 0 : std::min(FusedTiles(vocab), kSoftChunks); }

size_t FusedSoftEmbeddingScratchBytes(int rows, int vocab, int dim) {
  if (rows <= 0 || vocab <= 0 || dim <= 0) return 0;
  return size_t(std::min(rows, kSoftSlabRows)) * size_t(FusedSoftChunks(vocab)) * size_t(dim) *
         sizeof(float);
}

absl::Status FusedSoftEmbedding(const FusedVocabArgs& a, const VocabRowResult* results,
                                float embed_scale, void* scratch, float* soft) {
  if (a.rows < 0 || a.vocab <= 0 || a.vocab > kMaxVocab || a.dim <= 0) {
    return absl::InvalidArgumentError(
        "FusedSoftEmbedding: need rows ≥ 0, dim ≥ 1 and 1 ≤ vocab ≤ 2^30");
  }
  if (a.rows == 0) return absl::OkStatus();
  if (a.hidden == nullptr || a.embed == nullptr || a.temperature == nullptr || results == nullptr ||
      scratch == nullptr || soft == nullptr ||
      (a.mask_index != nullptr && a.mask_table == nullptr) ||
      (a.sc_skip_mass != nullptr && a.scratch == nullptr)) {
    return absl::InvalidArgumentError("FusedSoftEmbedding: null pointer");
  }
  const size_t smem = sizeof(SoftSmem);
  if (absl::Status st = AllowShared(smem); !st.ok()) return st;
  const int tiles = FusedTiles(a.vocab), chunks = FusedSoftChunks(a.vocab);
  const uint8_t* skip = a.sc_skip_mass != nullptr ? vocab_tile::FusedSkipFlags(a) : nullptr;
  auto* acc = static_cast<float*>(scratch);
  const cudaStream_t s = static_cast<cudaStream_t>(a.stream);
  for (int slab0 = 0; slab0 < a.rows; slab0 += kSoftSlabRows) {
    const int slab_rows = std::min(kSoftSlabRows, a.rows - slab0);
    LaunchKernel(SoftTileKernel, dim3(chunks, (slab_rows + kFR - 1) / kFR), kFT, smem, s, a,
                 results, skip, tiles, chunks, slab0, slab_rows, acc);
    const int64_t n = int64_t(slab_rows) * a.dim;
    LaunchKernel(SoftCombineKernel, unsigned((n + 255) / 256), 256, 0, s, acc, chunks, n,
                 embed_scale, soft + int64_t(slab0) * a.dim);
  }
  return Status(cudaGetLastError(), "launch");
}

}  // namespace dgserve::cuda
