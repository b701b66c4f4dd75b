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

TEST(CutCompletionTest, TakesUpToTheFirstStopToken) {
  const std::vector<int32_t> piece = {5, 7, 106, 0, 0};
  const CompletionCut cut = CutCompletion(piece, kStops, 0, 100);
  EXPECT_EQ(cut.take, 2);
  EXPECT_TRUE(cut.stop_token);
  EXPECT_FALSE(cut.length);
}

TEST(CutCompletionTest, WholePieceWithoutStopOrLimit) {
  const std::vector<int32_t> piece = {5, 7, 9};
  const CompletionCut cut = CutCompletion(piece, kStops, 3, 10);
  EXPECT_EQ(cut.take, 3);
  EXPECT_FALSE(cut.stop_token);
  EXPECT_FALSE(cut.length);
}

TEST(CutCompletionTest, LimitCountsTheEarlierPieces) {
  const std::vector<int32_t> piece = {5, 7, 9, 11};
  const CompletionCut cut = CutCompletion(piece, kStops, 8, 10);
  EXPECT_EQ(cut.take, 2);
  EXPECT_TRUE(cut.length);
  EXPECT_FALSE(cut.stop_token);
}

TEST(CutCompletionTest, StopTokenRightAtTheLimitEndsOnLength) {
  const std::vector<int32_t> piece = {5, 7, 1};
  const CompletionCut cut = CutCompletion(piece, kStops, 0, 2);
  EXPECT_EQ(cut.take, 2);
  EXPECT_TRUE(cut.length);
  EXPECT_FALSE(cut.stop_token);
}

TEST(CutCompletionTest, LimitReachedExactlyAtTheEndSetsNoFlag) {
  const std::vector<int32_t> piece = {5, 7};
  const CompletionCut cut = CutCompletion(piece, kStops, 2, 4);
  EXPECT_EQ(cut.take, 2);
  EXPECT_FALSE(cut.length);
  EXPECT_FALSE(cut.stop_token);
  // The next piece is cut at once.
  const CompletionCut next = CutCompletion(piece, kStops, 4, 4);
  EXPECT_EQ(next.take, 0);
  EXPECT_TRUE(next.length);
}

TEST(CutCompletionTest, StopTokenFirstTakesNothing) {
  const std::vector<int32_t> piece = {50, 7};
  const CompletionCut cut = CutCompletion(piece, kStops, 0, 10);
  EXPECT_EQ(cut.take, 0);
  EXPECT_TRUE(cut.stop_token);
}

}  // namespace
}  // namespace dgserve
