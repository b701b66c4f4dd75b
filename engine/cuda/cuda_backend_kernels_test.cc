// The small kernels of cuda_backend_kernels.h against host references written here (label
// `gpu`, skipped without a GPU; and `gpu-emu`, under the host emulation).
#include "engine/cuda/cuda_backend_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/gemm.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;

std::vector<float> RandomFloats(size_t n, float scale, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

class CudaBackendKernelsTest : public CudaTest {};

TEST_F(CudaBackendKernelsTest, EmbedRowsGathersScaledBf16Rows) {
  const int vocab = 37, dim = 70, rows = 9;
  std::vector<uint16_t> table(size_t(vocab) * dim);
  const std::vector<float> f = RandomFloats(table.size(), 2.0f, 1);
  for (size_t i = 0; i < table.size(); ++i) table[i] = FloatToBf16(f[i]);
  const std::vector<int32_t> ids = {0, 36, 5, 5, 17, 2, 36, 30, 1};
  const float scale = 8.0f;  // √64, exact
  float* out = Alloc<float>(size_t(rows) * dim, 0xFF);
  ASSERT_THAT(EmbedRows(Upload(ids), Upload(table), rows, dim, scale, out), IsOk());
  const std::vector<float> got = Download(out, size_t(rows) * dim);
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < dim; ++d) {
      ASSERT_EQ(got[size_t(r) * dim + d], Bf16ToFloat(table[size_t(ids[r]) * dim + d]) * scale)
          << r << " " << d;
    }
  }
}

TEST_F(CudaBackendKernelsTest, ElementwiseResidualOps) {
  const int64_t n = 1000;
  const std::vector<float> h = RandomFloats(n, 3.0f, 2), x = RandomFloats(n, 1.0f, 3);
  float* dh = Upload(h);
  ASSERT_THAT(AddInPlace(dh, Upload(x), n), IsOk());
  std::vector<float> got = Download(dh, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], h[i] + x[i]) << i;

  dh = Upload(h);
  ASSERT_THAT(AddScale(dh, Upload(x), 0.75f, n), IsOk());
  got = Download(dh, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], (h[i] + x[i]) * 0.75f) << i;

  dh = Upload(h);
  ASSERT_THAT(Scale(dh, n, -2.5f), IsOk());
  got = Download(dh, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], h[i] * -2.5f) << i;

  // Scaled then rounded as a bf16-mode GEMM input (the router's input): the CPU's rounding of
  // the product, bit for bit, denormal products read as zero.
  std::vector<float> r = h;
  r[0] = 0x1p-130f;         // × 0.5: a denormal product → +0
  r[1] = -0x1p-127f;        // → −0
  r[2] = 1.0f + 0x1p-8f;    // × 0.5: a tie, to even (0.5)
  r[3] = 1.0f + 0x1.8p-8f;  // rounds up
  dh = Upload(r);
  ASSERT_THAT(ScaleAndRoundToBf16(dh, n, 0.5f), IsOk());
  got = Download(dh, n);
  for (int64_t i = 0; i < n; ++i) {
    const float want = Bf16ToFloat(cpu::RoundActivationToBf16(r[i] * 0.5f));
    ASSERT_EQ(std::memcmp(&got[i], &want, 4), 0) << i << ": " << got[i] << " want " << want;
  }
  EXPECT_EQ(std::memcmp(&got[0], "\0\0\0\0", 4), 0);
  EXPECT_EQ(got[2], 0.5f);
  EXPECT_EQ(got[3], 0.5f + 0x1p-8f);
}

// out[r, i] = gelu_tanh(gate) · up on the packed [rows, 2·width] input, against float64.
TEST_F(CudaBackendKernelsTest, GeluGateRowsSplitsThePackedInput) {
  const int rows = 7, width = 45;
  const std::vector<float> gu = RandomFloats(size_t(rows) * 2 * width, 4.0f, 4);
  float* out = Alloc<float>(size_t(rows) * width, 0xFF);
  ASSERT_THAT(GeluGateRows(Upload(gu), rows, width, out), IsOk());
  const std::vector<float> got = Download(out, size_t(rows) * width);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < width; ++i) {
      const double g = gu[size_t(r) * 2 * width + i], u = gu[size_t(r) * 2 * width + width + i];
      const double want =
          0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))) * u;
      ASSERT_NEAR(got[size_t(r) * width + i], want, 1e-5 * (1.0 + std::fabs(want)))
          << r << " " << i;
    }
  }
}

// GatherRows (negative index: a zero row), then MoeCombine (k = 3 slots per row, −1 skipped).
TEST_F(CudaBackendKernelsTest, GatherRowsAndMoeCombine) {
  const int src_rows = 6, dim = 33;
  const std::vector<float> src = RandomFloats(size_t(src_rows) * dim, 2.0f, 5);
  const std::vector<int32_t> idx = {5, -1, 0, 3, 3};
  const int rows = int(idx.size());
  float* dst = Alloc<float>(size_t(rows) * dim, 0xFF);
  ASSERT_THAT(GatherRows(Upload(src), Upload(idx), rows, dim, dst), IsOk());
  const std::vector<float> gathered = Download(dst, size_t(rows) * dim);
  for (int r = 0; r < rows; ++r) {
    for (int d = 0; d < dim; ++d) {
      ASSERT_EQ(gathered[size_t(r) * dim + d], idx[r] < 0 ? 0.0f : src[size_t(idx[r]) * dim + d])
          << r << " " << d;
    }
  }

  const int k = 3, out_rows = 4;
  const std::vector<int32_t> slot = {0, 2, -1, 5, 1, 4, -1, -1, -1, 3, 3, 0};
  const std::vector<float> weight = {0.5f, 0.25f, 9.0f, 1.0f, -2.0f, 0.125f,
                                     7.0f, 7.0f,  7.0f, 0.3f, 0.7f,  0.01f};
  float* out = Alloc<float>(size_t(out_rows) * dim, 0xFF);
  ASSERT_THAT(MoeCombine(Upload(src), Upload(slot), Upload(weight), out_rows, k, dim, out), IsOk());
  const std::vector<float> got = Download(out, size_t(out_rows) * dim);
  for (int r = 0; r < out_rows; ++r) {
    for (int d = 0; d < dim; ++d) {
      double want = 0, mag = 0;
      for (int j = 0; j < k; ++j) {
        const int s = slot[r * k + j];
        if (s < 0) continue;
        want += double(weight[r * k + j]) * src[size_t(s) * dim + d];
        mag += std::fabs(double(weight[r * k + j]) * src[size_t(s) * dim + d]);
      }
      ASSERT_NEAR(got[size_t(r) * dim + d], want, 1e-6 * (1.0 + mag)) << r << " " << d;
    }
  }
}

// CopyRowsToBlocks / CopyRowsFromBlocks: rows land at pool row table[s / bs]·bs + s % bs for
// s = first_slot + r (blocks shuffled, first_slot mid-block), float32 and bf16 pools (the float32
// rows rounded by FloatToBf16 into a bf16 pool); rows outside the copied slots keep their fill;
// reading the blocks back gives the rows written.
// Blocks 5 and 3 of a 6-block pool of 3-element blocks into blocks 0 and 2 of a 4-block array
// (the other blocks untouched), float32 and bf16 bits.
TEST_F(CudaBackendKernelsTest, CopyPoolBlocksMovesWholeBlocks) {
  const int per = 3;
  const std::vector<float> from = RandomFloats(6 * per, 2.0f, 11);
  const std::vector<int32_t> moves = {5, 0, 3, 2};
  float* to = Alloc<float>(4 * per, 0xFF);  // NaN bits everywhere
  ASSERT_THAT(CopyPoolBlocks(Upload(from), to, Upload(moves), 2, per), IsOk());
  const std::vector<float> got = Download(to, 4 * per);
  for (int e = 0; e < per; ++e) {
    EXPECT_EQ(got[0 * per + e], from[5 * per + e]) << e;
    EXPECT_EQ(got[2 * per + e], from[3 * per + e]) << e;
    EXPECT_TRUE(std::isnan(got[1 * per + e])) << e;
    EXPECT_TRUE(std::isnan(got[3 * per + e])) << e;
  }
  std::vector<uint16_t> bits(6 * per);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = uint16_t(1000 + i);
  uint16_t* to16 = Alloc<uint16_t>(4 * per, 0);
  ASSERT_THAT(CopyPoolBlocks(Upload(bits), to16, Upload(moves), 2, per), IsOk());
  EXPECT_EQ(Download(to16, 4 * per),
            (std::vector<uint16_t>{1015, 1016, 1017, 0, 0, 0, 1009, 1010, 1011, 0, 0, 0}));
  EXPECT_THAT(CopyPoolBlocks(Upload(bits), to16, Upload(moves), 0, per), IsOk());
}

TEST_F(CudaBackendKernelsTest, CopyRowsToAndFromBlocks) {
  const int bs = 4, width = 6, num_blocks = 7, first_slot = 6, rows = 9;  // slots 6..14
  const std::vector<int32_t> table = {-1, 5, 0, 3, -1, 2};  // blocks 1..3 used (slots 4..15)
  const std::vector<float> src = RandomFloats(size_t(rows) * width, 3.0f, 8);
  // Where slot s lives, written out by hand from the table above.
  const auto pool_row = [&](int s) { return table[s / bs] * bs + s % bs; };
  ASSERT_EQ(pool_row(6), 22);   // block 1 → pool block 5, row 2
  ASSERT_EQ(pool_row(8), 0);    // block 2 → pool block 0, row 0
  ASSERT_EQ(pool_row(14), 14);  // block 3 → pool block 3, row 2
  const size_t pool_size = size_t(num_blocks) * bs * width;
  const int32_t* t = Upload(table);

  float* pool = Alloc<float>(pool_size, 0xFF);  // NaN bits everywhere
  ASSERT_THAT(CopyRowsToBlocks(Upload(src), rows, width, t, bs, first_slot, pool), IsOk());
  std::vector<float> got = Download(pool, pool_size);
  std::vector<bool> written(size_t(num_blocks) * bs, false);
  for (int r = 0; r < rows; ++r) {
    const int row = pool_row(first_slot + r);
    written[row] = true;
    for (int e = 0; e < width; ++e) {
      ASSERT_EQ(got[size_t(row) * width + e], src[size_t(r) * width + e]) << r << " " << e;
    }
  }
  for (size_t row = 0; row < written.size(); ++row) {
    if (!written[row]) {
      ASSERT_TRUE(std::isnan(got[row * width])) << row;
    }
  }
  float* back = Alloc<float>(src.size(), 0xFF);
  ASSERT_THAT(CopyRowsFromBlocks(pool, rows, width, t, bs, first_slot, back), IsOk());
  EXPECT_EQ(Download(back, src.size()), src);

  // bf16 pool: float32 rows rounded, and bf16 rows copied as they are.
  uint16_t* pool16 = Alloc<uint16_t>(pool_size, 0xFF);
  ASSERT_THAT(CopyRowsToBlocks(Upload(src), rows, width, t, bs, first_slot, pool16), IsOk());
  std::vector<uint16_t> bits(src.size());
  for (size_t i = 0; i < src.size(); ++i) bits[i] = FloatToBf16(src[i]);
  const std::vector<uint16_t> got16 = Download(pool16, pool_size);
  for (int r = 0; r < rows; ++r) {
    for (int e = 0; e < width; ++e) {
      ASSERT_EQ(got16[size_t(pool_row(first_slot + r)) * width + e], bits[size_t(r) * width + e])
          << r << " " << e;
    }
  }
  uint16_t* back16 = Alloc<uint16_t>(bits.size(), 0xFF);
  ASSERT_THAT(CopyRowsFromBlocks(pool16, rows, width, t, bs, first_slot, back16), IsOk());
  EXPECT_EQ(Download(back16, bits.size()), bits);
  uint16_t* pool16b = Alloc<uint16_t>(pool_size, 0xFF);
  ASSERT_THAT(CopyRowsToBlocks(Upload(bits), rows, width, t, bs, first_slot, pool16b), IsOk());
  EXPECT_EQ(Download(pool16b, pool_size), got16);

  EXPECT_EQ(CopyRowsToBlocks(Upload(src), rows, width, t, 0, first_slot, pool).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CopyRowsFromBlocks(pool, rows, width, t, bs, -1, back).code(),
            absl::StatusCode::kInvalidArgument);
}

// probs = bf16(exp(cap·tanh(raw/cap)/T − lse)) with VocabStep's lse; a row with a non-finite lse
// is all zeros. Within one bf16 ulp of a float64 reference.
TEST_F(CudaBackendKernelsTest, SoftmaxProbsBf16UsesTheRowsLse) {
  const int rows = 3, vocab = 300;  // two vocabulary chunks of 256
  const float cap = 30.0f;
  const std::vector<float> raw = RandomFloats(size_t(rows) * vocab, 50.0f, 6);
  const std::vector<float> temps = {0.8f, 1.5f, 1.0f};
  std::vector<VocabRowResult> res(rows);
  for (int r = 0; r < rows; ++r) {
    double m = -INFINITY;
    for (int v = 0; v < vocab; ++v) {
      m = std::max(m, cap * std::tanh(double(raw[size_t(r) * vocab + v]) / cap) / temps[r]);
    }
    double s = 0;
    for (int v = 0; v < vocab; ++v) {
      s += std::exp(cap * std::tanh(double(raw[size_t(r) * vocab + v]) / cap) / temps[r] - m);
    }
    res[r] = VocabRowResult{0, 0, 0.0f, float(m + std::log(s))};
  }
  res[2].lse = NAN;
  uint16_t* probs = Alloc<uint16_t>(size_t(rows) * vocab, 0xFF);
  ASSERT_THAT(SoftmaxProbsBf16(Upload(raw), rows, vocab, cap, Upload(temps), Upload(res), probs),
              IsOk());
  const std::vector<uint16_t> got = Download(probs, size_t(rows) * vocab);
  for (int r = 0; r < 2; ++r) {
    double total = 0;
    for (int v = 0; v < vocab; ++v) {
      const double l = cap * std::tanh(double(raw[size_t(r) * vocab + v]) / cap);
      const uint16_t want = FloatToBf16(float(std::exp(l / temps[r] - res[r].lse)));
      const uint16_t g = got[size_t(r) * vocab + v];
      ASSERT_LE(std::abs(int(g) - int(want)), 1) << r << " " << v;
      total += Bf16ToFloat(g);
    }
    EXPECT_NEAR(total, 1.0, 2e-2) << r;  // a distribution, to bf16 rounding
  }
  for (int v = 0; v < vocab; ++v) ASSERT_EQ(got[size_t(2) * vocab + v], 0) << v;

  // With canvas-template masks: row 0 through mask 0 (ids ≡ 0 mod 3 allowed), row 1 without a
  // mask: masked-out ids are 0, the others unchanged.
  const int words = (vocab + 63) / 64;
  std::vector<uint64_t> table(words, 0);
  for (int v = 0; v < vocab; v += 3) table[v / 64] |= uint64_t(1) << (v % 64);
  const std::vector<int32_t> index = {0, -1, -1};
  uint16_t* masked = Alloc<uint16_t>(size_t(rows) * vocab, 0xFF);
  ASSERT_THAT(SoftmaxProbsBf16(Upload(raw), rows, vocab, cap, Upload(temps), Upload(res), masked,
                               Upload(table), Upload(index)),
              IsOk());
  const std::vector<uint16_t> got_masked = Download(masked, size_t(rows) * vocab);
  for (int r = 0; r < 2; ++r) {
    for (int v = 0; v < vocab; ++v) {
      const size_t i = size_t(r) * vocab + v;
      ASSERT_EQ(got_masked[i], r == 0 && v % 3 != 0 ? uint16_t(0) : got[i]) << r << " " << v;
    }
  }
}

}  // namespace
}  // namespace dgserve::cuda
