// Portable microkernels of the GEMM: std::fma on scalars, up to 4 rows × 16 columns, k ascending.
// The reference for the vector paths (same chains, so the same bits), and the path for CPUs
// without AVX2.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "engine/cpu/gemm_kernels.h"

namespace dgserve::cpu::gemm_internal {
namespace {

inline float Widen(float x) { return x; }
inline float Widen(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The bf16-input mode's flushes (gemm.h), in software. DAZ: a denormal read as a zero of its sign.
inline float Daz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }

// FTZ(fma(a, b, c)) as x86 computes it with MXCSR.FTZ (and VDPBF16PS always): a result that is
// tiny — below 2⁻¹²⁶ in magnitude after rounding with an unbounded exponent — becomes a zero of
// its sign. std::fma rounds a tiny result to a denormal instead; only a result of magnitude 2⁻¹²⁶
// exactly can be either, so that one is recomputed 2⁶⁴ times larger (exact scaling: such a result
// needs every term below 2⁻¹⁰⁰, see below) to see which side of 2⁻¹²⁶ it rounds to.
inline float FmaFtz(float a, float b, float c) {
  const float r = std::fma(a, b, c);
  const float mag = std::fabs(r);
  if (mag > FLT_MIN || !(mag == mag)) return r;  // normal (or inf / NaN)
  if (mag < FLT_MIN) return std::copysign(0.0f, r);
  // |r| = 2⁻¹²⁶: a nonzero sum that small is a multiple of the smaller ulp of c and a·b, so c
  // and a·b are both below about 2⁻¹⁰⁰; scale c and the smaller factor by 2⁶⁴ (exact).
  const float s = 0x1p64f;
  const bool a_small = std::fabs(a) <= std::fabs(b);
  const float rs = std::fma(a_small ? a * s : a, a_small ? b : b * s, c * s);
  return std::fabs(rs) < FLT_MIN * s ? std::copysign(0.0f, rs) : r;
}

// Widened B as the bf16-input mode reads it: DAZ.
inline float WidenDaz(uint16_t b) { return Daz(Widen(b)); }

template <int R>
void FtzKernel(const Tile& t) {
  float acc[R][16];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 16; ++j) acc[i][j] = t.load_c ? Daz(t.c[i * t.ldc + j]) : 0.0f;
  }
  for (int kk = 0; kk < t.kc; ++kk) {
    float bv[16];
    for (int j = 0; j < 16; ++j) {
      bv[j] = t.b_bf16 ? WidenDaz(static_cast<const uint16_t*>(t.b0)[kk * t.b_kstride + j])
                       : Daz(static_cast<const float*>(t.b0)[kk * t.b_kstride + j]);
    }
    for (int i = 0; i < R; ++i) {
      const float av = t.a[i * t.lda + kk];  // bf16(A): never denormal
      for (int j = 0; j < 16; ++j) acc[i][j] = FmaFtz(av, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 16; ++j) t.c[i * t.ldc + j] = acc[i][j];
  }
}

template <int R, typename BT>
void Kernel(const Tile& t) {
  float acc[R][16];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 16; ++j) acc[i][j] = t.load_c ? t.c[i * t.ldc + j] : 0.0f;
  }
  const BT* b = static_cast<const BT*>(t.b0);
  for (int kk = 0; kk < t.kc; ++kk) {
    float bv[16];
    for (int j = 0; j < 16; ++j) bv[j] = Widen(b[kk * t.b_kstride + j]);
    for (int i = 0; i < R; ++i) {
      const float av = t.a[i * t.lda + kk];
      for (int j = 0; j < 16; ++j) acc[i][j] = std::fma(av, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 16; ++j) t.c[i * t.ldc + j] = acc[i][j];
  }
}

template <typename BT>
void ByRows(int rows, const Tile& t) {
  switch (rows) {
    case 1: return Kernel<1, BT>(t);
    case 2: return Kernel<2, BT>(t);
    case 3: return Kernel<3, BT>(t);
    default: return Kernel<4, BT>(t);
  }
}

// Cloned for CPUs with and without FMA instructions (an ifunc picks one at load): with them
// std::fma is one instruction, without them glibc's correctly rounded fma(); both give the IEEE
// fused result, so the clone changes speed, not bits. `flatten` inlines the kernels into each
// clone.
#if defined(__clang__)
// (clang cannot combine the clones with `flatten`: one plain copy there.)
#define DGSERVE_GEMM_PORTABLE_CLONES
#else
#define DGSERVE_GEMM_PORTABLE_CLONES __attribute__((target_clones("fma", "default"), flatten))
#endif
DGSERVE_GEMM_PORTABLE_CLONES
void Run(int rows, int /*panels*/, bool bf16, const Tile& t) {
  if (bf16) {
    ByRows<uint16_t>(rows, t);
  } else {
    ByRows<float>(rows, t);
  }
}

template <typename BT>
void PackAs(int kc, const BT* src, int64_t src_kstride, float* dst, int64_t dst_kstride) {
  for (int kk = 0; kk < kc; ++kk) {
    for (int j = 0; j < 16; ++j) dst[kk * dst_kstride + j] = Widen(src[kk * src_kstride + j]);
  }
}

void Pack(int kc, const void* src, int64_t src_kstride, bool bf16, float* dst,
          int64_t dst_kstride) {
  if (bf16) {
    PackAs(kc, static_cast<const uint16_t*>(src), src_kstride, dst, dst_kstride);
  } else {
    PackAs(kc, static_cast<const float*>(src), src_kstride, dst, dst_kstride);
  }
}

DGSERVE_GEMM_PORTABLE_CLONES
void RunFtz(int rows, int /*panels*/, bool bf16, const Tile& t) {
  Tile u = t;
  u.b_bf16 = bf16;
  switch (rows) {
    case 1: return FtzKernel<1>(u);
    case 2: return FtzKernel<2>(u);
    case 3: return FtzKernel<3>(u);
    default: return FtzKernel<4>(u);
  }
}

}  // namespace

KernelSet PortableKernels() { return {4, 1, &Run, &Pack}; }
KernelSet PortableFtzKernels() { return {4, 1, &RunFtz, &Pack}; }

}  // namespace dgserve::cpu::gemm_internal
