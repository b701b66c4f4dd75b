// The float32 attention kernels: PrefillAttention, CanvasAttention and CanvasAttentionTable
// (cuda_attention.h). The tensor-core ones are in cuda_attention_tc.cu.
#include "engine/cuda/cuda_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "engine/cuda/cuda_attention_common.cuh"
#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"

namespace dgserve::cuda {
namespace {

using attention_internal::AllowSharedBytes;
using attention_internal::kFull;
using attention_internal::Range;

// Layout of one launch:
//   grid  = (ceil(rows · group / kWarps), kv_heads), block = kWarps warps (256 threads);
//   block (x, g) serves KV head g and kWarps consecutive (row, query head of g's group) pairs,
//   pair p = row · group + (h − g · group), one warp per pair. The block walks its key range in
//   tiles of kTileKeys keys: the tile's K and V rows (of KV head g) are staged in shared memory
//   once and used by all its warps. Within a warp, lane j scores key j of the tile (a full
//   head_dim dot product against the warp's query, kept in shared memory), the warp updates its
//   running max m and sum l (online softmax), and lane j accumulates output dims j, j+32, … in
//   registers (kPerLane of them: head_dim ≤ 32·kPerLane).
// Dynamic shared memory (floats): K tile kTileKeys·(head_dim+1) (the +1 pad makes lane j's row
// start in bank j·(head_dim+1) mod 32, distinct for even head_dim, so the per-lane dot products
// are conflict-free), V tile kTileKeys·head_dim, queries kWarps·head_dim; head_dim 512:
// 147,584 bytes (above the 48 KiB default: opted in with cudaFuncSetAttribute; H100/H200 allow
// 227 KiB per block).
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = 32;  // one key per lane

enum Mode : int { kPrefill = 0, kCanvas = 1 };

struct Keys {
  const float* ctx_k;
  const float* ctx_v;
  int ctx_tokens;
  const int32_t* block_table;
  int block_size;
  int first_slot;
  int ring;  // > 0: the context is a ring of `ring` rows (KvContext)
  const float* new_k;
  const float* new_v;
  int rows;  // new tokens (= query rows)
  int kv_heads;
  int head_dim;
  // The bf16 rounding mode (cuda_attention.h): q, K and V rounded to bf16 on load, P·V on bf16(p).
  bool round_bf16;
  // Prefill: (position of key 0) mod kTileKeys; the key tiles start at positions multiple of
  // kTileKeys (KvContext::position0).
  int tile_shift;
};

size_t SharedBytes(int head_dim) {
  return sizeof(float) * (size_t(kTileKeys) * (head_dim + 1) + size_t(kTileKeys) * head_dim +
                          size_t(kWarps) * head_dim);
}

// Keys [lo, hi) (indices into [context ++ new]) visible to query row r.
__device__ __forceinline__ Range KeyRange(int mode, int r, int ctx, int rows, int window) {
  if (mode == kPrefill) {
    const int hi = ctx + r + 1;
    return {window > 0 ? max(0, hi - window) : 0, hi};
  }
  return {window > 0 ? max(0, ctx - (window - 1)) : 0, ctx + rows};
}

// Element offset of key j's row for KV head g: into the context arrays when j < ctx_tokens,
// else into the new arrays.
__device__ __forceinline__ int64_t KeyRowOffset(const Keys& s, int j, int g) {
  int64_t row;
  if (j < s.ctx_tokens) {
    if (s.block_table != nullptr) {
      const int slot = s.first_slot + j;
      row = int64_t(s.block_table[slot / s.block_size]) * s.block_size + slot % s.block_size;
    } else if (s.ring > 0) {
      row = (s.first_slot + j) % s.ring;
    } else {
      row = j;
    }
  } else {
    row = j - s.ctx_tokens;
  }
  return (row * s.kv_heads + g) * s.head_dim;
}

// x as the tensor-core kernels round it (ToBf16Bits: nearest even, NaN kept) when `round`, else x.
__device__ __forceinline__ float MaybeBf16(float x, bool round) {
  return round ? Bf16BitsToFloat(ToBf16Bits(x)) : x;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// One block of AttentionKernel: `bx` is its index along the (row, query head) pairs.
template <int kPerLane>
__device__ __forceinline__ void AttentionBlock(const float* __restrict__ q, const Keys& keys,
                                               int num_heads, int group, int mode, int window,
                                               float* __restrict__ out, int64_t bx) {
  float* smem = DynamicShared<float>();
  const int hd = keys.head_dim, kstride = hd + 1;
  float* k_s = smem;                          // [kTileKeys][hd + 1]
  float* v_s = k_s + kTileKeys * kstride;     // [kTileKeys][hd]
  float* q_s = v_s + kTileKeys * hd;          // [kWarps][hd]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = blockIdx.y;
  const int64_t pairs = int64_t(keys.rows) * group;
  const int64_t p0 = bx * kWarps;
  const int64_t p = p0 + warp;
  const bool active = p < pairs;  // warp-uniform
  const int row = active ? int(p / group) : 0;
  const int head = g * group + (active ? int(p % group) : 0);

  // The block's key range: the union over its rows (lo and hi are non-decreasing in r).
  const int block_lo = KeyRange(mode, int(p0 / group), keys.ctx_tokens, keys.rows, window).lo;
  const int block_hi = KeyRange(mode, int((min(p0 + kWarps, pairs) - 1) / group),
                                keys.ctx_tokens, keys.rows, window).hi;
  const Range own = KeyRange(mode, row, keys.ctx_tokens, keys.rows, window);
  const int lo = own.lo, hi = own.hi;

  float* qw = q_s + warp * hd;
  const float* qrow = q + (int64_t(row) * num_heads + head) * hd;
  const bool rb = keys.round_bf16;
  for (int d = lane; d < hd; d += 32) qw[d] = active ? MaybeBf16(qrow[d], rb) : 0.0f;
  // (made visible to the warp by the __syncthreads() after the first tile load)

  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  // Prefill: tiles of the running max at positions multiple of kTileKeys (as the tensor-core
  // kernel's), so a row's tiles do not depend on its block; the canvas: from its first key.
  const int kb0 = mode == kPrefill ? block_lo - (block_lo + keys.tile_shift) % kTileKeys : block_lo;
  for (int kb = kb0; kb < block_hi; kb += kTileKeys) {
    const int nk = min(kTileKeys, block_hi - kb);
    __syncthreads();  // every warp is done with the previous tile
    for (int idx = threadIdx.x; idx < nk * hd; idx += kThreads) {
      const int jj = idx / hd, d = idx - jj * hd;
      if (kb + jj < block_lo) {  // before every row's keys (never read: p = 0 there)
        k_s[jj * kstride + d] = 0.0f;
        v_s[jj * hd + d] = 0.0f;
        continue;
      }
      const bool from_ctx = kb + jj < keys.ctx_tokens;
      const int64_t off = KeyRowOffset(keys, kb + jj, g);
      k_s[jj * kstride + d] = MaybeBf16((from_ctx ? keys.ctx_k : keys.new_k)[off + d], rb);
      v_s[jj * hd + d] = MaybeBf16((from_ctx ? keys.ctx_v : keys.new_v)[off + d], rb);
    }
    __syncthreads();
    // Warp-uniform skip of tiles entirely outside this warp's own range.
    if (!active || kb >= hi || kb + nk <= lo) continue;

    const int j = kb + lane;
    float s = -INFINITY;
    if (lane < nk && j >= lo && j < hi) {
      const float* kr = k_s + lane * kstride;
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
      int d = 0;
      for (; d + 4 <= hd; d += 4) {
        s0 = fmaf(qw[d], kr[d], s0);
        s1 = fmaf(qw[d + 1], kr[d + 1], s1);
        s2 = fmaf(qw[d + 2], kr[d + 2], s2);
        s3 = fmaf(qw[d + 3], kr[d + 3], s3);
      }
      for (; d < hd; ++d) s0 = fmaf(qw[d], kr[d], s0);
      s = (s0 + s1) + (s2 + s3);  // scale 1.0 (spec §3.1.5)
    }
    const float tile_max = WarpMax(s);
    if (tile_max == -INFINITY) continue;  // no visible key in this tile (warp-uniform)
    const float new_m = fmaxf(m, tile_max);
    const float alpha = expf(m - new_m);  // m = −inf before the first visible key: alpha = 0
    const float pj = s == -INFINITY ? 0.0f : expf(s - new_m);
    l = l * alpha + WarpSum(pj);         // the unrounded p (as the tensor-core kernels' l)
    const float pv = MaybeBf16(pj, rb);  // the p that multiplies V
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] *= alpha;
    for (int jj = 0; jj < nk; ++jj) {
      const float pk = __shfl_sync(kFull, pv, jj);
      if (pk == 0.0f) continue;  // masked (or underflowed) key: warp-uniform
      const float* vr = v_s + jj * hd;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) acc[i] = fmaf(pk, vr[d], acc[i]);
      }
    }
    m = new_m;
  }

  if (!active) return;  // after the last __syncthreads()
  float* orow = out + (int64_t(row) * num_heads + head) * hd;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // l = 0 only without any visible key
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < hd) orow[d] = acc[i] * inv;
  }
}

template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    AttentionKernel(const float* __restrict__ q, Keys keys, int num_heads, int group, int mode,
                    int window, float* __restrict__ out) {
  AttentionBlock<kPerLane>(q, keys, num_heads, group, mode, window, out, blockIdx.x);
}

// CanvasAttentionTable: segment blockIdx.z of the table, as CanvasAttention would run it alone
// (context from ctx_first, its rows' q / k_new / v_new / out); blocks past its rows return.
template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    CanvasTableKernel(const float* __restrict__ q, const float* __restrict__ k_new,
                      const float* __restrict__ v_new, const CanvasSegment* __restrict__ table,
                      int num_heads, int kv_heads, int head_dim, int window, bool round_bf16,
                      float* __restrict__ out) {
  const CanvasSegment seg = table[blockIdx.z];
  const int group = num_heads / kv_heads;
  if (int64_t(blockIdx.x) * kWarps >= int64_t(seg.rows) * group) return;  // block-uniform
  const int64_t kvw = int64_t(kv_heads) * head_dim, qw = int64_t(num_heads) * head_dim;
  Keys keys;
  keys.ctx_tokens = seg.ctx_tokens - seg.ctx_first;
  // Contiguous: the arrays from token ctx_first. Ring: from row 0, token j of the window (position
  // ctx_first + j) in row (ctx_first + j) % ring (KeyRowOffset). Paged: the pool from block 0,
  // token j of the window in slot first_slot + ctx_first + j (KeyRowOffset).
  const bool paged = seg.block_table != nullptr;
  const int64_t ctx_row0 = seg.ring > 0 || paged ? 0 : seg.ctx_first;
  keys.ctx_k = keys.ctx_tokens > 0 ? seg.ctx_k + ctx_row0 * kvw : nullptr;
  keys.ctx_v = keys.ctx_tokens > 0 ? seg.ctx_v + ctx_row0 * kvw : nullptr;
  keys.block_table = seg.block_table;
  keys.block_size = seg.block_size;
  keys.first_slot = paged ? seg.first_slot + seg.ctx_first : seg.ring > 0 ? seg.ctx_first : 0;
  keys.ring = paged ? 0 : seg.ring;
  keys.new_k = k_new + seg.row0 * kvw;
  keys.new_v = v_new + seg.row0 * kvw;
  keys.rows = seg.rows;
  keys.kv_heads = kv_heads;
  keys.head_dim = head_dim;
  keys.round_bf16 = round_bf16;
  keys.tile_shift = 0;
  AttentionBlock<kPerLane>(q + seg.row0 * qw, keys, num_heads, group, kCanvas, window,
                           out + seg.row0 * qw, blockIdx.x);
}

template <int kPerLane>
absl::Status Launch(const float* q, const Keys& keys, int num_heads, int group, int mode,
                    int window, float* out, void* stream, const char* name) {
  const size_t bytes = SharedBytes(keys.head_dim);
  if (absl::Status st = AllowSharedBytes(AttentionKernel<kPerLane>, bytes, name); !st.ok()) {
    return st;
  }
  const int64_t pairs = int64_t(keys.rows) * group;
  const dim3 grid(unsigned((pairs + kWarps - 1) / kWarps), unsigned(keys.kv_heads));
  LaunchKernel(AttentionKernel<kPerLane>, grid, kThreads, bytes, static_cast<cudaStream_t>(stream),
               q, keys, num_heads, group, mode, window, out);
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(name) + ": " + cudaGetErrorString(e));
}

absl::Status Attention(int mode, const char* name, const float* q, const float* k_new,
                       const float* v_new, int rows, const KvContext& ctx, int num_heads,
                       int kv_heads, int head_dim, int window, float* out, void* stream,
                       bool round_bf16) {
  const std::string n = name;
  if (rows < 0 || num_heads <= 0 || kv_heads <= 0 || num_heads % kv_heads != 0) {
    return absl::InvalidArgumentError(n + ": need rows ≥ 0 and num_heads a multiple of kv_heads");
  }
  if (head_dim <= 0 || head_dim > kMaxAttentionHeadDim) {
    return absl::InvalidArgumentError(n + ": head_dim must be in [1, 512]");
  }
  if (ctx.tokens < 0 || (ctx.tokens > 0 && (ctx.k == nullptr || ctx.v == nullptr)) ||
      (ctx.tokens > 0 && ctx.block_table != nullptr &&
       (ctx.block_size <= 0 || ctx.first_slot < 0 || ctx.ring != 0)) ||
      (ctx.tokens > 0 && ctx.ring != 0 && (ctx.ring < ctx.tokens || ctx.first_slot < 0)) ||
      ctx.position0 < 0) {
    return absl::InvalidArgumentError(n + ": bad context K/V");
  }
  if (rows == 0) return absl::OkStatus();
  if (q == nullptr || k_new == nullptr || v_new == nullptr || out == nullptr) {
    return absl::InvalidArgumentError(n + ": null pointer");
  }
  if (int64_t(rows) * (num_heads / kv_heads) > int64_t(INT32_MAX) * kWarps / 2) {
    return absl::InvalidArgumentError(n + ": too many rows");
  }
  Keys keys;
  keys.ctx_k = ctx.k;
  keys.ctx_v = ctx.v;
  keys.ctx_tokens = ctx.tokens;
  keys.block_table = ctx.tokens > 0 ? ctx.block_table : nullptr;
  keys.block_size = ctx.block_size;
  keys.first_slot = ctx.first_slot;
  keys.ring = ctx.tokens > 0 && ctx.block_table == nullptr ? ctx.ring : 0;
  keys.new_k = k_new;
  keys.new_v = v_new;
  keys.rows = rows;
  keys.kv_heads = kv_heads;
  keys.head_dim = head_dim;
  keys.round_bf16 = round_bf16;
  keys.tile_shift = ctx.position0 % kTileKeys;
  const int group = num_heads / kv_heads;
  if (head_dim <= 32) return Launch<1>(q, keys, num_heads, group, mode, window, out, stream, name);
  if (head_dim <= 64) return Launch<2>(q, keys, num_heads, group, mode, window, out, stream, name);
  if (head_dim <= 128) {
    return Launch<4>(q, keys, num_heads, group, mode, window, out, stream, name);
  }
  if (head_dim <= 256) {
    return Launch<8>(q, keys, num_heads, group, mode, window, out, stream, name);
  }
  return Launch<16>(q, keys, num_heads, group, mode, window, out, stream, name);
}

template <int kPerLane>
absl::Status LaunchTable(const float* q, const float* k_new, const float* v_new,
                         const CanvasSegment* table, int num_segments, int max_rows, int num_heads,
                         int kv_heads, int head_dim, int window, bool round_bf16, float* out,
                         void* stream) {
  const char* name = "CanvasAttentionTable";
  const size_t bytes = SharedBytes(head_dim);
  if (absl::Status st = AllowSharedBytes(CanvasTableKernel<kPerLane>, bytes, name); !st.ok()) {
    return st;
  }
  const int64_t pairs = int64_t(max_rows) * (num_heads / kv_heads);
  const dim3 grid(unsigned((pairs + kWarps - 1) / kWarps), unsigned(kv_heads),
                  unsigned(num_segments));
  LaunchKernel(CanvasTableKernel<kPerLane>, grid, kThreads, bytes,
               static_cast<cudaStream_t>(stream), q, k_new, v_new, table, num_heads, kv_heads,
               head_dim, window, round_bf16, out);
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(name) + ": " + cudaGetErrorString(e));
}

}  // namespace

absl::Status PrefillAttention(const float* q, const float* k_new, const float* v_new, int rows,
                              const KvContext& context, int num_heads, int kv_heads, int head_dim,
                              int window, float* out, void* stream, bool round_bf16) {
  return Attention(kPrefill, "PrefillAttention", q, k_new, v_new, rows, context, num_heads,
                   kv_heads, head_dim, window, out, stream, round_bf16);
}

absl::Status CanvasAttention(const float* q, const float* k_new, const float* v_new, int rows,
                             const KvContext& context, int num_heads, int kv_heads, int head_dim,
                             int window, float* out, void* stream, bool round_bf16) {
  return Attention(kCanvas, "CanvasAttention", q, k_new, v_new, rows, context, num_heads, kv_heads,
                   head_dim, window, out, stream, round_bf16);
}

int CanvasWindowStart(int ctx_tokens, int window) {
  return window > 0 ? std::max(0, ctx_tokens - (window - 1)) : 0;
}

absl::Status CanvasAttentionTable(const float* q, const float* k_new, const float* v_new,
                                  const CanvasSegment* segments, int num_segments, int max_rows,
                                  int num_heads, int kv_heads, int head_dim, int window, float* out,
                                  void* stream, bool round_bf16) {
  if (num_segments < 0 || max_rows < 0 || num_heads <= 0 || kv_heads <= 0 ||
      num_heads % kv_heads != 0 || head_dim <= 0 || head_dim > kMaxAttentionHeadDim) {
    return absl::InvalidArgumentError(
        "CanvasAttentionTable: need num_segments, max_rows ≥ 0, num_heads a multiple of "
        "kv_heads and head_dim in [1, 512]");
  }
  if (num_segments == 0 || max_rows == 0) return absl::OkStatus();
  if (q == nullptr || k_new == nullptr || v_new == nullptr || out == nullptr ||
      segments == nullptr) {
    return absl::InvalidArgumentError("CanvasAttentionTable: null pointer");
  }
  if (num_segments > 65535 ||
      int64_t(max_rows) * (num_heads / kv_heads) > int64_t(INT32_MAX) * kWarps / 2) {
    return absl::InvalidArgumentError("CanvasAttentionTable: too many segments or rows");
  }
  const auto launch = [&](auto per_lane) {
    return LaunchTable<decltype(per_lane)::value>(q, k_new, v_new, segments, num_segments, max_rows,
                                                  num_heads, kv_heads, head_dim, window, round_bf16,
                                                  out, stream);
  };
  if (head_dim <= 32) return launch(std::integral_constant<int, 1>{});
  if (head_dim <= 64) return launch(std::integral_constant<int, 2>{});
  if (head_dim <= 128) return launch(std::integral_constant<int, 4>{});
  if (head_dim <= 256) return launch(std::integral_constant<int, 8>{});
  return launch(std::integral_constant<int, 16>{});
}

}  // namespace dgserve::cuda
