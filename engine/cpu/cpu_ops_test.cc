#include "engine/cpu/cpu_ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine/model/model_math.h"

namespace dgserve::cpu {
namespace {

TEST(RmsNormTest, WithAndWithoutWeight) {
  // x = [3, 4]: mean(x²) = 12.5, rms = 3.5355339.
  const float x[2] = {3.0f, 4.0f};
  const float w[2] = {2.0f, 0.5f};
  float y[2];
  RmsNorm(x, nullptr, 1, 2, 0.0f, y);
  EXPECT_NEAR(y[0], 3.0 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], 4.0 / std::sqrt(12.5), 1e-6);
  // Gemma 4 multiplies by the weight directly: no (1 + w).
  RmsNorm(x, w, 1, 2, 0.0f, y);
  EXPECT_NEAR(y[0], 2.0 * 3.0 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], 0.5 * 4.0 / std::sqrt(12.5), 1e-6);
  // eps enters inside the root; rms(0) = 0, never NaN.
  RmsNorm(x, nullptr, 1, 2, 1.0f, y);
  EXPECT_NEAR(y[0], 3.0 / std::sqrt(13.5), 1e-6);
  const float zero[3] = {0, 0, 0};
  float z[3];
  RmsNorm(zero, nullptr, 1, 3, 1e-6f, z);
  EXPECT_EQ(z[0], 0.0f);
  EXPECT_EQ(z[2], 0.0f);
}

TEST(RmsNormTest, RowsAreIndependent) {
  const std::vector<float> x = {1, 1, 10, 10};
  std::vector<float> y(4);
  RmsNorm(x.data(), nullptr, 2, 2, 0.0f, y.data());
  EXPECT_NEAR(y[0], 1.0f, 1e-6);
  EXPECT_NEAR(y[2], 1.0f, 1e-6);
}

TEST(GeluTanhTest, MatchesPyTorchTanhApproximation) {
  // torch.nn.functional.gelu(x, approximate="tanh") values.
  EXPECT_NEAR(GeluTanh(0.0f), 0.0f, 1e-7);
  EXPECT_NEAR(GeluTanh(1.0f), 0.8411919906, 1e-6);
  EXPECT_NEAR(GeluTanh(-1.0f), -0.1588080094, 1e-6);
  EXPECT_NEAR(GeluTanh(2.5f), 2.4849157, 1e-5);
  EXPECT_NEAR(GeluTanh(-3.0f), -0.0036374, 1e-6);
  // The exact (erf) GELU differs at 1.0: 0.8413447. The tanh form must be used.
  EXPECT_GT(std::fabs(GeluTanh(1.0f) - 0.8413447f), 1e-4);
}

TEST(RopeTest, RotatesPairsAcrossHalves) {
  const int hd = 8;
  const std::vector<float> f = RopeInvFreq(10000.0f, hd, hd / 2);
  std::vector<float> v = {1, 0, 0, 0, 0, 1, 0, 0};
  ApplyRope(v.data(), 1, hd, 3, f);
  // Pair (0, 4): angle 3·1 rad applied to (1, 0).
  EXPECT_NEAR(v[0], std::cos(3.0), 1e-6);
  EXPECT_NEAR(v[4], std::sin(3.0), 1e-6);
  // Pair (1, 5): angle 3·10000^(−2/8) applied to (0, 1).
  const double a = 3.0 * std::pow(10000.0, -0.25);
  EXPECT_NEAR(v[1], -std::sin(a), 1e-6);
  EXPECT_NEAR(v[5], std::cos(a), 1e-6);
  // Position 0 is the identity.
  std::vector<float> w = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<float> w0 = w;
  ApplyRope(w.data(), 1, hd, 0, f);
  EXPECT_EQ(w, w0);
}

TEST(RopeTest, IdentitySlotsStayUnchangedAtLargePositions) {
  const int hd = 16;
  const std::vector<float> f = RopeInvFreq(1e6f, hd, 2);  // rotate pairs 0 and 1 only
  std::vector<float> v(hd);
  for (int i = 0; i < hd; ++i) v[i] = float(i + 1);
  const std::vector<float> orig = v;
  ApplyRope(v.data(), 1, hd, 100000, f);
  for (int j = 2; j < hd / 2; ++j) {
    EXPECT_EQ(v[j], orig[j]);
    EXPECT_EQ(v[j + hd / 2], orig[j + hd / 2]);
  }
  EXPECT_NE(v[0], orig[0]);
}

TEST(SoftcapTest, VectorPathMatchesTanhEverywhere) {
  // 200003 values (not a multiple of 8 or of the chunk) from −200 to 200.
  std::vector<float> x(200003);
  for (size_t i = 0; i < x.size(); ++i) x[i] = -200.0f + 400.0f * float(i) / float(x.size());
  std::vector<float> y = x;
  Softcap(y.data(), int64_t(y.size()), 30.0f);
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_NEAR(y[i], 30.0 * std::tanh(double(x[i]) / 30.0), 2e-5) << x[i];
  }
}

TEST(SoftcapTest, NanStaysNan) {
  std::vector<float> x(19, 1.0f);
  x[3] = std::nanf("");
  x[17] = std::nanf("");
  Softcap(x.data(), int64_t(x.size()), 30.0f);
  EXPECT_TRUE(std::isnan(x[3]));
  EXPECT_TRUE(std::isnan(x[17]));
  EXPECT_FALSE(std::isnan(x[4]));
}

TEST(SoftcapTest, TanhCap) {
  std::vector<float> x = {0.0f, 30.0f, -60.0f, 1e6f};
  Softcap(x.data(), 4, 30.0f);
  EXPECT_EQ(x[0], 0.0f);
  EXPECT_NEAR(x[1], 30.0 * std::tanh(1.0), 1e-5);
  EXPECT_NEAR(x[2], -30.0 * std::tanh(2.0), 1e-5);
  EXPECT_NEAR(x[3], 30.0f, 1e-5);
}

// Every element gets the same bits on the AVX2 lanes, in the scalar tail and on a CPU without
// AVX2 (SoftcapOne), so a logit does not depend on its position or the machine.
TEST(SoftcapTest, EveryPathGivesTheSameBits) {
  std::vector<float> x(1003);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * float(i)) * 90.0f - 3.0f * (i % 5);
  x[5] = std::nanf("");
  x[6] = 1e30f;
  x[7] = -1e30f;
  std::vector<float> y = x;
  Softcap(y.data(), int64_t(y.size()), 30.0f);
  for (size_t i = 0; i < x.size(); ++i) {
    const float one = SoftcapOne(x[i], 30.0f);
    if (std::isnan(one)) {
      EXPECT_TRUE(std::isnan(y[i])) << i;
      continue;
    }
    uint32_t a, b;
    std::memcpy(&a, &one, 4);
    std::memcpy(&b, &y[i], 4);
    ASSERT_EQ(a, b) << "element " << i << " (" << x[i] << "): " << one << " vs " << y[i]
                    << (UseAvx2Elementwise() ? " (AVX2 lanes)" : " (scalar)");
  }
  // Starting the same values one element later moves every lane: still the same bits.
  std::vector<float> z(x.begin() + 1, x.end());
  Softcap(z.data(), int64_t(z.size()), 30.0f);
  for (size_t i = 0; i < z.size(); ++i) {
    if (!std::isnan(z[i])) ASSERT_EQ(z[i], y[i + 1]) << i;
  }
}

}  // namespace
}  // namespace dgserve::cpu
