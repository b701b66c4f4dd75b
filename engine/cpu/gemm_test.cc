// THE PROPERTY of gemm.h, tested directly: every output element equals the scalar fma chain over
// k in ascending order (computed here, independently of the GEMM), bit for bit, on every ISA path
// this CPU has, for random shapes, offsets, layouts, thread counts and bf16 or float32 B.
#include "engine/cpu/gemm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "engine/cpu/packed_matrix.h"

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

std::vector<GemmIsa> AllIsas() {
  return {GemmIsa::kAvx512Bf16, GemmIsa::kAvx512, GemmIsa::kAvx2, GemmIsa::kPortable};
}

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

// ---- The bf16-input mode (gemm.h, THE BF16-INPUT MODE). ----

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The definition, written out independently of the GEMM: DAZ reads a denormal as a zero of its
// sign; each step is one fma (the product of two bf16 values is exact) whose denormal result is
// flushed to a zero of its sign; steps in ascending k, in the pairs VDPBF16PS forms (k first,
// then k + 1). A result exactly ±2⁻¹²⁶ after denormal rounding does not occur in these tests'
// data except by construction below, where it is checked against the native instruction.
float Daz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
float Step(float c, float a, float b) {
  const float r = std::fma(Daz(a), Daz(b), Daz(c));
  return std::fpclassify(r) == FP_SUBNORMAL ? std::copysign(0.0f, r) : r;
}
float Bf16ChainReference(const float* a_row, const std::vector<float>& b_kn, int n, int k, int j,
                         float c0) {
  float c = c0;
  for (int p = 0; 2 * p < k; ++p) {
    const int k0 = 2 * p, k1 = 2 * p + 1;
    c = Step(c, Bf16ToFloat(RoundActivationToBf16(a_row[k0])), b_kn[size_t(k0) * n + j]);
    if (k1 < k)
      c = Step(c, Bf16ToFloat(RoundActivationToBf16(a_row[k1])), b_kn[size_t(k1) * n + j]);
  }
  return c;
}

// Values over the whole finite range that a sum of ≤ 600 products cannot overflow: mostly
// unit-normal, some with exponents from −140 to 50 (bf16 and float32 denormals among them, and
// products far below 2⁻¹²⁶), some exact zeros of either sign.
std::vector<float> ExtremeFloats(size_t n, std::mt19937& rng, bool bf16) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 19), e(-140, 50);
  std::uniform_int_distribution<uint32_t> denormal(1, 0x7FFFFF);
  std::vector<float> v(n);
  for (float& x : v) {
    const int kind = pick(rng);
    if (kind < 13) {
      x = d(rng);
    } else if (kind < 17) {
      x = std::ldexp(d(rng), e(rng));
    } else if (kind == 17) {
      x = FromBits(denormal(rng) | (d(rng) < 0 ? 0x80000000u : 0));
    } else {
      x = kind == 18 ? 0.0f : -0.0f;
    }
    if (bf16) x = Bf16ToFloat(FloatToBf16(x));  // B is stored bf16: keep its denormals
  }
  return v;
}

std::vector<GemmIsa> SupportedIsas() {
  std::vector<GemmIsa> v;
  for (GemmIsa isa : AllIsas()) {
    if (GemmIsaSupported(isa)) v.push_back(isa);
  }
  return v;
}

// Every element on every path this CPU has equals the defined chain, bit for bit: random shapes
// (m 1..300, odd and even n and k), packed and row-major bf16 B, with and without accumulate,
// with and without A rounded in advance (Bf16Activations), values over the extreme range.
TEST_P(GemmIsaTest, Bf16InputEveryElementIsTheVdpbf16psChain) {
  std::mt19937 rng(4321 + int(GetParam()));
  const int ns[] = {1, 3, 15, 17, 31, 33, 47, 70, 97, 257, 301};
  const int ks[] = {1, 2, 3, 7, 16, 63, 255, 257, 511, 513, 599};
  std::uniform_int_distribution<int> mdist(1, 300);
  for (int trial = 0; trial < 22; ++trial) {
    const int m = trial < 3 ? trial + 1 : mdist(rng);
    const int n = ns[trial % std::size(ns)], k = ks[(trial * 7) % std::size(ks)];
    const int lda = k + trial % 3, ldb = n + (trial % 2) * 5, ldc = n + trial % 4;
    std::vector<float> a = ExtremeFloats(size_t(m) * lda, rng, false);
    std::vector<float> b_kn = ExtremeFloats(size_t(k) * n, rng, true);
    std::vector<uint16_t> b_bf16(size_t(k) * ldb, 0);
    std::vector<uint16_t> w_nk(size_t(n) * k);
    for (int kk = 0; kk < k; ++kk) {
      for (int j = 0; j < n; ++j) {
        const uint16_t h = FloatToBf16(b_kn[size_t(kk) * n + j]);
        b_bf16[size_t(kk) * ldb + j] = h;
        w_nk[size_t(j) * k + kk] = h;
      }
    }
    const PackedMatrix packed = PackedMatrix::FromBf16(w_nk.data(), n, k);
    const Bf16Activations rounded = Bf16Activations::Round(a.data(), m, k, lda);
    const GemmB layouts[] = {GemmB::RowMajor(b_bf16.data(), ldb), packed.AsGemmB()};
    for (int li = 0; li < 2; ++li) {
      for (int variant = 0; variant < 3; ++variant) {  // plain, accumulate, pre-rounded A
        const bool acc = variant == 1;
        std::vector<float> c0 = ExtremeFloats(size_t(m) * ldc, rng, false);
        std::vector<float> c = c0;
        GemmArgs g = GemmArgs::Of(m, n, k, a.data(), lda, layouts[li], c.data(), ldc, acc);
        g.input = GemmInput::kBf16;
        if (variant == 2) g.a_bf16 = rounded.View();
        Gemm(g, GetParam(), GemmThreads::kOpenMp);
        int bad = 0;
        for (int i = 0; i < m && bad < 3; ++i) {
          for (int j = 0; j < n && bad < 3; ++j) {
            const float want = Bf16ChainReference(a.data() + size_t(i) * lda, b_kn, n, k, j,
                                                  acc ? c0[size_t(i) * ldc + j] : 0.0f);
            const float got = c[size_t(i) * ldc + j];
            if (Bits(got) != Bits(want)) {
              ++bad;
              ADD_FAILURE() << (li == 0 ? "row-major" : "packed") << " variant " << variant
                            << " m=" << m << " n=" << n << " k=" << k << " C[" << i << "," << j
                            << "] = " << got << " (" << std::hexfloat << got << "), chain gives "
                            << want << std::defaultfloat;
            }
          }
        }
        for (int i = 0; i < m; ++i) {
          for (int j = n; j < ldc; ++j) {
            ASSERT_EQ(Bits(c[size_t(i) * ldc + j]), Bits(c0[size_t(i) * ldc + j]))
                << "wrote past column n at row " << i;
          }
        }
      }
    }
  }
}

// The order inside a pair and the flushes, on cases built to tell them apart (each would give
// another result with the pair's products added in the other order, with a three-term sum
// rounded once, or without DAZ / FTZ).
TEST_P(GemmIsaTest, Bf16InputPairOrderAndFlushes) {
  struct Case {
    const char* what;
    float c0;
    std::vector<float> a, b;
    float want;
  };
  const float t24 = 16777216.0f;
  const Case cases[] = {
      {"k first: (2^24 + 1) rounds to 2^24, then - 1", t24, {1, -1}, {1, 1}, t24 - 1},
      {"k first: (2^24 - 1), then + 1", t24, {-1, 1}, {1, 1}, t24},
      {"two roundings, not one: 2^24 + 1 + 1", t24, {1, 1}, {1, 1}, t24},
      {"odd k: the pad leaves -0", -0.0f, {-0.0f}, {1}, -0.0f},
      {"intermediate flush: 0 + 2^-130 -> 0, + 2^-126",
       0.0f,
       {std::ldexp(1.0f, -65), std::ldexp(1.0f, -63)},
       {std::ldexp(1.0f, -65), std::ldexp(1.0f, -63)},
       std::ldexp(1.0f, -126)},
      {"exact tiny product in the fma: 1.5*2^-126 - 2^-130",
       std::ldexp(1.5f, -126),
       {std::ldexp(1.0f, -70)},
       {-std::ldexp(1.0f, -60)},
       std::ldexp(23.0f, -130)},
      {"DAZ on C: denormal C0 + 2^-120",
       std::ldexp(1.0f, -130),
       {1.0f},
       {std::ldexp(1.0f, -120)},
       std::ldexp(1.0f, -120)},
      {"DAZ on B: denormal bf16 B", 1.0f, {std::ldexp(1.0f, 100)}, {Bf16ToFloat(0x0001)}, 1.0f},
      {"A rounded to bf16 (RNE): 1 + 2^-8 -> 1", 0.0f, {1.0f + std::ldexp(1.0f, -8)}, {1.0f}, 1.0f},
      {"A denormal -> 0", 1.0f, {std::ldexp(1.0f, -130)}, {std::ldexp(1.0f, 100)}, 1.0f},
  };
  for (const Case& cs : cases) {
    const int k = int(cs.a.size());
    std::vector<uint16_t> b16(k);
    for (int kk = 0; kk < k; ++kk) b16[kk] = FloatToBf16(cs.b[kk]);
    for (int n : {1, 16, 17, 32}) {  // partial and full panels: every column the same
      std::vector<uint16_t> bn(size_t(k) * n);
      for (int kk = 0; kk < k; ++kk) std::fill_n(&bn[size_t(kk) * n], n, b16[kk]);
      std::vector<float> c(n, cs.c0);
      GemmArgs g = GemmArgs::Of(1, n, k, cs.a.data(), k, GemmB::RowMajor(bn.data(), n), c.data(), n,
                                /*accumulate=*/true);
      g.input = GemmInput::kBf16;
      Gemm(g, GetParam(), GemmThreads::kCallerOnly);
      for (int j = 0; j < n; ++j) {
        ASSERT_EQ(Bits(c[j]), Bits(cs.want))
            << cs.what << " (n=" << n << ", column " << j << "): got " << std::hexfloat << c[j]
            << ", want " << cs.want;
      }
    }
  }
}

// In the bf16-input mode, too, a row's result does not depend on m, its offset or the threads,
// and every path gives the bits of every other.
TEST_P(GemmIsaTest, Bf16InputRowsDoNotDependOnBatchOffsetThreadsOrPath) {
  std::mt19937 rng(77);
  const int n = 201, k = 335, m = 300;
  std::vector<float> a = ExtremeFloats(size_t(m) * k, rng, false);
  std::vector<float> w = RandomBf16Values(size_t(n) * k, rng);
  const PackedMatrix packed = PackedMatrix::FromFloat(w.data(), n, k);
  std::vector<float> full(size_t(m) * n);
  GemmArgs fg = GemmArgs::Of(m, n, k, a.data(), k, packed.AsGemmB(), full.data(), n);
  fg.input = GemmInput::kBf16;
  Gemm(fg, GemmIsa::kPortable, GemmThreads::kOpenMp);  // the reference path
  const int saved_threads = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (int off : {0, 1, 7, 63, 64, 129, 250, 299}) {
      for (int rows : {1, 5, 8, 13, 40, 64, 100, 300}) {
        if (off + rows > m) continue;
        std::vector<float> part(size_t(rows) * n);
        GemmArgs g = GemmArgs::Of(rows, n, k, a.data() + size_t(off) * k, k, packed.AsGemmB(),
                                  part.data(), n);
        g.input = GemmInput::kBf16;
        Gemm(g, GetParam(), GemmThreads::kOpenMp);
        ASSERT_EQ(
            0, std::memcmp(part.data(), full.data() + size_t(off) * n, sizeof(float) * part.size()))
            << GemmIsaName(GetParam()) << " vs portable: rows [" << off << ", " << off + rows
            << ") with " << threads << " threads";
      }
    }
  }
  omp_set_num_threads(saved_threads);
}

// The mode leaves MXCSR as it found it (the emulation sets FTZ and DAZ only inside the call).
TEST_P(GemmIsaTest, Bf16InputRestoresMxcsr) {
  std::vector<float> a(64 * 40, 0.5f), c(64 * 48);
  std::vector<uint16_t> b(40 * 48, FloatToBf16(0.25f));
  GemmArgs g = GemmArgs::Of(64, 48, 40, a.data(), 40, GemmB::RowMajor(b.data(), 48), c.data(), 48);
  g.input = GemmInput::kBf16;
  const float tiny = std::ldexp(1.0f, -140);
  Gemm(g, GetParam(), GemmThreads::kCallerOnly);
  volatile float x = tiny;
  EXPECT_EQ(x * 1.0f, tiny) << "denormals flushed after the call";
  EXPECT_EQ(c[0], 0.5f * 0.25f * 40);
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

TEST(GemmTest, RoundActivationToBf16) {
  EXPECT_EQ(RoundActivationToBf16(1.0f), 0x3F80);
  EXPECT_EQ(RoundActivationToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);  // tie to even
  EXPECT_EQ(RoundActivationToBf16(1.0f + std::ldexp(3.0f, -8)), 0x3F82);  // tie to even (up)
  EXPECT_EQ(RoundActivationToBf16(std::ldexp(1.0f, -130)), 0x0000);       // denormal -> +0
  EXPECT_EQ(RoundActivationToBf16(-std::ldexp(1.0f, -130)), 0x8000);      // -> -0
  EXPECT_EQ(RoundActivationToBf16(FLT_MIN), 0x0080);
  EXPECT_EQ(ParseGemmInput("bf16").value(), GemmInput::kBf16);
  EXPECT_EQ(ParseGemmInput("float32").value(), GemmInput::kFloat32);
  EXPECT_FALSE(ParseGemmInput("fp8").ok());
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
