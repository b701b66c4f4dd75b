#include "engine/cuda/cuda_gemm.h"

#include <cublas_v2.h>

#include <string>

#include "common/status_macros.h"
#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_launch.cuh"

namespace dgserve::cuda {
namespace {

absl::Status CublasCheck(const char* call, cublasStatus_t s) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(std::string(call) + ": " + cublasGetStatusString(s));
}

__global__ void SplitTermKernel(const float* x, int64_t n, int term, uint16_t* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = SplitTermBits(x[i], term);
  }
}

__global__ void ToBf16Kernel(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = ToBf16Bits(x[i]);
  }
}

// GemmInput::kBf16's rounding of a GEMM input (ActivationBf16Bits: DAZ, then nearest even).
__global__ void ActivationToBf16Kernel(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = ActivationBf16Bits(x[i]);
  }
}

// The same rounding written back as float32 values (for the float32 cuBLAS router GEMM).
__global__ void RoundActivationsKernel(float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = Bf16BitsToFloat(ActivationBf16Bits(x[i]));
  }
}

int Blocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return int(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

// Row-major y[m, n] = xb[m, k] · w[n, k]ᵀ as the column-major product yᵀ[n, m] = w·xbᵀ:
// A = w viewed column-major [k, n] (ld k), transposed; B = xb viewed column-major [k, m] (ld k).
// beta = 1 adds the product to y (the split's later terms).
absl::Status Gemm(cublasHandle_t h, const uint16_t* xb, const uint16_t* w, int m, int k, int n,
                  float* y, float beta = 0.0f) {
  const float alpha = 1.0f;
  NoteCublas();
  return CublasCheck("cublasGemmEx",
                     cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, CUDA_R_16BF,
                                  k, xb, CUDA_R_16BF, k, &beta, y, CUDA_R_32F, n,
                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

absl::Status FloatToBf16(const float* x, int64_t n, uint16_t* y, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(ToBf16Kernel, Blocks(n, 256), 256, 0, S(stream), x, n, y);
  return Check("FloatToBf16");
}

absl::Status RoundActivationsToBf16(float* x, int64_t n, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(RoundActivationsKernel, Blocks(n, 256), 256, 0, S(stream), x, n);
  return Check("RoundActivationsToBf16");
}

absl::Status SplitToBf16(const float* x, int64_t n, int term, uint16_t* y, void* stream) {
  if (term < 0 || term > 2) {
    return absl::InvalidArgumentError("SplitToBf16: term must be 0 (hi), 1 (mid) or 2 (lo)");
  }
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(SplitTermKernel, Blocks(n, 256), 256, 0, S(stream), x, n, term, y);
  return Check("SplitToBf16");
}

namespace {

// The terms GEMMed for an input mode, smallest first (each later one accumulates with β = 1).
int Terms(GemmInput input) { return input == GemmInput::kFloat32 ? 3 : 1; }

absl::Status ConvertTerm(GemmInput input, int term, const float* x, int64_t n, uint16_t* xb,
                         cudaStream_t stream) {
  if (input == GemmInput::kBf16) {
    LaunchKernel(ActivationToBf16Kernel, Blocks(n, 256), 256, 0, stream, x, n, xb);
  } else {
    LaunchKernel(SplitTermKernel, Blocks(n, 256), 256, 0, stream, x, n, term, xb);
  }
  return Check("Linear (bf16 conversion)");
}

}  // namespace

CublasContext::~CublasContext() {
  if (handle_ != nullptr) cublasDestroy(static_cast<cublasHandle_t>(handle_));
  if (scratch_ != nullptr) cudaFree(scratch_);
}

absl::Status CublasContext::EnsureHandle() {
  if (handle_ != nullptr) return absl::OkStatus();
  cublasHandle_t h = nullptr;
  const cublasStatus_t s = cublasCreate(&h);
  if (s != CUBLAS_STATUS_SUCCESS) {
    cudaGetLastError();  // do not leave a sticky runtime error behind (e.g. no device)
    return CublasCheck("cublasCreate", s);
  }
  handle_ = h;
  return absl::OkStatus();
}

absl::Status CublasContext::EnsureScratch(size_t elements) {
  if (elements <= scratch_elements_) return absl::OkStatus();
  if (scratch_ != nullptr) {
    NoteAlloc();
    cudaFree(scratch_);  // waits for queued work that may still read it
    scratch_ = nullptr;
    scratch_elements_ = 0;
  }
  void* p = nullptr;
  NoteAlloc();
  NoteScratchMoved();
  const cudaError_t e = cudaMalloc(&p, elements * sizeof(uint16_t));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(std::string("CublasContext scratch cudaMalloc: ") +
                               cudaGetErrorString(e));
  }
  scratch_ = static_cast<uint16_t*>(p);
  scratch_elements_ = elements;
  return absl::OkStatus();
}

absl::Status CublasContext::Linear(const float* x, const uint16_t* w, int rows, int in, int out,
                                   float* y, void* stream, uint16_t* x_bf16) {
  if (rows < 0 || in <= 0 || out <= 0) {
    return absl::InvalidArgumentError("Linear: rows must be ≥ 0, in and out > 0");
  }
  if (rows == 0) return absl::OkStatus();
  const int64_t n = int64_t(rows) * in;
  uint16_t* xb = x_bf16;
  if (xb == nullptr) {
    if (absl::Status st = EnsureScratch(size_t(n)); !st.ok()) return st;
    xb = scratch_;
  }
  if (absl::Status st = EnsureHandle(); !st.ok()) return st;
  const auto h = static_cast<cublasHandle_t>(handle_);
  if (absl::Status st = CublasCheck("cublasSetStream", cublasSetStream(h, S(stream)));
      !st.ok()) {
    return st;
  }
  // One scratch buffer serves every term: the stream orders each conversion after the GEMM
  // that read the previous one.
  for (int term = Terms(input_) - 1; term >= 0; --term) {
    DGSERVE_RETURN_IF_ERROR(ConvertTerm(input_, term, x, n, xb, S(stream)));
    const float beta = term == Terms(input_) - 1 ? 0.0f : 1.0f;
    DGSERVE_RETURN_IF_ERROR(Gemm(h, xb, w, rows, in, out, y, beta));
  }
  return absl::OkStatus();
}

absl::Status CublasContext::GroupedLinear(const float* x, const uint16_t* w, int groups,
                                          const int32_t* row_offsets,
                                          const int32_t* expert_of_group, int in, int out,
                                          float* y, void* stream, uint16_t* x_bf16) {
  if (groups < 0 || in <= 0 || out <= 0 || (groups > 0 && row_offsets == nullptr)) {
    return absl::InvalidArgumentError(
        "GroupedLinear: groups must be ≥ 0 with row_offsets, in and out > 0");
  }
  if (groups == 0) return absl::OkStatus();
  if (row_offsets[0] < 0) {
    return absl::InvalidArgumentError("GroupedLinear: negative row offset");
  }
  for (int g = 0; g < groups; ++g) {
    if (row_offsets[g + 1] < row_offsets[g]) {
      return absl::InvalidArgumentError("GroupedLinear: row_offsets must be non-decreasing");
    }
    if (expert_of_group != nullptr && expert_of_group[g] < 0) {
      return absl::InvalidArgumentError("GroupedLinear: negative expert id");
    }
  }
  const int first = row_offsets[0];
  const int64_t n = int64_t(row_offsets[groups] - first) * in;
  if (n == 0) return absl::OkStatus();
  uint16_t* xb = x_bf16;
  if (xb == nullptr) {
    if (absl::Status st = EnsureScratch(size_t(n)); !st.ok()) return st;
    xb = scratch_;
  }
  if (absl::Status st = EnsureHandle(); !st.ok()) return st;
  const auto h = static_cast<cublasHandle_t>(handle_);
  if (absl::Status st = CublasCheck("cublasSetStream", cublasSetStream(h, S(stream)));
      !st.ok()) {
    return st;
  }
  for (int term = Terms(input_) - 1; term >= 0; --term) {
    DGSERVE_RETURN_IF_ERROR(
        ConvertTerm(input_, term, x + int64_t(first) * in, n, xb, S(stream)));
    const float beta = term == Terms(input_) - 1 ? 0.0f : 1.0f;
    for (int g = 0; g < groups; ++g) {
      const int r0 = row_offsets[g], m = row_offsets[g + 1] - r0;
      if (m == 0) continue;
      const int64_t e = expert_of_group != nullptr ? expert_of_group[g] : g;
      DGSERVE_RETURN_IF_ERROR(Gemm(h, xb + int64_t(r0 - first) * in,
                                        w + e * int64_t(out) * in, m, in, out,
                                        y + int64_t(r0) * out, beta));
    }
  }
  return absl::OkStatus();
}

}  // namespace dgserve::cuda
