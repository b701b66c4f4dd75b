#include "engine/denoise/canvas_state.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "engine/denoise/entropy_bound.h"

namespace dgserve {
namespace {

absl::Status ValidateCommon(const SamplerParams& params, int32_t vocab, int canvas_index) {
  DGSERVE_RETURN_IF_ERROR(ValidateSamplerParams(params));
  if (vocab < 1)
    return absl::InvalidArgumentError(absl::StrFormat("vocab must be >= 1, got %d", vocab));
  if (canvas_index < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("canvas_index must be >= 0, got %d", canvas_index));
  }
  return absl::OkStatus();
}

}  // namespace

CanvasDenoiser::CanvasDenoiser(const SamplerParams& params, int canvas_length, int32_t vocab,
                               int canvas_index, DrawSource* draws)
    : params_(params),
      vocab_(vocab),
      canvas_index_(canvas_index),
      draws_(draws),
      canvas_(canvas_length),
      stop_rule_(params.stability_threshold, params.confidence_threshold) {
  for (int j = 0; j < canvas_length; ++j) canvas_[j] = draws_->InitToken(canvas_index_, j);
  argmax_ = canvas_;
  RefillUniforms();
}

CanvasDenoiser::CanvasDenoiser(const SamplerParams& params, std::span<const int32_t> initial_canvas,
                               int32_t vocab, int canvas_index, DrawSource* draws)
    : params_(params),
      vocab_(vocab),
      canvas_index_(canvas_index),
      draws_(draws),
      canvas_(initial_canvas.begin(), initial_canvas.end()),
      argmax_(canvas_),
      stop_rule_(params.stability_threshold, params.confidence_threshold) {
  RefillUniforms();
}

absl::StatusOr<CanvasDenoiser> CanvasDenoiser::Create(const SamplerParams& params,
                                                      int canvas_length, int32_t vocab,
                                                      int canvas_index, DrawSource* draws) {
  DGSERVE_RETURN_IF_ERROR(ValidateCommon(params, vocab, canvas_index));
  if (canvas_length < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("canvas_length must be >= 1, got %d", canvas_length));
  }
  if (draws == nullptr) return absl::InvalidArgumentError("draws must not be null");
  CanvasDenoiser denoiser(params, canvas_length, vocab, canvas_index, draws);
  for (int32_t t : denoiser.canvas()) {
    if (t < 0 || t >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("draws->InitToken returned %d, outside [0, %d)", t, vocab));
    }
  }
  return denoiser;
}

absl::StatusOr<CanvasDenoiser> CanvasDenoiser::CreateWithInitialCanvas(
    const SamplerParams& params, std::span<const int32_t> initial_canvas, int32_t vocab,
    int canvas_index, DrawSource* draws) {
  DGSERVE_RETURN_IF_ERROR(ValidateCommon(params, vocab, canvas_index));
  if (initial_canvas.empty()) return absl::InvalidArgumentError("initial_canvas is empty");
  for (size_t j = 0; j < initial_canvas.size(); ++j) {
    if (initial_canvas[j] < 0 || initial_canvas[j] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrFormat("initial_canvas[%d] = %d outside [0, %d)", j, initial_canvas[j], vocab));
    }
  }
  return CanvasDenoiser(params, initial_canvas, vocab, canvas_index, draws);
}

void CanvasDenoiser::RefillUniforms() {
  uniforms_.clear();
  if (done_ || draws_ == nullptr) return;
  uniforms_.resize(canvas_.size());
  for (size_t j = 0; j < canvas_.size(); ++j) {
    uniforms_[j] = draws_->SampleUniform(canvas_index_, step_, static_cast<int>(j));
  }
}

absl::StatusOr<StepOutcome> CanvasDenoiser::ApplyStep(std::span<const RowResult> rows) {
  if (draws_ == nullptr) {
    return absl::FailedPreconditionError("ApplyStep needs a DrawSource; use ApplyStepWithDraws");
  }
  return Apply(rows, {});
}

absl::StatusOr<StepOutcome> CanvasDenoiser::ApplyStepWithDraws(
    std::span<const RowResult> rows, std::span<const int32_t> renoise_tokens) {
  if (renoise_tokens.size() != canvas_.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("renoise_tokens has %d entries, canvas length is %d", renoise_tokens.size(),
                        canvas_.size()));
  }
  return Apply(rows, renoise_tokens);
}

absl::StatusOr<StepOutcome> CanvasDenoiser::Apply(std::span<const RowResult> rows,
                                                  std::span<const int32_t> renoise_tokens) {
  const int n = canvas_length();
  if (done_) {
    return absl::FailedPreconditionError(
        absl::StrFormat("canvas %d is done after %d steps", canvas_index_, step_));
  }
  if (static_cast<int>(rows.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rows has %d entries, canvas length is %d", rows.size(), n));
  }
  auto in_vocab = [&](int32_t t) { return t >= 0 && t < vocab_; };
  for (int j = 0; j < n; ++j) {
    if (!in_vocab(rows[j].argmax) || !in_vocab(rows[j].sampled)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rows[%d] has argmax %d / sampled %d outside [0, %d)", j, rows[j].argmax,
                          rows[j].sampled, vocab_));
    }
  }

  StepOutcome outcome;
  outcome.step = step_;
  outcome.temperature = temperature();
  std::vector<float> entropy(n);
  for (int j = 0; j < n; ++j) entropy[j] = rows[j].entropy;
  outcome.accepted = AcceptPositions(entropy, static_cast<double>(params_.entropy_bound));
  outcome.mean_entropy = MeanEntropy(entropy);

  std::vector<char> is_accepted(n, 0);
  for (int pos : outcome.accepted) is_accepted[pos] = 1;
  std::vector<int32_t> next(n);
  for (int j = 0; j < n; ++j) {
    if (is_accepted[j]) {
      next[j] = rows[j].sampled;
    } else {
      next[j] = renoise_tokens.empty() ? draws_->RenoiseToken(canvas_index_, step_, j)
                                       : renoise_tokens[j];
      if (!in_vocab(next[j])) {
        return absl::InvalidArgumentError(
            absl::StrFormat("renoise token %d at position %d outside [0, %d)", next[j], j, vocab_));
      }
    }
  }

  // Everything validated: commit the step.
  std::vector<int32_t> argmax(n);
  for (int j = 0; j < n; ++j) argmax[j] = rows[j].argmax;
  outcome.stop = stop_rule_.Update(argmax, outcome.mean_entropy);
  outcome.stable = stop_rule_.stable();
  outcome.confident = stop_rule_.confident();
  outcome.argmax_unchanged = stop_rule_.argmax_unchanged();
  argmax_ = std::move(argmax);
  canvas_ = std::move(next);
  ++step_;
  stopped_early_ = outcome.stop;
  done_ = outcome.stop || step_ >= params_.max_denoising_steps;
  RefillUniforms();
  return outcome;
}

}  // namespace dgserve
