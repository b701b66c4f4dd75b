// AVX512_BF16 microkernels of the GEMM's bf16-input mode (gemm.h): up to 8 rows × 2 panels (32
// columns) of float32 accumulators in zmm registers; per pair of k one VDPBF16PS per (row, panel),
// A's pair broadcast from memory, B read from pair-packed panels (Pack: one 64-byte load of two
// k steps and one VPERMW per pair). VDPBF16PS adds the high half's product first, so A and B hold
// k in the high half and k + 1 in the low half: the chain runs in ascending k.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "engine/cpu/gemm_kernels.h"

// Compiled for AVX-512F/BW/BF16; called only when the CPU has them. No standard library template.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma")
// _mm512_castsi256_si512 leaves the upper half undefined on purpose (it is overwritten at once);
// GCC 12's headers then warn that it "may be used uninitialized".
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace dgserve::cpu::gemm_internal {
namespace {

inline __attribute__((always_inline)) __m512bh Bh(__m512i v) { return (__m512bh)v; }

// Words of [k row (16 columns) | k+1 row (16 columns)] → pairs (k+1 low, k high) per column.
inline __attribute__((always_inline)) __m512i PairIndex() {
  return _mm512_set_epi16(15, 31, 14, 30, 13, 29, 12, 28, 11, 27, 10, 26, 9, 25, 8, 24, 7, 23, 6,
                          22, 5, 21, 4, 20, 3, 19, 2, 18, 1, 17, 0, 16);
}

// Pair pp of a stored panel ([k][16] bf16, kstride apart): rows 2pp and 2pp + 1 as pairs.
inline __attribute__((always_inline)) __m512i DirectPair(const uint16_t* b, int64_t kstride, int pp,
                                                         __m512i idx) {
  const uint16_t* r0 = b + 2 * pp * kstride;
  if (kstride == 16) return _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(r0));
  const __m512i lo =
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0)));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + kstride));
  return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(lo, hi, 1));
}

// The last k of an odd block alone (its pair's low half +0).
inline __attribute__((always_inline)) __m512i DirectLast(const uint16_t* b, int64_t kstride, int kc,
                                                         __m512i idx) {
  const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (kc - 1) * kstride));
  return _mm512_permutexvar_epi16(idx, _mm512_zextsi256_si512(r));
}

template <int R, int P, bool kDirect>
void Kernel(const TileBf16& t) {
  __m512 acc[R][P];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      acc[i][p] = t.load_c ? _mm512_loadu_ps(t.c + i * t.ldc + 16 * p) : _mm512_setzero_ps();
    }
  }
  const uint16_t* b0 = t.b0;
  const uint16_t* b1 = t.b1;
  const uint16_t* a = t.a;
  const int64_t lda = t.lda, ps = t.b_pstride;
  const int pairs = kDirect ? (t.kc + 1) / 2 : t.pairs;
  [[maybe_unused]] const __m512i idx = PairIndex();
  [[maybe_unused]] const int64_t ks = t.b_kstride;
  for (int pp = 0; pp < pairs; ++pp) {
    __m512i bv[P];
    if constexpr (kDirect) {
      if (2 * pp + 1 < t.kc) {
        bv[0] = DirectPair(b0, ks, pp, idx);
        if constexpr (P > 1) bv[1] = DirectPair(b1, ks, pp, idx);
      } else {
        bv[0] = DirectLast(b0, ks, t.kc, idx);
        if constexpr (P > 1) bv[1] = DirectLast(b1, ks, t.kc, idx);
      }
    } else {
      bv[0] = _mm512_loadu_si512(b0 + pp * ps);
      if constexpr (P > 1) bv[1] = _mm512_loadu_si512(b1 + pp * ps);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * pp, sizeof pair);
      const __m512i av = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) acc[i][p] = _mm512_dpbf16_ps(acc[i][p], Bh(av), Bh(bv[p]));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(t.c + i * t.ldc + 16 * p, acc[i][p]);
  }
}

template <int R>
void ByPanels(int panels, const TileBf16& t) {
  if (t.direct) {
    if (panels == 2) {
      Kernel<R, 2, true>(t);
    } else {
      Kernel<R, 1, true>(t);
    }
  } else if (panels == 2) {
    Kernel<R, 2, false>(t);
  } else {
    Kernel<R, 1, false>(t);
  }
}

void Run(int rows, int panels, const TileBf16& t) {
  switch (rows) {
    case 1: return ByPanels<1>(panels, t);
    case 2: return ByPanels<2>(panels, t);
    case 3: return ByPanels<3>(panels, t);
    case 4: return ByPanels<4>(panels, t);
    case 5: return ByPanels<5>(panels, t);
    case 6: return ByPanels<6>(panels, t);
    case 7: return ByPanels<7>(panels, t);
    default: return ByPanels<8>(panels, t);
  }
}

void PackPairs(int kc, const uint16_t* src, int64_t src_kstride, uint16_t* dst,
               int64_t dst_pstride) {
  const __m512i idx = PairIndex();
  const int full = kc / 2;
  if (src_kstride == 16) {  // packed panels: k and k+1 are 64 contiguous bytes
    for (int p = 0; p < full; ++p) {
      const __m512i v = _mm512_loadu_si512(src + 2 * p * 16);
      _mm512_storeu_si512(dst + p * dst_pstride, _mm512_permutexvar_epi16(idx, v));
    }
  } else {
    for (int p = 0; p < full; ++p) {
      _mm512_storeu_si512(dst + p * dst_pstride, DirectPair(src, src_kstride, p, idx));
    }
  }
  if (kc % 2 != 0) {  // the last k alone: its pair's low half (k + 1) is +0
    _mm512_storeu_si512(dst + full * dst_pstride, DirectLast(src, src_kstride, kc, idx));
  }
}

void RoundPairs(const float* a, int n, uint16_t* dst) {
  for (int i = 0; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(a + i), hi = _mm512_loadu_ps(a + i + 16);
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0–15 from lo
    _mm512_storeu_si512(dst + i, _mm512_rol_epi32(h, 16));   // swap each pair's halves
  }
}

}  // namespace

Bf16KernelSet Avx512Bf16Kernels() { return {8, 2, &Run, &PackPairs, &RoundPairs}; }

}  // namespace dgserve::cpu::gemm_internal

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
