// The CPU backend's GEMM: C[m, n] (+)= A[m, k] · B[k, n], A float32, B float32 or bf16 (weights).
//
// THE PROPERTY (what every caller relies on for "same seed, same tokens"):
//   every output element C[i, j] is computed as ONE fused-multiply-add chain over k in ascending
//   order,  c = C₀;  for kk = 0 … k−1:  c = fma(A[i, kk], B[kk, j], c)   (C₀ = 0, or C[i, j] with
//   `accumulate`), rounded once per step as IEEE fma does. k-blocking stores c to C and reloads
//   it, which is exact, so the chain continues unchanged. Hence C[i, j] depends only on row i of A,
//   column j of B and k — not on m, n, the offset of the row or column inside a tile, the tile
//   sizes, the thread count or the instruction set (AVX-512F, AVX2+FMA and the portable std::fma
//   path produce the same bits). bf16 values are widened to float32 exactly (in registers, or, for
//   GEMMs of ≥ 64 rows, once per tile and k block into a float32 copy of the B block that all the
//   tile's rows read), so a bf16 B gives the bits of the same GEMM on a float32 copy of B.
//
// Threads: output tiles only (never k) are shared among OpenMP threads; see GemmThreads.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cpu {

// Microkernel instruction sets. Chosen once per process: the best the CPU has, or the one named
// by the environment variable DGSERVE_GEMM_ISA (avx512, avx2 or portable); SetGemmIsa() changes
// it (tests, benchmarks).
enum class GemmIsa { kPortable, kAvx2, kAvx512 };

const char* GemmIsaName(GemmIsa isa);
// True when this CPU can run `isa` (portable always).
bool GemmIsaSupported(GemmIsa isa);
// The path Gemm() uses now.
GemmIsa ActiveGemmIsa();
// Makes `isa` the active path. INVALID_ARGUMENT (nothing changed) when the CPU lacks it.
absl::Status SetGemmIsa(GemmIsa isa);

// Columns of B per panel: B is read 16 columns at a time (one AVX-512 register of float32).
inline constexpr int kGemmPanel = 16;

// The B operand: a [k, n] matrix read as 16-column panels. Element (kk, j) is at
//   data[(j / 16) · panel_stride + kk · k_stride + j % 16]
// (elements of `type`). Panels past n need not exist: the last partial panel is read only in
// its first n % 16 columns.
struct GemmB {
  enum class Type { kF32, kBf16 };
  const void* data = nullptr;
  Type type = Type::kF32;
  int64_t k_stride = 0;
  int64_t panel_stride = 0;

  // B[k, n] row-major with leading dimension ldb ≥ n (element (kk, j) at b[kk·ldb + j]).
  static GemmB RowMajor(const float* b, int64_t ldb) { return {b, Type::kF32, ldb, kGemmPanel}; }
  static GemmB RowMajor(const uint16_t* b, int64_t ldb) {
    return {b, Type::kBf16, ldb, kGemmPanel};
  }
  // Panel layout of k rows: panel p holds [k][16] contiguous (see PackedMatrix), panels k·16 apart.
  static GemmB Panels(const float* b, int64_t k) {
    return {b, Type::kF32, kGemmPanel, k * kGemmPanel};
  }
  static GemmB Panels(const uint16_t* b, int64_t k) {
    return {b, Type::kBf16, kGemmPanel, k * kGemmPanel};
  }
};

struct GemmArgs {
  int m = 0, n = 0, k = 0;
  const float* a = nullptr;  // [m, k], row i at a + i·lda
  int64_t lda = 0;
  GemmB b;
  float* c = nullptr;  // [m, n], row i at c + i·ldc
  int64_t ldc = 0;
  bool accumulate = false;  // C += A·B instead of C = A·B

  // C[m, n] (+)= A[m, k] · B with the leading dimensions lda and ldc.
  static GemmArgs Of(int m, int n, int k, const float* a, int64_t lda, GemmB b, float* c,
                     int64_t ldc, bool accumulate = false) {
    GemmArgs g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.a = a;
    g.lda = lda;
    g.b = b;
    g.c = c;
    g.ldc = ldc;
    g.accumulate = accumulate;
    return g;
  }
};

enum class GemmThreads {
  kOpenMp,      // output tiles shared by the threads of a new OpenMP region (serial when called
                // from inside one)
  kCallerOnly,  // all of it on the calling thread (callers that parallelise themselves)
};

// C (+)= A·B with THE PROPERTY above, on the active path. m, n or k of 0 is a no-op for C apart
// from k = 0 without accumulate, which writes zeros.
void Gemm(const GemmArgs& args, GemmThreads threads = GemmThreads::kOpenMp);
// The same on an explicit path (tests and benchmarks); `isa` must be supported.
void Gemm(const GemmArgs& args, GemmIsa isa, GemmThreads threads);

}  // namespace dgserve::cpu
