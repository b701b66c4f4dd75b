// 2^w for 8 float lanes with AVX2+FMA (internal to the CPU backend): round w to the nearest
// integer r, a degree-5 polynomial for 2^(w−r) on [−0.5, 0.5] (Cephes exp2f, relative error
// ≤ 2e-7) and r added to the exponent field. Valid for w in [−126, 126]; callers clamp.
// Include only from functions compiled with [[gnu::target("avx2,fma")]].
// Exp2Scalar is the same arithmetic on one float (std::fma, std::nearbyint): the same bits as a
// lane of Exp2Avx2, on any CPU.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dgserve::cpu {

[[gnu::target("avx2,fma"), gnu::always_inline]] inline __m256 Exp2Avx2(__m256 w) {
  const __m256 r = _mm256_round_ps(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(w, r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.535336188319500e-4f), f,
                             _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(r), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float Exp2Scalar(float w) {
  if (std::isnan(w)) return w;
  const float r = std::nearbyint(w);  // ties to even, as _MM_FROUND_TO_NEAREST_INT
  const float f = w - r;
  float p = std::fma(1.535336188319500e-4f, f, 1.339887440266574e-3f);
  p = std::fma(p, f, 9.618437357674640e-3f);
  p = std::fma(p, f, 5.550332471162809e-2f);
  p = std::fma(p, f, 2.402264791363012e-1f);
  p = std::fma(p, f, 6.931472028550421e-1f);
  p = std::fma(p, f, 1.0f);
  const uint32_t bits = uint32_t(int32_t(r) + 127) << 23;
  float e;
  std::memcpy(&e, &bits, sizeof e);
  return p * e;
}

}  // namespace dgserve::cpu
