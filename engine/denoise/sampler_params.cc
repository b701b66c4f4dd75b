#include "engine/denoise/sampler_params.h"

#include <cmath>

#include "absl/strings/str_format.h"

namespace dgserve {

absl::Status ValidateSamplerParams(const SamplerParams& p) {
  if (p.max_denoising_steps <= 0 || p.max_denoising_steps > kMaxDenoisingStepsCap) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_denoising_steps must be in [1, %d], got %d", kMaxDenoisingStepsCap,
                        p.max_denoising_steps));
  }
  if (!std::isfinite(p.t_min) || p.t_min < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrFormat("t_min must be finite and >= 0, got %g", p.t_min));
  }
  if (!std::isfinite(p.t_max) || !(p.t_min < p.t_max)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("t_max must be finite and > t_min (%g), got %g", p.t_min, p.t_max));
  }
  // The schedule falls from t_max (step 0) to its lowest value at the last step.
  if (const float lowest = StepTemperature(p, p.max_denoising_steps - 1);
      !(lowest >= kMinStepTemperature)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "t_max and t_min give a last-step temperature t_min + (t_max - t_min) / N = %g (N = %d "
        "steps), below the minimum %g (a safety floor: far smaller temperatures overflow the "
        "processed logits); raise t_max or t_min, or lower max_denoising_steps",
        lowest, p.max_denoising_steps, kMinStepTemperature));
  }
  if (!std::isfinite(p.entropy_bound) || !(p.entropy_bound > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("entropy_bound must be finite and > 0, got %g", p.entropy_bound));
  }
  if (p.stability_threshold < 0 || p.stability_threshold > kMaxStabilityThresholdCap) {
    return absl::InvalidArgumentError(
        absl::StrFormat("stability_threshold must be in [0, %d], got %d", kMaxStabilityThresholdCap,
                        p.stability_threshold));
  }
  if (!std::isfinite(p.confidence_threshold) || !(p.confidence_threshold > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "confidence_threshold must be finite and > 0, got %g", p.confidence_threshold));
  }
  if (!std::isfinite(p.sample_temperature_spread) ||
      p.sample_temperature_spread < kMinSampleTemperatureSpread ||
      p.sample_temperature_spread > kMaxSampleTemperatureSpread) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sample_temperature_spread must be in [%g, %g], got %g", kMinSampleTemperatureSpread,
        kMaxSampleTemperatureSpread, p.sample_temperature_spread));
  }
  // The last sample's schedule (t_min and t_max × (1 + spread)): the lowest of the samples'
  // schedules for a negative spread, the highest for a positive one, so with sample 0's (checked
  // above) it bounds every sample's. Its temperatures must stay finite and above the floor.
  if (p.sample_temperature_spread != 0.0f) {
    const SamplerParams last = SampleSamplerParams(p, 1, 2);
    if (absl::Status s = ValidateSamplerParams(last); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "sample_temperature_spread %g makes the last sample's schedule (t_min %g, t_max %g) "
          "invalid: %s",
          p.sample_temperature_spread, last.t_min, last.t_max, s.message()));
    }
  }
  return absl::OkStatus();
}

SamplerParams SampleSamplerParams(const SamplerParams& params, int sample, int num_samples) {
  SamplerParams p = params;
  if (num_samples <= 1 || params.sample_temperature_spread == 0.0f) return p;
  const float f = 1.0f + params.sample_temperature_spread * static_cast<float>(sample) /
                             static_cast<float>(num_samples - 1);
  p.t_min = params.t_min * f;
  p.t_max = params.t_max * f;
  p.sample_temperature_spread = 0.0f;  // this sample's schedule is scaled already
  return p;
}

float StepTemperature(const SamplerParams& p, int step) {
  const float n = static_cast<float>(p.max_denoising_steps);
  const float frac = static_cast<float>(p.max_denoising_steps - step) / n;
  // float32 throughout; this file is compiled with -ffp-contract=off (no FMA contraction).
  const float span = p.t_max - p.t_min;
  const float scaled = span * frac;
  return p.t_min + scaled;
}

}  // namespace dgserve
