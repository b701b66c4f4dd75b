#include "engine/denoise/sampler_params.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "common/testing/status_matchers.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::HasSubstr;

TEST(SamplerParamsTest, DefaultsAreTheShippedGenerationConfig) {
  const SamplerParams p;
  EXPECT_EQ(p.max_denoising_steps, 48);
  EXPECT_EQ(p.t_min, 0.4f);
  EXPECT_EQ(p.t_max, 0.8f);
  EXPECT_EQ(p.entropy_bound, 0.1f);
  EXPECT_EQ(p.stability_threshold, 1);
  EXPECT_EQ(p.confidence_threshold, 0.005f);
  EXPECT_THAT(ValidateSamplerParams(p), IsOk());
}

TEST(SamplerParamsTest, TemperatureScheduleSpec43) {
  const SamplerParams p;
  EXPECT_EQ(StepTemperature(p, 0), 0.8f);
  EXPECT_NEAR(StepTemperature(p, 1), 0.79167f, 5e-6f);
  EXPECT_NEAR(StepTemperature(p, 46), 0.41667f, 5e-6f);
  EXPECT_NEAR(StepTemperature(p, 47), 0.40833f, 5e-6f);
  // Bit-exact float32 formula of golden README §4 (the golden `t` values are checked in
  // golden_replay_test).
  for (int s = 0; s < 48; ++s) {
    const float frac = static_cast<float>(48 - s) / 48.0f;
    const float span = 0.8f - 0.4f;
    const float prod = span * frac;
    EXPECT_EQ(StepTemperature(p, s), 0.4f + prod) << "step " << s;
    if (s > 0) EXPECT_LT(StepTemperature(p, s), StepTemperature(p, s - 1));
  }
  EXPECT_GT(StepTemperature(p, 47), p.t_min);  // t_min is never reached
}

TEST(SamplerParamsTest, TemperatureWithOtherStepCounts) {
  SamplerParams p;
  p.max_denoising_steps = 1;
  EXPECT_EQ(StepTemperature(p, 0), 0.8f);
  p.max_denoising_steps = 4;
  p.t_min = 0.0f;
  p.t_max = 1.0f;
  EXPECT_EQ(StepTemperature(p, 0), 1.0f);
  EXPECT_EQ(StepTemperature(p, 1), 0.75f);
  EXPECT_EQ(StepTemperature(p, 3), 0.25f);
}

struct BadCase {
  const char* field;
  SamplerParams params;
};

SamplerParams With(void (*edit)(SamplerParams&)) {
  SamplerParams p;
  edit(p);
  return p;
}

TEST(SamplerParamsTest, ValidationNamesTheOffendingField) {
  const BadCase cases[] = {
      {"max_denoising_steps", With([](SamplerParams& p) { p.max_denoising_steps = 0; })},
      {"max_denoising_steps", With([](SamplerParams& p) { p.max_denoising_steps = -3; })},
      {"max_denoising_steps", With([](SamplerParams& p) { p.max_denoising_steps = 1025; })},
      {"t_min", With([](SamplerParams& p) { p.t_min = -0.1f; })},
      {"t_min", With([](SamplerParams& p) { p.t_min = std::numeric_limits<float>::quiet_NaN(); })},
      {"t_max", With([](SamplerParams& p) { p.t_max = 0.4f; })},  // t_min == t_max
      {"t_max", With([](SamplerParams& p) { p.t_max = 0.3f; })},
      {"t_max", With([](SamplerParams& p) { p.t_max = std::numeric_limits<float>::infinity(); })},
      // A last-step temperature below kMinStepTemperature (1e-40 overflowed the logits of the
      // whole batch: a 500 for every request denoised with it).
      {"t_max and t_min give a last-step temperature", With([](SamplerParams& p) {
         p.t_min = 0.0f;
         p.t_max = 1e-40f;
       })},
      {"t_max and t_min give a last-step temperature", With([](SamplerParams& p) {
         p.t_min = 0.0f;
         p.t_max = 4e-5f;  // 4e-5 / 48 ≈ 8.3e-7 at the last step
       })},
      {"entropy_bound", With([](SamplerParams& p) { p.entropy_bound = 0.0f; })},
      {"entropy_bound",
       With([](SamplerParams& p) { p.entropy_bound = std::numeric_limits<float>::infinity(); })},
      {"stability_threshold", With([](SamplerParams& p) { p.stability_threshold = -1; })},
      {"stability_threshold", With([](SamplerParams& p) { p.stability_threshold = 65; })},
      {"confidence_threshold", With([](SamplerParams& p) { p.confidence_threshold = 0.0f; })},
      {"confidence_threshold", With([](SamplerParams& p) { p.confidence_threshold = -1.0f; })},
      {"confidence_threshold", With([](SamplerParams& p) {
         p.confidence_threshold = std::numeric_limits<float>::quiet_NaN();
       })},
  };
  for (const BadCase& c : cases) {
    EXPECT_THAT(ValidateSamplerParams(c.params),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.field)))
        << c.field;
  }
}

TEST(SamplerParamsTest, LowestTemperatureIsTheLastStepsAndHasAFloor) {
  SamplerParams p;
  p.t_min = 0.0f;
  p.t_max = 48e-6f;  // the last step's temperature: 48e-6 · 1/48 = 1e-6 (float32 rounding aside)
  EXPECT_NEAR(StepTemperature(p, p.max_denoising_steps - 1), kMinStepTemperature, 1e-12f);
  p.t_max = 47e-6f;  // ≈ 0.98e-6 at the last step, though 47e-6 at step 0
  EXPECT_THAT(ValidateSamplerParams(p), StatusIs(absl::StatusCode::kInvalidArgument));
  p.t_max = 49e-6f;
  EXPECT_THAT(ValidateSamplerParams(p), IsOk());
  p.t_min = kMinStepTemperature;  // t_min alone keeps every step at or above the floor
  p.t_max = 2 * kMinStepTemperature;
  EXPECT_THAT(ValidateSamplerParams(p), IsOk());
  p.t_min = 0.0f;
  p.t_max = 1e-40f;
  EXPECT_THAT(ValidateSamplerParams(p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("below the minimum 1e-06")));
}

TEST(SamplerParamsTest, SampleTemperatureSpreadScalesEachSamplesSchedule) {
  SamplerParams p;  // t_min 0.4, t_max 0.8
  p.sample_temperature_spread = -0.75f;
  // Sample i of 4: factor 1 − 0.75·i/3 = 1, 0.75, 0.5, 0.25.
  const float want[4][2] = {{0.4f, 0.8f}, {0.3f, 0.6f}, {0.2f, 0.4f}, {0.1f, 0.2f}};
  for (int i = 0; i < 4; ++i) {
    const SamplerParams s = SampleSamplerParams(p, i, 4);
    EXPECT_FLOAT_EQ(s.t_min, want[i][0]) << i;
    EXPECT_FLOAT_EQ(s.t_max, want[i][1]) << i;
    EXPECT_EQ(s.max_denoising_steps, p.max_denoising_steps);
    EXPECT_EQ(s.entropy_bound, p.entropy_bound);
  }
  // Sample 0 and a single sample keep the schedule bit for bit; spread 0 changes nothing.
  EXPECT_EQ(SampleSamplerParams(p, 0, 8).t_max, p.t_max);
  EXPECT_EQ(SampleSamplerParams(p, 0, 1).t_min, p.t_min);
  p.sample_temperature_spread = 2.0f;
  EXPECT_FLOAT_EQ(SampleSamplerParams(p, 1, 2).t_max, 2.4f);  // the last sample: × 3
  p.sample_temperature_spread = 0.0f;
  EXPECT_EQ(SampleSamplerParams(p, 3, 4).t_max, p.t_max);
}

TEST(SamplerParamsTest, SampleTemperatureSpreadIsValidated) {
  SamplerParams p;
  for (float ok : {kMinSampleTemperatureSpread, 0.0f, -0.5f, kMaxSampleTemperatureSpread}) {
    p.sample_temperature_spread = ok;
    EXPECT_THAT(ValidateSamplerParams(p), IsOk()) << ok;
  }
  for (float bad : {-1.0f, -0.96f, 4.01f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    p.sample_temperature_spread = bad;
    EXPECT_THAT(ValidateSamplerParams(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   HasSubstr("sample_temperature_spread must")))
        << bad;
  }
  // The last sample's schedule must stay above the temperature floor: 48e-6 → 1e-6 at the last
  // step is valid alone but not at 5 % of it.
  p.t_min = 0.0f;
  p.t_max = 49e-6f;
  p.sample_temperature_spread = 0.0f;
  EXPECT_THAT(ValidateSamplerParams(p), IsOk());
  p.sample_temperature_spread = -0.95f;
  EXPECT_THAT(ValidateSamplerParams(p),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the last sample")));
  // A positive spread must not carry t_max past float32's range.
  p = SamplerParams{};
  p.t_max = 1e38f;
  p.sample_temperature_spread = 4.0f;
  EXPECT_THAT(ValidateSamplerParams(p),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("sample_temperature_spread 4 makes the last sample's schedule")));
}

// Each sample's own settings are valid whenever the request's are, and are not scaled again by
// a second validation (found by a new user: the worker re-checked a sample's scaled schedule
// with the spread still set and refused valid requests naming the wrong sample).
TEST(SamplerParamsTest, EverySamplesScheduleOfAValidRequestIsValid) {
  SamplerParams p;
  p.max_denoising_steps = 1;
  p.t_min = 0.0f;
  p.t_max = 1e-4f;  // the last sample at 5 %: 5e-6 ≥ 1e-6 at its only step
  p.sample_temperature_spread = -0.95f;
  ASSERT_THAT(ValidateSamplerParams(p), IsOk());
  for (int n : {2, 4, 16}) {
    for (int i = 0; i < n; ++i) {
      const SamplerParams s = SampleSamplerParams(p, i, n);
      EXPECT_EQ(s.sample_temperature_spread, 0.0f);
      EXPECT_THAT(ValidateSamplerParams(s), IsOk()) << "sample " << i << " of " << n;
    }
  }
  EXPECT_FLOAT_EQ(SampleSamplerParams(p, 3, 4).t_max, 5e-6f);
}

TEST(SamplerParamsTest, EdgeValuesAreValid) {
  SamplerParams p;
  p.max_denoising_steps = 1;
  p.t_min = 0.0f;
  p.stability_threshold = 0;
  EXPECT_THAT(ValidateSamplerParams(p), IsOk());
  p.max_denoising_steps = kMaxDenoisingStepsCap;
  p.stability_threshold = kMaxStabilityThresholdCap;
  EXPECT_THAT(ValidateSamplerParams(p), IsOk());
}

}  // namespace
}  // namespace dgserve
