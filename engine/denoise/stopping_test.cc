#include "engine/denoise/stopping.h"

#include <gtest/gtest.h>

#include <vector>

namespace dgserve {
namespace {

const std::vector<int32_t> kA = {3, 1, 4, 1, 5};
const std::vector<int32_t> kB = {3, 1, 4, 1, 6};

TEST(MeanEntropyTest, FloatRunningSumInPositionOrder) {
  EXPECT_EQ(MeanEntropy({}), 0.0f);
  const std::vector<float> h = {0.5f, 1.5f, 1.0f};
  EXPECT_EQ(MeanEntropy(h), 1.0f);
  // A float32 running sum: 2^24 + 1 + 1 stays 2^24 (double accumulation would give 2^24 + 2).
  const std::vector<float> g = {16777216.0f, 1.0f, 1.0f};
  EXPECT_EQ(MeanEntropy(g), 16777216.0f / 3.0f);
}

TEST(StableAndConfidentStopTest, StepZeroIsNeverStable) {
  StableAndConfidentStop stop(1, 0.005f);
  EXPECT_FALSE(stop.stable());
  EXPECT_FALSE(stop.Update(kA, 0.0f));
  EXPECT_FALSE(stop.stable());
  EXPECT_TRUE(stop.confident());
  EXPECT_FALSE(stop.argmax_unchanged());
  // A canvas of −1 tokens would match the initial history, but real argmax ids are ≥ 0.
}

TEST(StableAndConfidentStopTest, ThresholdOneStopsWhenUnchangedAndConfident) {
  StableAndConfidentStop stop(1, 0.005f);
  EXPECT_FALSE(stop.Update(kA, 0.001f));
  EXPECT_TRUE(stop.Update(kA, 0.001f));
  EXPECT_TRUE(stop.stable());
  EXPECT_TRUE(stop.confident());
  EXPECT_TRUE(stop.argmax_unchanged());
  EXPECT_FALSE(stop.Update(kB, 0.001f));  // changed
  EXPECT_FALSE(stop.stable());
  EXPECT_TRUE(stop.confident());
}

TEST(StableAndConfidentStopTest, ConfidenceIsStrict) {
  StableAndConfidentStop stop(1, 0.005f);
  stop.Update(kA, 1.0f);
  EXPECT_FALSE(stop.Update(kA, 0.005f));  // mean == κ is not confident
  EXPECT_TRUE(stop.stable());
  EXPECT_FALSE(stop.confident());
  EXPECT_TRUE(stop.Update(kA, 0.0049999f));
  EXPECT_TRUE(stop.Update(kA, 0.0f));
}

TEST(StableAndConfidentStopTest, ThresholdZeroIsAlwaysStable) {
  StableAndConfidentStop stop(0, 1.48f);
  EXPECT_FALSE(stop.Update(kA, 2.0f));
  EXPECT_TRUE(stop.stable());
  EXPECT_FALSE(stop.confident());
  EXPECT_TRUE(stop.Update(kB, 1.0f));  // changed canvas, but S = 0
  EXPECT_TRUE(stop.stable());
  EXPECT_FALSE(stop.argmax_unchanged());  // what the golden traces record as `stable`
  // Even step 0 may stop with S = 0.
  StableAndConfidentStop first(0, 0.005f);
  EXPECT_TRUE(first.Update(kA, 0.001f));
}

TEST(StableAndConfidentStopTest, ThresholdTwoNeedsThreeEqualCanvases) {
  StableAndConfidentStop stop(2, 0.005f);
  EXPECT_FALSE(stop.Update(kA, 0.0f));  // history [-1, -1]
  EXPECT_FALSE(stop.stable());
  EXPECT_FALSE(stop.Update(kA, 0.0f));  // history [-1, A]
  EXPECT_FALSE(stop.stable());
  EXPECT_TRUE(stop.argmax_unchanged());
  EXPECT_TRUE(stop.Update(kA, 0.0f));  // history [A, A]
  EXPECT_TRUE(stop.stable());
  EXPECT_FALSE(stop.Update(kB, 0.0f));  // history [A, A]
  EXPECT_FALSE(stop.Update(kB, 0.0f));  // history [A, B]
  EXPECT_TRUE(stop.Update(kB, 0.0f));   // history [B, B]
  EXPECT_FALSE(stop.Update(kA, 0.0f));
  EXPECT_FALSE(stop.Update(kB, 0.0f));  // history [B, A]
  EXPECT_FALSE(stop.stable());
}

}  // namespace
}  // namespace dgserve
