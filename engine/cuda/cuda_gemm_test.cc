// The cuBLAS projections against a float64 reference (label `gpu`; skipped without a GPU): on
// bf16-rounded activations for GemmInput::kBf16, on the float32 activations themselves for
// GemmInput::kFloat32.
#include "engine/cuda/cuda_gemm.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
using ::dgserve::testing::StatusIs;

std::vector<float> RandomFloats(size_t n, float scale, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

std::vector<uint16_t> RandomBf16(size_t n, float scale, uint32_t seed) {
  const std::vector<float> f = RandomFloats(n, scale, seed);
  std::vector<uint16_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = ::dgserve::FloatToBf16(f[i]);
  return b;
}

// Checks y[rows, out] against Σ_i bf16(x[r, i])·w[o, i] in double: relative 1e-2 (of the result,
// or of Σ|x·w| for results that cancel to near zero).
void ExpectLinear(const std::vector<float>& x, const uint16_t* w, int rows, int in, int out,
                  const float* y, const char* what) {
  int bad = 0;
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < out; ++o) {
      double sum = 0, abs_sum = 0;
      for (int i = 0; i < in; ++i) {
        const double t = double(RoundToBf16(x[size_t(r) * in + i])) *
                         double(Bf16ToFloat(w[size_t(o) * in + i]));
        sum += t;
        abs_sum += std::fabs(t);
      }
      const double got = y[size_t(r) * out + o];
      const double tol = 1e-2 * std::max(std::fabs(sum), 1e-2 * abs_sum) + 1e-30;
      if (!(std::fabs(got - sum) <= tol) && ++bad <= 5) {
        ADD_FAILURE() << what << ": y[" << r << ", " << o << "] = " << got << ", want " << sum;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// The elements of y[rows, out] farther than 2e-5·Σ|x·w| from Σ_i x[r, i]·w[o, i] in double (x
// not rounded): float32 accumulation in any order stays well inside (about 4e-6 at in = 2816
// even with truncating additions); one bf16 rounding of x misses it by about 1e-4·Σ|x·w| at
// in = 96.
int CountFloat32Misses(const std::vector<float>& x, const uint16_t* w, int rows, int in, int out,
                       const float* y) {
  int misses = 0;
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < out; ++o) {
      double sum = 0, abs_sum = 0;
      for (int i = 0; i < in; ++i) {
        const double t = double(x[size_t(r) * in + i]) * double(Bf16ToFloat(w[size_t(o) * in + i]));
        sum += t;
        abs_sum += std::fabs(t);
      }
      if (!(std::fabs(double(y[size_t(r) * out + o]) - sum) <= 2e-5 * abs_sum + 1e-30)) ++misses;
    }
  }
  return misses;
}

class CudaGemmTest : public CudaTest {};

TEST_F(CudaGemmTest, SplitTermsSumToTheInputExactly) {
  // Magnitudes from 1e-25 to 1e30 (inside float32's normal range for all three terms), both
  // signs, bf16-representable values (mid = lo = 0) and non-finite ones (hi alone).
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f), exponent(-83.0f, 99.0f);
  std::vector<float> x;
  for (int i = 0; i < 20000; ++i) {
    x.push_back((i % 2 ? -1.0f : 1.0f) * mantissa(gen) * std::exp2(std::floor(exponent(gen))));
  }
  for (float f : {0.0f, -0.0f, 1.0f, -3.5f, 1.00390625f, 65504.0f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN()}) {
    x.push_back(f);
  }
  float* dx = Upload(x);
  std::vector<std::vector<uint16_t>> terms;
  for (int term = 0; term < 3; ++term) {
    uint16_t* dy = Alloc<uint16_t>(x.size(), 0xFF);
    ASSERT_THAT(SplitToBf16(dx, int64_t(x.size()), term, dy), IsOk());
    terms.push_back(Download(dy, x.size()));
  }
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(terms[0][i], ::dgserve::FloatToBf16(x[i])) << "hi of " << x[i];
    if (!std::isfinite(x[i])) {
      ASSERT_EQ(terms[1][i] | terms[2][i], 0) << "mid and lo of " << x[i];
      continue;
    }
    // The sum in double is exact (three values within 2⁴⁸ of each other's magnitude).
    const double sum = double(Bf16ToFloat(terms[0][i])) + double(Bf16ToFloat(terms[1][i])) +
                       double(Bf16ToFloat(terms[2][i]));
    ASSERT_EQ(sum, double(x[i])) << "x = " << x[i] << " (element " << i << ")";
  }
  EXPECT_THAT(SplitToBf16(dx, 1, 3, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(CudaGemmTest, Float32InputMatchesTheUnroundedProduct) {
  CublasContext exact(GemmInput::kFloat32), rounded(GemmInput::kBf16);
  struct Shape {
    int rows, in, out;
  };
  const Shape shapes[] = {{37, 96, 130}, {5, 7, 3}, {300, 2816, 64}, {64, 704, 2816}};
  uint32_t seed = 40;
  for (const Shape& s : shapes) {
    if (kEmulated && s.in * s.out > 96 * 130) continue;
    const std::vector<float> x = RandomFloats(size_t(s.rows) * s.in, 2.0f, seed++);
    const std::vector<uint16_t> w = RandomBf16(size_t(s.out) * s.in, 0.5f, seed++);
    float* dx = Upload(x);
    uint16_t* dw = Upload(w);
    float* dy = Alloc<float>(size_t(s.rows) * s.out, 0xFF);
    ASSERT_THAT(exact.Linear(dx, dw, s.rows, s.in, s.out, dy), IsOk());
    std::vector<float> y = Download(dy, size_t(s.rows) * s.out);
    EXPECT_EQ(CountFloat32Misses(x, w.data(), s.rows, s.in, s.out, y.data()), 0)
        << s.rows << "x" << s.in << "x" << s.out;
    if (s.rows * s.out >= 1000) {  // the check tells the modes apart
      ASSERT_THAT(rounded.Linear(dx, dw, s.rows, s.in, s.out, dy), IsOk());
      y = Download(dy, size_t(s.rows) * s.out);
      EXPECT_GT(CountFloat32Misses(x, w.data(), s.rows, s.in, s.out, y.data()), 0)
          << "bf16 input " << s.rows << "x" << s.in << "x" << s.out;
    }
  }
  // Expert groups: every group (offsets not starting at 0, an empty group, mapped experts).
  const int experts = 3, in = 96, out = 40;
  const std::vector<int32_t> offsets = {3, 20, 20, 33};
  const std::vector<int32_t> expert_of_group = {2, 0, 1};
  const std::vector<float> x = RandomFloats(size_t(33) * in, 1.5f, 50);
  const std::vector<uint16_t> w = RandomBf16(size_t(experts) * out * in, 0.5f, 51);
  float* dy = Alloc<float>(size_t(33) * out, 0xFF);
  ASSERT_THAT(exact.GroupedLinear(Upload(x), Upload(w), experts, offsets.data(),
                                  expert_of_group.data(), in, out, dy),
              IsOk());
  const std::vector<float> y = Download(dy, size_t(33) * out);
  for (int g = 0; g < experts; ++g) {
    const int r0 = offsets[g], n = offsets[g + 1] - r0;
    const std::vector<float> xg(x.begin() + size_t(r0) * in, x.begin() + size_t(r0 + n) * in);
    EXPECT_EQ(CountFloat32Misses(xg, w.data() + size_t(expert_of_group[g]) * out * in, n, in, out,
                                 y.data() + size_t(r0) * out),
              0)
        << "group " << g;
  }
}

TEST_F(CudaGemmTest, FloatToBf16MatchesTheHostConversionBitForBit) {
  std::vector<float> x = RandomFloats(10007, 1e3f, 1);
  const uint32_t special[] = {0x3f808000u,  // tie, even: rounds down
                              0x3f818000u,  // tie, odd: rounds up
                              0x7f7fffffu,  // largest float: rounds to inf
                              0x00000001u,  // smallest subnormal
                              0x807fffffu,  // largest negative subnormal
                              0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffa00000u,
                              0x80000000u};
  for (uint32_t b : special) {
    float f;
    std::memcpy(&f, &b, 4);
    x.push_back(f);
  }
  std::vector<uint16_t> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = ::dgserve::FloatToBf16(x[i]);
  uint16_t* dy = Alloc<uint16_t>(x.size(), 0xFF);
  ASSERT_THAT(FloatToBf16(Upload(x), int64_t(x.size()), dy), IsOk());
  const std::vector<uint16_t> got = Download(dy, x.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got[i], want[i]) << "element " << i;
}

// GemmInput::kBf16 rounds a GEMM input as the CPU's bf16-input mode does
// (cpu::RoundActivationToBf16: denormals read as zero, then nearest even), bit for bit: the
// scratch of Linear and RoundActivationsToBf16 (the router's input), on ties, denormals of both
// signs, infinities and NaNs.
TEST_F(CudaGemmTest, Bf16InputRoundsAsTheCpuBf16Mode) {
  std::vector<float> x = RandomFloats(4093, 1e3f, 3);
  const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x00000001u, 0x807fffffu,
                              0x00400000u, 0x80008000u, 0x00800000u, 0x80800000u, 0x7f800000u,
                              0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffa00000u, 0x80000000u};
  for (uint32_t b : special) {
    float f;
    std::memcpy(&f, &b, 4);
    x.push_back(f);
  }
  const int rows = 1, in = int(x.size()), out = 1;
  std::vector<uint16_t> want(x.size());
  int denormals = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    want[i] = cpu::RoundActivationToBf16(x[i]);
    denormals += std::fpclassify(x[i]) == FP_SUBNORMAL;
  }
  ASSERT_EQ(denormals, 4);
  // Linear's scratch holds the rounded input (the weights are zeros: only the scratch matters).
  CublasContext ctx(GemmInput::kBf16);
  float* dx = Upload(x);
  uint16_t* scratch = Alloc<uint16_t>(x.size(), 0xFF);
  float* dy = Alloc<float>(1);
  ASSERT_THAT(ctx.Linear(dx, Alloc<uint16_t>(x.size()), rows, in, out, dy, nullptr, scratch),
              IsOk());
  const std::vector<uint16_t> got = Download(scratch, x.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got[i], want[i]) << "Linear, element " << i;
  // In place, as float32 values.
  ASSERT_THAT(RoundActivationsToBf16(dx, int64_t(x.size())), IsOk());
  const std::vector<float> rounded = Download(dx, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t b;
    std::memcpy(&b, &rounded[i], 4);
    ASSERT_EQ(b, uint32_t(want[i]) << 16) << "RoundActivationsToBf16, element " << i;
  }
}

TEST_F(CudaGemmTest, LinearMatchesDoubleReference) {
  CublasContext ctx;
  struct Shape {
    int rows, in, out;
  };
  // Odd sizes (no multiple-of-8 alignment), a single row, the model's hidden width; the cached
  // scratch grows between calls. Emulated (gpu-emu, a naive host GEMM): the first three.
  const Shape shapes[] = {{1, 16, 8}, {37, 96, 130}, {5, 7, 3}, {300, 2816, 64}, {64, 704, 2816}};
  uint32_t seed = 10;
  for (const Shape& s : shapes) {
    if (kEmulated && s.in * s.out > 96 * 130) continue;
    const std::vector<float> x = RandomFloats(size_t(s.rows) * s.in, 2.0f, seed++);
    const std::vector<uint16_t> w = RandomBf16(size_t(s.out) * s.in, 0.5f, seed++);
    float* dy = Alloc<float>(size_t(s.rows) * s.out, 0xFF);
    ASSERT_THAT(ctx.Linear(Upload(x), Upload(w), s.rows, s.in, s.out, dy), IsOk());
    const std::vector<float> y = Download(dy, size_t(s.rows) * s.out);
    ExpectLinear(x, w.data(), s.rows, s.in, s.out, y.data(), "Linear");
  }
}

TEST_F(CudaGemmTest, LinearWithCallerScratchAndStream) {
  CublasContext ctx;
  const int rows = 19, in = 264, out = 40;
  const std::vector<float> x = RandomFloats(size_t(rows) * in, 3.0f, 21);
  const std::vector<uint16_t> w = RandomBf16(size_t(out) * in, 0.25f, 22);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  uint16_t* scratch = Alloc<uint16_t>(size_t(rows) * in);
  float* dy = Alloc<float>(size_t(rows) * out, 0xFF);
  ASSERT_THAT(ctx.Linear(Upload(x), Upload(w), rows, in, out, dy, stream, scratch), IsOk());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  const std::vector<float> y = Download(dy, size_t(rows) * out);
  ExpectLinear(x, w.data(), rows, in, out, y.data(), "Linear (caller scratch)");
  // The scratch holds bf16(x).
  const std::vector<uint16_t> xb = Download(scratch, size_t(rows) * in);
  for (size_t i = 0; i < xb.size(); ++i) ASSERT_EQ(xb[i], ::dgserve::FloatToBf16(x[i])) << i;
  cudaStreamDestroy(stream);
}

TEST_F(CudaGemmTest, GroupedLinearMatchesPerExpertReference) {
  CublasContext ctx;
  const int experts = 5, in = 72, out = 56, total_rows = 44;
  // Rows 0–1 and 40–43 belong to no group and must stay untouched; group 1 is empty.
  const std::vector<int32_t> offsets = {2, 5, 5, 20, 21, 40};
  const std::vector<int32_t> expert_of_group = {3, 0, 4, 1, 2};
  const std::vector<float> x = RandomFloats(size_t(total_rows) * in, 1.5f, 31);
  const std::vector<uint16_t> w = RandomBf16(size_t(experts) * out * in, 0.5f, 32);
  float* dx = Upload(x);
  uint16_t* dw = Upload(w);
  for (const bool mapped : {false, true}) {
    float* dy = Alloc<float>(size_t(total_rows) * out, 0xFF);
    ASSERT_THAT(ctx.GroupedLinear(dx, dw, experts, offsets.data(),
                                  mapped ? expert_of_group.data() : nullptr, in, out, dy),
                IsOk());
    const std::vector<float> y = Download(dy, size_t(total_rows) * out);
    for (int g = 0; g < experts; ++g) {
      const int r0 = offsets[g], n = offsets[g + 1] - r0;
      const int e = mapped ? expert_of_group[g] : g;
      const std::vector<float> xg(x.begin() + size_t(r0) * in, x.begin() + size_t(r0 + n) * in);
      ExpectLinear(xg, w.data() + size_t(e) * out * in, n, in, out, y.data() + size_t(r0) * out,
                   mapped ? "GroupedLinear (mapped experts)" : "GroupedLinear");
    }
    for (int r : {0, 1, 40, 41, 42, 43}) {
      for (int o = 0; o < out; ++o) {
        ASSERT_TRUE(std::isnan(y[size_t(r) * out + o])) << "row " << r << " was written";
      }
    }
  }
}

// Argument checks return before touching the device: these run without a GPU too.
TEST(CudaGemmArgsTest, BadShapesAreInvalidArgument) {
  CublasContext ctx;
  EXPECT_THAT(ctx.Linear(nullptr, nullptr, 0, 16, 8, nullptr), IsOk());
  EXPECT_THAT(ctx.Linear(nullptr, nullptr, -1, 16, 8, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ctx.Linear(nullptr, nullptr, 4, 0, 8, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  const int32_t decreasing[] = {0, 4, 2};
  EXPECT_THAT(ctx.GroupedLinear(nullptr, nullptr, 2, decreasing, nullptr, 16, 8, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  const int32_t empty[] = {3, 3, 3};
  EXPECT_THAT(ctx.GroupedLinear(nullptr, nullptr, 2, empty, nullptr, 16, 8, nullptr), IsOk());
}

}  // namespace
}  // namespace dgserve::cuda
