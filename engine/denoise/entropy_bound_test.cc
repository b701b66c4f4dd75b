#include "engine/denoise/entropy_bound.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <vector>

namespace dgserve {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(EntropyBoundTest, EmptyInput) { EXPECT_THAT(AcceptPositions({}, 0.1), IsEmpty()); }

TEST(EntropyBoundTest, LowestIsAlwaysAccepted) {
  const std::vector<float> h = {5.0f, 2.0f, 3.0f, 9.0f};
  EXPECT_THAT(AcceptPositions(h, 0.1), ElementsAre(1));
  // Even a bound far below the lowest entropy accepts one position.
  EXPECT_THAT(AcceptPositions(h, 1e-9), ElementsAre(1));
}

TEST(EntropyBoundTest, SingleAcceptWithTiesTakesLowestPosition) {
  const std::vector<float> h = {5.0f, 2.0f, 2.0f};
  EXPECT_THAT(AcceptPositions(h, 0.1), ElementsAre(1));
}

TEST(EntropyBoundTest, AllAccepted) {
  const std::vector<float> zeros(16, 0.0f);
  EXPECT_EQ(AcceptPositions(zeros, 0.1).size(), 16u);
  // Sum of everything but the largest is 0.09 ≤ 0.1: the largest (3.0) is accepted too.
  const std::vector<float> h = {0.03f, 3.0f, 0.03f, 0.03f};
  EXPECT_THAT(AcceptPositions(h, 0.1), ElementsAre(0, 1, 2, 3));
}

TEST(EntropyBoundTest, ExactBoundaryIsAccepted) {
  // Exactly representable: sums before ranks are 0, 0.25, 0.5, 1.0.
  const std::vector<float> h = {0.5f, 0.25f, 1.0f, 0.25f};
  EXPECT_THAT(AcceptPositions(h, 0.5), ElementsAre(0, 1, 3));
  // Just below the boundary the third rank drops out.
  EXPECT_THAT(AcceptPositions(h, 0.4999999), ElementsAre(1, 3));
}

TEST(EntropyBoundTest, TiesBrokenByLowerPositionFirst) {
  // Ranking: pos1 (0.1), pos0 (0.3), pos2 (0.3), pos3 (0.3). Sums before: 0, 0.1, 0.4, 0.7.
  const std::vector<float> h = {0.3f, 0.1f, 0.3f, 0.3f};
  EXPECT_THAT(AcceptPositions(h, 0.35), ElementsAre(0, 1));
  // Ties at the low end: pos2 ranks before pos3.
  const std::vector<float> g = {1.0f, 1.0f, 0.2f, 0.2f};
  EXPECT_THAT(AcceptPositions(g, 0.1), ElementsAre(2));
  EXPECT_THAT(AcceptPositions(g, 0.25), ElementsAre(2, 3));
}

TEST(EntropyBoundTest, ResultIsAscendingNotRankOrder) {
  // Ranking: pos1, pos3, pos0, pos2; sums before: 0, 0.001, 0.003, 0.093.
  const std::vector<float> h = {0.09f, 0.001f, 0.5f, 0.002f};
  EXPECT_THAT(AcceptPositions(h, 0.1), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(AcceptPositions(h, 0.05), ElementsAre(0, 1, 3));
  EXPECT_THAT(AcceptPositions(h, 0.002), ElementsAre(1, 3));
}

TEST(EntropyBoundTest, SumsInDoubleOfFloatEntropies) {
  // 0.1f as a double is 0.100000001490116...; ten 0.01f sum (in double) to 0.0999999977648258,
  // so an 11th position is accepted with bound 0.1f but not with bound 0.0999999.
  std::vector<float> h(12, 0.01f);
  EXPECT_EQ(AcceptPositions(h, static_cast<double>(0.1f)).size(), 11u);
  EXPECT_EQ(AcceptPositions(h, 0.0999999).size(), 10u);
}

TEST(EntropyBoundTest, NanRanksLast) {
  const std::vector<float> h = {std::numeric_limits<float>::quiet_NaN(), 0.05f, 0.01f};
  EXPECT_THAT(AcceptPositions(h, 0.1), ElementsAre(0, 1, 2));
  EXPECT_THAT(AcceptPositions(h, 0.02), ElementsAre(1, 2));
}

}  // namespace
}  // namespace dgserve
