// The per-canvas denoising state machine (spec §4.2), independent of the model: it owns the
// canvas fed to the decoder, the step counter and temperature schedule, the per-step uniforms for
// the row sampler, acceptance, renoise, the stop rule and the committed (argmax) canvas.
//
// Use: while (!d.done()) { logits = decoder(d.canvas()); SampleRows(logits, ..., d.temperature(),
// d.uniforms(), ...) → rows; d.ApplyStep(rows); } then d.committed() is the canvas to append.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include <memory>

#include "engine/denoise/canvas_template.h"
#include "engine/denoise/rng.h"
#include "engine/denoise/row_sampler.h"
#include "engine/denoise/sampler_params.h"
#include "engine/denoise/stopping.h"

namespace dgserve {

// What one ApplyStep did.
struct StepOutcome {
  int step = 0;               // 0-based index of the step just applied.
  float temperature = 0.f;    // its temperature (StepTemperature).
  std::vector<int> accepted;  // accepted positions, ascending (AcceptPositions).
  float mean_entropy = 0.f;   // MeanEntropy of the step's entropies (nats).
  bool stable = false;        // stop rule parts (StableAndConfidentStop) after this step.
  bool confident = false;
  bool argmax_unchanged = false;  // argmax canvas equal to the previous step's (golden `stable`).
  bool stop = false;              // stable ∧ confident: the loop ends early after this step.
};

// One per canvas; not thread-safe (distinct denoisers may run on distinct threads, sharing a
// thread-safe DrawSource such as CounterDrawSource).
class CanvasDenoiser {
 public:
  // Fresh canvas: token j = draws->InitToken(canvas_index, j) (spec §4.2 Init). Preconditions
  // (checked by Create): ValidateSamplerParams(params) is OK, canvas_length ≥ 1, vocab ≥ 1,
  // canvas_index ≥ 0, draws non-null and outliving this object.
  CanvasDenoiser(const SamplerParams& params, int canvas_length, int32_t vocab, int canvas_index,
                 DrawSource* draws);

  // Given initial canvas (replay of recorded traces). `draws` may be null; then uniforms() is
  // empty and only ApplyStepWithDraws may be used.
  CanvasDenoiser(const SamplerParams& params, std::span<const int32_t> initial_canvas,
                 int32_t vocab, int canvas_index, DrawSource* draws);

  // Validating factories for the two constructors: INVALID_ARGUMENT for bad params (message from
  // ValidateSamplerParams), canvas_length/initial canvas empty, vocab < 1, canvas_index < 0,
  // initial tokens outside [0, vocab), or a null `draws` in the first form.
  static absl::StatusOr<CanvasDenoiser> Create(const SamplerParams& params, int canvas_length,
                                               int32_t vocab, int canvas_index, DrawSource* draws);
  // A fresh canvas clamped by `canvas_template` (canvas_template.h; its length and vocabulary
  // are the canvas's): fixed positions hold their token from Init on; a restricted hole starts
  // at allowed[draws->InitIndex(canvas_index, j, |allowed|)], an unrestricted one at InitToken.
  // The backend must mask each row with row_masks(); ApplyStep then checks that every argmax and
  // sample is allowed, accepts among the holes only (entropy bound over the holes' entropies),
  // renoises a restricted hole from its set (RenoiseIndex), keeps fixed positions, and the stop
  // rule's mean entropy is over the holes. A template without holes is done() at once, with
  // committed() = the template and no step. Same errors as Create.
  static absl::StatusOr<CanvasDenoiser> CreateWithTemplate(
      const SamplerParams& params, std::shared_ptr<const CanvasTemplate> canvas_template,
      int canvas_index, DrawSource* draws);
  static absl::StatusOr<CanvasDenoiser> CreateWithInitialCanvas(
      const SamplerParams& params, std::span<const int32_t> initial_canvas, int32_t vocab,
      int canvas_index, DrawSource* draws);

  // Number of steps applied so far = 0-based index of the next step.
  int step() const { return step_; }
  // Temperature of the next step (StepTemperature(params, step())).
  float temperature() const { return StepTemperature(params_, step_); }
  // Tokens to feed the next decoder pass, length canvas_length().
  std::span<const int32_t> canvas() const { return canvas_; }
  // u_j = draws->SampleUniform(canvas_index, step(), j) for the next step's row sampler (length
  // canvas_length()); empty when done() or when there is no DrawSource.
  std::span<const float> uniforms() const { return uniforms_; }

  // Applies one step from the row sampler's results (rows[j] for position j; size must be
  // canvas_length()): acceptance over rows[*].entropy with β = params.entropy_bound; the next
  // canvas takes rows[j].sampled at accepted positions and draws->RenoiseToken(canvas_index,
  // step, j) elsewhere; the stop rule on rows[*].argmax; the argmax canvas becomes committed().
  // Errors (state unchanged): FAILED_PRECONDITION if done() or there is no DrawSource;
  // INVALID_ARGUMENT if rows has the wrong size or a token outside [0, vocab).
  absl::StatusOr<StepOutcome> ApplyStep(std::span<const RowResult> rows);

  // As ApplyStep, but non-accepted position j takes renoise_tokens[j] (size canvas_length();
  // entries at accepted positions are ignored). For replaying recorded traces.
  absl::StatusOr<StepOutcome> ApplyStepWithDraws(std::span<const RowResult> rows,
                                                 std::span<const int32_t> renoise_tokens);

  // Per row, the vocabulary mask the backend must apply (CanvasTemplate::row_masks), or an empty
  // span without a template.
  std::span<const uint64_t* const> row_masks() const {
    return template_ ? template_->row_masks() : std::span<const uint64_t* const>();
  }
  const CanvasTemplate* canvas_template() const { return template_.get(); }

  // True once the stop rule fired or max_denoising_steps steps were applied.
  bool done() const { return done_; }
  // True if the stop rule fired (at any step).
  bool stopped_early() const { return stopped_early_; }
  // The argmax canvas of the last applied step (the canvas to commit, spec §4.2 "Commit"); before
  // the first step, the initial canvas (spec: A = x at Init).
  std::span<const int32_t> committed() const { return argmax_; }

  int canvas_length() const { return static_cast<int>(canvas_.size()); }
  int canvas_index() const { return canvas_index_; }
  int32_t vocab() const { return vocab_; }
  const SamplerParams& params() const { return params_; }

 private:
  absl::StatusOr<StepOutcome> Apply(std::span<const RowResult> rows,
                                    std::span<const int32_t> renoise_tokens);
  void RefillUniforms();

  SamplerParams params_;
  std::shared_ptr<const CanvasTemplate> template_;  // null: no template
  int32_t vocab_;
  int canvas_index_;
  DrawSource* draws_;
  int step_ = 0;
  bool done_ = false;
  bool stopped_early_ = false;
  std::vector<int32_t> canvas_;
  std::vector<int32_t> argmax_;
  std::vector<float> uniforms_;
  StableAndConfidentStop stop_rule_;
};

}  // namespace dgserve
