// Emulation stand-in for cuBLAS (gpu-emu targets only, see engine/cuda/emu/cuda_emu.h): the
// handful of calls dgserve makes, as a naive host GEMM (double accumulation, column-major as
// cuBLAS) that checks the shapes and leading dimensions as cuBLAS does. It tests how our code
// calls cuBLAS (operands, transposes, leading dimensions), not cuBLAS itself.
#pragma once

#include "engine/cuda/emu/cuda_emu.h"

typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
} cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

struct cublasContext;
typedef struct cublasContext* cublasHandle_t;

cublasStatus_t cublasCreate(cublasHandle_t* handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
const char* cublasGetStatusString(cublasStatus_t status);

// C = alpha·op(A)·op(B) + beta·C, column-major, op(A): m×k, op(B): k×n, C: m×n.
cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float* alpha,
                           const float* A, int lda, const float* B, int ldb, const float* beta,
                           float* C, int ldc);
// As cublasSgemm with A and B float32 or bf16 (CUDA_R_16BF: bits in uint16), C float32 and
// float32 compute; other types are CUBLAS_STATUS_NOT_SUPPORTED.
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C,
                            cudaDataType_t Ctype, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo);
