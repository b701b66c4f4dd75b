#include "engine/denoise/rng.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

namespace dgserve {
namespace {

TEST(RngTest, SplitMix64KnownAnswers) {
  EXPECT_EQ(SplitMix64(0), 0xE220A8397B1DCDAFull);  // first output of splitmix64 seeded with 0
  // Golden README §2.3 worked value: splitmix64(key + 0).
  EXPECT_EQ(SplitMix64(0x0E9423349363554Eull), 0xF95E1B14EFBE96E5ull);
}

TEST(RngTest, CounterBitsFollowsTheDocumentedConstruction) {
  const DrawKey key{42, DrawStream::kRenoiseToken, 3, 17, 255};
  uint64_t h = SplitMix64(42);
  h = SplitMix64(h ^ ((2ull << 32) | 3));
  h = SplitMix64(h ^ ((17ull << 32) | 255));
  EXPECT_EQ(CounterBits(key), h);
}

TEST(RngTest, EveryKeyComponentMatters) {
  const DrawKey base{7, DrawStream::kSampleUniform, 1, 2, 3};
  std::set<uint64_t> seen = {CounterBits(base)};
  DrawKey k = base;
  k.seed = 8;
  seen.insert(CounterBits(k));
  k = base;
  k.stream = DrawStream::kRenoiseToken;
  seen.insert(CounterBits(k));
  k = base;
  k.canvas = 2;
  seen.insert(CounterBits(k));
  k = base;
  k.step = 3;
  seen.insert(CounterBits(k));
  k = base;
  k.pos = 4;
  seen.insert(CounterBits(k));
  // Swapping step and pos must not collide either.
  k = base;
  std::swap(k.step, k.pos);
  seen.insert(CounterBits(k));
  EXPECT_EQ(seen.size(), 7u);
}

TEST(RngTest, ResultsDoNotDependOnCallOrderOrThreads) {
  CounterDrawSource draws(123456789, 262144);
  constexpr int kSteps = 48, kPos = 256;
  std::vector<int32_t> forward(kSteps * kPos), backward(kSteps * kPos), parallel(kSteps * kPos);
  for (int s = 0; s < kSteps; ++s) {
    for (int p = 0; p < kPos; ++p) forward[s * kPos + p] = draws.RenoiseToken(2, s, p);
  }
  for (int i = kSteps * kPos - 1; i >= 0; --i) {
    backward[i] = draws.RenoiseToken(2, i / kPos, i % kPos);
  }
#pragma omp parallel for schedule(dynamic, 7) num_threads(2)
  for (int i = 0; i < kSteps * kPos; ++i) {
    parallel[i] = draws.RenoiseToken(2, i / kPos, i % kPos);
  }
  EXPECT_EQ(forward, backward);
  EXPECT_EQ(forward, parallel);
  // A second source with the same seed replays the same draws; another seed does not.
  CounterDrawSource same(123456789, 262144), other(123456790, 262144);
  int differ = 0;
  for (int p = 0; p < kPos; ++p) {
    EXPECT_EQ(same.InitToken(0, p), draws.InitToken(0, p));
    EXPECT_EQ(same.SampleUniform(0, 5, p), draws.SampleUniform(0, 5, p));
    differ += other.InitToken(0, p) != draws.InitToken(0, p);
  }
  EXPECT_GT(differ, kPos - 3);
}

TEST(RngTest, CounterDrawSourceUsesTheDocumentedStreams) {
  CounterDrawSource draws(99, 512);
  EXPECT_EQ(draws.InitToken(1, 7), UniformToken({99, DrawStream::kInitToken, 1, 0, 7}, 512));
  EXPECT_EQ(draws.SampleUniform(1, 4, 7), Uniform01({99, DrawStream::kSampleUniform, 1, 4, 7}));
  EXPECT_EQ(draws.RenoiseToken(1, 4, 7),
            UniformToken({99, DrawStream::kRenoiseToken, 1, 4, 7}, 512));
}

TEST(RngTest, UniformsAreInRangeAndUniform) {
  constexpr int kN = 200000;
  double sum_f = 0.0, sum_d = 0.0, sum_sq = 0.0;
  float min_f = 1.0f, max_f = 0.0f;
  for (int i = 0; i < kN; ++i) {
    const DrawKey key{5, DrawStream::kSampleUniform, 0, static_cast<uint32_t>(i / 256),
                      static_cast<uint32_t>(i % 256)};
    const float f = Uniform01(key);
    const double d = Uniform01Double(key);
    ASSERT_GE(f, 0.0f);
    ASSERT_LT(f, 1.0f);
    ASSERT_GE(d, 0.0);
    ASSERT_LT(d, 1.0);
    EXPECT_NEAR(f, d, 1e-7);  // both are views of the same 64 bits
    sum_f += f;
    sum_d += d;
    sum_sq += d * d;
    min_f = std::min(min_f, f);
    max_f = std::max(max_f, f);
  }
  EXPECT_NEAR(sum_f / kN, 0.5, 0.004);
  EXPECT_NEAR(sum_d / kN, 0.5, 0.004);
  EXPECT_NEAR(sum_sq / kN, 1.0 / 3.0, 0.004);
  EXPECT_LT(min_f, 1e-3f);
  EXPECT_GT(max_f, 0.999f);
}

TEST(RngTest, UniformIndexBoundsAndExactness) {
  EXPECT_EQ(UniformIndex(0, 262144), 0);
  EXPECT_EQ(UniformIndex(~0ull, 262144), 262143);
  EXPECT_EQ(UniformIndex(~0ull, 1), 0);
  EXPECT_EQ(UniformIndex(1ull << 63, 512), 256);
  // For a power of two n, the index is exactly the top log2(n) bits.
  for (uint64_t bits : {0x0123456789ABCDEFull, 0xFEDCBA9876543210ull, 0x8000000000000001ull}) {
    EXPECT_EQ(UniformIndex(bits, 262144), static_cast<int32_t>(bits >> 46));
  }
}

TEST(RngTest, UniformTokenHistogram) {
  constexpr int kVocab = 10, kN = 100000;
  std::vector<int> counts(kVocab, 0);
  for (int i = 0; i < kN; ++i) {
    const int32_t t = UniformToken(
        {11, DrawStream::kRenoiseToken, 0, static_cast<uint32_t>(i), static_cast<uint32_t>(i * 7)},
        kVocab);
    ASSERT_GE(t, 0);
    ASSERT_LT(t, kVocab);
    ++counts[t];
  }
  double chi2 = 0.0;
  for (int c : counts) chi2 += (c - kN / kVocab) * (c - kN / kVocab) / double(kN / kVocab);
  EXPECT_LT(chi2, 30.0);  // 9 degrees of freedom: p < 0.0005 to exceed
}

}  // namespace
}  // namespace dgserve
