// Sampler settings of the entropy-bound denoising loop and their validation (spec §1.3, §4.2).
#pragma once

#include "absl/status/status.h"

namespace dgserve {

// The per-request settings of the inner denoising loop. Defaults are the shipped
// generation_config.json values (spec §1.3). Validate with ValidateSamplerParams() before use.
struct SamplerParams {
  int max_denoising_steps = 48;         // N: decoder passes per canvas at most.
  float t_min = 0.4f;                   // temperature approached at the last step (never reached).
  float t_max = 0.8f;                   // temperature of step 0.
  float entropy_bound = 0.1f;           // β: acceptance budget in nats (spec §4.2 step 5).
  int stability_threshold = 1;          // S: argmax canvases that must repeat (0 = always stable).
  float confidence_threshold = 0.005f;  // κ: mean entropy must be strictly below it (nats).
  // Self-conditioning (spec §3.5 steps 2–3). false is an ablation: the decoder's
  // self-conditioning input is zero at every step, exactly as at step 0 (soft = 0; the SC block
  // then adds sig(0) = 0 and the canvas input is rms_noscale(e)). Temperatures, acceptance and
  // the stop rule are unchanged. Always valid.
  bool self_conditioning = true;
  // Best-of-n diversity (issue 36 item 8): sample i of a request's n samples runs the schedule
  // with t_min and t_max times 1 + spread·i/(n − 1) (SampleSamplerParams), so sample 0 keeps the
  // request's schedule and the last sample's is scaled by 1 + spread. 0 (the default): every
  // sample the same schedule. Range [kMinSampleTemperatureSpread, kMaxSampleTemperatureSpread].
  float sample_temperature_spread = 0.0f;
};

// Sanity caps beyond the spec's rules, so a request cannot ask for unbounded work or memory.
inline constexpr int kMaxDenoisingStepsCap = 1024;
inline constexpr int kMaxStabilityThresholdCap = 64;
// The lowest temperature a schedule may reach (at step N − 1). Processed logits are ℓ / T with
// |ℓ| ≤ 30 after the softcap (spec §2, §4.2 step 3), so |ℓ / T| ≤ 3·10⁷ here: far from float32's
// and bf16's overflow (3.4·10³⁸), which T below 30 / 3.4·10³⁸ ≈ 9·10⁻³⁸ reaches and which turns a
// whole batched denoising step into an error. At 10⁻⁶ sampling is already argmax in practice.
inline constexpr float kMinStepTemperature = 1e-6f;

// The range of SamplerParams::sample_temperature_spread: the last sample's temperatures at 5 %
// to 5× the request's.
inline constexpr float kMinSampleTemperatureSpread = -0.95f;
inline constexpr float kMaxSampleTemperatureSpread = 4.0f;

// Checks the validation rules of spec §1.3 (HF `validate`) plus the caps above:
// 0 < max_denoising_steps ≤ 1024; t_min, t_max finite and 0 ≤ t_min < t_max;
// 0 ≤ stability_threshold ≤ 64; confidence_threshold finite and > 0; entropy_bound finite and > 0;
// and every step's temperature ≥ kMinStepTemperature (the lowest is StepTemperature(N − 1)),
// for every sample's scaled schedule too (sample_temperature_spread finite and in range, and the
// last sample's t_min and t_max, × (1 + spread), finite with their last step above the floor).
// Returns OK or INVALID_ARGUMENT whose message starts with the offending field's name.
absl::Status ValidateSamplerParams(const SamplerParams& params);

// Temperature of step `step` (0-based, 0 ≤ step < N), spec §4.2 step 1 and golden README §4:
// t_min + (t_max − t_min)·((float)(N − step) / (float)N), every operation in float32.
// Defaults: step 0 → 0.8, step 1 → 0.791667, step 47 → 0.408333 (t_min is never reached).
// `step` outside [0, N) is not rejected; the formula is simply evaluated.
float StepTemperature(const SamplerParams& params, int step);

// The settings sample `sample` (0 ≤ sample < num_samples) of a request runs: `params` with t_min
// and t_max times 1 + sample_temperature_spread·sample/(num_samples − 1) (float32) and the
// spread set to 0 (the result is one sample's own schedule, validated as such). num_samples ≤ 1
// or spread 0: `params` unchanged.
SamplerParams SampleSamplerParams(const SamplerParams& params, int sample, int num_samples);

}  // namespace dgserve
