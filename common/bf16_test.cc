#include "common/bf16.h"

#include <gtest/gtest.h>

#include <cmath>

namespace dgserve {
namespace {

TEST(Bf16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly halfway between 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3F80);
  // 1.0078125 + 2^-8 is halfway with an odd low bit: rounds up.
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3F82);
  EXPECT_FLOAT_EQ(Bf16ToFloat(0x3F63), 0.88671875f);
  // bf16(sqrt(128)) = 11.3125, bf16(sqrt(2816)) = 53.0 (spec §5.3).
  EXPECT_EQ(RoundToBf16(std::sqrt(128.0f)), 11.3125f);
  EXPECT_EQ(RoundToBf16(std::sqrt(2816.0f)), 53.0f);
}

TEST(Bf16Test, HalfConversions) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x0001), 5.9604644775390625e-08f);  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7C00)));
}

}  // namespace
}  // namespace dgserve
