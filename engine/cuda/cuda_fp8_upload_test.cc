// UploadFp8 (cuda_fp8_memory.h) against the checkpoint's codes and scales (labels `gpu` and
// `gpu-emu`; a file of its own, so that the kernel mutants of cuda_fp8_test.cc link without the
// backend's host code).
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/cuda/cuda_fp8_memory.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

class CudaFp8UploadTest : public CudaTest {};

// UploadFp8 keeps the checkpoint's codes and scales, row-major, whatever QuantMatrix's panel
// layout (rows not a multiple of 16); a non-FP8 matrix is refused without an upload.
TEST_F(CudaFp8UploadTest, KeepsCodesAndScales) {
  const int E = 3, rows = 20, cols = 40;
  std::mt19937 gen(600);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(1e-3f, 1e-2f);
  struct {
    std::vector<uint8_t> codes;
    std::vector<float> scales;
  } w;
  w.codes.resize(size_t(E) * rows * cols);
  for (uint8_t& q : w.codes) q = uint8_t(byte(gen));
  w.scales.resize(size_t(E) * rows);
  for (float& s : w.scales) s = scale(gen);
  std::vector<cpu::PackedMatrix> experts;
  for (int e = 0; e < E; ++e) {
    experts.push_back(cpu::PackedMatrix::Quantized(cpu::QuantMatrix::FromFp8(
        &w.codes[size_t(e) * rows * cols], &w.scales[size_t(e) * rows], rows, cols)));
  }
  DeviceFp8 d;
  absl::StatusOr<bool> ok = UploadFp8(experts, &d);
  ASSERT_THAT(ok.status(), IsOk());
  ASSERT_TRUE(*ok);
  EXPECT_EQ(d.rows, 20);
  EXPECT_EQ(d.cols, 40);
  EXPECT_EQ(Download(d.codes.get(), w.codes.size()), w.codes);
  const std::vector<float> scales = Download(d.scales.get(), w.scales.size());
  for (size_t i = 0; i < scales.size(); ++i) ASSERT_EQ(Bits(scales[i]), Bits(w.scales[i])) << i;
  std::vector<uint16_t> bf16(20 * 40, 0x3f80);
  DeviceFp8 none;
  ok = UploadFp8(cpu::PackedMatrix::FromBf16(bf16.data(), 20, 40), &none);
  ASSERT_THAT(ok.status(), IsOk());
  EXPECT_FALSE(*ok);
  EXPECT_EQ(none.rows, 0);
}

}  // namespace
}  // namespace dgserve::cuda
