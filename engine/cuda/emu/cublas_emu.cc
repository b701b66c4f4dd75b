// The naive host GEMM behind the emulated cublas_v2.h.
#include <cublas_v2.h>

#include <cstdint>
#include <cstring>

struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace {

float Element(const void* p, cudaDataType_t type, int64_t i) {
  if (type == CUDA_R_32F) return static_cast<const float*>(p)[i];
  const uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

cublasStatus_t Gemm(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                    int k, float alpha, const void* A, cudaDataType_t at, int lda, const void* B,
                    cudaDataType_t bt, int ldb, float beta, float* C, int ldc) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  dgserve::cuda::emu::CountGemmCall();
  // cuBLAS's argument checks: A is lda × (k or m) with lda ≥ its row count, likewise B and C.
  if (m < 0 || n < 0 || k < 0 || lda < (ta == CUBLAS_OP_N ? m : k) || lda < 1 ||
      ldb < (tb == CUBLAS_OP_N ? k : n) || ldb < 1 || ldc < m || ldc < 1) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // Runs now, or at the replay of a capture of the handle's stream (alpha and beta are read
  // now, as cuBLAS's host pointer mode does).
  const cudaError_t e = dgserve::cuda::emu::Enqueue(handle->stream, [=] {
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        double acc = 0;
        for (int l = 0; l < k; ++l) {
          const int64_t ai = ta == CUBLAS_OP_N ? i + int64_t(l) * lda : l + int64_t(i) * lda;
          const int64_t bi = tb == CUBLAS_OP_N ? l + int64_t(j) * ldb : j + int64_t(l) * ldb;
          acc += double(Element(A, at, ai)) * Element(B, bt, bi);
        }
        float& c = C[i + int64_t(j) * ldc];
        c = float(alpha * acc + (beta == 0.0f ? 0.0 : double(beta) * c));
      }
    }
  });
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}

}  // namespace

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  *handle = new cublasContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS (emulated)";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED (emulated)";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE (emulated)";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED (emulated)";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED (emulated)";
  }
  return "unknown cuBLAS status (emulated)";
}
cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float* alpha,
                           const float* A, int lda, const float* B, int ldb, const float* beta,
                           float* C, int ldc) {
  return Gemm(handle, transa, transb, m, n, k, *alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb,
              *beta, C, ldc);
}
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C,
                            cudaDataType_t Ctype, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t) {
  if (Ctype != CUDA_R_32F || compute != CUBLAS_COMPUTE_32F ||
      (Atype != CUDA_R_32F && Atype != CUDA_R_16BF) ||
      (Btype != CUDA_R_32F && Btype != CUDA_R_16BF)) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  return Gemm(handle, transa, transb, m, n, k, *static_cast<const float*>(alpha), A, Atype, lda, B,
              Btype, ldb, *static_cast<const float*>(beta), static_cast<float*>(C), ldc);
}
