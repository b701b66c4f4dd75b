#include "engine/cuda/cuda_fp8.h"

#include <math.h>

#include <string>

#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_launch.cuh"
#include "engine/cuda/cuda_mma.cuh"

namespace dgserve::cuda {
namespace {

// ---- Per-token quantization (the bits of common/fp8.h and cpu::QuantizeRowFp8) ---------------

constexpr float kE4m3Max = 448.0f;
// vLLM's min_scaling_factor<float8_e4m3fn>: 1 / (448 · 512), rounded to float32 once.
constexpr float kMinScale = 1.0f / (448.0f * 512.0f);

// s_x of a row whose largest |x| is `absmax`.
__device__ __forceinline__ float TokenScale(float absmax) {
  return fmaxf(__fdiv_rn(absmax, kE4m3Max), kMinScale);
}

// x rounded to the nearest e4m3 value, ties to even, saturating at ±448 (a NaN saturates too):
// RoundToE4m3 of common/fp8.h on the float32 bits.
__device__ __forceinline__ float RoundE4m3(float x) {
  const uint32_t b = __float_as_uint(x);
  const uint32_t sign = b & 0x80000000u, ab = b & 0x7fffffffu;
  uint32_t r;
  if (ab >= 0x43e00000u) {  // |x| ≥ 448
    r = 0x43e00000u;
  } else if (ab < 0x3c800000u) {  // |x| < 2⁻⁶: multiples of 2⁻⁹, nearest even by the adder
    const float m = 24576.0f;     // 1.5 · 2¹⁴: its ulp is 2⁻⁹
    r = __float_as_uint(__fsub_rn(__fadd_rn(__uint_as_float(ab), m), m));
  } else {  // 3 mantissa bits, nearest even (a carry moves into the exponent)
    r = (ab + 0x7ffffu + ((ab >> 20) & 1u)) & ~0xfffffu;
  }
  return __uint_as_float(r | sign);
}

// The e4m3 code of v, an e4m3 value (RoundE4m3's result): subnormals m · 2⁻⁹ give m, normal
// values their exponent rebiased (127 → 7) and 3 mantissa bits.
__device__ __forceinline__ uint32_t E4m3Code(float v) {
  const uint32_t b = __float_as_uint(v), ab = b & 0x7fffffffu;
  const uint32_t sign = (b >> 24) & 0x80u;
  if (ab < 0x3c800000u) return sign | uint32_t(__fmul_rn(__uint_as_float(ab), 512.0f));
  return sign | ((ab >> 20) - (120u << 3));
}

__device__ __forceinline__ uint32_t QuantizeCode(float x, float scale) {
  return E4m3Code(RoundE4m3(__fdiv_rn(x, scale)));
}

constexpr int kQuantWarps = 4;  // rows per block, one warp each

__global__ void QuantizeRowsKernel(const float* x, int rows, int k, uint8_t* codes, float* scales) {
  const int row = blockIdx.x * kQuantWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;  // the whole warp
  const float* xr = x + int64_t(row) * k;
  float m = 0.0f;  // the max is exact in any order
  for (int c = lane; c < k; c += 32) m = fmaxf(m, fabsf(xr[c]));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float s = TokenScale(m);
  if (lane == 0) scales[row] = s;
  for (int c = lane; c < k; c += 32) codes[int64_t(row) * k + c] = uint8_t(QuantizeCode(xr[c], s));
}

// ---- The grouped GEMM on mma.m16n8k32 .e4m3 -----------------------------------------------------
// Block: 4 warps, 32 gathered rows × 64 weight rows, the reduction in chunks of 64 inputs (two
// k32 steps). Before the loop the block computes its rows' s_x (4 threads a row over the whole
// row); each chunk of A is then read as float32, gathered, quantized to codes and stored in
// shared memory, and the chunk of W copied there as bytes (16-byte cp.async when `in` is a
// multiple of 16). Both tiles are row-major with k contiguous, so every fragment register is one
// aligned 32-bit word (cuda_mma.cuh). Warp w owns tile weight rows 16w … 16w+15 (two n8 fragments)
// for all 32 rows (two m16 fragments). Gated: its fragment 0 holds the gate rows col0 + 8w + j and
// fragment 1 the up rows of the same j, so gelu(gate)·up is formed in registers. Rows of 80
// bytes: the eight rows g = 0..7 of a fragment load start on banks 20g mod 32, all distinct.
// Block (blockIdx.x = group e · tiles + row tile t, blockIdx.y = column tile); a block whose row
// tile is past its group's rows exits.
constexpr int kRows = 32;
constexpr int kW = 64;
constexpr int kK = 64;
constexpr int kLd = kK + 16;
constexpr int kThreads = 128;

// The aligned 32-bit word at p (shared memory): four e4m3 codes, the lowest address in the low
// byte (little-endian, the fragment order of cuda_mma.cuh).
__device__ __forceinline__ uint32_t Word(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <bool kGated>
__global__ void __launch_bounds__(kThreads)
    Fp8GemmKernel(const float* x, const int32_t* gather, const int32_t* offsets, int group_rows,
                  int tiles, const uint8_t* w, const float* w_scales, int in, int out,
                  const float* row_scale, float* y) {
  __align__(16) __shared__ uint8_t As[kRows * kLd];
  __align__(16) __shared__ uint8_t Ws[kW * kLd];
  __shared__ float sx[kRows];
  const int e = blockIdx.x / tiles, t_row = blockIdx.x % tiles;
  const int lo = offsets != nullptr ? offsets[e] : 0;
  const int hi = offsets != nullptr ? offsets[e + 1] : group_rows;
  const int r0 = lo + t_row * kRows;
  const int nrows = min(kRows, hi - r0);
  if (nrows <= 0) return;  // the whole block
  const int64_t w_rows = kGated ? 2 * int64_t(out) : int64_t(out);
  const uint8_t* we = w + int64_t(e) * w_rows * in;
  const float* se = w_scales + int64_t(e) * w_rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col0 = blockIdx.y * (kGated ? kW / 2 : kW);

  // s_x of the tile's rows: row threadIdx.x / 4, every fourth input from threadIdx.x % 4.
  const int ar = threadIdx.x / 4;
  const int64_t a_src = ar < nrows ? (gather != nullptr ? gather[r0 + ar] : r0 + ar) : -1;
  {
    float m = 0.0f;
    if (a_src >= 0) {
      for (int c = threadIdx.x % 4; c < in; c += 4) m = fmaxf(m, fabsf(x[a_src * in + c]));
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    if (threadIdx.x % 4 == 0) sx[ar] = TokenScale(m);
  }
  __syncthreads();
  const float a_scale = sx[ar];

  // The weight rows of this thread's two 16-byte pieces: tile row c = (threadIdx.x + 128 i) / 4.
  int64_t w_src[2];
  for (int i = 0; i < 2; ++i) {
    const int c = (threadIdx.x + kThreads * i) / 4;
    if (kGated) {
      const int f = col0 + 8 * (c / 16) + (c % 8);
      w_src[i] = f < out ? ((c % 16) < 8 ? f : out + f) : -1;
    } else {
      w_src[i] = col0 + c < out ? col0 + c : -1;
    }
  }
  const int w_off = (threadIdx.x % 4) * 16;
  const bool vec = in % 16 == 0;
  const int g = lane >> 2, t = lane & 3;

  float acc[2][2][4];
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b)
      for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.0f;
  for (int k0 = 0; k0 < in; k0 += kK) {
    {  // A: row ar, 16 inputs at (threadIdx.x % 4) · 16, quantized with the row's s_x.
      const int c0 = (threadIdx.x % 4) * 16;
      uint32_t* dst = reinterpret_cast<uint32_t*>(As + ar * kLd + c0);
      for (int q4 = 0; q4 < 4; ++q4) {
        uint32_t word = 0;
        for (int q = 0; q < 4; ++q) {
          const int kk = k0 + c0 + 4 * q4 + q;
          const float v = a_src >= 0 && kk < in ? x[a_src * in + kk] : 0.0f;
          word |= QuantizeCode(v, a_scale) << (8 * q);
        }
        dst[q4] = word;
      }
    }
    for (int i = 0; i < 2; ++i) {  // W: 16 codes of tile row c at w_off (zeros past the row)
      const int c = (threadIdx.x + kThreads * i) / 4;
      const int kk = k0 + w_off;
      uint32_t* dst = reinterpret_cast<uint32_t*>(Ws + c * kLd + w_off);
      if (w_src[i] >= 0 && vec && kk + 16 <= in) {
        mma::CpAsync16(dst, we + w_src[i] * in + kk);
      } else {
        for (int q4 = 0; q4 < 4; ++q4) {
          uint32_t word = 0;
          for (int q = 0; q < 4; ++q) {
            const int kq = kk + 4 * q4 + q;
            if (w_src[i] >= 0 && kq < in) word |= uint32_t(we[w_src[i] * in + kq]) << (8 * q);
          }
          dst[q4] = word;
        }
      }
    }
    mma::CpAsyncCommit();
    mma::CpAsyncWaitAll();
    __syncthreads();
    const int steps = (min(kK, in - k0) + 31) / 32;
    for (int s = 0; s < steps; ++s) {
      const int kb = s * 32 + 4 * t;
      uint32_t b[2][2];
      for (int nb = 0; nb < 2; ++nb) {
        const uint8_t* wrow = Ws + (warp * 16 + nb * 8 + g) * kLd;
        b[nb][0] = Word(wrow + kb);
        b[nb][1] = Word(wrow + kb + 16);
      }
      for (int mf = 0; mf < 2; ++mf) {
        const uint8_t* arow = As + (mf * 16 + g) * kLd;
        const uint32_t a[4] = {Word(arow + kb), Word(arow + 8 * kLd + kb), Word(arow + kb + 16),
                               Word(arow + 8 * kLd + kb + 16)};
        mma::MmaE4m3M16N8K32(acc[mf][0], a, b[0]);
        mma::MmaE4m3M16N8K32(acc[mf][1], a, b[1]);
      }
    }
    __syncthreads();  // both tiles are rewritten next
  }
  for (int mf = 0; mf < 2; ++mf) {
    for (int i = 0; i < 4; ++i) {
      const int m = mf * 16 + g + (i >= 2 ? 8 : 0);
      if (m >= nrows) continue;
      const int64_t n = r0 + m;
      const int j = 2 * t + (i % 2);
      const float s = sx[m];
      if (kGated) {
        const int f = col0 + 8 * warp + j;
        if (f < out) {
          const float gv = __fmul_rn(s, __fmul_rn(se[f], acc[mf][0][i]));
          const float u = __fmul_rn(s, __fmul_rn(se[out + f], acc[mf][1][i]));
          constexpr float kSqrt2OverPi = 0.7978845608028654f;
          y[n * out + f] =
              0.5f * gv * (1.0f + tanhf(kSqrt2OverPi * (gv + 0.044715f * gv * gv * gv))) * u;
        }
      } else {
        for (int nb = 0; nb < 2; ++nb) {
          const int d = col0 + 16 * warp + 8 * nb + j;
          if (d >= out) continue;
          float v = __fmul_rn(s, __fmul_rn(se[d], acc[mf][nb][i]));
          if (row_scale != nullptr) v = __fmul_rn(row_scale[n], v);
          y[n * out + d] = v;
        }
      }
    }
  }
}

absl::Status CheckShape(const char* what, int rows, int k, int E, int in, int out,
                        const Fp8Weights& w) {
  if (rows < 0 || k < 1 || E < k || in <= 0 || out <= 0) {
    return absl::InvalidArgumentError(std::string(what) +
                                      ": need rows ≥ 0, 1 ≤ k ≤ experts and positive widths");
  }
  if (w.codes == nullptr || w.scales == nullptr) {
    return absl::InvalidArgumentError(std::string(what) + ": FP8 weights need codes and scales");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantizeRowsFp8(const float* x, int rows, int k, uint8_t* codes, float* scales,
                             void* stream) {
  if (rows < 0 || k <= 0) return absl::InvalidArgumentError("QuantizeRowsFp8: rows ≥ 0, k > 0");
  if (rows == 0) return absl::OkStatus();
  LaunchKernel(QuantizeRowsKernel, (rows + kQuantWarps - 1) / kQuantWarps, 32 * kQuantWarps, 0,
               S(stream), x, rows, k, codes, scales);
  return Check("QuantizeRowsFp8");
}

absl::Status MoeGateUpFp8(const float* x, const int32_t* gather, const int32_t* offsets,
                          const Fp8Weights& w, int rows, int k, int num_experts, int dim, int width,
                          float* act, void* stream) {
  if (absl::Status st = CheckShape("MoeGateUpFp8", rows, k, num_experts, dim, width, w); !st.ok()) {
    return st;
  }
  if (rows == 0) return absl::OkStatus();
  const int tiles = (rows + kRows - 1) / kRows;  // an expert has at most `rows` gathered rows
  const dim3 grid(num_experts * tiles, (width + kW / 2 - 1) / (kW / 2));
  const float* no_scale = nullptr;
  LaunchKernel(Fp8GemmKernel<true>, grid, kThreads, 0, S(stream), x, gather, offsets, 0, tiles,
               w.codes, w.scales, dim, width, no_scale, act);
  return Check("MoeGateUpFp8");
}

absl::Status MoeDownFp8(const float* act, const int32_t* offsets, const float* slot_weight,
                        const Fp8Weights& w, int rows, int k, int num_experts, int width, int dim,
                        float* y, void* stream) {
  if (absl::Status st = CheckShape("MoeDownFp8", rows, k, num_experts, width, dim, w); !st.ok()) {
    return st;
  }
  if (rows == 0) return absl::OkStatus();
  const int tiles = (rows + kRows - 1) / kRows;
  const dim3 grid(num_experts * tiles, (dim + kW - 1) / kW);
  const int32_t* no_gather = nullptr;
  LaunchKernel(Fp8GemmKernel<false>, grid, kThreads, 0, S(stream), act, no_gather, offsets, 0,
               tiles, w.codes, w.scales, width, dim, slot_weight, y);
  return Check("MoeDownFp8");
}

absl::Status DenseLinearFp8(const float* x, const Fp8Weights& w, int rows, int in, int out,
                            float* y, void* stream) {
  if (absl::Status st = CheckShape("DenseLinearFp8", rows, 1, 1, in, out, w); !st.ok()) return st;
  if (rows == 0) return absl::OkStatus();
  // One group of `rows` rows: offsets nullptr, no gather, no row scale.
  const int tiles = (rows + kRows - 1) / kRows;
  const dim3 grid(tiles, (out + kW - 1) / kW);
  const int32_t* none = nullptr;
  const float* no_scale = nullptr;
  LaunchKernel(Fp8GemmKernel<false>, grid, kThreads, 0, S(stream), x, none, none, rows, tiles,
               w.codes, w.scales, in, out, no_scale, y);
  return Check("DenseLinearFp8");
}

}  // namespace dgserve::cuda
