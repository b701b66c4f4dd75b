// The matrix-core wrapper (cuda_mma.cuh) through its test kernels (cuda_mma_test_kernels.h)
// against float64 host references and the PTX ISA's lane mappings, written out again here (label
// `gpu`, skipped without a GPU; and `gpu-emu`, where the emulation's layouts are what is tested).
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "common/fp8.h"
#include "common/testing/status_matchers.h"
#include "engine/cuda/cuda_mma_test_kernels.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;

std::vector<uint16_t> RandomBf16(size_t n, float scale, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = FloatToBf16(dist(gen));
  return v;
}

// Multiples of 1/8 in [-2, 2]: every product and every sum of a 16-term dot product is exact in
// float32, so the device's and the emulation's orders of addition give the same bits.
std::vector<uint16_t> EighthsBf16(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(-16, 16);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = FloatToBf16(float(dist(gen)) / 8.0f);
  return v;
}

class CudaMmaTest : public CudaTest {
 protected:
  // d = c + a·b on one warp; a [16, 16], b [16, 8] (k × n), c [16, 8], all row-major.
  std::vector<float> Tile(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                          const std::vector<float>& c) {
    float* d = Alloc<float>(16 * 8, 0xFF);
    EXPECT_THAT(MmaTileForTest(Upload(a), Upload(b), Upload(c), d), IsOk());
    return Download(d, 16 * 8);
  }

  // The tiled GEMM (cp.async pipeline, ldmatrix, mma) against float64, for both B layouts.
  void ExpectGemm(bool b_k_major) {
    const int m = 128, n = 128, k = 96;  // 2 × 2 blocks, 3 steps of the pipeline
    const std::vector<uint16_t> a = RandomBf16(size_t(m) * k, 1.0f, 11);
    const std::vector<uint16_t> b = RandomBf16(size_t(n) * k, 1.0f, 12);  // [n, k] or [k, n]
    float* c = Alloc<float>(size_t(m) * n, 0xFF);
    ASSERT_THAT(MmaGemmForTest(Upload(a), Upload(b), b_k_major, m, n, k, c), IsOk());
    const std::vector<float> got = Download(c, size_t(m) * n);
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < n; ++j) {
        double want = 0, magnitude = 0;
        for (int l = 0; l < k; ++l) {
          const double bv = Bf16ToFloat(b_k_major ? b[size_t(l) * n + j] : b[size_t(j) * k + l]);
          const double p = double(Bf16ToFloat(a[size_t(i) * k + l])) * bv;
          want += p;
          magnitude += std::fabs(p);
        }
        ASSERT_NEAR(got[size_t(i) * n + j], want, (k + 1) * 0x1p-23 * magnitude + 1e-30)
            << "row " << i << " col " << j;
      }
    }
  }
};

// Exact values: the result must be the float64 reference bit for bit, on the device and in the
// emulation. A wrong fragment index moves products to other rows or columns.
TEST_F(CudaMmaTest, SingleTileMatchesReference) {
  const std::vector<uint16_t> a = EighthsBf16(16 * 16, 1), b = EighthsBf16(16 * 8, 2);
  std::vector<float> c(16 * 8);
  for (int i = 0; i < 16 * 8; ++i) c[i] = float(i % 13) - 6.0f;
  const std::vector<float> d = Tile(a, b, c);
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      double want = c[i * 8 + j];
      for (int k = 0; k < 16; ++k) {
        want += double(Bf16ToFloat(a[i * 16 + k])) * Bf16ToFloat(b[k * 8 + j]);
      }
      ASSERT_EQ(d[i * 8 + j], want) << "row " << i << " col " << j;
    }
  }
}

// Random bf16 values (products exact in float32, sums rounded): within float32 rounding of the
// float64 reference, whatever the order of the additions.
TEST_F(CudaMmaTest, SingleTileRandomValuesWithinRounding) {
  const std::vector<uint16_t> a = RandomBf16(16 * 16, 3.0f, 3), b = RandomBf16(16 * 8, 3.0f, 4);
  std::vector<float> c(16 * 8);
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(-10.0f, 10.0f);
  for (float& x : c) x = dist(gen);
  const std::vector<float> d = Tile(a, b, c);
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      double want = c[i * 8 + j], magnitude = std::fabs(c[i * 8 + j]);
      for (int k = 0; k < 16; ++k) {
        const double p = double(Bf16ToFloat(a[i * 16 + k])) * Bf16ToFloat(b[k * 8 + j]);
        want += p;
        magnitude += std::fabs(p);
      }
      // 17 float32 additions at most, each off by at most 2⁻²³ of the running magnitude (the
      // device may truncate rather than round).
      ASSERT_NEAR(d[i * 8 + j], want, 17 * 0x1p-23 * magnitude + 1e-30)
          << "row " << i << " col " << j;
    }
  }
}

// mma.m16n8k32 .e4m3 (FP8 tensor cores): codes whose values are multiples of 1/4 in [−4, 4] (and
// 0), so every product is a multiple of 1/16 and every partial sum of 32 of them plus c is exact
// in float32 (and in any narrower accumulator of ≥ 14 bits): bit for bit the float64 reference.
// Every row and column of A and B differs, so a misplaced fragment element shows.
TEST_F(CudaMmaTest, E4m3TileMatchesReference) {
  std::mt19937 gen(21);
  std::uniform_int_distribution<int> dist(-16, 16);
  auto codes = [&](size_t n) {
    std::vector<uint8_t> v(n);
    for (uint8_t& x : v) x = FloatToE4m3(float(dist(gen)) / 4.0f);
    return v;
  };
  const std::vector<uint8_t> a = codes(16 * 32), b = codes(32 * 8);
  std::vector<float> c(16 * 8);
  for (int i = 0; i < 16 * 8; ++i) c[i] = float(i % 11) - 5.0f;
  float* d = Alloc<float>(16 * 8, 0xFF);
  ASSERT_THAT(MmaE4m3TileForTest(Upload(a), Upload(b), Upload(c), d), IsOk());
  const std::vector<float> got = Download(d, 16 * 8);
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 8; ++j) {
      double want = c[i * 8 + j];
      for (int k = 0; k < 32; ++k)
        want += double(E4m3ToFloat(a[i * 32 + k])) * E4m3ToFloat(b[k * 8 + j]);
      ASSERT_EQ(got[i * 8 + j], want) << "row " << i << " col " << j;
    }
  }
}

// ldmatrix: lane 8j + r names row r of matrix j (a permutation of 64 shared rows, so a wrong
// address-to-matrix assignment shows); lane l gets (l/4, 2(l%4)..+1) of each matrix, or with
// .trans (2(l%4)..+1, l/4). Every element is a distinct 16-bit value: its own position.
TEST_F(CudaMmaTest, LdMatrixLaneMappingFollowsTheIsa) {
  const int num_rows = 64;
  std::vector<uint16_t> rows(num_rows * 8);
  for (int i = 0; i < num_rows * 8; ++i) rows[i] = uint16_t(0x1000 + i);
  std::vector<int32_t> row_of_lane(32);
  for (int l = 0; l < 32; ++l) row_of_lane[l] = (l * 37 + 11) % num_rows;  // 37 is odd: distinct
  const uint16_t* dev_rows = Upload(rows);
  const int32_t* dev_lanes = Upload(row_of_lane);
  for (const int matrices : {2, 4}) {
    for (const bool trans : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "x" << matrices << (trans ? ".trans" : ""));
      uint32_t* out = Alloc<uint32_t>(32 * 4, 0xAB);
      ASSERT_THAT(LdMatrixForTest(dev_rows, num_rows, dev_lanes, matrices, trans, out), IsOk());
      const std::vector<uint32_t> got = Download(out, 32 * 4);
      // Element (r, c) of matrix j: column c of the row lane 8j + r addressed.
      auto at = [&](int j, int r, int c) { return uint32_t(rows[row_of_lane[8 * j + r] * 8 + c]); };
      for (int l = 0; l < 32; ++l) {
        const int r = l / 4, c = 2 * (l % 4);
        for (int j = 0; j < 4; ++j) {
          const uint32_t want = j >= matrices ? 0xABABABABu
                                : trans       ? at(j, c, r) | at(j, c + 1, r) << 16
                                              : at(j, r, c) | at(j, r, c + 1) << 16;
          ASSERT_EQ(got[l * 4 + j], want) << "lane " << l << " register " << j;
        }
      }
    }
  }
}

TEST_F(CudaMmaTest, TiledGemmMatchesReferenceBNMajor) { ExpectGemm(false); }
TEST_F(CudaMmaTest, TiledGemmMatchesReferenceBKMajor) { ExpectGemm(true); }

TEST_F(CudaMmaTest, TiledGemmRejectsShapesItCannotTile) {
  EXPECT_FALSE(MmaGemmForTest(nullptr, nullptr, false, 64, 64, 48, nullptr).ok());
  EXPECT_FALSE(MmaGemmForTest(nullptr, nullptr, false, 96, 64, 32, nullptr).ok());
}

}  // namespace
}  // namespace dgserve::cuda
