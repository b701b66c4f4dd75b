// cuBLAS GEMMs for the model's projections (issue #5): y = x·Wᵀ with the weight in PyTorch Linear
// layout (spec §3: W stored [out, in]) kept as bf16 on the device, float32 activations in and out.
// The tensor cores take bf16 inputs only, so x is converted (a small kernel) into a bf16 scratch
// buffer, then cublasGemmEx runs with bf16 inputs, float32 accumulation (CUBLAS_COMPUTE_32F) and
// float32 output; how x is converted is the context's GemmInput. Every pointer is a device
// pointer except where marked host; calls run on `stream` (0 = the default stream) and return
// INTERNAL naming the kernel or cuBLAS call on an error.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cuda {

// How a CublasContext feeds float32 activations x to the bf16 GEMM.
enum class GemmInput {
  // x rounded to bf16 once (a denormal read as zero, then nearest even:
  // cpu::RoundActivationToBf16),
  // one GEMM: HF's bf16 activations (spec §5.3) and the CPU backend's --cpu_gemm_input=bf16, the
  // same rounding points with the same values; only the order of the float32 additions differs.
  // The backend's default.
  kBf16,
  // x split exactly into three bf16 terms, x = hi + mid + lo (hi = bf16(x), mid = bf16(x − hi),
  // lo = x − hi − mid, which fits bf16; the subtractions are exact in float32), and three GEMMs
  // accumulated in float32 (lo, then mid and hi with β = 1). Each product w·term is exact in
  // float32, so the result is the float32 GEMM of the CPU backend up to the order of float32
  // additions. Three times the tensor-core work and weight reads of kBf16. A non-finite x is
  // its own hi term (mid = lo = 0); for |x| below ~2⁻¹¹⁰ the lo term can lose bits to bf16's
  // subnormal range (a relative error far below float32 accumulation's at the model's scales).
  kFloat32,
};

// Owns a cuBLAS handle (created lazily on the first GEMM, on the device current then; a failure,
// e.g. no GPU, is returned as INTERNAL) and a cached bf16 scratch buffer for the converted
// activations. Not thread-safe. The cached scratch is shared by every call on this context:
// calls that use it on different streams must not run concurrently on the device (give each
// stream its own context, or pass a caller-owned scratch buffer). Growing the cached scratch
// frees the old buffer with cudaFree, which waits for the work already queued on the device.
class CublasContext {
 public:
  explicit CublasContext(GemmInput input = GemmInput::kBf16) : input_(input) {}
  ~CublasContext();
  CublasContext(const CublasContext&) = delete;
  CublasContext& operator=(const CublasContext&) = delete;

  GemmInput input() const { return input_; }

  // y[rows, out] = x[rows, in] · w[out, in]ᵀ with x converted as input() says, float32
  // accumulation and result.
  // x: [rows, in] float32; w: [out, in] bf16 bits (uint16); y: [rows, out] float32 (must not
  // overlap x). x_bf16: caller-provided scratch of rows·in bf16 values, or nullptr to use the
  // context's cached scratch. rows = 0 is a no-op; rows < 0, in ≤ 0 or out ≤ 0: INVALID_ARGUMENT.
  absl::Status Linear(const float* x, const uint16_t* w, int rows, int in, int out, float* y,
                      void* stream = nullptr, uint16_t* x_bf16 = nullptr);

  // MoE expert groups: for g in [0, groups), rows [row_offsets[g], row_offsets[g+1]) of x and y
  // form group g, computed with expert e = expert_of_group ? expert_of_group[g] : g:
  //   y[rows of g, out] = x[rows of g, in] · w[e]ᵀ,   w: [num_experts, out, in] bf16
  // (x converted as input() says).
  // row_offsets (host, [groups + 1], non-decreasing) index rows of x and y directly (so
  // row_offsets[0] need not be 0); expert_of_group (host, [groups]) or nullptr. Empty groups
  // are skipped. x is converted once for rows [row_offsets[0], row_offsets[groups]); x_bf16 then
  // needs (row_offsets[groups] − row_offsets[0])·in values. One cublasGemmEx per non-empty group
  // (cublasGemmGroupedBatchedEx would need device pointer arrays per call). The backend's MoE no
  // longer uses it: cuda_moe.h's grouped GEMMs read the groups from device memory.
  absl::Status GroupedLinear(const float* x, const uint16_t* w, int groups,
                             const int32_t* row_offsets, const int32_t* expert_of_group, int in,
                             int out, float* y, void* stream = nullptr,
                             uint16_t* x_bf16 = nullptr);

 private:
  absl::Status EnsureHandle();
  absl::Status EnsureScratch(size_t elements);

  const GemmInput input_;
  void* handle_ = nullptr;      // cublasHandle_t
  uint16_t* scratch_ = nullptr;  // cached bf16 scratch (device)
  size_t scratch_elements_ = 0;
};

// Rounds n float32 values to bf16 bits (round-to-nearest-even, NaN stays NaN), as
// dgserve::FloatToBf16. x: [n] float32, y: [n] bf16 bits.
absl::Status FloatToBf16(const float* x, int64_t n, uint16_t* y, void* stream = nullptr);

// x[i] = bf16(x[i]) in place, as GemmInput::kBf16 rounds a GEMM input (denormal → zero of its
// sign, then nearest even; cpu::RoundActivationToBf16), kept as float32 values: the input of a
// float32 GEMM whose products must be those of the bf16-input mode (the router). x: [n] float32.
absl::Status RoundActivationsToBf16(float* x, int64_t n, void* stream = nullptr);

// Term `term` (0: hi, 1: mid, 2: lo) of GemmInput::kFloat32's exact split of n float32 values
// into bf16 bits: x = hi + mid + lo for every finite x in float32's normal range. term outside
// [0, 2]: INVALID_ARGUMENT. x: [n] float32, y: [n] bf16 bits.
absl::Status SplitToBf16(const float* x, int64_t n, int term, uint16_t* y,
                         void* stream = nullptr);

}  // namespace dgserve::cuda
