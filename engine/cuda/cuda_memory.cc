#include "engine/cuda/cuda_memory.h"

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "engine/cpu/gemm_quant.h"

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

absl::StatusOr<bool> UploadW4A16(const std::vector<cpu::PackedMatrix>& experts, DeviceW4A16* out) {
  if (experts.empty()) return false;
  const int rows = experts[0].rows(), cols = experts[0].cols();
  const cpu::QuantMatrix* first = experts[0].quant();
  if (first == nullptr || first->format() != cpu::QuantFormat::kW4A16) return false;
  const int group = first->group_size(), groups = first->groups();
  // The kernel's group: a multiple of 8; one group per row (strategy "channel", G = cols) as
  // cols rounded up to a multiple of 8.
  const int device_group = groups == 1 ? (std::max(group, cols) + 7) / 8 * 8 : group;
  if (device_group % 8 != 0) return false;
  const int words = (cols + 7) / 8;
  std::vector<uint32_t> packed(experts.size() * rows * words, 0);
  std::vector<uint16_t> scales(experts.size() * rows * groups);
  for (size_t e = 0; e < experts.size(); ++e) {
    const cpu::QuantMatrix* q = experts[e].quant();
    if (q == nullptr || q->format() != cpu::QuantFormat::kW4A16 || q->rows() != rows ||
        q->cols() != cols || q->group_size() != group) {
      return false;
    }
    // QuantMatrix's W4A16 panels (gemm_quant.h): 16 rows per panel, per input c 8 bytes, byte j
    // holding row j in the low nibble and row j + 8 in the high one, each q + 8; scales
    // [groups][16] per panel.
    for (int r = 0; r < rows; ++r) {
      const uint8_t* panel = q->panel(r / cpu::kGemmPanel);
      const float* panel_scales = q->panel_scales(r / cpu::kGemmPanel);
      const int j = r % cpu::kGemmPanel;
      uint32_t* row_words = &packed[(e * rows + r) * words];
      for (int c = 0; c < cols; ++c) {
        const uint8_t byte = panel[size_t(c) * 8 + j % 8];
        const uint32_t nibble = j < 8 ? byte & 0x0fu : byte >> 4;
        row_words[c / 8] |= nibble << (4 * (c % 8));
      }
      for (int c = cols; c < words * 8; ++c) row_words[c / 8] |= 8u << (4 * (c % 8));  // q = 0
      for (int g = 0; g < groups; ++g) {
        const float s = panel_scales[size_t(g) * cpu::kGemmPanel + j];
        const uint16_t b = FloatToBf16(s);
        if (Bf16ToFloat(b) != s) return false;  // not a bf16 value
        scales[(e * rows + r) * groups + g] = b;
      }
    }
  }
  DGSERVE_RETURN_IF_ERROR(out->packed.Upload(packed));
  DGSERVE_RETURN_IF_ERROR(out->scales.Upload(scales));
  out->group = device_group;
  return true;
}

absl::StatusOr<bool> UploadW4A16(const cpu::PackedMatrix& w, DeviceW4A16* out) {
  const cpu::QuantMatrix* q = w.quant();
  if (q == nullptr || q->format() != cpu::QuantFormat::kW4A16) return false;
  return UploadW4A16(std::vector<cpu::PackedMatrix>{w}, out);  // copies the handle only
}

absl::Status UploadFloat(const cpu::PackedMatrix& w, DeviceArray<float>* out) {
  const std::vector<uint16_t> bits = w.UnpackBf16();
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = Bf16ToFloat(bits[i]);
  return out->Upload(f);
}

}  // namespace dgserve::cuda
