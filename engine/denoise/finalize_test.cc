#include "engine/denoise/finalize.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

namespace dgserve {
namespace {

using ::testing::ElementsAre;

const std::vector<int32_t> kStops = {1, 106, 50};

TEST(FinalizeTest, KeepsFirstStopAndPadsTheRest) {
  std::vector<int32_t> c = {5, 7, 106, 9, 1, 50, 11};
  EXPECT_TRUE(FinalizeCanvas(c, kStops, 0));
  EXPECT_THAT(c, ElementsAre(5, 7, 106, 0, 0, 0, 0));
}

TEST(FinalizeTest, NoStopTokenLeavesCanvasUnchanged) {
  std::vector<int32_t> c = {5, 7, 105, 9, 0, 2};
  EXPECT_FALSE(FinalizeCanvas(c, kStops, 0));
  EXPECT_THAT(c, ElementsAre(5, 7, 105, 9, 0, 2));
}

TEST(FinalizeTest, StopAtLastPosition) {
  std::vector<int32_t> c = {5, 7, 9, 50};
  EXPECT_TRUE(FinalizeCanvas(c, kStops, 0));
  EXPECT_THAT(c, ElementsAre(5, 7, 9, 50));
}

TEST(FinalizeTest, StopAtFirstPositionAndCustomPad) {
  std::vector<int32_t> c = {1, 7, 9, 1};
  EXPECT_TRUE(FinalizeCanvas(c, kStops, -2));
  EXPECT_THAT(c, ElementsAre(1, -2, -2, -2));
}

TEST(FinalizeTest, EmptyInputs) {
  std::vector<int32_t> empty;
  EXPECT_FALSE(FinalizeCanvas(empty, kStops, 0));
  std::vector<int32_t> c = {1, 106};
  EXPECT_FALSE(FinalizeCanvas(c, {}, 0));
  EXPECT_THAT(c, ElementsAre(1, 106));
}

}  // namespace
}  // namespace dgserve
