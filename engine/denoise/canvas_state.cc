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

absl::StatusOr<CanvasDenoiser> CanvasDenoiser::CreateWithTemplate(
    const SamplerParams& params, std::shared_ptr<const CanvasTemplate> canvas_template,
    int canvas_index, DrawSource* draws) {
  if (canvas_template == nullptr) return absl::InvalidArgumentError("canvas_template is null");
  const int C = canvas_template->canvas_length();
  DGSERVE_ASSIGN_OR_RETURN(CanvasDenoiser d,
                           Create(params, C, canvas_template->vocab(), canvas_index, draws));
  const CanvasTemplate& t = *canvas_template;
  for (int j = 0; j < C; ++j) {
    if (!t.is_hole(j)) {
      d.canvas_[j] = t.fixed(j);
    } else if (std::span<const int32_t> allowed = t.allowed(j); !allowed.empty()) {
      const int32_t k = draws->InitIndex(canvas_index, j, int32_t(allowed.size()));
      if (k < 0 || k >= int32_t(allowed.size())) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "draws->InitIndex returned %d, outside [0, %d)", k, allowed.size()));
      }
      d.canvas_[j] = allowed[k];
    }
  }
  d.argmax_ = d.canvas_;
  d.template_ = std::move(canvas_template);
  if (t.holes().empty()) {  // nothing to denoise: the template is the canvas
    d.done_ = true;
    d.stopped_early_ = true;
    d.uniforms_.clear();
  }
  return d;
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
  if (template_) {
    for (int j = 0; j < n; ++j) {
      if (!template_->Allows(j, rows[j].argmax) || !template_->Allows(j, rows[j].sampled)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "rows[%d] has argmax %d / sampled %d outside the canvas template's allowed set at "
            "position %d (the backend did not apply the row masks)",
            j, rows[j].argmax, rows[j].sampled, j));
      }
    }
  }
  // Without a template every position takes part; with one, only the holes (fixed positions
  // have entropy 0 by construction and would only dilute the stop rule's mean).
  std::vector<int> all_positions;
  std::span<const int> positions;
  if (template_) {
    positions = template_->holes();
  } else {
    all_positions.resize(n);
    for (int j = 0; j < n; ++j) all_positions[j] = j;
    positions = all_positions;
  }
  std::vector<float> entropy(positions.size());
  for (size_t i = 0; i < positions.size(); ++i) entropy[i] = rows[positions[i]].entropy;
  outcome.accepted = AcceptPositions(entropy, static_cast<double>(params_.entropy_bound));
  for (int& i : outcome.accepted) i = positions[i];
  outcome.mean_entropy = MeanEntropy(entropy);

  std::vector<char> is_accepted(n, 0);
  for (int pos : outcome.accepted) is_accepted[pos] = 1;
  std::vector<int32_t> next(n);
  for (int j = 0; j < n; ++j) {
    if (template_ && !template_->is_hole(j)) {
      next[j] = template_->fixed(j);
    } else if (is_accepted[j]) {
      next[j] = rows[j].sampled;
    } else if (std::span<const int32_t> allowed =
                   template_ ? template_->allowed(j) : std::span<const int32_t>();
               !allowed.empty()) {
      if (!renoise_tokens.empty()) {
        next[j] = renoise_tokens[j];
        if (!template_->Allows(j, next[j])) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "renoise token %d at position %d is outside its allowed set", next[j], j));
        }
      } else {
        const int32_t k =
            draws_->RenoiseIndex(canvas_index_, step_, j, int32_t(allowed.size()));
        if (k < 0 || k >= int32_t(allowed.size())) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "renoise index %d at position %d outside the allowed set of %d ids", k, j,
              allowed.size()));
        }
        next[j] = allowed[k];
      }
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
