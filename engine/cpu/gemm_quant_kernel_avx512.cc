// AVX-512F widening of quantized weight panels (gemm_quant.h), one 16-column k step per
// register; the same exact conversions as the AVX2 version.
#include <cstdint>

#include "common/fp8.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/cpu/immintrin_avx512.h"  // <immintrin.h>, without GCC 12's false warnings

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#endif

namespace dgserve::cpu::quant_internal {
namespace {

inline __attribute__((always_inline)) __m512 E4m3x16(__m512i c) {
  const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7f));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(7))),
                                   _mm512_set1_ps(0x1p-9f));
  const __mmask16 is_sub = _mm512_testn_epi32_mask(c, _mm512_set1_epi32(0x78));
  const __m512i v = _mm512_mask_blend_epi32(is_sub, normal, _mm512_castps_si512(sub));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(v, sign));
}

void Fp8(int kc, const uint8_t* codes, float* dst) {
  for (int kk = 0; kk < kc; ++kk) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + size_t(kk) * 16));
    _mm512_storeu_ps(dst + size_t(kk) * 16, E4m3x16(_mm512_cvtepu8_epi32(b)));
  }
}

void Int4(int kc, int k0, const uint8_t* bytes, const float* scales, int group, float* dst) {
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m512i eight = _mm512_set1_epi32(8);
  int g = k0 / group, left = (g + 1) * group - k0;  // k steps left in group g
  for (int kk = 0; kk < kc; ++kk, --left) {
    if (left == 0) ++g, left = group;
    const float* s = scales + size_t(g) * 16;
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + size_t(kk) * 8));
    const __m128i lo = _mm_and_si128(v, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)), eight);
    _mm512_storeu_ps(dst + size_t(kk) * 16,
                     _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_loadu_ps(s)));
  }
}

// max(a, b) as the standard library's, without instantiating a template under this file's
// target options.
inline float MaxF(float a, float b) { return a < b ? b : a; }

// RoundToE4m3 (common/fp8.h) on 16 lanes: the same integer and float steps, so the same bits.
inline __attribute__((always_inline)) __m512 RoundE4m3x16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(b, _mm512_set1_epi32(int(0x80000000u)));
  const __m512i ab = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(ab, _mm512_set1_epi32(0x7ffff)), odd),
                       _mm512_set1_epi32(int(~0xfffffu)));
  const __m512 m = _mm512_set1_ps(24576.0f);
  const __m512 t = _mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(ab), m), m);
  r = _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(ab, _mm512_set1_epi32(0x3c800000)), r,
                              _mm512_castps_si512(t));
  r = _mm512_mask_blend_epi32(_mm512_cmpge_epi32_mask(ab, _mm512_set1_epi32(0x43e00000)), r,
                              _mm512_set1_epi32(0x43e00000));
  return _mm512_castsi512_ps(_mm512_or_si512(r, sign));
}

float QuantizeFp8(const float* x, int k, float* q) {
  __m512 mx = _mm512_setzero_ps();
  int c = 0;
  for (; c + 16 <= k; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + c)));
  float absmax = _mm512_reduce_max_ps(mx);
  for (; c < k; ++c) absmax = MaxF(absmax, __builtin_fabsf(x[c]));
  const float s = MaxF(absmax / kE4m3Max, 1.0f / (kE4m3Max * 512.0f));
  const __m512 sv = _mm512_set1_ps(s);
  for (c = 0; c + 16 <= k; c += 16) {
    _mm512_storeu_ps(q + c, RoundE4m3x16(_mm512_div_ps(_mm512_loadu_ps(x + c), sv)));
  }
  for (; c < k; ++c) q[c] = RoundToE4m3(x[c] / s);
  return s;
}

// NVFP4: the 16 nibbles of a k step looked up in the e2m1 table (codes 8..15 the negatives) by
// a permutation, times the block's 16 e4m3 scales (both exact, the product exact).
void Nvfp4(int kc, int k0, const uint8_t* bytes, const uint8_t* block_scales, float* dst) {
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                      -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  __m512 s = _mm512_setzero_ps();
  for (int kk = 0; kk < kc; ++kk) {
    if (kk == 0 || (k0 + kk) % kNvfp4Block == 0) {
      const __m128i sc = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(block_scales + size_t((k0 + kk) / kNvfp4Block) * 16));
      s = E4m3x16(_mm512_cvtepu8_epi32(sc));
    }
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + size_t(kk) * 8));
    const __m128i lo = _mm_and_si128(v, low);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi));
    _mm512_storeu_ps(dst + size_t(kk) * 16, _mm512_mul_ps(_mm512_permutexvar_ps(q, table), s));
  }
}

// ---- The in-register path (DirectTile): up to 8 rows × 2 panels of zmm accumulators; per k
// step each panel's 16 codes are widened in a register exactly as above and fma-ed into every
// row's accumulator, k ascending from +0 over all of k. ----

template <int R, int P>
inline __attribute__((always_inline)) void FmaStep(__m512 (&acc)[R][P], const float* a, int64_t lda,
                                                   const __m512 (&b)[P]) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const __m512 av = _mm512_set1_ps(a[i * lda]);
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) acc[i][p] = _mm512_fmadd_ps(av, b[p], acc[i][p]);
  }
}

template <int R, int P>
inline __attribute__((always_inline)) void Store(const __m512 (&acc)[R][P], const DirectTile& t) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(t.c + i * t.ldc + 16 * p, acc[i][p]);
  }
}

// The 16 nibbles of a k step (low nibbles rows 0–7, high nibbles rows 8–15) as 16 int32 lanes.
inline __attribute__((always_inline)) __m512i Nibbles16(const uint8_t* bytes) {
  const __m128i low = _mm_set1_epi8(0x0f);
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i lo = _mm_and_si128(v, low);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi));
}

// e4m3 codes → float32 by way of fp16: the code's exponent and mantissa put in an fp16's bits
// 7..13 (sign at 15) make the e4m3 value / 256, normal or subnormal alike (fp16's exponent bias
// is 8 more than e4m3's and its subnormals cover e4m3's), VCVTPH2PS widens that exactly (fp16
// subnormals included: MXCSR's DAZ does not apply to it), and · 256 is exact. The same floats as
// E4m3x16 (code 0x7f, not a value of the format, gives 480 in both) at 5 instructions for 12.
inline __attribute__((always_inline)) __m512 E4m3x16ViaHalf(__m128i codes) {
  const __m256i c = _mm256_cvtepi8_epi16(codes);  // sign-extended: bits 7..15 the sign
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(int16_t(0xbf80)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

template <int R, int P>
void DirectFp8(const DirectTile& t) {
  __m512 acc[R][P];
  for (int i = 0; i < R; ++i) {
    for (int p = 0; p < P; ++p) acc[i][p] = _mm512_setzero_ps();
  }
  for (int kk = 0; kk < t.k; ++kk) {
    __m512 b[P];
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const __m128i c =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(t.data[p] + size_t(kk) * 16));
      b[p] = E4m3x16ViaHalf(c);
    }
    FmaStep<R, P>(acc, t.a + kk, t.lda, b);
  }
  Store<R, P>(acc, t);
}

template <int R, int P>
void DirectInt4(const DirectTile& t) {
  __m512 acc[R][P];
  for (int i = 0; i < R; ++i) {
    for (int p = 0; p < P; ++p) acc[i][p] = _mm512_setzero_ps();
  }
  const __m512i eight = _mm512_set1_epi32(8);
  for (int k0 = 0, g = 0; k0 < t.k; k0 += t.group, ++g) {
    const int k1 = t.k - k0 < t.group ? t.k : k0 + t.group;
    __m512 s[P];
    for (int p = 0; p < P; ++p) s[p] = _mm512_loadu_ps(t.scales[p] + size_t(g) * 16);
    for (int kk = k0; kk < k1; ++kk) {
      __m512 b[P];
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) {
        const __m512i q = _mm512_sub_epi32(Nibbles16(t.data[p] + size_t(kk) * 8), eight);
        b[p] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), s[p]);
      }
      FmaStep<R, P>(acc, t.a + kk, t.lda, b);
    }
  }
  Store<R, P>(acc, t);
}

template <int R, int P>
void DirectNvfp4(const DirectTile& t) {
  __m512 acc[R][P];
  for (int i = 0; i < R; ++i) {
    for (int p = 0; p < P; ++p) acc[i][p] = _mm512_setzero_ps();
  }
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                      -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  for (int k0 = 0; k0 < t.k; k0 += kNvfp4Block) {  // k is a multiple of 16
    __m512 s[P];
    for (int p = 0; p < P; ++p) {
      const __m128i sc = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(t.block_scales[p] + size_t(k0 / kNvfp4Block) * 16));
      s[p] = E4m3x16(_mm512_cvtepu8_epi32(sc));
    }
    for (int kk = k0; kk < k0 + kNvfp4Block; ++kk) {
      __m512 b[P];
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) {
        const __m512i q = Nibbles16(t.data[p] + size_t(kk) * 8);
        b[p] = _mm512_mul_ps(_mm512_permutexvar_ps(q, table), s[p]);
      }
      FmaStep<R, P>(acc, t.a + kk, t.lda, b);
    }
  }
  Store<R, P>(acc, t);
}

struct Fp8K {
  template <int R, int P>
  static void Run(const DirectTile& t) {
    DirectFp8<R, P>(t);
  }
};
struct Int4K {
  template <int R, int P>
  static void Run(const DirectTile& t) {
    DirectInt4<R, P>(t);
  }
};
struct Nvfp4K {
  template <int R, int P>
  static void Run(const DirectTile& t) {
    DirectNvfp4<R, P>(t);
  }
};

template <class K, int R>
void ByPanels(int panels, const DirectTile& t) {
  if (panels > 1) {
    K::template Run<R, 2>(t);
  } else {
    K::template Run<R, 1>(t);
  }
}

template <class K>
void ByRows(int rows, int panels, const DirectTile& t) {
  switch (rows) {
    case 1: return ByPanels<K, 1>(panels, t);
    case 2: return ByPanels<K, 2>(panels, t);
    case 3: return ByPanels<K, 3>(panels, t);
    case 4: return ByPanels<K, 4>(panels, t);
    case 5: return ByPanels<K, 5>(panels, t);
    case 6: return ByPanels<K, 6>(panels, t);
    case 7: return ByPanels<K, 7>(panels, t);
    default: return ByPanels<K, 8>(panels, t);
  }
}

}  // namespace

WidenKernels Avx512Widen() { return {&Fp8, &Int4, &QuantizeFp8, &Nvfp4}; }

DirectKernels Avx512Direct() { return {8, 2, &ByRows<Fp8K>, &ByRows<Int4K>, &ByRows<Nvfp4K>}; }

}  // namespace dgserve::cpu::quant_internal

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
