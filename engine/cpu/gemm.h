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
// THE BF16-INPUT MODE (GemmInput::kBf16, issue 38; the reference's bf16 GEMM inputs, spec §5.3):
//   A is rounded to bf16 once per GEMM (RoundActivationToBf16: a denormal is read as a zero of its
//   sign, then round to nearest even, as VCVTNE2PS2BF16 does), B must be bf16 (weights, the
//   embedding table) and is used as stored, and every output element is the chain that VDPBF16PS
//   computes when A and B are fed to it in pairs of k:
//     c = C₀;  for kk = 0 … k−1:  c = FTZ(fma(bf16(A[i, kk]), DAZ(B[kk, j]), DAZ(c)))
//   in ascending k, each step one fma rounded to nearest even (the product of two bf16 values is
//   exact in float32 unless it underflows, so this is "add the exact product"), DAZ(x) = x with a
//   float32 denormal read as a zero of its sign, FTZ(x) = x with a denormal result written as a
//   zero of its sign. That is VDPBF16PS exactly (checked on Zen 5, and Intel's definition: per lane
//   it does `dst += a[2j+1]·b[2j+1]; dst += a[2j]·b[2j]`, each an fma with DAZ in and FTZ out, RNE,
//   MXCSR ignored): the native path puts k in the high (first) half of each pair and k + 1 in the
//   low half, and pads an odd k with a −0 · +0 product, which leaves every value unchanged. The
//   other paths run the same chain on float32 copies of bf16(A): AVX-512F and AVX2+FMA their fma
//   kernels with MXCSR's FTZ and DAZ bits set for the call, the portable path std::fma with the
//   flushes in software. All paths give the same bits, and THE PROPERTY above (a row depends on
//   its own inputs only) holds in this mode too. MXCSR is restored before Gemm returns.
//
// Threads: output tiles only (never k) are shared among OpenMP threads; see GemmThreads.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dgserve::cpu {

// Microkernel instruction sets. One per process: the best the CPU has until SetGemmIsa() changes
// it (tests, benchmarks, and CreateBackend for a program's DGSERVE_GEMM_ISA: worker/backend_env.h).
// kAvx512Bf16 (AVX-512F + BW + BF16) runs the float32 mode with the AVX-512F kernels and the bf16
// mode with VDPBF16PS; kAvx512, kAvx2 and kPortable emulate VDPBF16PS in the bf16 mode.
enum class GemmIsa { kPortable, kAvx2, kAvx512, kAvx512Bf16 };

const char* GemmIsaName(GemmIsa isa);
// True when this CPU can run `isa` (portable always).
bool GemmIsaSupported(GemmIsa isa);
// The path Gemm() uses now.
GemmIsa ActiveGemmIsa();
// Makes `isa` the active path. INVALID_ARGUMENT (nothing changed) when the CPU lacks it.
absl::Status SetGemmIsa(GemmIsa isa);

// What the GEMM's inputs are (see THE BF16-INPUT MODE above).
enum class GemmInput {
  kFloat32,  // A float32 as given; each output one plain fma chain (THE PROPERTY)
  kBf16,     // A rounded to bf16, the VDPBF16PS chain (needs a bf16 B)
};
// "float32" or "bf16".
const char* GemmInputName(GemmInput input);
// Parses "float32" or "bf16"; INVALID_ARGUMENT otherwise.
absl::StatusOr<GemmInput> ParseGemmInput(absl::string_view name);

// bf16(x) as the bf16-input mode rounds A, and as VCVTNE2PS2BF16 does: a denormal x is read as
// a zero of its sign (DAZ), then rounded to nearest even (a normal x never rounds to a denormal);
// NaN stays NaN (quieted). Returns the bf16 bits.
uint16_t RoundActivationToBf16(float x);

// A already rounded for the bf16-input mode (see Bf16Activations), for callers that multiply the
// same rows by many B (the vocabulary tiles). Row i of the rounded values is at values + i·ld;
// its VDPBF16PS pairs at pairs + i·ld_pairs.
struct GemmABf16 {
  const float* values = nullptr;  // float32 copies of bf16(A)
  int64_t ld = 0;
  const uint16_t* pairs = nullptr;  // per pair of k: bf16(A[2p+1]), bf16(A[2p]) (low, high half)
  int64_t ld_pairs = 0;
  bool empty() const { return values == nullptr; }
};

// A [m, k] rounded once for the bf16-input mode, in both forms the paths read.
class Bf16Activations {
 public:
  Bf16Activations() = default;
  // Rounds a [m, k] (row i at a + i·lda) with RoundActivationToBf16.
  static Bf16Activations Round(const float* a, int m, int k, int64_t lda);
  // The rows from row0 on.
  GemmABf16 View(int row0 = 0) const;
  int rows() const { return m_; }
  int cols() const { return k_; }

 private:
  int m_ = 0, k_ = 0;
  int64_t ld_pairs_ = 0;
  std::vector<float> values_;
  std::vector<uint16_t> pairs_;
};

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
  // kBf16: the bf16-input mode (B must then be bf16: with a float32 B the GEMM runs as kFloat32).
  GemmInput input = GemmInput::kFloat32;
  // kBf16 only, optional: A already rounded (its rows must be bf16(A) of the rows `a` points at;
  // `a` is then not read). Without it the GEMM rounds A itself, once per call.
  GemmABf16 a_bf16;

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

// C (+)= A·B with THE PROPERTY above (in args.input's mode), on the active path. m, n or k of 0 is
// a no-op for C apart from k = 0 without accumulate, which writes zeros.
void Gemm(const GemmArgs& args, GemmThreads threads = GemmThreads::kOpenMp);
// The same on an explicit path (tests and benchmarks); `isa` must be supported.
void Gemm(const GemmArgs& args, GemmIsa isa, GemmThreads threads);

}  // namespace dgserve::cpu
