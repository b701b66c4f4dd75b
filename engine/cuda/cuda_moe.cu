#include "engine/cuda/cuda_moe.h"

#include <math.h>

#include <string>

#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_launch.cuh"
#include "engine/cuda/cuda_mma.cuh"

namespace dgserve::cuda {
namespace {

int Blocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return int(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

// ---- exp: glibc's expf (sysdeps/ieee754/flt-32/e_expf.c with e_exp2f_data.c, table bits 5) ----
// exp(x) = 2^(k/32) · 2^(r/32) with k = round(x·32/ln2), the 2^(r/32) factor a cubic in double,
// one rounding to float at the end. Written with explicit _rn double operations (no
// contraction), as glibc's generic build; its FMA build can round differently only when the
// double result lies within a few double ulps of a float rounding boundary.

// 2^(i/32) as binary64 bits minus i << 47 (glibc's __exp2f_data.tab).
__device__ const uint64_t kExp2fTable[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull,
};

__device__ __forceinline__ float ExpF(float x) {
  constexpr double kInvLn2N = 0x1.71547652b82fep+0 * 32;
  constexpr double kShift = 0x1.8p+52;
  constexpr double kC0 = 0x1.c6af84b912394p-5 / 32 / 32 / 32;
  constexpr double kC1 = 0x1.ebfce50fac4f3p-3 / 32 / 32;
  constexpr double kC2 = 0x1.62e42ff0c52d6p-1 / 32;
  const uint32_t ux = __float_as_uint(x);
  const uint32_t abstop = (ux >> 20) & 0x7ffu;
  if (abstop >= 0x42bu) {                                        // |x| ≥ 88 or NaN
    if (ux == 0xff800000u) return 0.0f;                          // −∞
    if (abstop >= 0x7f8u) return x + x;                          // +∞, NaN
    if (x > 0x1.62e42ep6f) return __uint_as_float(0x7f800000u);  // overflow
    if (x < -0x1.9fe368p6f) return 0.0f;                         // underflow
  }
  const double z = __dmul_rn(kInvLn2N, double(x));
  double kd = __dadd_rn(z, kShift);  // round to integer, ties to even
  const uint64_t ki = uint64_t(__double_as_longlong(kd));
  kd = __dadd_rn(kd, -kShift);
  const double r = __dadd_rn(z, -kd);
  const uint64_t t = kExp2fTable[ki % 32] + (ki << 47);
  const double s = __longlong_as_double((long long)t);
  const double zz = __dadd_rn(__dmul_rn(kC0, r), kC1);
  const double r2 = __dmul_rn(r, r);
  double y = __dadd_rn(__dmul_rn(kC2, r), 1.0);
  y = __dadd_rn(__dmul_rn(zz, r2), y);
  y = __dmul_rn(y, s);
  return float(y);
}

__global__ void ExpKernel(const float* x, int64_t n, float* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = ExpF(x[i]);
  }
}

// ---- Routing ------------------------------------------------------------------------------------

// The order of RouteTopK's partial_sort: a before b when its probability is larger, ties to
// the lower expert id.
__device__ __forceinline__ bool Before(float pa, int a, float pb, int b) {
  return pa > pb || (pa == pb && a < b);
}

constexpr int kRouteWarps = 4;  // rows per block, one warp each

// One warp per row; per warp E floats (probabilities) and E ints (rank of a chosen expert, or
// −1) of dynamic shared memory.
__global__ void MoeRouteKernel(const float* scores, int rows, int E, int k,
                               const float* per_expert_scale, int32_t* expert, float* weight) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* p = DynamicShared<float>() + warp * E;
  int* rank = reinterpret_cast<int*>(DynamicShared<float>() + kRouteWarps * E) + warp * E;
  const int row = blockIdx.x * kRouteWarps + warp;
  if (row >= rows) return;  // the whole warp
  const float* s = scores + int64_t(row) * E;
  // Softmax as the CPU: the max (exact in any order), exp, a float32 sum in expert order.
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, s[e]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  for (int e = lane; e < E; e += 32) {
    p[e] = ExpF(s[e] - mx);
    rank[e] = -1;
  }
  __syncwarp();
  float sum = 0.0f;
  if (lane == 0) {
    for (int e = 0; e < E; ++e) sum = __fadd_rn(sum, p[e]);
  }
  sum = __shfl_sync(0xffffffffu, sum, 0);
  for (int e = lane; e < E; e += 32) p[e] = __fdiv_rn(p[e], sum);
  __syncwarp();
  // Top-k: round t takes the first expert in Before's order among those not yet taken (with NaN
  // probabilities, where Before is no order, still k distinct experts: the lowest ids first).
  float top = 0.0f;
  for (int t = 0; t < k; ++t) {
    float bp = 0.0f;
    int be = -1;
    for (int e = lane; e < E; e += 32) {
      if (rank[e] >= 0) continue;
      const float pe = p[e];
      if (be < 0 || Before(pe, e, bp, be)) {
        bp = pe;
        be = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float op = __shfl_xor_sync(0xffffffffu, bp, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (oe >= 0 && (be < 0 || Before(op, oe, bp, be))) {
        bp = op;
        be = oe;
      }
    }
    bp = __shfl_sync(0xffffffffu, bp, 0);  // lane 0's pick for all (the same without NaN)
    be = __shfl_sync(0xffffffffu, be, 0);
    if (lane == 0) rank[be] = t;
    __syncwarp();
    top = __fadd_rn(top, bp);  // Σ_top p in descending order, as the CPU
  }
  // Out in ascending expert id: w = p / Σ_top · per_expert_scale.
  int base = 0;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const bool chosen = e < E && rank[e] >= 0;
    const unsigned m = __ballot_sync(0xffffffffu, chosen);
    if (chosen) {
      const int j = base + __popc(m & ((1u << lane) - 1u));
      expert[int64_t(row) * k + j] = e;
      weight[int64_t(row) * k + j] = __fmul_rn(__fdiv_rn(p[e], top), per_expert_scale[e]);
    }
    base += __popc(m);
  }
}

// Sum of v over the block (blockDim.x a multiple of 32, ≤ 1024); `scratch` holds 32 ints.
__device__ int BlockSum(int v, int* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  int t = 0;
  for (int w = 0; w < int(blockDim.x / 32); ++w) t += scratch[w];
  __syncthreads();
  return t;
}

// One block per expert e. Pass 1: its offset = the choices of lower experts (each row's ids are
// ascending, so that is the exclusive scan of the per-expert counts), and its count. Pass 2: its
// rows in ascending order, placed by a block-wide prefix sum over the rows that chose e.
__global__ void MoeGroupKernel(const int32_t* expert, const float* weight, int rows, int E, int k,
                               int32_t* offsets, int32_t* gather, int32_t* slot,
                               float* slot_weight) {
  __shared__ int scratch[32];
  const int e = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int below = 0, mine = 0;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int32_t* ids = expert + int64_t(r) * k;
    for (int j = 0; j < k; ++j) {
      below += ids[j] < e;
      mine += ids[j] == e;
    }
  }
  below = BlockSum(below, scratch);
  mine = BlockSum(mine, scratch);
  if (threadIdx.x == 0) {
    offsets[e] = below;
    if (e == E - 1) offsets[E] = below + mine;
  }
  int base = below;
  for (int r0 = 0; r0 < rows; r0 += blockDim.x) {
    const int r = r0 + threadIdx.x;
    int j = -1;
    if (r < rows) {
      const int32_t* ids = expert + int64_t(r) * k;
      for (int jj = 0; jj < k; ++jj) {
        if (ids[jj] == e) j = jj;
      }
    }
    const unsigned m = __ballot_sync(0xffffffffu, j >= 0);
    if (lane == 0) scratch[warp] = __popc(m);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < int(blockDim.x / 32); ++w) {
      total += scratch[w];
      if (w < warp) before += scratch[w];
    }
    if (j >= 0) {
      const int pos = base + before + __popc(m & ((1u << lane) - 1u));
      gather[pos] = r;
      slot[int64_t(r) * k + j] = pos;
      slot_weight[pos] = weight[int64_t(r) * k + j];
    }
    base += total;
    __syncthreads();
  }
}

// ---- Grouped expert GEMM ------------------------------------------------------------------------

// Which row tile block t works on (run by warp 0): the experts' groups cut into tiles of bm
// rows, numbered in expert order; tile[0] = the expert (−1: t is past the last tile), tile[1]
// = the tile's first gathered row, tile[2] = its rows. Lanes take 32 experts at a time and a
// warp scan of their tile counts finds t.
// offsets == nullptr: one group of E rows (DenseLinear), cut into tiles of bm rows in order.
__device__ void FindTile(const int32_t* offsets, int E, int bm, int t, int* tile) {
  const int lane = threadIdx.x % 32;
  if (offsets == nullptr) {
    if (lane == 0) {
      const int r0 = t * bm;
      tile[0] = r0 < E ? 0 : -1;
      tile[1] = r0;
      tile[2] = min(bm, E - r0);
    }
    return;
  }
  int base = 0;  // tiles of the experts before this group of 32
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    int lo = 0, count = 0;
    if (e < E) {
      lo = offsets[e];
      count = offsets[e + 1] - lo;
    }
    const int tiles = (count + bm - 1) / bm;
    int incl = tiles;
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    const int first = base + incl - tiles;  // this expert's first tile
    const bool mine = t >= first && t < base + incl;
    if (mine) {
      tile[0] = e;
      tile[1] = lo + (t - first) * bm;
      tile[2] = min(bm, count - (t - first) * bm);
    }
    if (__any_sync(0xffffffffu, mine)) return;
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) tile[0] = -1;
}

constexpr int kTileRows = 32;      // gathered rows per block
constexpr int kTileK = 32;         // reduction chunk staged in shared memory
constexpr int kTileW = 64;         // weight rows per block (gated: 32 gate + 32 up)
constexpr int kGemmThreads = 256;  // 8 × 32: each thread 4 rows × 2 weight rows

// Upper bound of the row tiles of the grouped GEMMs: Σ_e ⌈n_e / 32⌉ with Σ n_e = rows·k and
// n_e ≤ rows.
int RowTiles(int rows, int k, int E) {
  const int64_t n = int64_t(rows) * k;
  const int64_t a = (n + kTileRows - 1) / kTileRows + E;
  const int64_t b = int64_t(E) * ((rows + kTileRows - 1) / kTileRows);
  return int(a < b ? a : b);
}

// Block (blockIdx.x = row tile t, blockIdx.y = column tile). Row tile t is found from offsets
// (FindTile); a block past the last tile exits. Each thread owns rows
// 4·ty … 4·ty+3 of its tile and two weight rows: gated, gate column c and up column c
// (c = col0 + tx, the output y[n, c] = gelu(g)·u); plain, output columns col0 + tx and
// col0 + 32 + tx. Each output is a float32 fused multiply-add chain over the reduction index in
// order 0 … in−1: independent of the tile's other rows and of the batch.
template <bool kGated>
__global__ void __launch_bounds__(kGemmThreads)
    MoeGemmKernel(const float* x, const int32_t* gather, const int32_t* offsets, int E,
                  const uint16_t* w, int in, int out, int bf16_input, const float* row_scale,
                  float* y) {
  __shared__ float As[kTileK][kTileRows + 1];
  __shared__ float Ws[kTileK][kTileW + 1];
  __shared__ int tile[3];
  if (threadIdx.x < 32) FindTile(offsets, E, kTileRows, blockIdx.x, tile);
  __syncthreads();
  const int e = tile[0], r0 = tile[1], nrows = tile[2];
  if (e < 0) return;  // uniform: no work for this block
  const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
  constexpr int kCols = kGated ? kTileW / 2 : kTileW;  // output columns per block
  const int col0 = blockIdx.y * kCols;
  const int64_t w_rows = kGated ? 2 * int64_t(out) : int64_t(out);
  const uint16_t* we = w + int64_t(e) * w_rows * in;
  // What this thread stages: A rows ty + 8i (i < 4) and weight rows ty + 8i (i < 8), column tx of
  // each chunk (coalesced along the reduction index).
  int64_t a_src[4];
  for (int i = 0; i < 4; ++i) {
    const int lr = ty + 8 * i;
    a_src[i] = lr < nrows ? (gather != nullptr ? gather[r0 + lr] : r0 + lr) : -1;
  }
  int64_t w_src[8];
  for (int i = 0; i < 8; ++i) {
    const int c = ty + 8 * i;
    if (kGated) {
      const int f = col0 + (c % kCols);
      w_src[i] = f < out ? (c < kCols ? f : out + f) : -1;
    } else {
      w_src[i] = col0 + c < out ? col0 + c : -1;
    }
  }
  float acc[4][2];
  for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = 0.0f;
  for (int k0 = 0; k0 < in; k0 += kTileK) {
    const int kk = k0 + tx;
    for (int i = 0; i < 4; ++i) {
      float v = 0.0f;
      if (a_src[i] >= 0 && kk < in) {
        v = x[a_src[i] * in + kk];
        if (bf16_input) v = Bf16BitsToFloat(ActivationBf16Bits(v));
      }
      As[tx][ty + 8 * i] = v;
    }
    for (int i = 0; i < 8; ++i) {
      Ws[tx][ty + 8 * i] =
          w_src[i] >= 0 && kk < in ? Bf16BitsToFloat(we[w_src[i] * in + kk]) : 0.0f;
    }
    __syncthreads();
    const int kn = min(kTileK, in - k0);
    for (int q = 0; q < kn; ++q) {
      const float w0 = Ws[q][tx], w1 = Ws[q][32 + tx];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float a = As[q][4 * ty + i];
        acc[i][0] = fmaf(a, w0, acc[i][0]);
        acc[i][1] = fmaf(a, w1, acc[i][1]);
      }
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int lr = 4 * ty + i;
    if (lr >= nrows) continue;
    const int64_t n = r0 + lr;
    if (kGated) {
      const int f = col0 + tx;
      if (f < out) {
        constexpr float kSqrt2OverPi = 0.7978845608028654f;
        const float g = acc[i][0], u = acc[i][1];
        y[n * out + f] = 0.5f * g * (1.0f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * u;
      }
    } else {
      const float scale = row_scale != nullptr ? row_scale[n] : 1.0f;
      if (col0 + tx < out) y[n * out + col0 + tx] = __fmul_rn(scale, acc[i][0]);
      if (col0 + 32 + tx < out) y[n * out + col0 + 32 + tx] = __fmul_rn(scale, acc[i][1]);
    }
  }
}

// ---- Tensor-core path (mma.sync m16n8k16 bf16, cuda_mma.cuh) -----------------------------------
// Block: 4 warps, 32 gathered rows × 64 weight rows, reduction in chunks of 64 (4 k16 steps).
// The weight chunk is streamed with cp.async (two stages: the next chunk is in flight while this
// one is multiplied); the A chunk is read as float32, gathered, and converted in the load: bf16
// mode rounds it, float32 mode splits it exactly into three bf16 terms (hi + mid + lo) kept as
// three A tiles, each multiplied with the same weight fragments (products exact in float32, the
// weights read once). Warp w owns weight rows 16w … 16w+15 of the tile (two n8 fragments) for
// all 32 rows (two m16 fragments). Gated: its fragment 0 holds gate columns col0 + 8w + j and
// fragment 1 the up columns of the same j, so gelu(g)·u is formed in registers. Every output
// is accumulated over the k16 steps in ascending order (terms lo, mid, hi within a step): a
// fixed order that does not depend on the other rows.
constexpr int kMmaRows = 32;
constexpr int kMmaW = 64;
constexpr int kMmaK = 64;
constexpr int kMmaLd =
    kMmaK + 8;  // bf16 per shared row: 144 bytes, ldmatrix rows on distinct banks
constexpr int kMmaThreads = 128;

template <int kTerms>
size_t MmaSharedBytes() {
  return size_t(kTerms * kMmaRows + 2 * kMmaW) * kMmaLd * sizeof(uint16_t);
}

// The W4A16 arguments of a bf16-weight launch.
constexpr const uint32_t* kNoW4 = nullptr;
constexpr const uint16_t* kNoW4Scales = nullptr;

int MmaRowTiles(int rows, int k, int E) {
  const int64_t n = int64_t(rows) * k;
  const int64_t a = (n + kMmaRows - 1) / kMmaRows + E;
  const int64_t b = int64_t(E) * ((rows + kMmaRows - 1) / kMmaRows);
  return int(a < b ? a : b);
}

//
// W4A16 weights (kW4, MoeGateUpW4A16 / MoeDownW4A16): the same tile loop with the weight chunk
// staged through registers instead of cp.async. Each thread reads, one chunk ahead (the loads in
// flight while the current chunk is multiplied), the int32 word of eight 4-bit values and the
// bf16 scale of each of its four (row, 8 inputs) pieces, and dequantizes them into shared memory
// as the CPU's W4A16 GEMM widens them: v = float32(q) · s in float32 (exact: s is a bf16 value,
// q ∈ [−8, 7], so v has at most 11 significant bits), then stored exactly as two bf16 terms
// hi = bf16_rn(v), lo = bf16(v − hi) in the two stage buffers (the double buffer of the bf16 path
// holds the two terms of one chunk). The mma then multiplies each A term by the lo and the hi
// fragments (products exact in float32): Σ a·lo + a·hi per k16 step, i.e. a·v with the CPU's
// widened weight, up to the order of float32 additions.
// The activations are always the exact three-term split of the float32 input (kTerms = 3): the
// CPU's W4A16 GEMM ignores the GEMM input mode, so a bf16-rounded input would be another model.
template <bool kGated, int kTerms, bool kW4 = false>
__global__ void __launch_bounds__(kMmaThreads)
    MoeMmaKernel(const float* x, const int32_t* gather, const int32_t* offsets, int E,
                 const uint16_t* w, int in, int out, const float* row_scale, float* y,
                 const uint32_t* w4, const uint16_t* w4_scales, int group) {
  // W4A16 weights take float32 activations only (the three-term split), as cpu::QuantLinear does
  // in both CPU GEMM modes: no bf16-input instance exists (issue 37, the bf16-mode mismatch).
  static_assert(!kW4 || kTerms == 3, "W4A16 weights take float32 activations");
  __shared__ int tile[3];
  if (threadIdx.x < 32) FindTile(offsets, E, kMmaRows, blockIdx.x, tile);
  __syncthreads();
  const int e = tile[0], r0 = tile[1], nrows = tile[2];
  if (e < 0) return;
  uint16_t* As = DynamicShared<uint16_t>();        // [kTerms][kMmaRows][kMmaLd]
  uint16_t* Ws = As + kTerms * kMmaRows * kMmaLd;  // [2][kMmaW][kMmaLd]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kCols = kGated ? kMmaW / 2 : kMmaW;
  const int col0 = blockIdx.y * kCols;
  const int64_t w_rows = kGated ? 2 * int64_t(out) : int64_t(out);
  const uint16_t* we = kW4 ? w : w + int64_t(e) * w_rows * in;  // W4A16: w unused (nullptr)
  const bool vec = in % 8 == 0;
  // Weight chunks this thread stages: tile rows c = threadIdx.x / 8 + 16 i, 8 bf16 at
  // (threadIdx.x % 8) · 8.
  int64_t w_src[4];
  for (int i = 0; i < 4; ++i) {
    const int c = threadIdx.x / 8 + 16 * i;
    if (kGated) {
      const int f = col0 + 8 * (c / 16) + (c % 8);
      w_src[i] = f < out ? ((c % 16) < 8 ? f : out + f) : -1;
    } else {
      w_src[i] = col0 + c < out ? col0 + c : -1;
    }
  }
  const int wk = (threadIdx.x % 8) * 8;
  auto load_w = [&](int stage, int k0) {
    for (int i = 0; i < 4; ++i) {
      const int c = threadIdx.x / 8 + 16 * i;
      uint16_t* dst = Ws + (stage * kMmaW + c) * kMmaLd + wk;
      const int kk = k0 + wk;
      if (w_src[i] >= 0 && vec && kk + 8 <= in) {
        mma::CpAsync16(dst, we + w_src[i] * in + kk);
      } else {
        for (int q = 0; q < 8; ++q) {
          dst[q] = w_src[i] >= 0 && kk + q < in ? we[w_src[i] * in + kk + q] : uint16_t(0);
        }
      }
    }
  };
  // W4A16: words per weight row, scale groups per row, the prefetched words and scales.
  const int w4_words = (in + 7) / 8, w4_groups = kW4 ? (in + group - 1) / group : 0;
  uint32_t w4_word[4];
  uint16_t w4_scale[4];
  auto fetch_w4 = [&](int k0) {  // global → registers, one chunk ahead
    const int kk = k0 + wk;
    for (int i = 0; i < 4; ++i) {
      const bool live = w_src[i] >= 0 && kk < in;
      const int64_t row = int64_t(e) * w_rows + w_src[i];
      w4_word[i] = live ? w4[row * w4_words + kk / 8] : 0x88888888u;  // q = 0
      w4_scale[i] = live ? w4_scales[row * w4_groups + kk / group] : uint16_t(0);
    }
  };
  auto dequant_w4 = [&](int k0) {  // registers → the two bf16 terms in shared memory
    for (int i = 0; i < 4; ++i) {
      const int c = threadIdx.x / 8 + 16 * i;
      uint16_t* hi = Ws + c * kMmaLd + wk;
      uint16_t* lo = Ws + (kMmaW + c) * kMmaLd + wk;
      const float sc = Bf16BitsToFloat(w4_scale[i]);
      for (int q = 0; q < 8; ++q) {
        const int qv = int((w4_word[i] >> (4 * q)) & 0xFu) - 8;
        const float v = k0 + wk + q < in ? __fmul_rn(float(qv), sc) : 0.0f;
        const uint16_t h = ToBf16Bits(v);
        hi[q] = h;
        lo[q] = ToBf16Bits(__fsub_rn(v, Bf16BitsToFloat(h)));
      }
    }
  };
  // A: row threadIdx.x / 4, 16 floats at (threadIdx.x % 4) · 16.
  const int ar = threadIdx.x / 4, ak = (threadIdx.x % 4) * 16;
  const int64_t a_src = ar < nrows ? (gather != nullptr ? gather[r0 + ar] : r0 + ar) : -1;
  auto load_a = [&](int k0) {
    for (int q = 0; q < 16; ++q) {
      const int kk = k0 + ak + q;
      float v = a_src >= 0 && kk < in ? x[a_src * in + kk] : 0.0f;
      for (int term = 0; term < kTerms; ++term) {
        // One term (kBf16): the activation rounding; three: the exact split (kFloat32).
        const uint16_t h = kTerms == 1 ? ActivationBf16Bits(v) : ToBf16Bits(v);
        As[(term * kMmaRows + ar) * kMmaLd + ak + q] = h;
        if (term + 1 < kTerms) {
          v = (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u ? 0.0f
                                                                : __fsub_rn(v, Bf16BitsToFloat(h));
        }
      }
    }
  };
  float acc[2][2][4];
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;
  if (kW4) {
    fetch_w4(0);
  } else {
    load_w(0, 0);
    mma::CpAsyncCommit();
  }
  // Weight terms per chunk: bf16 one (in stage `stage`), W4A16 two (lo in buffer 1, hi in 0).
  constexpr int kWTerms = kW4 ? 2 : 1;
  int stage = 0;
  for (int k0 = 0; k0 < in; k0 += kMmaK, stage ^= 1) {
    load_a(k0);
    if (kW4) {
      dequant_w4(k0);
      if (k0 + kMmaK < in) fetch_w4(k0 + kMmaK);
    } else {
      if (k0 + kMmaK < in) load_w(stage ^ 1, k0 + kMmaK);
      mma::CpAsyncCommit();
      mma::CpAsyncWaitGroup<1>();  // this chunk's weights have landed
    }
    __syncthreads();
    const int steps = (min(kMmaK, in - k0) + 15) / 16;
    for (int s = 0; s < steps; ++s) {
      for (int wt = kWTerms - 1; wt >= 0; --wt) {  // W4A16: lo, hi
        const int buffer = kW4 ? wt : stage;
        uint32_t b[4];  // b[0..1]: weight rows 16w … 16w+7, b[2..3]: 16w+8 … 16w+15
        mma::LdMatrixX4(b, Ws + (buffer * kMmaW + warp * 16 + (lane / 16) * 8 + lane % 8) * kMmaLd +
                               s * 16 + ((lane / 8) % 2) * 8);
        for (int term = kTerms - 1; term >= 0; --term) {  // lo, mid, hi
          for (int mf = 0; mf < 2; ++mf) {
            uint32_t a[4];
            mma::LdMatrixX4(a, As + (term * kMmaRows + mf * 16 + lane % 16) * kMmaLd + s * 16 +
                                   (lane / 16) * 8);
            mma::MmaBf16M16N8K16(acc[mf][0], a, b);
            mma::MmaBf16M16N8K16(acc[mf][1], a, b + 2);
          }
        }
      }
    }
    __syncthreads();  // As and this stage are rewritten next
  }
  mma::CpAsyncWaitAll();
  const int g = lane >> 2, t = lane & 3;
  for (int mf = 0; mf < 2; ++mf) {
    for (int i = 0; i < 4; ++i) {
      const int m = mf * 16 + g + (i >= 2 ? 8 : 0);
      if (m >= nrows) continue;
      const int64_t n = r0 + m;
      const int j = 2 * t + (i % 2);
      if (kGated) {
        const int f = col0 + 8 * warp + j;
        if (f < out) {
          constexpr float kSqrt2OverPi = 0.7978845608028654f;
          const float gv = acc[mf][0][i], u = acc[mf][1][i];
          y[n * out + f] =
              0.5f * gv * (1.0f + tanhf(kSqrt2OverPi * (gv + 0.044715f * gv * gv * gv))) * u;
        }
      } else {
        const float scale = row_scale != nullptr ? row_scale[n] : 1.0f;
        for (int nb = 0; nb < 2; ++nb) {
          const int d = col0 + 16 * warp + 8 * nb + j;
          if (d < out) y[n * out + d] = __fmul_rn(scale, acc[mf][nb][i]);
        }
      }
    }
  }
}

__global__ void MoeSumKernel(const float* y, const int32_t* slot, int rows, int k, int dim,
                             float* out) {
  const int64_t n = int64_t(rows) * dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / dim, d = i % dim;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) acc = __fadd_rn(acc, y[int64_t(slot[r * k + j]) * dim + d]);
    out[i] = acc;
  }
}

absl::Status CheckMoeShape(const char* what, int rows, int k, int E) {
  if (rows < 0 || k < 1 || E < k || E > 1024) {
    return absl::InvalidArgumentError(std::string(what) +
                                      ": need rows ≥ 0 and 1 ≤ k ≤ experts ≤ 1024");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeExp(const float* x, int64_t n, float* y, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(ExpKernel, Blocks(n, 256), 256, 0, S(stream), x, n, y);
  return Check("MoeExp");
}

absl::Status MoeRoute(const float* scores, int rows, int num_experts, int k,
                      const float* per_expert_scale, int32_t* expert, float* weight, void* stream) {
  if (absl::Status st = CheckMoeShape("MoeRoute", rows, k, num_experts); !st.ok()) return st;
  if (rows == 0) return absl::OkStatus();
  const size_t shared = size_t(kRouteWarps) * num_experts * (sizeof(float) + sizeof(int));
  LaunchKernel(MoeRouteKernel, (rows + kRouteWarps - 1) / kRouteWarps, 32 * kRouteWarps, shared,
               S(stream), scores, rows, num_experts, k, per_expert_scale, expert, weight);
  return Check("MoeRoute");
}

absl::Status MoeGroup(const int32_t* expert, const float* weight, int rows, int num_experts, int k,
                      int32_t* offsets, int32_t* gather, int32_t* slot, float* slot_weight,
                      void* stream) {
  if (absl::Status st = CheckMoeShape("MoeGroup", rows, k, num_experts); !st.ok()) return st;
  if (rows == 0) return absl::OkStatus();
  LaunchKernel(MoeGroupKernel, num_experts, 256, 0, S(stream), expert, weight, rows, num_experts, k,
               offsets, gather, slot, slot_weight);
  return Check("MoeGroup");
}

absl::Status MoeGateUp(const float* x, const int32_t* gather, const int32_t* offsets,
                       const uint16_t* w, int rows, int k, int num_experts, int dim, int width,
                       GemmInput input, float* act, void* stream, MoeKernel kernel) {
  if (absl::Status st = CheckMoeShape("MoeGateUp", rows, k, num_experts); !st.ok()) return st;
  if (dim <= 0 || width <= 0) return absl::InvalidArgumentError("MoeGateUp: dim, width > 0");
  if (rows == 0) return absl::OkStatus();
  if (kernel == MoeKernel::kSimt) {
    const dim3 grid(RowTiles(rows, k, num_experts), (width + kTileW / 2 - 1) / (kTileW / 2));
    LaunchKernel(MoeGemmKernel<true>, grid, kGemmThreads, 0, S(stream), x, gather, offsets,
                 num_experts, w, dim, width, int(input == GemmInput::kBf16),
                 static_cast<const float*>(nullptr), act);
    return Check("MoeGateUp (SIMT)");
  }
  const dim3 grid(MmaRowTiles(rows, k, num_experts), (width + kMmaW / 2 - 1) / (kMmaW / 2));
  if (input == GemmInput::kBf16) {
    LaunchKernel(MoeMmaKernel<true, 1>, grid, kMmaThreads, MmaSharedBytes<1>(), S(stream), x,
                 gather, offsets, num_experts, w, dim, width, static_cast<const float*>(nullptr),
                 act, kNoW4, kNoW4Scales, 0);
  } else {
    LaunchKernel(MoeMmaKernel<true, 3>, grid, kMmaThreads, MmaSharedBytes<3>(), S(stream), x,
                 gather, offsets, num_experts, w, dim, width, static_cast<const float*>(nullptr),
                 act, kNoW4, kNoW4Scales, 0);
  }
  return Check("MoeGateUp");
}

absl::Status MoeDown(const float* act, const int32_t* offsets, const float* slot_weight,
                     const uint16_t* w, int rows, int k, int num_experts, int width, int dim,
                     GemmInput input, float* y, void* stream, MoeKernel kernel) {
  if (absl::Status st = CheckMoeShape("MoeDown", rows, k, num_experts); !st.ok()) return st;
  if (dim <= 0 || width <= 0) return absl::InvalidArgumentError("MoeDown: dim, width > 0");
  if (rows == 0) return absl::OkStatus();
  const int32_t* no_gather = nullptr;
  if (kernel == MoeKernel::kSimt) {
    const dim3 grid(RowTiles(rows, k, num_experts), (dim + kTileW - 1) / kTileW);
    LaunchKernel(MoeGemmKernel<false>, grid, kGemmThreads, 0, S(stream), act, no_gather, offsets,
                 num_experts, w, width, dim, int(input == GemmInput::kBf16), slot_weight, y);
    return Check("MoeDown (SIMT)");
  }
  const dim3 grid(MmaRowTiles(rows, k, num_experts), (dim + kMmaW - 1) / kMmaW);
  if (input == GemmInput::kBf16) {
    LaunchKernel(MoeMmaKernel<false, 1>, grid, kMmaThreads, MmaSharedBytes<1>(), S(stream), act,
                 no_gather, offsets, num_experts, w, width, dim, slot_weight, y, kNoW4, kNoW4Scales,
                 0);
  } else {
    LaunchKernel(MoeMmaKernel<false, 3>, grid, kMmaThreads, MmaSharedBytes<3>(), S(stream), act,
                 no_gather, offsets, num_experts, w, width, dim, slot_weight, y, kNoW4, kNoW4Scales,
                 0);
  }
  return Check("MoeDown");
}

namespace {

absl::Status CheckW4A16(const char* what, const W4A16Weights& w) {
  if (w.packed == nullptr || w.scales == nullptr || w.group <= 0 || w.group % 8 != 0) {
    return absl::InvalidArgumentError(std::string(what) +
                                      ": W4A16 weights need packed words, scales and a group "
                                      "size that is a positive multiple of 8");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status MoeGateUpW4A16(const float* x, const int32_t* gather, const int32_t* offsets,
                            const W4A16Weights& w, int rows, int k, int num_experts, int dim,
                            int width, float* act, void* stream) {
  if (absl::Status st = CheckMoeShape("MoeGateUpW4A16", rows, k, num_experts); !st.ok()) return st;
  if (dim <= 0 || width <= 0) return absl::InvalidArgumentError("MoeGateUpW4A16: dim, width > 0");
  if (absl::Status st = CheckW4A16("MoeGateUpW4A16", w); !st.ok()) return st;
  if (rows == 0) return absl::OkStatus();
  const dim3 grid(MmaRowTiles(rows, k, num_experts), (width + kMmaW / 2 - 1) / (kMmaW / 2));
  const uint16_t* no_w = nullptr;
  const float* no_scale = nullptr;
  // Float32 activations only (the exact three-term split), as cpu::QuantLinear takes them.
  LaunchKernel(MoeMmaKernel<true, 3, true>, grid, kMmaThreads, MmaSharedBytes<3>(), S(stream), x,
               gather, offsets, num_experts, no_w, dim, width, no_scale, act, w.packed, w.scales,
               w.group);
  return Check("MoeGateUpW4A16");
}

absl::Status MoeDownW4A16(const float* act, const int32_t* offsets, const float* slot_weight,
                          const W4A16Weights& w, int rows, int k, int num_experts, int width,
                          int dim, float* y, void* stream) {
  if (absl::Status st = CheckMoeShape("MoeDownW4A16", rows, k, num_experts); !st.ok()) return st;
  if (dim <= 0 || width <= 0) return absl::InvalidArgumentError("MoeDownW4A16: dim, width > 0");
  if (absl::Status st = CheckW4A16("MoeDownW4A16", w); !st.ok()) return st;
  if (rows == 0) return absl::OkStatus();
  const dim3 grid(MmaRowTiles(rows, k, num_experts), (dim + kMmaW - 1) / kMmaW);
  const int32_t* no_gather = nullptr;
  const uint16_t* no_w = nullptr;
  LaunchKernel(MoeMmaKernel<false, 3, true>, grid, kMmaThreads, MmaSharedBytes<3>(), S(stream), act,
               no_gather, offsets, num_experts, no_w, width, dim, slot_weight, y, w.packed,
               w.scales, w.group);
  return Check("MoeDownW4A16");
}

absl::Status DenseLinear(const float* x, const uint16_t* w, int rows, int in, int out,
                         GemmInput input, float* y, void* stream) {
  if (rows < 0 || in <= 0 || out <= 0) {
    return absl::InvalidArgumentError("DenseLinear: rows ≥ 0, in > 0, out > 0");
  }
  if (rows == 0) return absl::OkStatus();
  // One group of `rows` rows: offsets nullptr and E = rows (FindTile), no gather, no row scale.
  const dim3 grid((rows + kMmaRows - 1) / kMmaRows, (out + kMmaW - 1) / kMmaW);
  const int32_t* none = nullptr;
  const float* no_scale = nullptr;
  if (input == GemmInput::kBf16) {
    LaunchKernel(MoeMmaKernel<false, 1>, grid, kMmaThreads, MmaSharedBytes<1>(), S(stream), x, none,
                 none, rows, w, in, out, no_scale, y, kNoW4, kNoW4Scales, 0);
  } else {
    LaunchKernel(MoeMmaKernel<false, 3>, grid, kMmaThreads, MmaSharedBytes<3>(), S(stream), x, none,
                 none, rows, w, in, out, no_scale, y, kNoW4, kNoW4Scales, 0);
  }
  return Check("DenseLinear");
}

absl::Status DenseLinearW4A16(const float* x, const W4A16Weights& w, int rows, int in, int out,
                              float* y, void* stream) {
  if (rows < 0 || in <= 0 || out <= 0) {
    return absl::InvalidArgumentError("DenseLinearW4A16: rows ≥ 0, in > 0, out > 0");
  }
  if (absl::Status st = CheckW4A16("DenseLinearW4A16", w); !st.ok()) return st;
  if (rows == 0) return absl::OkStatus();
  // DenseLinear's one group of `rows` rows (expert 0: weight row o is packed row o).
  const dim3 grid((rows + kMmaRows - 1) / kMmaRows, (out + kMmaW - 1) / kMmaW);
  const int32_t* none = nullptr;
  const uint16_t* no_w = nullptr;
  const float* no_scale = nullptr;
  const int dense_group = w.group;
  LaunchKernel(MoeMmaKernel<false, 3, true>, grid, kMmaThreads, MmaSharedBytes<3>(), S(stream), x,
               none, none, rows, no_w, in, out, no_scale, y, w.packed, w.scales, dense_group);
  return Check("DenseLinearW4A16");
}

absl::Status MoeSum(const float* y, const int32_t* slot, int rows, int k, int dim, float* out,
                    void* stream) {
  if (rows < 0 || k < 1 || dim <= 0) {
    return absl::InvalidArgumentError("MoeSum: rows ≥ 0, k ≥ 1, dim > 0");
  }
  if (rows == 0) return absl::OkStatus();
  LaunchKernel(MoeSumKernel, Blocks(int64_t(rows) * dim, 256), 256, 0, S(stream), y, slot, rows, k,
               dim, out);
  return Check("MoeSum");
}

}  // namespace dgserve::cuda
