#include "engine/cuda/cuda_calibrate.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/status_macros.h"
#include "engine/cuda/cuda_memory.h"
#include "engine/cuda/cuda_synthetic.h"

namespace dgserve::cuda {
namespace {

// Events for the timing (created once per call, destroyed on every path).
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~EventPair() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
  absl::Status Create() {
    DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaEventCreateWithFlags(&start, cudaEventDefault), "event"));
    return CudaCheck(cudaEventCreateWithFlags(&stop, cudaEventDefault), "event");
  }
  // Milliseconds between the two records, after waiting for the second.
  absl::StatusOr<float> Elapsed() {
    DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaEventSynchronize(stop), "cudaEventSynchronize"));
    float ms = 0;
    DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaEventElapsedTime(&ms, start, stop), "elapsed"));
    return ms;
  }
};

}  // namespace

absl::StatusOr<Ceilings> MeasureCeilings(size_t copy_bytes, int gemm_n, int repetitions) {
  Ceilings out;
  repetitions = std::max(1, repetitions);
  EventPair ev;
  DGSERVE_RETURN_IF_ERROR(ev.Create());
  if (copy_bytes > 0) {
    const size_t n = (copy_bytes + 1) / 2;
    DeviceArray<uint16_t> src, dst;
    DGSERVE_RETURN_IF_ERROR(src.Ensure(n));
    DGSERVE_RETURN_IF_ERROR(dst.Ensure(n));
    DGSERVE_RETURN_IF_ERROR(FillSyntheticBf16({0x5eed, 0.5f, 0, false}, int64_t(n), src.get()));
    float best = 0;
    for (int r = 0; r <= repetitions; ++r) {  // r = 0: warm-up
      DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaEventRecord(ev.start), "cudaEventRecord"));
      DGSERVE_RETURN_IF_ERROR(CudaCheck(
          cudaMemcpyAsync(dst.get(), src.get(), n * 2, cudaMemcpyDeviceToDevice), "copy"));
      DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaEventRecord(ev.stop), "cudaEventRecord"));
      DGSERVE_ASSIGN_OR_RETURN(const float ms, ev.Elapsed());
      if (r > 0 && (best == 0 || ms < best)) best = ms;
    }
    out.copy_bytes = n * 2;
    out.copy_gbs = best > 0 ? 2.0 * double(n * 2) / (best * 1e-3) / 1e9 : 0;
  }
  if (gemm_n > 0) {
    const size_t nn = size_t(gemm_n) * gemm_n;
    DeviceArray<uint16_t> a, b;
    DeviceArray<float> c;
    DGSERVE_RETURN_IF_ERROR(a.Ensure(nn));
    DGSERVE_RETURN_IF_ERROR(b.Ensure(nn));
    DGSERVE_RETURN_IF_ERROR(c.Ensure(nn));
    // Values of a LINEAR weight's size (|x| ≤ 0.02), not zeros (a GEMM of zeros draws less power).
    DGSERVE_RETURN_IF_ERROR(FillSyntheticBf16({0xa, 0.02f, 0, false}, int64_t(nn), a.get()));
    DGSERVE_RETURN_IF_ERROR(FillSyntheticBf16({0xb, 0.02f, 0, false}, int64_t(nn), b.get()));
    cublasHandle_t h = nullptr;
    DGSERVE_RETURN_IF_ERROR(CublasCheck(cublasCreate(&h), "cublasCreate"));
    const float alpha = 1.0f, beta = 0.0f;
    float best = 0;
    absl::Status st;
    for (int r = 0; r <= repetitions && st.ok(); ++r) {
      st = CudaCheck(cudaEventRecord(ev.start), "cudaEventRecord");
      if (!st.ok()) break;
      st = CublasCheck(
          cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, gemm_n, gemm_n, gemm_n, &alpha, a.get(),
                       CUDA_R_16BF, gemm_n, b.get(), CUDA_R_16BF, gemm_n, &beta, c.get(),
                       CUDA_R_32F, gemm_n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx (calibration)");
      if (!st.ok()) break;
      st = CudaCheck(cudaEventRecord(ev.stop), "cudaEventRecord");
      if (!st.ok()) break;
      auto ms = ev.Elapsed();
      if (!ms.ok()) {
        st = ms.status();
        break;
      }
      if (r > 0 && (best == 0 || *ms < best)) best = *ms;
    }
    cublasDestroy(h);
    DGSERVE_RETURN_IF_ERROR(st);
    out.gemm_n = gemm_n;
    out.gemm_tflops = best > 0 ? 2.0 * double(gemm_n) * gemm_n * gemm_n / (best * 1e-3) / 1e12 : 0;
  }
  return out;
}

std::string CurrentDeviceName() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return "";
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "";
  return prop.name;
}

}  // namespace dgserve::cuda
