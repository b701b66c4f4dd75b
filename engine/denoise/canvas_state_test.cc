#include "engine/denoise/canvas_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/denoise/entropy_bound.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Draws with recognisable values: init 100 + pos, uniform pos/100 + step/1000, renoise
// 200 + 10·step + pos (vocab 512).
class FakeDraws : public DrawSource {
 public:
  int32_t InitToken(int canvas, int pos) override { return 100 + pos + canvas; }
  float SampleUniform(int canvas, int step, int pos) override {
    return pos / 100.0f + step / 1000.0f;
  }
  int32_t RenoiseToken(int canvas, int step, int pos) override {
    ++renoise_calls;
    return 200 + 10 * step + pos;
  }
  int32_t InitIndex(int canvas, int pos, int32_t n) override { return (pos + canvas) % n; }
  int32_t RenoiseIndex(int canvas, int step, int pos, int32_t n) override {
    ++renoise_calls;
    return (step + pos) % n;
  }
  int renoise_calls = 0;
};

std::vector<RowResult> Rows(const std::vector<float>& entropy, int32_t argmax_base,
                            int32_t sampled_base) {
  std::vector<RowResult> rows(entropy.size());
  for (size_t j = 0; j < entropy.size(); ++j) {
    rows[j].argmax = argmax_base + static_cast<int32_t>(j);
    rows[j].sampled = sampled_base + static_cast<int32_t>(j);
    rows[j].entropy = entropy[j];
  }
  return rows;
}

TEST(CanvasDenoiserTest, InitialStateFromDrawSource) {
  FakeDraws draws;
  CanvasDenoiser d(SamplerParams{}, 4, 512, 0, &draws);
  EXPECT_EQ(d.step(), 0);
  EXPECT_EQ(d.temperature(), 0.8f);
  EXPECT_THAT(d.canvas(), ElementsAre(100, 101, 102, 103));
  EXPECT_THAT(d.committed(), ElementsAre(100, 101, 102, 103));  // A = x at Init
  EXPECT_THAT(d.uniforms(), ElementsAre(0.0f, 0.01f, 0.02f, 0.03f));
  EXPECT_FALSE(d.done());
  CanvasDenoiser second(SamplerParams{}, 2, 512, 3, &draws);
  EXPECT_THAT(second.canvas(), ElementsAre(103, 104));
}

TEST(CanvasDenoiserTest, StepAcceptsRenoisesAndCommitsArgmax) {
  FakeDraws draws;
  CanvasDenoiser d(SamplerParams{}, 4, 512, 0, &draws);
  // Ranking: pos2 (0.01), pos0 (0.05), pos3 (0.07), pos1 (2.0); sums before 0, 0.01, 0.06, 0.13.
  const std::vector<float> h = {0.05f, 2.0f, 0.01f, 0.07f};
  absl::StatusOr<StepOutcome> out = d.ApplyStep(Rows(h, 10, 300));
  ASSERT_THAT(out, IsOk());
  EXPECT_EQ(out->step, 0);
  EXPECT_EQ(out->temperature, 0.8f);
  EXPECT_THAT(out->accepted, ElementsAre(0, 2, 3));
  EXPECT_EQ(out->mean_entropy, MeanEntropy(h));
  EXPECT_FALSE(out->stable);
  EXPECT_FALSE(out->confident);
  EXPECT_FALSE(out->stop);
  EXPECT_THAT(d.canvas(), ElementsAre(300, 200 + 1, 302, 303));  // pos1 renoised at step 0
  EXPECT_EQ(draws.renoise_calls, 1);
  EXPECT_THAT(d.committed(), ElementsAre(10, 11, 12, 13));
  EXPECT_EQ(d.step(), 1);
  EXPECT_EQ(d.temperature(), StepTemperature(SamplerParams{}, 1));
  EXPECT_THAT(d.uniforms(), ElementsAre(0.001f, 0.011f, 0.021f, 0.031f));
}

TEST(CanvasDenoiserTest, RunsToMaxStepsWithoutStop) {
  FakeDraws draws;
  SamplerParams p;
  p.max_denoising_steps = 5;
  CanvasDenoiser d(p, 3, 512, 0, &draws);
  for (int s = 0; s < 5; ++s) {
    ASSERT_FALSE(d.done());
    // Argmax changes every step: never stable.
    ASSERT_THAT(d.ApplyStep(Rows({0.0f, 0.0f, 0.0f}, 10 * s, 400)), IsOk());
  }
  EXPECT_TRUE(d.done());
  EXPECT_FALSE(d.stopped_early());
  EXPECT_THAT(d.committed(), ElementsAre(40, 41, 42));
  EXPECT_TRUE(d.uniforms().empty());
  EXPECT_THAT(d.ApplyStep(Rows({0.0f, 0.0f, 0.0f}, 0, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(CanvasDenoiserTest, StopsEarlyWhenStableAndConfident) {
  FakeDraws draws;
  CanvasDenoiser d(SamplerParams{}, 3, 512, 0, &draws);
  const std::vector<float> low = {0.001f, 0.002f, 0.003f};
  auto s0 = d.ApplyStep(Rows(low, 7, 9));  // step 0: never stable
  ASSERT_THAT(s0, IsOk());
  EXPECT_FALSE(s0->stop);
  EXPECT_TRUE(s0->confident);
  auto s1 = d.ApplyStep(Rows(low, 7, 9));  // same argmax, mean 0.002 < 0.005
  ASSERT_THAT(s1, IsOk());
  EXPECT_TRUE(s1->stable);
  EXPECT_TRUE(s1->argmax_unchanged);
  EXPECT_TRUE(s1->stop);
  EXPECT_TRUE(d.done());
  EXPECT_TRUE(d.stopped_early());
  EXPECT_EQ(d.step(), 2);
  EXPECT_THAT(d.committed(), ElementsAre(7, 8, 9));
}

TEST(CanvasDenoiserTest, ReplayWithExplicitDraws) {
  SamplerParams p;
  p.stability_threshold = 0;
  p.confidence_threshold = 1.0f;
  const std::vector<int32_t> init = {5, 6, 7};
  CanvasDenoiser d(p, init, 512, 0, nullptr);
  EXPECT_TRUE(d.uniforms().empty());
  EXPECT_THAT(d.ApplyStep(Rows({1.0f, 1.0f, 1.0f}, 0, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  const std::vector<int32_t> renoise = {50, 51, 52};
  auto out = d.ApplyStepWithDraws(Rows({3.0f, 2.0f, 4.0f}, 20, 30), renoise);
  ASSERT_THAT(out, IsOk());
  EXPECT_THAT(out->accepted, ElementsAre(1));
  EXPECT_THAT(d.canvas(), ElementsAre(50, 31, 52));
  EXPECT_FALSE(out->stop);  // mean 3 ≥ 1
  out = d.ApplyStepWithDraws(Rows({0.5f, 0.5f, 0.5f}, 20, 30), renoise);
  ASSERT_THAT(out, IsOk());
  EXPECT_TRUE(out->stable);  // S = 0
  EXPECT_TRUE(out->stop);
  EXPECT_TRUE(d.stopped_early());
}

TEST(CanvasDenoiserTest, InvalidInputsLeaveStateUnchanged) {
  FakeDraws draws;
  CanvasDenoiser d(SamplerParams{}, 3, 512, 0, &draws);
  EXPECT_THAT(d.ApplyStep(Rows({0.1f, 0.1f}, 0, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows")));
  EXPECT_THAT(d.ApplyStep(Rows({0.1f, 0.1f, 0.1f}, 510, 0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside")));
  EXPECT_THAT(d.ApplyStepWithDraws(Rows({0.1f, 0.1f, 0.1f}, 0, 0), std::vector<int32_t>{1, 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("renoise_tokens")));
  // Position 1 (entropy 5) is renoised with an out-of-range token.
  EXPECT_THAT(d.ApplyStepWithDraws(Rows({0.1f, 5.0f, 0.1f}, 0, 0), std::vector<int32_t>{1, 512, 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("renoise token")));
  EXPECT_EQ(d.step(), 0);
  EXPECT_THAT(d.canvas(), ElementsAre(100, 101, 102));
}

TEST(CanvasDenoiserTest, FactoriesValidate) {
  FakeDraws draws;
  SamplerParams bad;
  bad.t_max = 0.1f;
  EXPECT_THAT(CanvasDenoiser::Create(bad, 4, 512, 0, &draws),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("t_max")));
  EXPECT_THAT(CanvasDenoiser::Create(SamplerParams{}, 0, 512, 0, &draws),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("canvas_length")));
  EXPECT_THAT(CanvasDenoiser::Create(SamplerParams{}, 4, 0, 0, &draws),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vocab")));
  EXPECT_THAT(CanvasDenoiser::Create(SamplerParams{}, 4, 512, -1, &draws),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("canvas_index")));
  EXPECT_THAT(CanvasDenoiser::Create(SamplerParams{}, 4, 512, 0, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("draws")));
  // FakeDraws' init tokens (100 + pos) fall outside a vocabulary of 101 at pos 1.
  EXPECT_THAT(CanvasDenoiser::Create(SamplerParams{}, 4, 101, 0, &draws),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("InitToken")));
  EXPECT_THAT(CanvasDenoiser::CreateWithInitialCanvas(SamplerParams{}, std::vector<int32_t>{1, 9},
                                                      8, 0, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("initial_canvas[1]")));
  EXPECT_THAT(CanvasDenoiser::Create(SamplerParams{}, 4, 512, 0, &draws), IsOk());
}

TEST(CanvasDenoiserTest, CounterDrawsAreReproducibleAcrossInterleaving) {
  // Two canvases of the same request, stepped in different interleavings, see the same draws.
  auto run = [](bool interleave) {
    CounterDrawSource draws(2024, 512);
    CanvasDenoiser a(SamplerParams{}, 8, 512, 0, &draws);
    CanvasDenoiser b(SamplerParams{}, 8, 512, 1, &draws);
    std::vector<int32_t> trace;
    auto step = [&](CanvasDenoiser& d) {
      std::vector<RowResult> rows(8);
      for (int j = 0; j < 8; ++j) {
        rows[j] = {j, static_cast<int32_t>(d.uniforms()[j] * 512), 0.02f * (j + d.step()), 0.f};
      }
      ASSERT_THAT(d.ApplyStep(rows), IsOk());
      trace.insert(trace.end(), d.canvas().begin(), d.canvas().end());
    };
    for (int s = 0; s < 3; ++s) {
      if (interleave) {
        step(a);
        step(b);
      }
    }
    if (!interleave) {
      for (int s = 0; s < 3; ++s) step(b);
      for (int s = 0; s < 3; ++s) step(a);
    }
    std::vector<int32_t> result(a.canvas().begin(), a.canvas().end());
    result.insert(result.end(), b.canvas().begin(), b.canvas().end());
    return result;
  };
  EXPECT_EQ(run(true), run(false));
}

}  // namespace
}  // namespace dgserve
