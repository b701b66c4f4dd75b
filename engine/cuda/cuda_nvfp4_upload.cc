#include "engine/cuda/cuda_nvfp4_upload.h"

#include "common/status_macros.h"
#include "engine/cpu/gemm_quant.h"

namespace dgserve::cuda {
namespace {

absl::StatusOr<bool> Upload(const std::vector<const cpu::QuantMatrix*>& experts, DeviceNvfp4* out) {
  if (experts.empty() || experts[0] == nullptr) return false;
  const int rows = experts[0]->rows(), cols = experts[0]->cols();
  const bool weight_only = experts[0]->nvfp4_weight_only();
  if (cols % cpu::kNvfp4Block != 0) return false;
  const int words = cols / 8, blocks = cols / cpu::kNvfp4Block;
  std::vector<uint32_t> codes(experts.size() * rows * words, 0);
  std::vector<uint8_t> scales(experts.size() * rows * blocks);
  std::vector<float> alpha(experts.size() * rows), global(experts.size());
  for (size_t e = 0; e < experts.size(); ++e) {
    const cpu::QuantMatrix* q = experts[e];
    // W4A4 and weight-only NVFP4 (NVFP4A16) both upload; experts that mix them are declined (one
    // kernel mode per launch), and the backend then refuses them (RefuseWidening).
    if (q == nullptr || q->format() != cpu::QuantFormat::kNvfp4 ||
        q->nvfp4_weight_only() != weight_only || q->rows() != rows || q->cols() != cols) {
      return false;
    }
    // QuantMatrix's NVFP4 panels (gemm_quant.h): 16 rows per panel, per input c 8 bytes, byte j
    // holding row j's e2m1 code in the low nibble and row j + 8's in the high one; block scales
    // [cols/16][16] e4m3 codes per panel.
    for (int r = 0; r < rows; ++r) {
      const uint8_t* panel = q->panel(r / cpu::kGemmPanel);
      const uint8_t* panel_scales = q->panel_block_scales(r / cpu::kGemmPanel);
      const int j = r % cpu::kGemmPanel;
      uint32_t* row_words = &codes[(e * rows + r) * words];
      for (int c = 0; c < cols; ++c) {
        const uint8_t byte = panel[size_t(c) * 8 + j % 8];
        const uint32_t nibble = j < 8 ? byte & 0x0fu : byte >> 4;
        row_words[c / 8] |= nibble << (4 * (c % 8));
      }
      for (int b = 0; b < blocks; ++b) {
        scales[(e * rows + r) * blocks + b] = panel_scales[size_t(b) * cpu::kGemmPanel + j];
      }
      alpha[e * rows + r] = q->RowScale(r);  // weight-only: weight_scale_2
    }
    global[e] = q->InputGlobal();
  }
  DGSERVE_RETURN_IF_ERROR(out->codes.Upload(codes));
  DGSERVE_RETURN_IF_ERROR(out->block_scales.Upload(scales));
  DGSERVE_RETURN_IF_ERROR(out->alpha.Upload(alpha));
  DGSERVE_RETURN_IF_ERROR(out->input_global.Upload(global));
  out->experts = int(experts.size());
  out->weight_only = weight_only;
  return true;
}

}  // namespace

absl::StatusOr<bool> UploadNvfp4(const std::vector<cpu::PackedMatrix>& experts, DeviceNvfp4* out) {
  std::vector<const cpu::QuantMatrix*> q;
  for (const cpu::PackedMatrix& m : experts) q.push_back(m.quant());
  return Upload(q, out);
}

absl::StatusOr<bool> UploadNvfp4(const cpu::PackedMatrix& w, DeviceNvfp4* out) {
  return Upload({w.quant()}, out);
}

}  // namespace dgserve::cuda
