#include "engine/cuda/cuda_memory.h"

#include "absl/strings/str_cat.h"
#include "common/bf16.h"

namespace dgserve::cuda {

absl::Status CudaCheck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status CublasCheck(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": cuBLAS status ", int(s)));
}

absl::Status Download(void* host, const void* device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  NoteDownload();
  return CudaCheck(cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}

absl::Status UploadBf16(const std::vector<uint16_t>& bits, DeviceArray<uint16_t>* out) {
  return out->Upload(bits);
}

absl::Status UploadBf16(const cpu::PackedMatrix& w, DeviceArray<uint16_t>* out) {
  return out->Upload(w.UnpackBf16());
}

absl::Status UploadBf16(const std::vector<cpu::PackedMatrix>& experts,
                        DeviceArray<uint16_t>* out) {
  std::vector<uint16_t> bits;
  for (const cpu::PackedMatrix& e : experts) {
    const std::vector<uint16_t> one = e.UnpackBf16();
    bits.insert(bits.end(), one.begin(), one.end());
  }
  return out->Upload(bits);
}

absl::Status UploadFloat(const cpu::PackedMatrix& w, DeviceArray<float>* out) {
  const std::vector<uint16_t> bits = w.UnpackBf16();
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = Bf16ToFloat(bits[i]);
  return out->Upload(f);
}

}  // namespace dgserve::cuda
