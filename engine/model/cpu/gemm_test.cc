// THE PROPERTY of gemm.h, tested directly: every output element equals the scalar fma chain over
// k in ascending order (computed here, independently of the GEMM), bit for bit, on every ISA path
// this CPU has, for random shapes, offsets, layouts, thread counts and bf16 or float32 B.
#include "engine/model/cpu/gemm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "engine/model/cpu/packed_matrix.h"

namespace dgserve::cpu {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Random bf16-representable values (so float and bf16 B hold the same numbers), with varied
// magnitudes so that rounding differences between orders would show.
std::vector<float> RandomBf16Values(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-6, 6);
  std::vector<float> v(n);
  for (float& x : v) x = Bf16ToFloat(FloatToBf16(std::ldexp(d(rng), e(rng))));
  return v;
}

std::vector<float> RandomFloats(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The definition: c = C₀; c = fma(a[i][kk], b[kk][j], c) for kk ascending.
float ChainReference(const float* a_row, const std::vector<float>& b_kn, int n, int k, int j,
                     float c0) {
  float c = c0;
  for (int kk = 0; kk < k; ++kk) c = std::fma(a_row[kk], b_kn[size_t(kk) * n + j], c);
  return c;
}

std::vector<GemmIsa> AllIsas() { return {GemmIsa::kAvx512, GemmIsa::kAvx2, GemmIsa::kPortable}; }

class GemmIsaTest : public ::testing::TestWithParam<GemmIsa> {
 protected:
  void SetUp() override {
    if (!GemmIsaSupported(GetParam())) {
      GTEST_SKIP() << "this CPU lacks " << GemmIsaName(GetParam()) << ": path not tested here";
    }
  }
};

// Random shapes over the layouts of B a caller can pass (row-major float and bf16 with ldb > n,
// packed weights), with and without accumulate: every element equals its reference chain.
TEST_P(GemmIsaTest, EveryElementIsTheAscendingFmaChain) {
  std::mt19937 rng(1234 + int(GetParam()));
  const int ns[] = {1, 3, 16, 17, 31, 32, 33, 48, 70, 257, 300};
  const int ks[] = {1, 2, 7, 16, 63, 255, 256, 257, 600};
  std::uniform_int_distribution<int> mdist(1, 300);
  for (int trial = 0; trial < 24; ++trial) {
    const int m = trial < 3 ? trial + 1 : mdist(rng);
    const int n = ns[trial % std::size(ns)], k = ks[(trial * 5) % std::size(ks)];
    const int lda = k + trial % 3, ldb = n + (trial % 2) * 5, ldc = n + trial % 4;
    std::vector<float> a = RandomFloats(size_t(m) * lda, rng);
    std::vector<float> b_kn = RandomBf16Values(size_t(k) * n, rng);  // B[k][n], dense
    std::vector<float> b_f32(size_t(k) * ldb, 0.0f);
    std::vector<uint16_t> b_bf16(size_t(k) * ldb, 0);
    std::vector<float> w_nk(size_t(n) * k);  // W = Bᵀ [n][k] for PackedMatrix
    for (int kk = 0; kk < k; ++kk) {
      for (int j = 0; j < n; ++j) {
        const float v = b_kn[size_t(kk) * n + j];
        b_f32[size_t(kk) * ldb + j] = v;
        b_bf16[size_t(kk) * ldb + j] = FloatToBf16(v);
        w_nk[size_t(j) * k + kk] = v;
      }
    }
    const PackedMatrix packed = PackedMatrix::FromFloat(w_nk.data(), n, k);
    const GemmB layouts[] = {GemmB::RowMajor(b_f32.data(), ldb),
                             GemmB::RowMajor(b_bf16.data(), ldb), packed.AsGemmB()};
    const char* names[] = {"row-major f32", "row-major bf16", "packed bf16"};
    for (int li = 0; li < 3; ++li) {
      for (bool acc : {false, true}) {
        std::vector<float> c0 = RandomFloats(size_t(m) * ldc, rng);
        std::vector<float> c = c0;
        const GemmArgs g = GemmArgs::Of(m, n, k, a.data(), lda, layouts[li], c.data(), ldc, acc);
        Gemm(g, GetParam(), GemmThreads::kOpenMp);
        int bad = 0;
        for (int i = 0; i < m && bad < 3; ++i) {
          for (int j = 0; j < n && bad < 3; ++j) {
            const float want = ChainReference(a.data() + size_t(i) * lda, b_kn, n, k, j,
                                              acc ? c0[size_t(i) * ldc + j] : 0.0f);
            const float got = c[size_t(i) * ldc + j];
            if (Bits(got) != Bits(want)) {
              ++bad;
              ADD_FAILURE() << names[li] << " m=" << m << " n=" << n << " k=" << k << " acc=" << acc
                            << " C[" << i << "," << j << "] = " << got << ", chain gives " << want;
            }
          }
        }
        // Padding columns of C (ldc > n) are never written.
        for (int i = 0; i < m; ++i) {
          for (int j = n; j < ldc; ++j) {
            ASSERT_EQ(Bits(c[size_t(i) * ldc + j]), Bits(c0[size_t(i) * ldc + j]))
                << names[li] << ": wrote past column n at row " << i;
          }
        }
      }
    }
  }
}

// A row's result does not depend on m, on its offset inside the call, or on the thread count:
// rows computed alone, inside bigger calls at offsets within and across tiles, with 1, 2 and 3
// threads, are the same bits.
TEST_P(GemmIsaTest, RowsDoNotDependOnBatchOffsetOrThreads) {
  std::mt19937 rng(99);
  const int n = 200, k = 333, m = 300;
  std::vector<float> a = RandomFloats(size_t(m) * k, rng);
  std::vector<float> w = RandomBf16Values(size_t(n) * k, rng);
  const PackedMatrix packed = PackedMatrix::FromFloat(w.data(), n, k);
  std::vector<float> full(size_t(m) * n);
  Linear(a.data(), m, packed, full.data());  // the active path: compared across paths below
  const int saved_threads = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (int off : {0, 1, 7, 127, 128, 129, 250, 299}) {
      for (int rows : {1, 5, 8, 13, 40, 64, 100}) {
        if (off + rows > m) continue;
        std::vector<float> part(size_t(rows) * n);
        const GemmArgs g = GemmArgs::Of(rows, n, k, a.data() + size_t(off) * k, k, packed.AsGemmB(),
                                        part.data(), n);
        Gemm(g, GetParam(), GemmThreads::kOpenMp);
        ASSERT_EQ(
            0, std::memcmp(part.data(), full.data() + size_t(off) * n, sizeof(float) * part.size()))
            << GemmIsaName(GetParam()) << " vs " << GemmIsaName(ActiveGemmIsa()) << ": rows ["
            << off << ", " << off + rows << ") with " << threads << " threads";
      }
    }
  }
  omp_set_num_threads(saved_threads);
}

// bf16 B gives the bits of the same GEMM on a float32 copy of B.
TEST_P(GemmIsaTest, Bf16WeightsEqualTheirFloatCopy) {
  std::mt19937 rng(5);
  for (const int m : {37, 150}) {  // below and above the rows of the widened path
    const int n = 96, k = 520;
    std::vector<float> a = RandomFloats(size_t(m) * k, rng);
    std::vector<float> b = RandomBf16Values(size_t(k) * n, rng);
    std::vector<uint16_t> b16(b.size());
    for (size_t i = 0; i < b.size(); ++i) b16[i] = FloatToBf16(b[i]);
    std::vector<float> c1(size_t(m) * n), c2(size_t(m) * n);
    GemmArgs g = GemmArgs::Of(m, n, k, a.data(), k, GemmB::RowMajor(b.data(), n), c1.data(), n);
    Gemm(g, GetParam(), GemmThreads::kCallerOnly);
    g.b = GemmB::RowMajor(b16.data(), n);
    g.c = c2.data();
    Gemm(g, GetParam(), GemmThreads::kCallerOnly);
    EXPECT_EQ(0, std::memcmp(c1.data(), c2.data(), sizeof(float) * c1.size())) << "m = " << m;
  }
}

INSTANTIATE_TEST_SUITE_P(AllPaths, GemmIsaTest, ::testing::ValuesIn(AllIsas()),
                         [](const auto& info) { return std::string(GemmIsaName(info.param)); });

// k = 0 writes zeros (or leaves C with accumulate); m or n = 0 touches nothing.
TEST(GemmTest, EmptyDimensions) {
  std::vector<float> c(6, 5.0f);
  std::vector<float> a(6, 1.0f), b(6, 1.0f);
  GemmArgs g = GemmArgs::Of(2, 3, 0, a.data(), 1, GemmB::RowMajor(b.data(), 3), c.data(), 3, true);
  Gemm(g);
  EXPECT_EQ(c, std::vector<float>(6, 5.0f));
  g.accumulate = false;
  Gemm(g);
  EXPECT_EQ(c, std::vector<float>(6, 0.0f));
  std::fill(c.begin(), c.end(), 5.0f);
  g.k = 2;
  g.m = 0;
  Gemm(g);
  EXPECT_EQ(c, std::vector<float>(6, 5.0f));
}

TEST(GemmTest, SetGemmIsaRefusesWhatTheCpuLacksAndKeepsThePath) {
  const GemmIsa before = ActiveGemmIsa();
  for (GemmIsa isa : AllIsas()) {
    const absl::Status s = SetGemmIsa(isa);
    EXPECT_EQ(s.ok(), GemmIsaSupported(isa)) << GemmIsaName(isa) << ": " << s;
    if (!s.ok()) EXPECT_NE(s.message().find("not supported"), absl::string_view::npos);
  }
  EXPECT_TRUE(GemmIsaSupported(GemmIsa::kPortable));
  ASSERT_TRUE(SetGemmIsa(before).ok());
}

TEST(PackedMatrixTest, KeepsBf16BitsAndShape) {
  std::mt19937 rng(3);
  const int n = 37, k = 19;
  std::vector<float> w = RandomBf16Values(size_t(n) * k, rng);
  const PackedMatrix p = PackedMatrix::FromFloat(w.data(), n, k);
  EXPECT_EQ(p.rows(), n);
  EXPECT_EQ(p.cols(), k);
  EXPECT_EQ(p.bytes(), size_t(48) * k * 2);  // 3 panels of 16 rows
  const std::vector<uint16_t> bits = p.UnpackBf16();
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < k; ++c) {
      ASSERT_EQ(p.At(r, c), w[size_t(r) * k + c]);
      ASSERT_EQ(bits[size_t(r) * k + c], FloatToBf16(w[size_t(r) * k + c]));
    }
  }
  EXPECT_EQ(PackedMatrix::FromBf16(bits.data(), n, k).UnpackBf16(), bits);
}

}  // namespace
}  // namespace dgserve::cpu
