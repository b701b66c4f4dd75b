// <immintrin.h> for the AVX-512 kernels without GCC 12's false uninitialized-value warnings.
//
// GCC 12's headers write _mm512_undefined_ps/_pd/_epi32 and _mm256_undefined_pd as a
// self-initialised variable (`__m512 __Y = __Y;`, a deliberately undefined value), and GCC 12.2
// warns -Wmaybe-uninitialized (-Wuninitialized for _mm256_undefined_pd) in every intrinsic that
// passes one as the unused merge source, wherever it is inlined: _mm512_cvtepu16_epi32,
// _mm512_cvtepu8_epi32, _mm512_srli_epi32, _mm512_reduce_max_ps and others, about 200 warnings
// from gemm_kernel_avx512.cc and gemm_quant_kernel_avx512.cc (GCC bug 105593; later GCC
// releases' headers carry this pragma themselves). The warnings' location is the header's line,
// so ignoring the two warnings for the header's lines only silences exactly these, never our
// code. Include it instead of <immintrin.h>; it works only where no header included before it
// pulled <immintrin.h> in (none of this directory's or common/'s do).
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
