#include "engine/cuda/cuda_nvfp4.h"

#include <math.h>

#include <cmath>
#include <string>

#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_launch.cuh"
#include "engine/cuda/cuda_mma.cuh"

namespace dgserve::cuda {
namespace {

// ---- The formats' values (common/fp8.h, bit for bit) -------------------------------------------

// x rounded to the nearest e4m3 value, saturating at ±448 (common/fp8.h's RoundToE4m3): below
// 2⁻⁶ the multiples of 2⁻⁹ by the FPU's nearest-even addition, else 3 mantissa bits by integer
// rounding (a carry moves into the exponent).
__device__ __forceinline__ float RoundToE4m3(float x) {
  const uint32_t b = __float_as_uint(x);
  const uint32_t sign = b & 0x80000000u, ab = b & 0x7fffffffu;
  uint32_t r;
  if (ab >= 0x43e00000u) {  // |x| ≥ 448 (and NaN, as the CPU's)
    r = 0x43e00000u;
  } else if (ab < 0x3c800000u) {    // |x| < 2⁻⁶
    constexpr float kM = 24576.0f;  // 1.5 · 2¹⁴: its ulp is 2⁻⁹
    r = __float_as_uint(__fsub_rn(__fadd_rn(__uint_as_float(ab), kM), kM));
  } else {
    r = (ab + 0x7ffffu + ((ab >> 20) & 1u)) & ~0xfffffu;
  }
  return __uint_as_float(r | sign);
}

// An e4m3 code's value (common/fp8.h's E4m3ToFloat; the loader refuses NaN codes): normal codes
// rebiased into a float32 (127 − 7 = 120), subnormal codes m · 2⁻⁹.
__device__ __forceinline__ float E4m3Value(uint32_t c) {
  const float mag = (c & 0x78u) == 0 ? __fmul_rn(float(c & 7u), 0x1p-9f)
                                     : __uint_as_float(((c & 0x7fu) << 20) + (120u << 23));
  return (c & 0x80u) ? -mag : mag;
}

// An e2m1 code's value (common/fp8.h's E2m1ToFloat): exponent bits e = (c >> 1) & 3 (bias 1),
// mantissa bit m = c & 1; e = 0 is the subnormal m · 0.5, else 2^(e−1) · (1 + m/2).
__device__ __forceinline__ float E2m1Value(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const float mag = e == 0 ? (m ? 0.5f : 0.0f) : __uint_as_float(((e + 126u) << 23) | (m << 22));
  return (c & 8u) ? -mag : mag;
}

// x rounded to e2m1 with nearest-even ties, saturating at ±6, as a value (common/fp8.h's
// FloatToE2m1 then E2m1ToFloat: the same bounds, x < 0 giving the negative code, so −0.1 gives
// −0 and −0 gives +0).
__device__ __forceinline__ float RoundToE2m1(float x) {
  const float a = fabsf(x);
  float m;
  if (a <= 0.25f) {
    m = 0.0f;
  } else if (a < 0.75f) {
    m = 0.5f;
  } else if (a <= 1.25f) {
    m = 1.0f;
  } else if (a < 1.75f) {
    m = 1.5f;
  } else if (a <= 2.5f) {
    m = 2.0f;
  } else if (a < 3.5f) {
    m = 3.0f;
  } else if (a <= 5.0f) {
    m = 4.0f;
  } else {
    m = 6.0f;
  }
  return x < 0.0f ? -m : m;
}

// One 16-input block of an activation row quantized in place to its dequantized values
// e2m1(x_q) · sx, exactly as cpu::QuantizeRowNvfp4Global (engine/cpu/gemm_quant.cc): the same
// float32 operations in the same order, each correctly rounded (the _rn intrinsics: no
// contraction, IEEE division). inv_g = 1 / g, computed once as the CPU does.
__device__ __forceinline__ void QuantizeBlock(float v[16], float g, float inv_g) {
  constexpr float kRcp6 = 1.0f / 6.0f;
  float absmax = 0.0f;
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const float a = fabsf(v[c]);
    absmax = absmax < a ? a : absmax;  // std::max(absmax, a)
  }
  const float sx = RoundToE4m3(__fmul_rn(g, __fmul_rn(absmax, kRcp6)));
  const float o = sx != 0.0f ? __fdiv_rn(1.0f, __fmul_rn(sx, inv_g)) : 0.0f;
#pragma unroll
  for (int c = 0; c < 16; ++c) v[c] = __fmul_rn(RoundToE2m1(__fmul_rn(v[c], o)), sx);
}

__global__ void QuantizeKernel(const float* x, int64_t blocks, float g, uint16_t* q) {
  const float inv_g = __fdiv_rn(1.0f, g);
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    float v[16];
    for (int c = 0; c < 16; ++c) v[c] = x[b * 16 + c];
    QuantizeBlock(v, g, inv_g);
    for (int c = 0; c < 16; ++c) q[b * 16 + c] = ToBf16Bits(v[c]);  // exact (see the header)
  }
}

// ---- The grouped GEMM ---------------------------------------------------------------------------
// Block: 4 warps; a tile of 32 gathered rows of one expert (blockIdx.z; blockIdx.x the tile within
// its group, so the grid depends only on host-known numbers and blocks past the group exit) × 64
// weight rows (blockIdx.y), the reduction in chunks of 64 inputs. Per chunk:
//  * A: thread t quantizes row t / 4, inputs 16·(t % 4) … +15 — exactly one NVFP4 block, so the
//    block's absmax is the thread's own — and stores the dequantized values as bf16 (exact);
//    weight-only (kATerms = 3): it stores the exact three-term split of the float32 inputs
//    (SplitTermBits) instead, as three A tiles;
//  * W: thread t widens four pieces (weight row t / 8 + 16 i, 8 inputs at 8·(t % 8)), each one
//    packed word and one e4m3 block scale fetched one chunk ahead into registers, as
//    bf16(e2m1(q) · sw) (exact) into shared memory;
//  * warp w multiplies all 32 rows by weight rows 16w … 16w+15 (two n8 fragments) with mma.sync
//    m16n8k16 bf16, the k16 steps in ascending order (weight-only: terms lo, mid, hi within a
//    step, as MoeMmaKernel): each output is one fixed-order float32 accumulation that does not
//    depend on the other rows of the tile or the batch.
// Gated (gate_up): the tile's weight rows 16w … 16w+7 are gate rows col0 + 8w + j and 16w+8 … +15
// the up rows out + col0 + 8w + j, so gelu(g)·u is formed in registers.
constexpr int kRows = 32;
constexpr int kW = 64;
constexpr int kK = 64;
constexpr int kLd = kK + 8;  // bf16 per shared row: 144 bytes, ldmatrix rows on distinct banks
constexpr int kThreads = 128;
// kATerms: bf16 A tiles per chunk, 1 (W4A4: the quantized activations) or 3 (weight-only: the
// exact split of the float32 activations).
constexpr size_t SharedBytes(int a_terms) {
  return size_t(a_terms * kRows + kW) * kLd * sizeof(uint16_t);
}

template <bool kGated, int kATerms>
__global__ void __launch_bounds__(kThreads)
    Nvfp4MmaKernel(const float* x, const int32_t* gather, const int32_t* offsets, int dense_rows,
                   Nvfp4Weights w, int in, int out, const float* row_scale, float* y) {
  static_assert(kATerms == 1 || kATerms == 3, "W4A4 (one term) or weight-only (three)");
  const int e = blockIdx.z;
  const int begin = offsets != nullptr ? offsets[e] : 0;
  const int end = offsets != nullptr ? offsets[e + 1] : dense_rows;
  const int r0 = begin + int(blockIdx.x) * kRows;
  if (r0 >= end) return;  // uniform: no rows for this block
  const int nrows = min(kRows, end - r0);
  uint16_t* As = DynamicShared<uint16_t>();   // [kATerms][kRows][kLd]
  uint16_t* Ws = As + kATerms * kRows * kLd;  // [kW][kLd]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kCols = kGated ? kW / 2 : kW;
  const int col0 = blockIdx.y * kCols;
  const int64_t w_rows = kGated ? 2 * int64_t(out) : int64_t(out);
  const int words = in / 8, blocks = in / 16;
  const float g = kATerms == 1 ? w.input_global[e] : 1.0f;  // weight-only: no quantization
  const float inv_g = __fdiv_rn(1.0f, g);
  // The weight rows (of all experts' rows) this thread widens; −1: past the layer's rows.
  int64_t w_row[4];
  for (int i = 0; i < 4; ++i) {
    const int c = threadIdx.x / 8 + 16 * i;
    int64_t r;
    if (kGated) {
      const int f = col0 + 8 * (c / 16) + (c % 8);
      r = f < out ? ((c % 16) < 8 ? f : out + f) : -1;
    } else {
      r = col0 + c < out ? col0 + c : -1;
    }
    w_row[i] = r >= 0 ? int64_t(e) * w_rows + r : -1;
  }
  const int wk = (threadIdx.x % 8) * 8;
  uint32_t word[4];
  uint32_t scale[4];
  auto fetch_w = [&](int k0) {  // global → registers, one chunk ahead
    const int kk = k0 + wk;
    for (int i = 0; i < 4; ++i) {
      const bool live = w_row[i] >= 0 && kk < in;
      word[i] = live ? w.codes[w_row[i] * words + kk / 8] : 0u;  // code 0: +0
      scale[i] = live ? w.block_scales[w_row[i] * blocks + kk / 16] : 0u;
    }
  };
  auto widen_w = [&]() {  // registers → bf16(e2m1 · e4m3) in shared memory (exact)
    for (int i = 0; i < 4; ++i) {
      uint16_t* dst = Ws + (threadIdx.x / 8 + 16 * i) * kLd + wk;
      const float sw = E4m3Value(scale[i]);
      for (int q = 0; q < 8; ++q) dst[q] = ToBf16Bits(__fmul_rn(E2m1Value(word[i] >> (4 * q)), sw));
    }
  };
  const int ar = threadIdx.x / 4, ak = (threadIdx.x % 4) * 16;
  const int64_t a_src = ar < nrows ? (gather != nullptr ? gather[r0 + ar] : r0 + ar) : -1;
  auto load_a = [&](int k0) {
    const int kk = k0 + ak;
    const bool live = a_src >= 0 && kk < in;  // in is a multiple of 16: whole blocks
    float v[16];
    for (int q = 0; q < 16; ++q) v[q] = live ? x[a_src * in + kk + q] : 0.0f;
    if (kATerms == 1) {
      QuantizeBlock(v, g, inv_g);
      for (int q = 0; q < 16; ++q) As[ar * kLd + ak + q] = ToBf16Bits(v[q]);  // exact
    } else {
      for (int term = 0; term < kATerms; ++term) {  // hi, mid, lo: x exactly
        for (int q = 0; q < 16; ++q) {
          As[(term * kRows + ar) * kLd + ak + q] = SplitTermBits(v[q], term);
        }
      }
    }
  };
  float acc[2][2][4];
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;
  fetch_w(0);
  for (int k0 = 0; k0 < in; k0 += kK) {
    load_a(k0);
    widen_w();
    if (k0 + kK < in) fetch_w(k0 + kK);
    __syncthreads();
    const int steps = min(kK, in - k0) / 16;
    for (int s = 0; s < steps; ++s) {
      uint32_t b[4];  // b[0..1]: weight rows 16w … 16w+7, b[2..3]: 16w+8 … 16w+15
      mma::LdMatrixX4(
          b, Ws + (warp * 16 + (lane / 16) * 8 + lane % 8) * kLd + s * 16 + ((lane / 8) % 2) * 8);
      for (int term = kATerms - 1; term >= 0; --term) {  // weight-only: lo, mid, hi
        for (int mf = 0; mf < 2; ++mf) {
          uint32_t a[4];
          mma::LdMatrixX4(
              a, As + (term * kRows + mf * 16 + lane % 16) * kLd + s * 16 + (lane / 16) * 8);
          mma::MmaBf16M16N8K16(acc[mf][0], a, b);
          mma::MmaBf16M16N8K16(acc[mf][1], a, b + 2);
        }
      }
    }
    __syncthreads();  // As and Ws are rewritten next
  }
  const int gq = lane >> 2, t = lane & 3;
  const float* alpha = w.alpha + int64_t(e) * w_rows;
  for (int mf = 0; mf < 2; ++mf) {
    for (int i = 0; i < 4; ++i) {
      const int m = mf * 16 + gq + (i >= 2 ? 8 : 0);
      if (m >= nrows) continue;
      const int64_t n = r0 + m;
      const int j = 2 * t + (i % 2);
      if (kGated) {
        const int f = col0 + 8 * warp + j;
        if (f < out) {
          constexpr float kSqrt2OverPi = 0.7978845608028654f;
          const float gv = __fmul_rn(alpha[f], acc[mf][0][i]);
          const float u = __fmul_rn(alpha[out + f], acc[mf][1][i]);
          y[n * out + f] =
              0.5f * gv * (1.0f + tanhf(kSqrt2OverPi * (gv + 0.044715f * gv * gv * gv))) * u;
        }
      } else {
        for (int nb = 0; nb < 2; ++nb) {
          const int d = col0 + 16 * warp + 8 * nb + j;
          if (d >= out) continue;
          const float v = __fmul_rn(alpha[d], acc[mf][nb][i]);
          y[n * out + d] = row_scale != nullptr ? __fmul_rn(row_scale[n], v) : v;
        }
      }
    }
  }
}

absl::Status CheckArgs(const char* what, const Nvfp4Weights& w, int rows, int k, int E, int in,
                       int out) {
  if (rows < 0 || k < 1 || E < k || E > 65535 || in <= 0 || in % 16 != 0 || out <= 0) {
    return absl::InvalidArgumentError(
        std::string(what) +
        ": need rows ≥ 0, 1 ≤ k ≤ experts ≤ 65535, inputs a positive multiple of 16, outputs > 0");
  }
  if (w.codes == nullptr || w.block_scales == nullptr || w.alpha == nullptr ||
      (w.input_global == nullptr && !w.weight_only)) {
    return absl::InvalidArgumentError(
        std::string(what) + ": NVFP4 weights need codes, block scales, alpha and (W4A4) g");
  }
  return absl::OkStatus();
}

// Launches Nvfp4MmaKernel<kGated, 1> (W4A4) or <kGated, 3> (weight-only) as w says.
template <bool kGated>
void LaunchNvfp4(dim3 grid, void* stream, const float* x, const int32_t* gather,
                 const int32_t* offsets, int dense_rows, const Nvfp4Weights& w, int in, int out,
                 const float* row_scale, float* y) {
  if (w.weight_only) {
    LaunchKernel(Nvfp4MmaKernel<kGated, 3>, grid, kThreads, SharedBytes(3), S(stream), x, gather,
                 offsets, dense_rows, w, in, out, row_scale, y);
  } else {
    LaunchKernel(Nvfp4MmaKernel<kGated, 1>, grid, kThreads, SharedBytes(1), S(stream), x, gather,
                 offsets, dense_rows, w, in, out, row_scale, y);
  }
}

}  // namespace

absl::Status QuantizeNvfp4Activations(const float* x, int rows, int in, float g, uint16_t* q,
                                      void* stream) {
  if (rows < 0 || in <= 0 || in % 16 != 0 || !(g > 0.0f) || !std::isfinite(g)) {
    return absl::InvalidArgumentError(
        "QuantizeNvfp4Activations: need rows ≥ 0, in a positive multiple of 16, 0 < g finite");
  }
  if (rows == 0) return absl::OkStatus();
  const int64_t blocks = int64_t(rows) * (in / 16);
  const int64_t grid = (blocks + 255) / 256;
  LaunchKernel(QuantizeKernel, int(grid < 65535 ? grid : 65535), 256, 0, S(stream), x, blocks, g,
               q);
  return Check("QuantizeNvfp4Activations");
}

absl::Status MoeGateUpNvfp4(const float* x, const int32_t* gather, const int32_t* offsets,
                            const Nvfp4Weights& w, int rows, int k, int num_experts, int dim,
                            int width, float* act, void* stream) {
  if (absl::Status st = CheckArgs("MoeGateUpNvfp4", w, rows, k, num_experts, dim, width);
      !st.ok()) {
    return st;
  }
  if (rows == 0) return absl::OkStatus();
  // A group holds at most `rows` rows (each token row picks k distinct experts).
  const dim3 grid((rows + kRows - 1) / kRows, (width + kW / 2 - 1) / (kW / 2), num_experts);
  LaunchNvfp4<true>(grid, stream, x, gather, offsets, 0, w, dim, width, nullptr, act);
  return Check("MoeGateUpNvfp4");
}

absl::Status MoeDownNvfp4(const float* act, const int32_t* offsets, const float* slot_weight,
                          const Nvfp4Weights& w, int rows, int k, int num_experts, int width,
                          int dim, float* y, void* stream) {
  if (absl::Status st = CheckArgs("MoeDownNvfp4", w, rows, k, num_experts, width, dim); !st.ok()) {
    return st;
  }
  if (rows == 0) return absl::OkStatus();
  const dim3 grid((rows + kRows - 1) / kRows, (dim + kW - 1) / kW, num_experts);
  LaunchNvfp4<false>(grid, stream, act, nullptr, offsets, 0, w, width, dim, slot_weight, y);
  return Check("MoeDownNvfp4");
}

absl::Status DenseLinearNvfp4(const float* x, const Nvfp4Weights& w, int rows, int in, int out,
                              float* y, void* stream) {
  if (absl::Status st = CheckArgs("DenseLinearNvfp4", w, rows, 1, 1, in, out); !st.ok()) {
    return st;
  }
  if (rows == 0) return absl::OkStatus();
  const dim3 grid((rows + kRows - 1) / kRows, (out + kW - 1) / kW, 1);
  LaunchNvfp4<false>(grid, stream, x, nullptr, nullptr, rows, w, in, out, nullptr, y);
  return Check("DenseLinearNvfp4");
}

}  // namespace dgserve::cuda
