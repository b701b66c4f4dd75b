// The tensor-core attention kernels: TensorCoreCanvasAttention (with split-KV) and
// TensorCorePrefillAttention (cuda_attention.h). The float32 ones are in cuda_attention.cu.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "engine/cuda/cuda_attention.h"
#include "engine/cuda/cuda_attention_common.cuh"
#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_mma.cuh"

namespace dgserve::cuda {
namespace {

using attention_internal::AllowSharedBytes;
using attention_internal::kFull;
using attention_internal::Range;

// ---- Tensor-core attention (TensorCoreCanvasAttention, TensorCorePrefillAttention) ----
//
// One kernel for both: kCausal = false is the canvas (every row of a segment sees the same keys),
// kCausal = true the prefill (row r sees its own causal, windowed range; PrefillKeys).
// Layout of one launch: grid = (ceil(total_rows · group / kTcPairs) + num_segments, kv_heads),
// block = kTcWarps warps. Block (x, g) finds its segment by walking the table (segment s has
// ceil(rows_s · group / kTcPairs) tiles; blocks past the last tile exit) and serves kTcPairs
// consecutive (row, query head of g's group) pairs of it, pair p = row · group + head offset: one
// mma M tile (GQA packing: the heads of one KV head share every K/V tile). It walks the keys
// [ctx_first, ctx_tokens) ++ canvas rows in tiles of kTcKeys keys, staged in shared memory as
// bf16 (the new rows converted from float32 while loading; the context too when it is float32,
// TCtx = float; a bf16 context, TCtx = uint16_t, is copied as it is: LoadBf16Pair; a paged
// context's rows found through its block table, TilePages, the tiles unchanged). Per tile:
//   S = Q·Kᵀ   warp w computes the 16 × 8 scores of keys [8w, 8w + 8) over the full head_dim
//              (Q by ldmatrix.x4, K [key][d] by ldmatrix.x2: B n-major);
//   softmax    S in shared float32; 8 threads per row update the running max m and sum l
//              (float32) and write P = exp(S − m) as bf16, and the rescale alpha = exp(m_old − m);
//   O += P·V   warp w owns output columns [w·hd/4, (w+1)·hd/4): O ← alpha·O + P·V (P by
//              ldmatrix.x4, V [key][d] by ldmatrix.x2.trans: B k-major), float32 accumulators in
//              registers (hd/32 n8 tiles: 64 floats per thread at 512).
// Shared memory (bytes): Q 16·(hd+8)·2, K and V 32·(hd+8)·2 each (8 bf16 of row padding keep
// ldmatrix rows 16-byte aligned and off one bank), S 16·32·4, P 16·40·2, m/l/alpha 3·16·4;
// head_dim 512: 86,720 (opted in above 48 KiB).
// Prefill: the block walks only the union of its rows' key ranges (the first row's window start
// to the last row's own key), in tiles aligned to multiples of kTcKeys of the key index (so a
// tile above the diagonal or before the window of every row of the block is never loaded); the
// per-(row, key) mask is applied to S. A row may see no key of a tile (its m stays −inf until
// its first visible key: the rescale then is 1 on zero sums).
constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * 32;
constexpr int kTcPairs = 16;  // query pairs per block: one mma M tile
constexpr int kTcKeys = 32;   // keys per tile: one n8 score tile per warp
constexpr int kTcPad = 8;     // bf16 elements of row padding
constexpr int kTcPStride = kTcKeys + kTcPad;

struct TcLayout {
  int q, k, v, s, p, stats, total;  // byte offsets into dynamic shared memory
};

__host__ __device__ inline TcLayout TcSharedLayout(int hd) {
  const int row = (hd + kTcPad) * 2;
  TcLayout t;
  t.q = 0;
  t.k = t.q + kTcPairs * row;
  t.v = t.k + kTcKeys * row;
  t.s = t.v + kTcKeys * row;
  t.p = t.s + kTcPairs * kTcKeys * 4;
  t.stats = t.p + kTcPairs * kTcPStride * 2;
  t.total = t.stats + 3 * kTcPairs * 4;
  return t;
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  return uint32_t(ToBf16Bits(lo)) | (uint32_t(ToBf16Bits(hi)) << 16);
}

// Elements p[0], p[1] of a K/V row as a packed bf16 pair (p[0] in the low half): rounded from
// float32, or read as they are from a bf16 row (one 32-bit load; p is 4-byte aligned: an even
// element of a row of a multiple of 32 elements).
__device__ __forceinline__ uint32_t LoadBf16Pair(const float* p) { return PackBf16(p[0], p[1]); }
__device__ __forceinline__ uint32_t LoadBf16Pair(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Keys [lo, hi) (indices into the segment's [context ++ new]) visible to prefill row r: causal
// (key_pos ≤ P + r) and, when window > 0, P + r − key_pos < window; never before ctx_first.
__device__ __forceinline__ Range PrefillKeys(int r, int ctx_tokens, int ctx_first, int window) {
  const int hi = ctx_tokens + r + 1;
  return {window > 0 ? max(ctx_first, hi - window) : ctx_first, hi};
}

// A paged context's addressing for one key tile (CanvasSegmentOf::block_table; block-uniform):
// Row(j) is the pool row of context key j, one of the keys [jlo, jhi) the tile loads. With
// block_size ≥ kTcKeys those keys (jhi − jlo ≤ kTcKeys) span at most two blocks, so Init reads
// two table entries per tile and Row is one add: slot + base0 before key `split` (the first key
// of the next block), slot + base1 from it (base = block_table[b]·block_size − b·block_size for
// the slot's block b). Smaller blocks: one table read per key. Table entries of slots outside
// [jlo, jhi) are never read.
struct TilePages {
  const int32_t* table;
  int bs, first_slot, split;
  int64_t base0, base1;

  __device__ __forceinline__ void Init(const int32_t* tab, int block_size, int slot0, int jlo,
                                       int jhi) {
    table = tab;
    bs = block_size;
    first_slot = slot0;
    split = INT32_MAX;
    base0 = base1 = 0;
    if (bs < kTcKeys || jlo >= jhi) return;
    const int b = (first_slot + jlo) / bs;
    base0 = (int64_t(table[b]) - b) * bs;
    const int64_t next = int64_t(b + 1) * bs - first_slot;  // the first key of block b + 1
    if (next < jhi) {
      split = int(next);
      base1 = (int64_t(table[b + 1]) - (b + 1)) * bs;
    }
  }
  __device__ __forceinline__ int64_t Row(int j) const {
    const int s = first_slot + j;
    if (bs >= kTcKeys) return s + (j < split ? base0 : base1);
    return int64_t(table[s / bs]) * bs + s % bs;
  }
};

// Split-KV (TensorCoreCanvasAttention with max_splits > 1): the splits a canvas segment's keys
// fall into. Split i holds context keys [i·split_keys, (i + 1)·split_keys) (boundaries counted
// from context token 0); a segment uses the `count` consecutive splits first … first + count − 1
// holding its visible context [ctx_first, ctx_tokens), and its canvas keys join the last of them
// (the split of the last context token; without visible context, the split of ctx_first alone).
struct SplitRange {
  int first, count;
};

__host__ __device__ inline SplitRange CanvasSplits(int ctx_tokens, int ctx_first, int split_keys) {
  const int first = ctx_first / split_keys;
  const int last = ctx_first < ctx_tokens ? (ctx_tokens - 1) / split_keys : first;
  return {first, last - first + 1};
}

// window: the prefill's sliding window (≤ 0: none); the canvas's is in its ctx_first.
// partial == nullptr: out = O / l. Else (canvas only) split-KV: block z of the grid's third
// dimension computes split slot z (split CanvasSplits(..).first + z) of its segment's keys and
// writes its unnormalised O, running max m and sum l to the record
// partial + ((z · total_rows + row) · num_heads + head) · (hd + 2) (O[hd], m, l); slots past the
// segment's count do nothing.
// TCtx: the context's element type (float or uint16_t bf16 bits; CanvasSegmentOf).
template <int kMaxTiles, bool kCausal, typename TCtx>  // kMaxTiles ≥ head_dim / 32
__global__ void __launch_bounds__(kTcThreads)
    TcAttentionKernel(const float* __restrict__ q, const float* __restrict__ k_new,
                      const float* __restrict__ v_new,
                      const CanvasSegmentOf<TCtx>* __restrict__ segs, int num_segments,
                      int num_heads, int kv_heads, int group, int hd, int window,
                      float* __restrict__ out, int split_keys, int total_rows,
                      float* __restrict__ partial) {
  // This block's segment and tile within it (block-uniform).
  int b = blockIdx.x, si = 0;
  CanvasSegmentOf<TCtx> seg;
  for (; si < num_segments; ++si) {
    seg = segs[si];
    const int tiles = (seg.rows * group + kTcPairs - 1) / kTcPairs;
    if (b < tiles) break;
    b -= tiles;
  }
  if (si == num_segments) return;  // past the last tile: the whole block
  // Split-KV: this block's keys [split_lo, split_hi) of [context ++ new] (block-uniform).
  int split_lo = 0, split_hi = INT32_MAX;
  if (!kCausal && partial != nullptr) {
    const SplitRange sr = CanvasSplits(seg.ctx_tokens, seg.ctx_first, split_keys);
    const int z = int(blockIdx.z);
    if (z >= sr.count) return;  // a slot past this segment's splits: the whole block
    split_lo = (sr.first + z) * split_keys;
    if (z < sr.count - 1) split_hi = (sr.first + z + 1) * split_keys;
  }
  const int g = blockIdx.y;
  const TcLayout lay = TcSharedLayout(hd);
  char* smem = DynamicShared<char>();
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem + lay.q);  // [16][hd + 8]
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem + lay.k);  // [32][hd + 8]
  uint16_t* vs = reinterpret_cast<uint16_t*>(smem + lay.v);  // [32][hd + 8]
  float* ss = reinterpret_cast<float*>(smem + lay.s);        // [16][32]
  uint16_t* ps = reinterpret_cast<uint16_t*>(smem + lay.p);  // [16][40]
  float* m_s = reinterpret_cast<float*>(smem + lay.stats);   // [16] running max
  float* l_s = m_s + kTcPairs;                               // [16] running sum
  float* a_s = l_s + kTcPairs;                               // [16] this tile's rescale
  const int stride = hd + kTcPad, half_hd = hd / 2;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int gq = lane / 4, t = lane % 4;
  const int pairs = seg.rows * group, p0 = b * kTcPairs;

  // Q tile (bf16); pairs past the segment's rows are zero rows (scores 0, never written).
  for (int idx = tid; idx < kTcPairs * half_hd; idx += kTcThreads) {
    const int i = idx / half_hd, d = (idx - i * half_hd) * 2, p = p0 + i;
    uint32_t w = 0;
    if (p < pairs) {
      const float* src =
          q + (int64_t(seg.row0 + p / group) * num_heads + g * group + p % group) * hd + d;
      w = PackBf16(src[0], src[1]);
    }
    *reinterpret_cast<uint32_t*>(qs + i * stride + d) = w;
  }
  if (tid < kTcPairs) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }

  float o[kMaxTiles][4];
#pragma unroll
  for (int nt = 0; nt < kMaxTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  const int ntiles = hd / 32, n_base = warp * (hd / 4);

  // Canvas: every row sees the same keys, [ctx_first, ctx_tokens) ++ the segment's rows.
  // Prefill: the union of the block's rows' ranges (lo and hi are non-decreasing in the row),
  // from the tile holding the first row's first key; row_of(i): the segment row of pair i (pairs
  // past the segment's end take its last row: never written).
  auto row_of = [&](int i) { return min(p0 + i, pairs - 1) / group; };
  int lo, hi, kb0;
  if constexpr (kCausal) {
    lo = PrefillKeys(row_of(0), seg.ctx_tokens, seg.ctx_first, window).lo;
    hi = PrefillKeys(row_of(kTcPairs - 1), seg.ctx_tokens, seg.ctx_first, window).hi;
    kb0 = lo - lo % kTcKeys;
  } else {
    lo = max(seg.ctx_first, split_lo);
    hi = min(seg.ctx_tokens + seg.rows, split_hi);
    kb0 = lo;
  }
  const bool paged = seg.block_table != nullptr;
  for (int kb = kb0; kb < hi; kb += kTcKeys) {
    const int nk = min(kTcKeys, hi - kb);
    // Paged: the pool rows of the context keys this tile loads, [max(kb, lo), ctx_tokens).
    TilePages pages{};
    if (paged) {
      pages.Init(seg.block_table, seg.block_size, seg.first_slot, max(kb, lo),
                 min(kb + nk, seg.ctx_tokens));
    }
    __syncthreads();  // the previous tile's K, V and P are no longer read
    for (int idx = tid; idx < kTcKeys * half_hd; idx += kTcThreads) {
      const int jj = idx / half_hd, d = (idx - jj * half_hd) * 2;
      // Keys outside the block's range (before lo in a prefill's first aligned tile, past the
      // tile's end): zero K and V, never read (P = 0 there; memory before ctx_first may hold
      // anything, NaN included, and 0 · NaN would poison O).
      uint32_t kw = 0, vw = 0;
      if (jj < nk && kb + jj >= lo) {
        const int j = kb + jj;
        if (j < seg.ctx_tokens) {
          // Paged: through the block table; else a sliding layer's ring, or contiguous.
          const int64_t row = paged ? pages.Row(j) : seg.ring > 0 ? j % seg.ring : j;
          const int64_t off = (row * kv_heads + g) * hd + d;
          kw = LoadBf16Pair(seg.ctx_k + off);
          vw = LoadBf16Pair(seg.ctx_v + off);
        } else {
          const int64_t off = (int64_t(seg.row0 + j - seg.ctx_tokens) * kv_heads + g) * hd + d;
          kw = LoadBf16Pair(k_new + off);
          vw = LoadBf16Pair(v_new + off);
        }
      }
      *reinterpret_cast<uint32_t*>(ks + jj * stride + d) = kw;
      *reinterpret_cast<uint32_t*>(vs + jj * stride + d) = vw;
    }
    __syncthreads();

    // S = Q·Kᵀ (scale 1.0, spec §3.1.5) for keys [8·warp, 8·warp + 8) of the tile.
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < hd; k0 += 16) {
      uint32_t a[4], bk[2];
      mma::LdMatrixX4(a, qs + (lane % 16) * stride + k0 + (lane / 16) * 8);
      mma::LdMatrixX2(bk, ks + (warp * 8 + lane % 8) * stride + k0 + ((lane / 8) % 2) * 8);
      mma::MmaBf16M16N8K16(s, a, bk);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = gq + (i >= 2 ? 8 : 0), c = warp * 8 + 2 * t + (i % 2);
      bool visible = c < nk;
      if constexpr (kCausal) {
        const Range kr = PrefillKeys(row_of(r), seg.ctx_tokens, seg.ctx_first, window);
        visible = visible && kb + c >= kr.lo && kb + c < kr.hi;
      }
      ss[r * kTcKeys + c] = visible ? s[i] : -INFINITY;
    }
    __syncthreads();

    // Online softmax: row r by the 8 lanes 8r … 8r + 7 (one warp), 4 keys each.
    {
      const int r = tid / 8, c0 = (tid % 8) * 4;
      float v[4], mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = ss[r * kTcKeys + c0 + i];
        mx = fmaxf(mx, v[i]);
      }
      for (int x = 1; x < 8; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, x));
      const float m_old = m_s[r];
      // Canvas: finite (every tile has a visible key). Prefill: −inf while the row has seen no
      // visible key yet (its p are 0 and its alpha is 1).
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float pi = v[i] == -INFINITY ? 0.0f : expf(v[i] - m_new);
        sum += pi;
        ps[r * kTcPStride + c0 + i] = ToBf16Bits(pi);
      }
      for (int x = 1; x < 8; x <<= 1) sum += __shfl_xor_sync(kFull, sum, x);
      __syncwarp();  // every lane of the row has read m_s[r]
      if (tid % 8 == 0) {
        // m_old = −inf before the first visible key: alpha = 0 (1 while m_new is −inf too).
        const float alpha = m_old == m_new ? 1.0f : expf(m_old - m_new);
        a_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();

    // O ← alpha·O + P·V over this warp's columns.
    const float a_lo = a_s[gq], a_hi = a_s[gq + 8];
#pragma unroll
    for (int nt = 0; nt < kMaxTiles; ++nt) {
      o[nt][0] *= a_lo;
      o[nt][1] *= a_lo;
      o[nt][2] *= a_hi;
      o[nt][3] *= a_hi;
    }
    for (int k0 = 0; k0 < kTcKeys; k0 += 16) {
      uint32_t a[4];
      mma::LdMatrixX4(a, ps + (lane % 16) * kTcPStride + k0 + (lane / 16) * 8);
#pragma unroll
      for (int nt = 0; nt < kMaxTiles; ++nt) {
        if (nt < ntiles) {  // block-uniform
          uint32_t bv[2];
          mma::LdMatrixX2Trans(bv, vs + (k0 + lane % 16) * stride + n_base + nt * 8);
          mma::MmaBf16M16N8K16(o[nt], a, bv);
        }
      }
    }
  }

  if (!kCausal && partial != nullptr) {
    // Split-KV: this split's unnormalised O, m and l for the pairs of the segment.
    const int64_t rec = hd + 2;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = gq + 8 * half, p = p0 + r;
      if (p >= pairs) continue;
      float* prec =
          partial + ((int64_t(blockIdx.z) * total_rows + seg.row0 + p / group) * num_heads +
                     g * group + p % group) *
                        rec;
#pragma unroll
      for (int nt = 0; nt < kMaxTiles; ++nt) {
        if (nt < ntiles) {
          const int c = n_base + nt * 8 + 2 * t;
          prec[c] = o[nt][2 * half];
          prec[c + 1] = o[nt][2 * half + 1];
        }
      }
      if (warp == 0 && t == 0) {
        prec[hd] = m_s[r];
        prec[hd + 1] = l_s[r];
      }
    }
    return;
  }
  // out = O / l for the pairs of the segment (l > 0: every row saw at least its own key).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = gq + 8 * half, p = p0 + r;
    if (p >= pairs) continue;
    const float inv = 1.0f / l_s[r];
    float* orow = out + (int64_t(seg.row0 + p / group) * num_heads + g * group + p % group) * hd;
#pragma unroll
    for (int nt = 0; nt < kMaxTiles; ++nt) {
      if (nt < ntiles) {
        const int c = n_base + nt * 8 + 2 * t;
        orow[c] = o[nt][2 * half] * inv;
        orow[c + 1] = o[nt][2 * half + 1] * inv;
      }
    }
  }
}

// Split-KV's combine: block x serves canvas row x (rows of no segment: nothing), its threads
// the row's (head, dim) outputs. The segment's split slots 0 … count − 1 (every one non-empty:
// l ≥ 1) merge in ascending order: M = max m_z, L = Σ l_z·e^(m_z − M), O = Σ O_z·e^(m_z − M),
// out = O · (1 / L), the first slot starting the sums (one slot: exactly the unsplit O · (1 / l)).
// A segment needing more slots than max_splits (a caller's bound too small) gets NaN.
constexpr int kCombineThreads = 256;

template <typename TCtx>
__global__ void __launch_bounds__(kCombineThreads)
    CanvasCombineKernel(const CanvasSegmentOf<TCtx>* __restrict__ segs, int num_segments,
                        int total_rows, int num_heads, int hd, int split_keys, int max_splits,
                        const float* __restrict__ partial, float* __restrict__ out) {
  const int row = blockIdx.x;
  int si = 0;
  CanvasSegmentOf<TCtx> seg;
  for (; si < num_segments; ++si) {
    seg = segs[si];
    if (row >= seg.row0 && row < seg.row0 + seg.rows) break;
  }
  if (si == num_segments) return;
  const int count = CanvasSplits(seg.ctx_tokens, seg.ctx_first, split_keys).count;
  const int64_t rec = hd + 2, slot = int64_t(total_rows) * num_heads * rec;
  for (int idx = threadIdx.x; idx < num_heads * hd; idx += kCombineThreads) {
    const int h = idx / hd, d = idx - h * hd;
    const float* base = partial + (int64_t(row) * num_heads + h) * rec;
    float res = NAN;
    if (count <= max_splits) {
      float mx = -INFINITY;
      for (int z = 0; z < count; ++z) mx = fmaxf(mx, base[z * slot + hd]);
      float e = expf(base[hd] - mx);
      float sum = base[hd + 1] * e, acc = base[d] * e;
      for (int z = 1; z < count; ++z) {
        const float* pz = base + z * slot;
        e = expf(pz[hd] - mx);
        sum = sum + pz[hd + 1] * e;
        acc = acc + pz[d] * e;
      }
      const float inv = 1.0f / sum;
      res = acc * inv;
    }
    out[(int64_t(row) * num_heads + h) * hd + d] = res;
  }
}

// max_splits > 1 (canvas only): split-KV into `partial`, then the combine (both on `stream`).
template <int kMaxTiles, bool kCausal, typename TCtx>
absl::Status LaunchTc(const char* name, const float* q, const float* k_new, const float* v_new,
                      const CanvasSegmentOf<TCtx>* segs, int num_segments, int total_rows,
                      int num_heads, int kv_heads, int head_dim, int window, int max_splits,
                      int split_keys, float* partial, float* out, void* stream) {
  const auto kernel = TcAttentionKernel<kMaxTiles, kCausal, TCtx>;
  const size_t bytes = size_t(TcSharedLayout(head_dim).total);
  if (absl::Status st = AllowSharedBytes(kernel, bytes, name); !st.ok()) return st;
  const int group = num_heads / kv_heads;
  const int64_t blocks = (int64_t(total_rows) * group + kTcPairs - 1) / kTcPairs + num_segments;
  const bool split = max_splits > 1;
  const dim3 grid{unsigned(blocks), unsigned(kv_heads), unsigned(split ? max_splits : 1)};
  const auto s = static_cast<cudaStream_t>(stream);
  LaunchKernel(kernel, grid, kTcThreads, bytes, s, q, k_new, v_new, segs, num_segments, num_heads,
               kv_heads, group, head_dim, window, out, split_keys, total_rows,
               split ? partial : nullptr);
  if constexpr (!kCausal) {
    if (split) {
      LaunchKernel(CanvasCombineKernel<TCtx>, dim3(unsigned(total_rows)), kCombineThreads, 0, s,
                   segs, num_segments, total_rows, num_heads, head_dim, split_keys, max_splits,
                   static_cast<const float*>(partial), out);
    }
  }
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(name) + ": " + cudaGetErrorString(e));
}

// The argument checks and head-dim dispatch of both tensor-core entry points.
template <bool kCausal, typename TCtx>
absl::Status TensorCoreAttention(const char* name, const float* q, const float* k_new,
                                 const float* v_new, const CanvasSegmentOf<TCtx>* segments,
                                 int num_segments, int total_rows, int num_heads, int kv_heads,
                                 int head_dim, int window, int max_splits, int split_keys,
                                 void* scratch, float* out, void* stream) {
  const std::string n = name;
  if (num_segments < 0 || total_rows < 0 || num_heads <= 0 || kv_heads <= 0 ||
      num_heads % kv_heads != 0) {
    return absl::InvalidArgumentError(
        n + ": need num_segments, total_rows ≥ 0 and num_heads a multiple of kv_heads");
  }
  if (head_dim <= 0 || head_dim > kMaxAttentionHeadDim || head_dim % 32 != 0) {
    return absl::InvalidArgumentError(n + ": head_dim must be a multiple of 32 in [32, 512]");
  }
  if (max_splits < 1 || max_splits > 65535 || split_keys <= 0 || split_keys % kTcKeys != 0) {
    return absl::InvalidArgumentError(
        n + ": need max_splits in [1, 65535] and split_keys a positive multiple of 32");
  }
  if (num_segments == 0 || total_rows == 0) return absl::OkStatus();
  if (q == nullptr || k_new == nullptr || v_new == nullptr || out == nullptr ||
      segments == nullptr || (max_splits > 1 && scratch == nullptr)) {
    return absl::InvalidArgumentError(n + ": null pointer");
  }
  if (int64_t(total_rows) * (num_heads / kv_heads) + num_segments > int64_t(INT32_MAX) / 2) {
    return absl::InvalidArgumentError(n + ": too many rows");
  }
  float* partial = static_cast<float*>(scratch);
  if (head_dim <= 256) {
    return LaunchTc<8, kCausal, TCtx>(name, q, k_new, v_new, segments, num_segments, total_rows,
                                      num_heads, kv_heads, head_dim, window, max_splits, split_keys,
                                      partial, out, stream);
  }
  return LaunchTc<16, kCausal, TCtx>(name, q, k_new, v_new, segments, num_segments, total_rows,
                                     num_heads, kv_heads, head_dim, window, max_splits, split_keys,
                                     partial, out, stream);
}

}  // namespace

namespace {

template <typename TCtx>
absl::Status CheckSegment(const CanvasSegmentOf<TCtx>& s) {
  if (s.rows < 0 || s.ctx_first < 0 || s.ctx_first > s.ctx_tokens) {
    return absl::InvalidArgumentError(
        "CheckCanvasSegment: need rows ≥ 0 and 0 ≤ ctx_first ≤ ctx_tokens");
  }
  if (s.ring < 0 || (s.ring > 0 && s.block_table != nullptr)) {
    return absl::InvalidArgumentError(
        "CheckCanvasSegment: a context is a ring (ring > 0) or paged (block_table), not both");
  }
  if (s.block_table != nullptr &&
      (s.block_size <= 0 || s.first_slot < 0 ||
       int64_t(s.first_slot) + s.ctx_tokens + s.block_size > int64_t(INT32_MAX))) {
    return absl::InvalidArgumentError(
        "CheckCanvasSegment: a paged context needs block_size > 0 and slots in [0, 2^31)");
  }
  const int visible = s.ctx_tokens - s.ctx_first;
  if (s.ring > 0 && s.ring < visible) {
    return absl::InvalidArgumentError(
        "CheckCanvasSegment: a ring needs ring ≥ ctx_tokens − ctx_first");
  }
  if (visible > 0 && (s.ctx_k == nullptr || s.ctx_v == nullptr)) {
    return absl::InvalidArgumentError("CheckCanvasSegment: null context K/V");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCanvasSegment(const CanvasSegment& segment) { return CheckSegment(segment); }

absl::Status CheckCanvasSegment(const CanvasSegmentBf16& segment) { return CheckSegment(segment); }

int CanvasSplitCount(int ctx_tokens, int ctx_first, int split_keys) {
  return CanvasSplits(ctx_tokens, ctx_first, split_keys).count;
}

size_t TensorCoreCanvasScratchBytes(int total_rows, int num_heads, int head_dim, int max_splits) {
  if (max_splits <= 1 || total_rows <= 0) return 0;
  return sizeof(float) * size_t(max_splits) * size_t(total_rows) * size_t(num_heads) *
         size_t(head_dim + 2);
}

namespace {

template <typename TCtx>
absl::Status CanvasEntry(const float* q, const float* k_new, const float* v_new,
                         const CanvasSegmentOf<TCtx>* segments, int num_segments, int total_rows,
                         int num_heads, int kv_heads, int head_dim, int max_splits, int split_keys,
                         void* scratch, float* out, void* stream) {
  return TensorCoreAttention<false>("TensorCoreCanvasAttention", q, k_new, v_new, segments,
                                    num_segments, total_rows, num_heads, kv_heads, head_dim,
                                    /*window=*/0, max_splits, split_keys, scratch, out, stream);
}

template <typename TCtx>
absl::Status PrefillEntry(const float* q, const float* k_new, const float* v_new,
                          const CanvasSegmentOf<TCtx>* segments, int num_segments, int total_rows,
                          int num_heads, int kv_heads, int head_dim, int window, float* out,
                          void* stream) {
  return TensorCoreAttention<true>("TensorCorePrefillAttention", q, k_new, v_new, segments,
                                   num_segments, total_rows, num_heads, kv_heads, head_dim, window,
                                   /*max_splits=*/1, kTcKeys, /*scratch=*/nullptr, out, stream);
}

}  // namespace

absl::Status TensorCoreCanvasAttention(const float* q, const float* k_new, const float* v_new,
                                       const CanvasSegment* segments, int num_segments,
                                       int total_rows, int num_heads, int kv_heads, int head_dim,
                                       float* out, void* stream) {
  return CanvasEntry(q, k_new, v_new, segments, num_segments, total_rows, num_heads, kv_heads,
                     head_dim, /*max_splits=*/1, kCanvasSplitKeys, /*scratch=*/nullptr, out,
                     stream);
}

absl::Status TensorCoreCanvasAttention(const float* q, const float* k_new, const float* v_new,
                                       const CanvasSegmentBf16* segments, int num_segments,
                                       int total_rows, int num_heads, int kv_heads, int head_dim,
                                       float* out, void* stream) {
  return CanvasEntry(q, k_new, v_new, segments, num_segments, total_rows, num_heads, kv_heads,
                     head_dim, /*max_splits=*/1, kCanvasSplitKeys, /*scratch=*/nullptr, out,
                     stream);
}

absl::Status TensorCoreCanvasAttention(const float* q, const float* k_new, const float* v_new,
                                       const CanvasSegment* segments, int num_segments,
                                       int total_rows, int num_heads, int kv_heads, int head_dim,
                                       int max_splits, int split_keys, void* scratch, float* out,
                                       void* stream) {
  return CanvasEntry(q, k_new, v_new, segments, num_segments, total_rows, num_heads, kv_heads,
                     head_dim, max_splits, split_keys, scratch, out, stream);
}

absl::Status TensorCoreCanvasAttention(const float* q, const float* k_new, const float* v_new,
                                       const CanvasSegmentBf16* segments, int num_segments,
                                       int total_rows, int num_heads, int kv_heads, int head_dim,
                                       int max_splits, int split_keys, void* scratch, float* out,
                                       void* stream) {
  return CanvasEntry(q, k_new, v_new, segments, num_segments, total_rows, num_heads, kv_heads,
                     head_dim, max_splits, split_keys, scratch, out, stream);
}

absl::Status TensorCorePrefillAttention(const float* q, const float* k_new, const float* v_new,
                                        const PrefillSegment* segments, int num_segments,
                                        int total_rows, int num_heads, int kv_heads, int head_dim,
                                        int window, float* out, void* stream) {
  return PrefillEntry(q, k_new, v_new, segments, num_segments, total_rows, num_heads, kv_heads,
                      head_dim, window, out, stream);
}

absl::Status TensorCorePrefillAttention(const float* q, const float* k_new, const float* v_new,
                                        const PrefillSegmentBf16* segments, int num_segments,
                                        int total_rows, int num_heads, int kv_heads, int head_dim,
                                        int window, float* out, void* stream) {
  return PrefillEntry(q, k_new, v_new, segments, num_segments, total_rows, num_heads, kv_heads,
                      head_dim, window, out, stream);
}

}  // namespace dgserve::cuda
