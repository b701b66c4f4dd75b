// AVX2 widening of quantized weight panels (gemm_quant.h), 8 columns at a time. e4m3: normal
// codes by placing exponent and mantissa into a float32 and rebiasing (exact), subnormal codes
// as m · 2⁻⁹ (exact), sign or-ed in. int4: nibble − 8 converted exactly, times the group scale
// (one rounding, the same as the portable version's).
#include <cpuid.h>
#include <immintrin.h>

#include <cstdint>

#include "common/fp8.h"
#include "engine/cpu/gemm_quant.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace dgserve::cpu::quant_internal {
namespace {

inline __attribute__((always_inline)) __m256 E4m3x8(__m256i c) {
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(7))),
                                   _mm256_set1_ps(0x1p-9f));
  const __m256i is_sub =
      _mm256_cmpeq_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
  const __m256 v = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, _mm256_castsi256_ps(is_sub));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

void Fp8(int kc, const uint8_t* codes, float* dst) {
  for (int i = 0; i < kc * 16; i += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    _mm256_storeu_ps(dst + i, E4m3x8(_mm256_cvtepu8_epi32(b)));
  }
}

void Int4(int kc, int k0, const uint8_t* bytes, const float* scales, int group, float* dst) {
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m256i eight = _mm256_set1_epi32(8);
  int g = k0 / group, left = (g + 1) * group - k0;  // k steps left in group g
  for (int kk = 0; kk < kc; ++kk, --left) {
    if (left == 0) ++g, left = group;
    const float* s = scales + size_t(g) * 16;
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + size_t(kk) * 8));
    const __m128i lo = _mm_and_si128(v, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    const __m256i q0 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(lo), eight);
    const __m256i q1 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(hi), eight);
    float* d = dst + size_t(kk) * 16;
    _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), _mm256_loadu_ps(s)));
    _mm256_storeu_ps(d + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(q1), _mm256_loadu_ps(s + 8)));
  }
}

// max(a, b) as the standard library's, without instantiating a template under this file's
// target options.
inline float MaxF(float a, float b) { return a < b ? b : a; }

// RoundToE4m3 (common/fp8.h) on 8 lanes: the same integer and float steps, so the same bits.
inline __attribute__((always_inline)) __m256 RoundE4m3x8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(b, _mm256_set1_epi32(int(0x80000000u)));
  const __m256i ab = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(ab, 20), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(ab, _mm256_set1_epi32(0x7ffff)), odd),
                       _mm256_set1_epi32(int(~0xfffffu)));
  const __m256 m = _mm256_set1_ps(24576.0f);
  const __m256 t = _mm256_sub_ps(_mm256_add_ps(_mm256_castsi256_ps(ab), m), m);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), ab);
  r = _mm256_blendv_epi8(r, _mm256_castps_si256(t), small);
  const __m256i big = _mm256_cmpgt_epi32(ab, _mm256_set1_epi32(0x43dfffff));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x43e00000), big);
  return _mm256_castsi256_ps(_mm256_or_si256(r, sign));
}

float QuantizeFp8(const float* x, int k, float* q) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  int c = 0;
  for (; c + 8 <= k; c += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + c), absmask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float absmax = 0.0f;
  for (float l : lanes) absmax = MaxF(absmax, l);
  for (; c < k; ++c) absmax = MaxF(absmax, __builtin_fabsf(x[c]));
  const float s = MaxF(absmax / kE4m3Max, 1.0f / (kE4m3Max * 512.0f));
  const __m256 sv = _mm256_set1_ps(s);
  for (c = 0; c + 8 <= k; c += 8) {
    _mm256_storeu_ps(q + c, RoundE4m3x8(_mm256_div_ps(_mm256_loadu_ps(x + c), sv)));
  }
  for (; c < k; ++c) q[c] = RoundToE4m3(x[c] / s);
  return s;
}

// e2m1 codes (8 lanes) -> float32: the magnitude from the 8-entry table by a permutation, the
// sign bit (code bit 3) moved to bit 31.
inline __attribute__((always_inline)) __m256 E2m1x8(__m256i c, __m256 table) {
  const __m256 mag = _mm256_permutevar8x32_ps(table, _mm256_and_si256(c, _mm256_set1_epi32(7)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
  return _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
}

void Nvfp4(int kc, int k0, const uint8_t* bytes, const uint8_t* block_scales, float* dst) {
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (int kk = 0; kk < kc; ++kk) {
    if (kk == 0 || (k0 + kk) % kNvfp4Block == 0) {
      const uint8_t* sc = block_scales + size_t((k0 + kk) / kNvfp4Block) * 16;
      s0 = E4m3x8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
      s1 = E4m3x8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8))));
    }
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + size_t(kk) * 8));
    const __m128i lo = _mm_and_si128(v, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    float* d = dst + size_t(kk) * 16;
    _mm256_storeu_ps(d, _mm256_mul_ps(E2m1x8(_mm256_cvtepu8_epi32(lo), table), s0));
    _mm256_storeu_ps(d + 8, _mm256_mul_ps(E2m1x8(_mm256_cvtepu8_epi32(hi), table), s1));
  }
}

// ---- The in-register path (DirectTile): up to 6 rows × 1 panel (two ymm halves) of
// accumulators; per k step the panel's 16 codes are widened in registers exactly as above and
// fma-ed into every row's accumulators, k ascending from +0 over all of k. ----

template <int R>
inline __attribute__((always_inline)) void FmaStep(__m256 (&acc)[R][2], const float* a, int64_t lda,
                                                   __m256 b0, __m256 b1) {
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    const __m256 av = _mm256_broadcast_ss(a + i * lda);
    acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
    acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
  }
}

template <int R>
inline __attribute__((always_inline)) void Zero(__m256 (&acc)[R][2]) {
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
}

template <int R>
inline __attribute__((always_inline)) void Store(const __m256 (&acc)[R][2], const DirectTile& t) {
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(t.c + i * t.ldc, acc[i][0]);
    _mm256_storeu_ps(t.c + i * t.ldc + 8, acc[i][1]);
  }
}

// e4m3 codes → float32 by way of fp16 (F16C): the code's exponent and mantissa put in an fp16's
// bits 7..13 (sign at 15) make the e4m3 value / 256, normal or subnormal alike (fp16's exponent
// bias is 8 more than e4m3's), VCVTPH2PS widens that exactly (fp16 subnormals included: MXCSR's
// DAZ does not apply to it), and · 256 is exact: the same floats as E4m3x8 (code 0x7f, not a
// value of the format, gives 480 in both) at 7 instructions for 16 columns instead of 24.
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void E4m3x16ViaHalf(__m128i codes,
                                                                                   __m256* lo,
                                                                                   __m256* hi) {
  const __m256i c = _mm256_cvtepi8_epi16(codes);  // sign-extended: bits 7..15 the sign
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(int16_t(0xbf80)));
  const __m256 k256 = _mm256_set1_ps(256.0f);
  *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k256);
  *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k256);
}

template <int R>
__attribute__((target("avx2,fma,f16c"))) void DirectFp8(const DirectTile& t) {
  __m256 acc[R][2];
  Zero<R>(acc);
  const uint8_t* codes = t.data[0];
  for (int kk = 0; kk < t.k; ++kk) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + size_t(kk) * 16));
    __m256 b0, b1;
    E4m3x16ViaHalf(c, &b0, &b1);
    FmaStep<R>(acc, t.a + kk, t.lda, b0, b1);
  }
  Store<R>(acc, t);
}

template <int R>
void DirectInt4(const DirectTile& t) {
  __m256 acc[R][2];
  Zero<R>(acc);
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m256i eight = _mm256_set1_epi32(8);
  const uint8_t* bytes = t.data[0];
  for (int k0 = 0, g = 0; k0 < t.k; k0 += t.group, ++g) {
    const int k1 = t.k - k0 < t.group ? t.k : k0 + t.group;
    const __m256 s0 = _mm256_loadu_ps(t.scales[0] + size_t(g) * 16);
    const __m256 s1 = _mm256_loadu_ps(t.scales[0] + size_t(g) * 16 + 8);
    for (int kk = k0; kk < k1; ++kk) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + size_t(kk) * 8));
      const __m128i lo = _mm_and_si128(v, low);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      const __m256i q0 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(lo), eight);
      const __m256i q1 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(hi), eight);
      FmaStep<R>(acc, t.a + kk, t.lda, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), s0),
                 _mm256_mul_ps(_mm256_cvtepi32_ps(q1), s1));
    }
  }
  Store<R>(acc, t);
}

template <int R>
void DirectNvfp4(const DirectTile& t) {
  __m256 acc[R][2];
  Zero<R>(acc);
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const uint8_t* bytes = t.data[0];
  for (int k0 = 0; k0 < t.k; k0 += kNvfp4Block) {  // k is a multiple of 16
    const uint8_t* sc = t.block_scales[0] + size_t(k0 / kNvfp4Block) * 16;
    const __m256 s0 =
        E4m3x8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
    const __m256 s1 =
        E4m3x8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8))));
    for (int kk = k0; kk < k0 + kNvfp4Block; ++kk) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + size_t(kk) * 8));
      const __m128i lo = _mm_and_si128(v, low);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      FmaStep<R>(acc, t.a + kk, t.lda, _mm256_mul_ps(E2m1x8(_mm256_cvtepu8_epi32(lo), table), s0),
                 _mm256_mul_ps(E2m1x8(_mm256_cvtepu8_epi32(hi), table), s1));
    }
  }
  Store<R>(acc, t);
}

struct Fp8K {
  template <int R>
  static void Run(const DirectTile& t) {
    DirectFp8<R>(t);
  }
};
struct Int4K {
  template <int R>
  static void Run(const DirectTile& t) {
    DirectInt4<R>(t);
  }
};
struct Nvfp4K {
  template <int R>
  static void Run(const DirectTile& t) {
    DirectNvfp4<R>(t);
  }
};

template <class K>
void ByRows(int rows, int /*panels*/, const DirectTile& t) {
  switch (rows) {
    case 1: return K::template Run<1>(t);
    case 2: return K::template Run<2>(t);
    case 3: return K::template Run<3>(t);
    case 4: return K::template Run<4>(t);
    case 5: return K::template Run<5>(t);
    default: return K::template Run<6>(t);
  }
}

}  // namespace

WidenKernels Avx2Widen() { return {&Fp8, &Int4, &QuantizeFp8, &Nvfp4}; }

DirectKernels Avx2Direct() {
  // FP8 needs F16C besides (every AVX2 CPU made has it; without it FP8 widens blocks). CPUID
  // leaf 1, ECX bit 29: clang 14's __builtin_cpu_supports does not know "f16c".
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  return {6, 1, f16c ? &ByRows<Fp8K> : nullptr, &ByRows<Int4K>, &ByRows<Nvfp4K>};
}

}  // namespace dgserve::cpu::quant_internal

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
