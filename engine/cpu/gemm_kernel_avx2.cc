// AVX2+FMA microkernels of the GEMM: up to 6 rows × 1 panel (16 columns, two ymm registers) of
// float32 accumulators; bf16 widened exactly (zero-extend, shift by 16); one vfmadd231ps per
// (row, half panel, k), k ascending.
#include <immintrin.h>

#include <cstdint>

#include "engine/cpu/gemm_kernels.h"

// Compiled for AVX2+FMA; called only when the CPU has them. No standard library template here.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace dgserve::cpu::gemm_internal {
namespace {

inline __attribute__((always_inline)) __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __attribute__((always_inline)) __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int R, typename BT>
void Kernel(const Tile& t) {
  // acc[i][h]: row i, half h of the panel. The loops over i and h are unrolled everywhere so that
  // the 12 accumulators live in registers (with the array left in memory GCC stored every
  // accumulator after each fma: 12 stores per k step, half the fma rate).
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      acc[i][h] = t.load_c ? _mm256_loadu_ps(t.c + i * t.ldc + 8 * h) : _mm256_setzero_ps();
    }
  }
  const BT* b = static_cast<const BT*>(t.b0);
  const float* a = t.a;
  const int64_t lda = t.lda, ks = t.b_kstride;
  for (int kk = 0; kk < t.kc; ++kk) {
    const __m256 bv[2] = {Load8(b + kk * ks), Load8(b + kk * ks + 8)};
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 av = _mm256_broadcast_ss(a + i * lda + kk);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_fmadd_ps(av, bv[h], acc[i][h]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(t.c + i * t.ldc + 8 * h, acc[i][h]);
  }
}

template <typename BT>
void ByRows(int rows, const Tile& t) {
  switch (rows) {
    case 1: return Kernel<1, BT>(t);
    case 2: return Kernel<2, BT>(t);
    case 3: return Kernel<3, BT>(t);
    case 4: return Kernel<4, BT>(t);
    case 5: return Kernel<5, BT>(t);
    default: return Kernel<6, BT>(t);
  }
}

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
    _mm256_storeu_ps(dst + kk * dst_kstride, Load8(src + kk * src_kstride));
    _mm256_storeu_ps(dst + kk * dst_kstride + 8, Load8(src + kk * src_kstride + 8));
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

}  // namespace

KernelSet Avx2Kernels() { return {6, 1, &Run, &Pack}; }

}  // namespace dgserve::cpu::gemm_internal

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
