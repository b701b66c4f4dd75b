#include "engine/cuda/cuda_fp8_memory.h"

#include "engine/cpu/gemm_quant.h"

namespace dgserve::cuda {
namespace {

bool IsFp8(const cpu::PackedMatrix& m) {
  return m.quant() != nullptr && m.quant()->format() == cpu::QuantFormat::kFp8;
}

absl::StatusOr<bool> Upload(const std::vector<const cpu::PackedMatrix*>& matrices, DeviceFp8* out) {
  if (matrices.empty() || !IsFp8(*matrices[0])) return false;
  const int rows = matrices[0]->rows(), cols = matrices[0]->cols();
  std::vector<uint8_t> codes(matrices.size() * size_t(rows) * cols);
  std::vector<float> scales(matrices.size() * size_t(rows));
  for (size_t e = 0; e < matrices.size(); ++e) {
    if (!IsFp8(*matrices[e]) || matrices[e]->rows() != rows || matrices[e]->cols() != cols) {
      return false;
    }
    const cpu::QuantMatrix& q = *matrices[e]->quant();
    // QuantMatrix's FP8 panels (gemm_quant.h): 16 rows per panel, per input c the 16 rows' codes.
    for (int r = 0; r < rows; ++r) {
      const uint8_t* panel = q.panel(r / cpu::kGemmPanel);
      const int j = r % cpu::kGemmPanel;
      uint8_t* dst = &codes[(e * rows + r) * size_t(cols)];
      for (int c = 0; c < cols; ++c) dst[c] = panel[size_t(c) * cpu::kGemmPanel + j];
      scales[e * rows + r] = q.RowScale(r);
    }
  }
  DGSERVE_RETURN_IF_ERROR(out->codes.Upload(codes));
  DGSERVE_RETURN_IF_ERROR(out->scales.Upload(scales));
  out->rows = rows;
  out->cols = cols;
  return true;
}

}  // namespace

absl::StatusOr<bool> UploadFp8(const std::vector<cpu::PackedMatrix>& matrices, DeviceFp8* out) {
  std::vector<const cpu::PackedMatrix*> p;
  for (const cpu::PackedMatrix& m : matrices) p.push_back(&m);
  return Upload(p, out);
}

absl::StatusOr<bool> UploadFp8(const cpu::PackedMatrix& matrix, DeviceFp8* out) {
  return Upload({&matrix}, out);
}

}  // namespace dgserve::cuda
