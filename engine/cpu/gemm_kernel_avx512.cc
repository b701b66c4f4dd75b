// AVX-512F microkernels of the GEMM: up to 8 rows × 2 panels (32 columns) of float32
// accumulators in zmm registers; B panels loaded 16 at a time (bf16 widened with a zero-extend and
// a 16-bit shift: exact); one vfmadd231ps per (row, panel, k), k ascending.
#include <cstdint>

#include "engine/cpu/gemm_kernels.h"
#include "engine/cpu/immintrin_avx512.h"  // <immintrin.h>, without GCC 12's false warnings

// Everything below is compiled for AVX-512F; it is called only when the CPU has it. No standard
// library template is instantiated here (it could be merged with the generic copy at link time).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
#endif

namespace dgserve::cpu::gemm_internal {
namespace {

inline __attribute__((always_inline)) __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __attribute__((always_inline)) __m512 Load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int R, int P, typename BT>
void Kernel(const Tile& t) {
  __m512 acc[R][P];
  for (int i = 0; i < R; ++i) {
    for (int p = 0; p < P; ++p) {
      acc[i][p] = t.load_c ? _mm512_loadu_ps(t.c + i * t.ldc + 16 * p) : _mm512_setzero_ps();
    }
  }
  const BT* b0 = static_cast<const BT*>(t.b0);
  const BT* b1 = static_cast<const BT*>(t.b1);
  const float* a = t.a;
  const int64_t lda = t.lda, ks = t.b_kstride;
  for (int kk = 0; kk < t.kc; ++kk) {
    __m512 bv[P];
    bv[0] = Load16(b0 + kk * ks);
    if constexpr (P > 1) bv[1] = Load16(b1 + kk * ks);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 av = _mm512_set1_ps(a[i * lda + kk]);
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) acc[i][p] = _mm512_fmadd_ps(av, bv[p], acc[i][p]);
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(t.c + i * t.ldc + 16 * p, acc[i][p]);
  }
}

template <int R, typename BT>
void ByPanels(int panels, const Tile& t) {
  if (panels == 2) {
    Kernel<R, 2, BT>(t);
  } else {
    Kernel<R, 1, BT>(t);
  }
}

template <typename BT>
void ByRows(int rows, int panels, const Tile& t) {
  switch (rows) {
    case 1: return ByPanels<1, BT>(panels, t);
    case 2: return ByPanels<2, BT>(panels, t);
    case 3: return ByPanels<3, BT>(panels, t);
    case 4: return ByPanels<4, BT>(panels, t);
    case 5: return ByPanels<5, BT>(panels, t);
    case 6: return ByPanels<6, BT>(panels, t);
    case 7: return ByPanels<7, BT>(panels, t);
    default: return ByPanels<8, BT>(panels, t);
  }
}

void Run(int rows, int panels, bool bf16, const Tile& t) {
  if (bf16) {
    ByRows<uint16_t>(rows, panels, t);
  } else {
    ByRows<float>(rows, panels, t);
  }
}

template <typename BT>
void PackAs(int kc, const BT* src, int64_t src_kstride, float* dst, int64_t dst_kstride) {
  for (int kk = 0; kk < kc; ++kk) {
    _mm512_storeu_ps(dst + kk * dst_kstride, Load16(src + kk * src_kstride));
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

KernelSet Avx512Kernels() { return {8, 2, &Run, &Pack}; }

}  // namespace dgserve::cpu::gemm_internal

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
