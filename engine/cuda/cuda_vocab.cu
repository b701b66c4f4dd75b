#include "engine/cuda/cuda_vocab.h"

#include <climits>
#include <string>

#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"

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

}  // namespace dgserve::cuda
