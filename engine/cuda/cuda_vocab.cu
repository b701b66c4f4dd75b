#include "engine/cuda/cuda_vocab.h"

#include <climits>
#include <string>

#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_mma.cuh"
#include "engine/cuda/cuda_vocab_tile.cuh"

namespace dgserve::cuda {
namespace {

// One block of kThreads threads per row. The row is cut into kSegments = kThreads contiguous
// segments of seg_len ids (a multiple of 32, ceil(V / kSegments) rounded up; trailing segments
// may be empty), so that the inverse-CDF search needs one block-wide scan over the segment sums
// and a single warp's scan of one segment.
//   Pass 1 (thread-strided, coalesced): ℓ = softcap(raw), max and first argmax, NaN check,
//           bf16(ℓ/T) written when asked.
//   Pass 2 (warp w takes segments w, w+32, …; lanes read 32 consecutive ids per step):
//           e = 2^w and Σ e, Σ e·w per lane in float, reduced per segment in double.
//   Scan:   block-wide inclusive scan of the segment sums in double → S and the segment where the
//           running sum first exceeds u·S; warp 0 rescans that segment 32 ids at a time.
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kSegments = kThreads;
constexpr unsigned kFull = 0xffffffffu;

// The CPU row sampler's constants (engine/denoise/row_sampler.cc).
constexpr float kWMin = -127.0f;
constexpr float kMagic127 = 12583039.0f;  // 1.5·2^23 + 127
constexpr float kQ0 = 1.535336188319500e-4f;
constexpr float kQ1 = 1.339887440266574e-3f;
constexpr float kQ2 = 9.618437357674640e-3f;
constexpr float kQ3 = 5.550332471162809e-2f;
constexpr float kQ4 = 2.402264791363012e-1f;
constexpr float kQ5 = 6.931472028550421e-1f;
constexpr double kLn2 = 0.69314718055994530942;
constexpr double kLog2e = 1.44269504088896340736;

// Softcap as the CPU backend's production path (cpu::Softcap, AVX2): cap·(1 − 2/(1 + e^{2x/cap}))
// with e^t = 2^(t·log2 e) from the Cephes exp2f polynomial, argument clamped to [−126, 126];
// within 1e-5 of cap·tanh(x/cap) at cap = 30, bit-identical to the CPU on the same input.
// k2 = fl(fl(2/cap)·log2 e). NaN stays NaN. The _rn intrinsics keep nvcc from contracting.
__device__ __forceinline__ float Softcap(float x, float cap, float k2) {
  float w = __fmul_rn(x, k2);
  w = w < -126.0f ? -126.0f : (w > 126.0f ? 126.0f : w);
  const float r = rintf(w);  // round to nearest even, as _mm256_round_ps
  const float f = __fsub_rn(w, r);
  float p = fmaf(kQ0, f, kQ1);
  p = fmaf(p, f, kQ2);
  p = fmaf(p, f, kQ3);
  p = fmaf(p, f, kQ4);
  p = fmaf(p, f, kQ5);
  p = fmaf(p, f, 1.0f);
  const float scale = __int_as_float((__float2int_rn(r) + 127) << 23);
  const float ex = __fmul_rn(p, scale);
  return __fmul_rn(cap, __fsub_rn(1.0f, __fdiv_rn(2.0f, __fadd_rn(1.0f, ex))));
}

// ℓ_i: the softcapped logit, or −∞ for an id outside the row's mask (`mask`: bit i of word
// i/64 set ⇔ id i allowed; nullptr = every id), as the CPU step masks after its softcap.
__device__ __forceinline__ float Logit(const float* row, int i, float cap, float k2,
                                       const uint64_t* mask) {
  if (mask != nullptr && ((mask[i >> 6] >> (i & 63)) & 1u) == 0) return -INFINITY;
  const float x = row[i];
  return cap > 0.0f ? Softcap(x, cap, k2) : x;
}

// e = 2^w, w = max(fl(fl(ℓ − m)·k), −127), exactly as the CPU row sampler's Exp2Lanes (FMA
// Horner steps as its AVX2+FMA build): 0 for w ≤ −126.5.
__device__ __forceinline__ float Exp2Row(float l, float m, float k, float* w_out) {
  float w = __fmul_rn(__fsub_rn(l, m), k);
  w = w < kWMin ? kWMin : w;
  const float t = __fadd_rn(w, kMagic127);
  const float f = __fsub_rn(w, __fsub_rn(t, kMagic127));  // exact
  float y = fmaf(f, kQ0, kQ1);
  y = fmaf(y, f, kQ2);
  y = fmaf(y, f, kQ3);
  y = fmaf(y, f, kQ4);
  y = fmaf(y, f, kQ5);
  y = fmaf(y, f, 1.0f);
  const float scale = __uint_as_float(__float_as_uint(t) << 23);
  *w_out = w;
  return __fmul_rn(y, scale);
}

__device__ __forceinline__ double WarpSumD(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Inclusive prefix sum over the 32 lanes (lane order).
__device__ __forceinline__ double WarpScanD(double v, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const double n = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// (value, index) max with the lower index on equal values; NaN values never win.
__device__ __forceinline__ void ArgmaxMerge(float ov, int oi, float* v, int* i) {
  if (ov > *v || (ov == *v && oi < *i)) {
    *v = ov;
    *i = oi;
  }
}

__device__ void WriteBadRow(VocabRowResult* out) {
  out->argmax = -1;
  out->sampled = -1;
  out->entropy = __int_as_float(0x7fc00000);
  out->lse = __int_as_float(0x7fc00000);
}

__global__ void __launch_bounds__(kThreads)
    VocabStepKernel(const float* __restrict__ logits, int vocab, int seg_len, float cap,
                    const float* __restrict__ temperature, const float* __restrict__ uniforms,
                    VocabRowResult* __restrict__ out, uint16_t* __restrict__ z_bf16,
                    const uint64_t* __restrict__ mask_table,
                    const int32_t* __restrict__ mask_index) {
  __shared__ double seg_sum[kSegments];  // Σ e of each segment
  __shared__ double incl[kSegments];     // inclusive prefix sums of seg_sum
  __shared__ double warp_tot[kWarps];
  __shared__ double warp_ew[kWarps];
  __shared__ float warp_max[kWarps];
  __shared__ int warp_arg[kWarps];
  __shared__ int chosen_seg, last_pos_seg;

  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float* lr = logits + row * vocab;
  const float T = temperature[row];
  const float k2 = 2.0f / cap * 1.44269504088896341f;
  const int mi = mask_index != nullptr ? mask_index[row] : -1;
  const uint64_t* mr =
      mi >= 0 ? mask_table + int64_t(mi) * ((int64_t(vocab) + 63) / 64) : nullptr;
  if (tid == 0) {
    chosen_seg = -1;
    last_pos_seg = -1;
  }

  // Pass 1: max / first argmax of ℓ, NaN check, bf16(ℓ/T).
  float best = -INFINITY;
  int best_i = INT_MAX;
  bool bad = false;
  uint16_t* zr = z_bf16 != nullptr ? z_bf16 + row * vocab : nullptr;
  for (int i = tid; i < vocab; i += kThreads) {
    const float l = Logit(lr, i, cap, k2, mr);
    bad |= l != l;
    if (l > best) {  // ids rise within a thread: strict > keeps the first
      best = l;
      best_i = i;
    }
    if (zr != nullptr) zr[i] = ToBf16Bits(__fdiv_rn(l, T));
  }
  for (int o = 16; o > 0; o >>= 1) {
    ArgmaxMerge(__shfl_xor_sync(kFull, best, o), __shfl_xor_sync(kFull, best_i, o), &best,
                &best_i);
  }
  if (lane == 0) {
    warp_max[warp] = best;
    warp_arg[warp] = best_i;
  }
  const bool any_bad = __syncthreads_or(bad) != 0;  // also the barrier for warp_max/arg
  float m = warp_max[0];
  int argmax = warp_arg[0];
  for (int w = 1; w < kWarps; ++w) ArgmaxMerge(warp_max[w], warp_arg[w], &m, &argmax);
  // Uniform across the block: every thread read the same shared values.
  if (any_bad || !isfinite(m) || argmax == INT_MAX || !(T > 0.0f) || !isfinite(T)) {
    if (tid == 0) WriteBadRow(out + row);
    return;
  }

  // Pass 2: per-segment Σ e (double) and the row's Σ e·w.
  const float k = float(kLog2e / double(T));
  double ew = 0.0;
  for (int s = warp; s < kSegments; s += kWarps) {
    const int begin = s * seg_len, end = min(begin + seg_len, vocab);
    float se = 0.0f, sew = 0.0f;
    for (int i = begin + lane; i < end; i += 32) {
      float w;
      const float e = Exp2Row(Logit(lr, i, cap, k2, mr), m, k, &w);
      se = __fadd_rn(se, e);
      sew = fmaf(e, w, sew);
    }
    const double dse = WarpSumD(double(se));
    ew += WarpSumD(double(sew));
    if (lane == 0) seg_sum[s] = dse;
  }
  if (lane == 0) warp_ew[warp] = ew;
  __syncthreads();

  // Block-wide inclusive scan of the segment sums (thread t owns segment t).
  const double x = seg_sum[tid];
  double xs = WarpScanD(x, lane);
  if (lane == 31) warp_tot[warp] = xs;
  __syncthreads();
  if (warp == 0) {
    const double wt = WarpScanD(warp_tot[lane], lane);
    __syncwarp();
    warp_tot[lane] = wt;  // inclusive over warps
  }
  __syncthreads();
  if (warp > 0) xs += warp_tot[warp - 1];
  incl[tid] = xs;
  __syncthreads();
  const double total = incl[kSegments - 1];
  if (!(total > 0.0) || !isfinite(total)) {
    if (tid == 0) WriteBadRow(out + row);
    return;
  }
  float u = uniforms[row];
  if (!(u >= 0.0f)) u = 0.0f;                   // also maps NaN to 0
  if (u >= 1.0f) u = __uint_as_float(0x3f7fffffu);  // nextafter(1, 0)
  const double target = double(u) * total;
  // The running sum is non-decreasing: at most one segment crosses the target.
  const double prev = tid > 0 ? incl[tid - 1] : 0.0;
  if (xs > target && prev <= target) chosen_seg = tid;
  if (x > 0.0) atomicMax(&last_pos_seg, tid);
  __syncthreads();

  if (tid == 0) {
    double sum_ew = 0.0;
    for (int w = 0; w < kWarps; ++w) sum_ew += warp_ew[w];
    const double log_total = log(total);
    out[row].argmax = argmax;
    out[row].entropy = float(fmax(0.0, log_total - kLn2 * sum_ew / total));
    out[row].lse = float(double(m) / double(T) + log_total);
  }
  if (warp != 0) return;
  // Warp 0: scan the chosen segment (or, if rounding put u·S past every segment, the last one
  // with e > 0, taking its last id with e > 0).
  const bool past_end = chosen_seg < 0;
  const int seg = past_end ? last_pos_seg : chosen_seg;
  int picked = -1, last_positive = -1;
  if (seg >= 0) {
    double cum = seg > 0 ? incl[seg - 1] : 0.0;
    const int begin = seg * seg_len, end = min(begin + seg_len, vocab);
    for (int base = begin; base < end; base += 32) {
      const int i = base + lane;
      float e = 0.0f, w;
      if (i < end) e = Exp2Row(Logit(lr, i, cap, k2, mr), m, k, &w);
      const double pre = WarpScanD(double(e), lane);
      const unsigned hit = __ballot_sync(kFull, e > 0.0f && !past_end && cum + pre > target);
      if (hit != 0) {
        picked = base + __ffs(hit) - 1;
        break;
      }
      const unsigned positive = __ballot_sync(kFull, e > 0.0f);
      if (positive != 0) last_positive = base + 31 - __clz(positive);
      cum += __shfl_sync(kFull, pre, 31);
    }
  }
  if (lane == 0) {
    out[row].sampled = picked >= 0 ? picked : (last_positive >= 0 ? last_positive : argmax);
  }
}

}  // namespace

absl::Status VocabStep(const float* logits, int rows, int vocab, float softcap,
                       const float* temperature, const float* uniforms, VocabRowResult* out,
                       uint16_t* z_bf16, const uint64_t* mask_table, const int32_t* mask_index,
                       void* stream) {
  if (rows < 0 || vocab <= 0 || vocab > kMaxVocab) {
    return absl::InvalidArgumentError("VocabStep: need rows ≥ 0 and 1 ≤ vocab ≤ 2^30");
  }
  if (rows == 0) return absl::OkStatus();
  if (logits == nullptr || temperature == nullptr || uniforms == nullptr || out == nullptr ||
      (mask_index != nullptr && mask_table == nullptr)) {
    return absl::InvalidArgumentError("VocabStep: null pointer");
  }
  const int per = (vocab + kSegments - 1) / kSegments;
  const int seg_len = (per + 31) / 32 * 32;
  LaunchKernel(VocabStepKernel, rows, kThreads, 0, static_cast<cudaStream_t>(stream), logits, vocab,
               seg_len, softcap, temperature, uniforms, out, z_bf16, mask_table, mask_index);
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string("VocabStep: ") + cudaGetErrorString(e));
}

// ---- The fused vocabulary pass (FusedVocabStep) ----
namespace {

// The tile shapes, TileMma, RowMask and ProbBits (cuda_vocab_tile.cuh).
using namespace vocab_tile;  // NOLINT(build/namespaces)

// One (row, tile) partial: the tile's max ℓ and its first argmax, S_t = Σ e and Q_t = Σ e·w
// relative to that max, and whether a NaN ℓ was seen.
struct TilePartial {
  double s;
  double q;
  float max;
  int32_t arg;
  int32_t bad;
  int32_t pad;
};

// Per row, from the combine to the sampled tile's scan.
struct RowSample {
  double total;      // S = Σ e over the row (relative to m)
  double cum;        // Σ of the tiles before `tile` (relative to m)
  double target;     // u·S
  float m;           // the row's max ℓ
  float k;           // fl(log2 e / T)
  int32_t tile;      // the tile to scan, −1: bad row (nothing to do)
  int32_t past_end;  // rounding left u·S past every tile: take the tile's last id with e > 0
};

// Rows 16·mi … 16·mi + 15 of the block's logits into sm->u.ls ([row][id]); the caller syncs
// before (the table chunk or the previous group is no longer read) and after.
__device__ __forceinline__ void StoreGroup(const float d[kMi][kNj][4], int mi, TileSmem* sm) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nj = 0; nj < kNj; ++nj) {
    const int n = warp * 32 + nj * 8 + 2 * t;
    sm->u.ls[g][n] = d[mi][nj][0];
    sm->u.ls[g][n + 1] = d[mi][nj][1];
    sm->u.ls[g + 8][n] = d[mi][nj][2];
    sm->u.ls[g + 8][n + 1] = d[mi][nj][3];
  }
}

// ℓ of id v from its raw dot product: softcap, then −∞ outside the mask (as Logit).
__device__ __forceinline__ float FusedLogit(float raw, int v, float cap, float k2,
                                            const uint64_t* mask) {
  if (mask != nullptr && ((mask[v >> 6] >> (v & 63)) & 1u) == 0) return -INFINITY;
  return cap > 0.0f ? Softcap(raw, cap, k2) : raw;
}

__global__ void __launch_bounds__(kFT)
    FusedTileKernel(FusedVocabArgs a, int tiles, TilePartial* __restrict__ partials) {
  __shared__ TileSmem sm;
  __shared__ float w_max[kFWarps];
  __shared__ int w_arg[kFWarps];
  __shared__ double w_s[kFWarps], w_q[kFWarps];
  const int tile = blockIdx.x, row0 = blockIdx.y * kFR;
  const int nrows = min(kFR, a.rows - row0);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int v0 = tile * kFT, v = v0 + tid;
  float d[kMi][kNj][4];
  TileMma(a.hidden, row0, nrows, a.dim, a.embed, v0, a.vocab, a.bf16_input, &sm, d);
  const float cap = a.softcap;
  const float k2 = 2.0f / cap * 1.44269504088896341f;
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
    if (mi * 16 >= nrows) continue;  // uniform over the block
    __syncthreads();                 // the table chunk / the previous group is no longer read
    StoreGroup(d, mi, &sm);
    __syncthreads();
    const int group_rows = min(16, nrows - mi * 16);
    for (int r = 0; r < group_rows; ++r) {
      const int row = row0 + mi * 16 + r;
      const uint64_t* mask = RowMask(a.mask_table, a.mask_index, row, a.vocab);
      const float l = v < a.vocab ? FusedLogit(sm.u.ls[r][tid], v, cap, k2, mask) : -INFINITY;
      // Tile max and first argmax (NaN never wins; reported through `bad`).
      float best = l > -INFINITY ? l : -INFINITY;
      int best_i = l > -INFINITY ? v : INT_MAX;
      for (int o = 16; o > 0; o >>= 1) {
        ArgmaxMerge(__shfl_xor_sync(kFull, best, o), __shfl_xor_sync(kFull, best_i, o), &best,
                    &best_i);
      }
      if (lane == 0) {
        w_max[warp] = best;
        w_arg[warp] = best_i;
      }
      const bool bad = __syncthreads_or(l != l) != 0;
      float tm = w_max[0];
      int targ = w_arg[0];
      for (int w = 1; w < kFWarps; ++w) ArgmaxMerge(w_max[w], w_arg[w], &tm, &targ);
      const float T = a.temperature[row];
      const float k = float(kLog2e / double(T));
      float e = 0.0f, w = 0.0f;
      if (tm > -INFINITY && !bad) e = Exp2Row(l, tm, k, &w);
      const double s = WarpSumD(double(e));
      const double q = WarpSumD(e > 0.0f ? double(e) * double(w) : 0.0);
      if (lane == 0) {
        w_s[warp] = s;
        w_q[warp] = q;
      }
      __syncthreads();
      if (tid == 0) {
        double ss = 0.0, qq = 0.0;
        for (int i = 0; i < kFWarps; ++i) {
          ss += w_s[i];
          qq += w_q[i];
        }
        TilePartial p;
        p.s = ss;
        p.q = qq;
        p.max = tm;
        p.arg = targ == INT_MAX ? -1 : targ;
        p.bad = bad ? 1 : 0;
        p.pad = 0;
        partials[int64_t(row) * tiles + tile] = p;
      }
      __syncthreads();  // w_* are rewritten by the next row
    }
  }
}

__global__ void FusedCombineKernel(int rows, int tiles, const float* __restrict__ temperature,
                                   const float* __restrict__ uniforms,
                                   const TilePartial* __restrict__ partials,
                                   RowSample* __restrict__ sample,
                                   VocabRowResult* __restrict__ out) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const TilePartial* p = partials + int64_t(row) * tiles;
  RowSample rs;
  rs.total = 0.0;
  rs.cum = 0.0;
  rs.target = 0.0;
  rs.m = -INFINITY;
  rs.k = 0.0f;
  rs.tile = -1;
  rs.past_end = 0;
  const float T = temperature[row];
  bool bad = !(T > 0.0f) || !isfinite(T);
  float m = -INFINITY;
  int argmax = -1;
  for (int t = 0; t < tiles; ++t) {
    bad |= p[t].bad != 0;
    if (p[t].arg >= 0 && p[t].max > m) {  // ascending tiles: strict > keeps the first index
      m = p[t].max;
      argmax = p[t].arg;
    }
  }
  if (bad || argmax < 0 || !isfinite(m)) {
    WriteBadRow(out + row);
    sample[row] = rs;
    return;
  }
  const float k = float(kLog2e / double(T));
  // The tiles' sums moved from their own max to m: e·2^δ, w + δ (log2 units).
  double total = 0.0, sum_ew = 0.0;
  for (int t = 0; t < tiles; ++t) {
    if (!(p[t].s > 0.0)) continue;
    const double d = (double(p[t].max) - double(m)) * double(k);
    const double alpha = exp2(d);
    total += alpha * p[t].s;
    sum_ew += alpha * (p[t].q + d * p[t].s);
  }
  if (!(total > 0.0) || !isfinite(total)) {
    WriteBadRow(out + row);
    sample[row] = rs;
    return;
  }
  float u = uniforms[row];
  if (!(u >= 0.0f)) u = 0.0f;                       // also maps NaN to 0
  if (u >= 1.0f) u = __uint_as_float(0x3f7fffffu);  // nextafter(1, 0)
  const double target = double(u) * total;
  double cum = 0.0;
  int chosen = -1, last_pos = -1;
  double cum_last = 0.0;
  for (int t = 0; t < tiles; ++t) {
    if (!(p[t].s > 0.0)) continue;
    const double ts = exp2((double(p[t].max) - double(m)) * double(k)) * p[t].s;
    if (cum + ts > target) {
      chosen = t;
      break;
    }
    last_pos = t;
    cum_last = cum;
    cum += ts;
  }
  rs.total = total;
  rs.target = target;
  rs.m = m;
  rs.k = k;
  if (chosen >= 0) {
    rs.tile = chosen;
    rs.cum = cum;
  } else {
    rs.tile = last_pos;
    rs.cum = cum_last;
    rs.past_end = 1;
  }
  sample[row] = rs;
  const double log_total = log(total);
  out[row].argmax = argmax;
  out[row].sampled = argmax;  // replaced by the tile scan
  out[row].entropy = float(fmax(0.0, log_total - kLn2 * sum_ew / total));
  out[row].lse = float(double(m) / double(T) + log_total);
}

__global__ void __launch_bounds__(kFT)
    FusedSampleKernel(FusedVocabArgs a, const RowSample* __restrict__ sample) {
  __shared__ TileSmem sm;
  __shared__ float ex[kFT];
  const int row = blockIdx.x, tid = threadIdx.x;
  const RowSample rs = sample[row];
  if (rs.tile < 0) return;  // uniform over the block
  const int v0 = rs.tile * kFT, v = v0 + tid;
  float d[kMi][kNj][4];
  TileMma(a.hidden, row, 1, a.dim, a.embed, v0, a.vocab, a.bf16_input, &sm, d);
  __syncthreads();
  StoreGroup(d, 0, &sm);
  __syncthreads();
  const float cap = a.softcap;
  const float k2 = 2.0f / cap * 1.44269504088896341f;
  const uint64_t* mask = RowMask(a.mask_table, a.mask_index, row, a.vocab);
  float e = 0.0f, w;
  if (v < a.vocab) e = Exp2Row(FusedLogit(sm.u.ls[0][tid], v, cap, k2, mask), rs.m, rs.k, &w);
  ex[tid] = e;
  __syncthreads();
  if (tid != 0) return;
  double cum = rs.cum;
  int picked = -1, last_positive = -1;
  for (int j = 0; j < kFT; ++j) {
    if (!(ex[j] > 0.0f)) continue;
    last_positive = v0 + j;
    cum += double(ex[j]);
    if (!rs.past_end && cum > rs.target) {
      picked = v0 + j;
      break;
    }
  }
  if (picked >= 0) {
    a.out[row].sampled = picked;
  } else if (last_positive >= 0) {
    a.out[row].sampled = last_positive;
  }  // else: the argmax the combine wrote
}

__global__ void __launch_bounds__(kFT)
    FusedProbsKernel(FusedVocabArgs a, const VocabRowResult* __restrict__ res,
                     const uint8_t* __restrict__ skip, int tiles, uint16_t* __restrict__ probs) {
  __shared__ TileSmem sm;
  const int tile = blockIdx.x, row0 = blockIdx.y * kFR;
  const int nrows = min(kFR, a.rows - row0);
  const int v = tile * kFT + threadIdx.x;
  // The sparse product's plan: a (row, tile) left out gets probability 0; a tile every row of
  // the block leaves out is not computed.
  if (skip != nullptr) {
    const bool kept = threadIdx.x < nrows && skip[int64_t(row0 + threadIdx.x) * tiles + tile] == 0;
    if (__syncthreads_or(kept) == 0) {
      for (int r = 0; r < nrows && v < a.vocab; ++r) probs[int64_t(row0 + r) * a.vocab + v] = 0;
      return;
    }
  }
  float d[kMi][kNj][4];
  TileMma(a.hidden, row0, nrows, a.dim, a.embed, tile * kFT, a.vocab, a.bf16_input, &sm, d);
  const float softcap = a.softcap;
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
    if (mi * 16 >= nrows) continue;  // uniform over the block
    __syncthreads();
    StoreGroup(d, mi, &sm);
    __syncthreads();
    const int group_rows = min(16, nrows - mi * 16);
    for (int r = 0; r < group_rows && v < a.vocab; ++r) {
      const int row = row0 + mi * 16 + r;
      const uint64_t* mask = RowMask(a.mask_table, a.mask_index, row, a.vocab);
      const float lse = res[row].lse;
      const float inv_t = 1.0f / a.temperature[row];
      // SoftmaxProbsBf16Kernel's formula (cuda_backend_kernels.cu), on the recomputed raw logit.
      const bool allowed = mask == nullptr || ((mask[v >> 6] >> (v & 63)) & 1u) != 0;
      const bool left_out = skip != nullptr && skip[int64_t(row) * tiles + tile] != 0;
      probs[int64_t(row) * a.vocab + v] =
          ProbBits(sm.u.ls[r][threadIdx.x], softcap, inv_t, lse, allowed && !left_out);
    }
  }
}

// The sparse self-conditioning plan of each row (cpu_vocab.cc's PlanRow at this pass's tiles):
// with q_t = 2^{δ_t}·S_t / S the exact mass of tile t and N_t its largest ‖E_v‖₂, greedily in
// tile order each tile whose mass still fits the row's budget ε is left out; the plan stands
// only if its bound B = scale·Σ_out q_t N_t ≤ 2⁻¹⁰·(L − B), L = scale·(q_max ‖E_argmax‖ −
// Σ_t q'_t N_t) ≤ ‖s‖ (q'_t = q_t less q_max in the argmax's tile), and it leaves out some mass;
// otherwise the row is dense. One thread per row; skip: [rows, tiles].
__global__ void FusedPlanKernel(FusedVocabArgs a, int tiles,
                                const TilePartial* __restrict__ partials,
                                const RowSample* __restrict__ sample, uint8_t* __restrict__ skip) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= a.rows) return;
  uint8_t* sk = skip + int64_t(row) * tiles;
  for (int t = 0; t < tiles; ++t) sk[t] = 0;
  const RowSample rs = sample[row];
  const double eps = a.sc_skip_mass[row];
  if (rs.tile < 0 || !(eps > 0.0)) return;  // bad row (reported elsewhere) or dense
  const TilePartial* p = partials + int64_t(row) * tiles;
  const int am = a.out[row].argmax;
  const double q_max = 1.0 / rs.total;  // the argmax's e is 2^0 = 1
  double left = 0.0, bound = 0.0, spread = 0.0;
  for (int t = 0; t < tiles; ++t) {
    double q = 0.0;
    if (p[t].s > 0.0)
      q = exp2((double(p[t].max) - double(rs.m)) * double(rs.k)) * p[t].s / rs.total;
    const double n_t = a.tile_norm_max[t];
    spread += (t == am / kFT ? fmax(0.0, q - q_max) : q) * n_t;
    if (left + q > eps) continue;
    left += q;
    bound += q * n_t;
    sk[t] = 1;
  }
  bool keep = left > 0.0;
  if (keep) {
    double am_norm2 = 0.0;
    for (int i = 0; i < a.dim; ++i) {
      const double x = Bf16BitsToFloat(a.embed[int64_t(am) * a.dim + i]);
      am_norm2 += x * x;
    }
    const double scale = fabs(double(a.embed_scale));
    const double b = scale * bound, lower = scale * (q_max * sqrt(am_norm2) - spread);
    keep = b <= 0x1.0p-10 * (lower - b);
  }
  if (!keep) {
    for (int t = 0; t < tiles; ++t) sk[t] = 0;
  }
}

// out[t] = max over the ids of tile t of ‖E_v‖₂ (float64 sums), rounded up by a factor 1 + 1e-6.
__global__ void __launch_bounds__(kFT)
    TileNormMaxKernel(const uint16_t* __restrict__ embed, int vocab, int dim,
                      float* __restrict__ out) {
  __shared__ double w_best[kFWarps];
  const int v = blockIdx.x * kFT + threadIdx.x;
  double ss = 0.0;
  if (v < vocab) {
    for (int i = 0; i < dim; ++i) {
      const double x = Bf16BitsToFloat(embed[int64_t(v) * dim + i]);
      ss += x * x;
    }
  }
  for (int o = 16; o > 0; o >>= 1) ss = fmax(ss, __shfl_xor_sync(kFull, ss, o));
  if (threadIdx.x % 32 == 0) w_best[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double best = 0.0;
    for (int w = 0; w < kFWarps; ++w) best = fmax(best, w_best[w]);
    out[blockIdx.x] = float(sqrt(best) * (1.0 + 1e-6));
  }
}

size_t PartialsBytes(int rows, int vocab) {
  const size_t b = size_t(rows) * FusedTiles(vocab) * sizeof(TilePartial);
  return (b + 255) / 256 * 256;
}

absl::Status CheckFused(const FusedVocabArgs& a, const char* what) {
  if (a.rows < 0 || a.vocab <= 0 || a.vocab > kMaxVocab || a.dim <= 0) {
    return absl::InvalidArgumentError(std::string(what) +
                                      ": need rows ≥ 0, dim ≥ 1 and 1 ≤ vocab ≤ 2^30");
  }
  if (a.rows == 0) return absl::OkStatus();
  if (a.hidden == nullptr || a.embed == nullptr || a.temperature == nullptr ||
      (a.mask_index != nullptr && a.mask_table == nullptr) ||
      (a.sc_skip_mass != nullptr && (a.tile_norm_max == nullptr || a.scratch == nullptr))) {
    return absl::InvalidArgumentError(std::string(what) + ": null pointer");
  }
  return absl::OkStatus();
}

// The sparse plan's flags in the scratch, after the partials and the row states.
uint8_t* SkipFlags(const FusedVocabArgs& a) {
  return static_cast<uint8_t*>(a.scratch) + PartialsBytes(a.rows, a.vocab) +
         size_t(a.rows) * sizeof(RowSample);
}

absl::Status LaunchStatus(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

uint8_t* vocab_tile::FusedSkipFlags(const FusedVocabArgs& args) { return SkipFlags(args); }

size_t FusedVocabScratchBytes(int rows, int vocab) {
  if (rows <= 0 || vocab <= 0) return 0;
  return PartialsBytes(rows, vocab) + size_t(rows) * sizeof(RowSample) +
         size_t(rows) * FusedTiles(vocab);
}

absl::Status FusedVocabStep(const FusedVocabArgs& a) {
  if (absl::Status st = CheckFused(a, "FusedVocabStep"); !st.ok()) return st;
  if (a.rows == 0) return absl::OkStatus();
  if (a.uniforms == nullptr || a.out == nullptr || a.scratch == nullptr) {
    return absl::InvalidArgumentError("FusedVocabStep: null pointer");
  }
  const int tiles = FusedTiles(a.vocab);
  auto* partials = static_cast<TilePartial*>(a.scratch);
  auto* sample =
      reinterpret_cast<RowSample*>(static_cast<char*>(a.scratch) + PartialsBytes(a.rows, a.vocab));
  const cudaStream_t s = static_cast<cudaStream_t>(a.stream);
  LaunchKernel(FusedTileKernel, dim3(tiles, (a.rows + kFR - 1) / kFR), kFT, 0, s, a, tiles,
               partials);
  LaunchKernel(FusedCombineKernel, (a.rows + 63) / 64, 64, 0, s, a.rows, tiles, a.temperature,
               a.uniforms, partials, sample, a.out);
  LaunchKernel(FusedSampleKernel, a.rows, kFT, 0, s, a, sample);
  if (a.sc_skip_mass != nullptr) {
    LaunchKernel(FusedPlanKernel, (a.rows + 63) / 64, 64, 0, s, a, tiles, partials, sample,
                 SkipFlags(a));
  }
  return LaunchStatus("FusedVocabStep");
}

absl::Status FusedTileNormMax(const uint16_t* embed, int vocab, int dim, float* out, void* stream) {
  if (vocab <= 0 || dim <= 0 || vocab > kMaxVocab) {
    return absl::InvalidArgumentError("FusedTileNormMax: need 1 ≤ vocab ≤ 2^30 and dim ≥ 1");
  }
  LaunchKernel(TileNormMaxKernel, FusedTiles(vocab), kFT, 0, static_cast<cudaStream_t>(stream),
               embed, vocab, dim, out);
  return LaunchStatus("FusedTileNormMax");
}

absl::Status FusedSoftmaxProbsBf16(const FusedVocabArgs& a, const VocabRowResult* results,
                                   uint16_t* probs) {
  if (absl::Status st = CheckFused(a, "FusedSoftmaxProbsBf16"); !st.ok()) return st;
  if (a.rows == 0) return absl::OkStatus();
  if (results == nullptr || probs == nullptr) {
    return absl::InvalidArgumentError("FusedSoftmaxProbsBf16: null pointer");
  }
  const int tiles = FusedTiles(a.vocab);
  LaunchKernel(FusedProbsKernel, dim3(tiles, (a.rows + kFR - 1) / kFR), kFT, 0,
               static_cast<cudaStream_t>(a.stream), a, results,
               a.sc_skip_mass != nullptr ? SkipFlags(a) : nullptr, tiles, probs);
  return LaunchStatus("FusedSoftmaxProbsBf16");
}

}  // namespace dgserve::cuda
