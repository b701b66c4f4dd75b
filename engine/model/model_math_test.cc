// The model math both backends share (model_math.h).
#include "engine/model/model_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

namespace dgserve {
namespace {

TEST(RopeTest, ProportionalTableRotatesOnlyTheFirstPairs) {
  // Real full layer: head_dim 512, factor 0.25 → 64 rotated pairs, exponent over 512.
  const std::vector<float> f = RopeInvFreq(1e6f, 512, 64);
  ASSERT_EQ(f.size(), 256u);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_NEAR(f[1], 0.947464, 1e-6);  // 1e6^(−2/512), not 1e6^(−2/128)
  EXPECT_NEAR(f[63], std::pow(1e6, -126.0 / 512), 1e-9);
  for (int j = 64; j < 256; ++j) EXPECT_EQ(f[j], 0.0f) << j;
}

TEST(RouteTopKTest, RenormalisesOverSelectedExpertsAndScales) {
  // Scores log(1), log(2), log(3), log(4): softmax = [0.1, 0.2, 0.3, 0.4].
  std::vector<float> s = {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};
  const float scale[4] = {1.0f, 1.0f, 0.5f, 2.0f};
  std::pair<int, float> out[2];
  RouteTopK(s.data(), 4, 2, scale, out);
  EXPECT_EQ(out[0].first, 3);
  EXPECT_EQ(out[1].first, 2);
  EXPECT_NEAR(out[0].second, 0.4 / 0.7 * 2.0, 1e-6);  // renormalised, × per_expert_scale
  EXPECT_NEAR(out[1].second, 0.3 / 0.7 * 0.5, 1e-6);
  EXPECT_NEAR(s[0], 0.1f, 1e-6);  // the full softmax is left in `scores`
}

TEST(RouteTopKTest, TiesGoToTheLowerExpertId) {
  std::vector<float> s = {1.0f, 2.0f, 2.0f, 2.0f};
  const float scale[4] = {1, 1, 1, 1};
  std::pair<int, float> out[2];
  RouteTopK(s.data(), 4, 2, scale, out);
  EXPECT_EQ(out[0].first, 1);
  EXPECT_EQ(out[1].first, 2);
  EXPECT_NEAR(out[0].second, 0.5f, 1e-6);
}

}  // namespace
}  // namespace dgserve
