// One sample's canvases as a step-by-step state machine (spec §4.1, §4.2): canvas Init (with a
// canvas template), the per-step input of the backend's fused denoising step, the step's
// result, the finalized canvas, the completion cut (first stop token, max_new_tokens) and stop
// sequences, and the canvas to commit before the next one. It runs no model pass itself: its
// driver batches the passes. Both drivers use it — Generator (one request, one process) and the
// denoise worker's DenoiseEngine (continuous batching of many samples) — so the two give the
// same tokens by construction.
//
// The phases, and the call that leaves each:
//
//   kStartCanvas --StartCanvas--> kDenoising --ApplyStep (stop rule or last step)--> kCanvasDone
//   (a template without holes: StartCanvas goes straight to kCanvasDone, no pass)
//   kDenoising: StepInput → backend DenoiseStep → ApplyStep, until the canvas is done
//   kCanvasDone --FinishCanvas--> kCommit (encode to_commit(), then CommitDone --> kStartCanvas)
//                             or kFinished (stop token, stop sequence, or the last canvas)
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/denoise/canvas_state.h"
#include "engine/denoise/canvas_template.h"
#include "engine/denoise/rng.h"
#include "engine/denoise/sampler_params.h"
#include "engine/model/backend.h"
#include "engine/generation/stop_matcher.h"
#include "engine/model/config.h"
#include "engine/tokenizer/tokenizer.h"

namespace dgserve {

// What one SampleRun generates.
struct SampleSpec {
  SamplerParams sampler;
  uint64_t seed = 0;  // keys this sample's draws (sample i of a request: the request's seed + i)
  // Canvases already committed before this run (a resumed request): canvas indices — and with
  // them draws, block indices and the template's first canvas — continue from here.
  int first_canvas = 0;
  int max_new_tokens = 0;               // > 0: completion tokens from first_canvas on, at most
  std::vector<int32_t> stop_token_ids;  // a canvas is cut after the first of these
  int32_t pad_token_id = 0;
  // Infilling: canvas 0 (every canvas with template_every_canvas) is clamped by this template;
  // null = none. Its canvas length and vocabulary must be the model's.
  std::shared_ptr<const CanvasTemplate> canvas_template;
  bool template_every_canvas = false;
  // Stop sequences, matched over the completion's decoded text; only with a tokenizer (read by
  // Create only). `completion_before`: a resume's completion before first_canvas, whose text a
  // stop sequence may begin in.
  const Tokenizer* tokenizer = nullptr;
  std::vector<std::string> stop_sequences;
  std::vector<int32_t> completion_before;
};

// A canvas FinishCanvas ended. The spans stay valid until the next FinishCanvas.
struct FinishedCanvas {
  int index = 0;                        // the canvas index
  std::span<const int32_t> tokens;      // [C] argmax canvas, padded after its first stop token
  std::span<const int32_t> completion;  // its tokens in the completion (CutCompletion)
  int steps = 0;                        // decoder passes spent on it
  bool stopped_early = false;           // the stop rule ended it
  bool stop_token = false;              // it holds a stop token (FinalizeCanvas)
  bool stop_sequence = false;           // its text completed a stop sequence
  float mean_entropy = 0;               // its last step's (0 when it took no step)
  bool last = false;                    // the sample ended with it: nothing is committed
};

class SampleRun {
 public:
  enum class Phase { kStartCanvas, kDenoising, kCanvasDone, kCommit, kFinished };

  // A run at kStartCanvas of canvas spec.first_canvas. INVALID_ARGUMENT, naming the field, for
  // max_new_tokens ≤ 0, first_canvas < 0, a stop or pad id outside the vocabulary, a template
  // of another canvas length or vocabulary, or bad sampler parameters (drivers validate their
  // requests before, with their own messages; this guards the run's own invariants).
  static absl::StatusOr<SampleRun> Create(const ModelConfig& config, SampleSpec spec);

  SampleRun(SampleRun&&) noexcept;
  SampleRun& operator=(SampleRun&&) noexcept;
  ~SampleRun();

  Phase phase() const { return phase_; }
  // The canvas being denoised (or next to be); after the last one, one past its index.
  int canvas() const { return canvas_; }
  // Whether a commit pass of this run is pending or may still come (kCommit, or a canvas before
  // the last): the K/V rows it may still add, for a scheduler's memory check. A stop token or
  // stop sequence may end the run sooner.
  bool may_commit() const {
    return phase_ == Phase::kCommit || (phase_ != Phase::kFinished && canvas_ + 1 < num_canvases_);
  }

  // kStartCanvas → kDenoising: a fresh canvas (spec §4.2 Init), clamped by the template when
  // it applies; a template without holes goes to kCanvasDone (no pass). FAILED_PRECONDITION
  // in another phase; the denoiser's error otherwise.
  absl::Status StartCanvas();

  // kDenoising: the input of this canvas's next fused denoising step over the committed
  // context `kv` (the run's rows and self-conditioning buffers receive the outputs; pointers
  // valid until ApplyStep). FAILED_PRECONDITION in another phase.
  absl::StatusOr<DenoiseStepInput> StepInput(const KvCache& kv);

  // kDenoising, after the backend ran StepInput's step: acceptance, renoise and the stop rule
  // (CanvasDenoiser::ApplyStep); this step's soft embedding becomes the next step's
  // self-conditioning input. Stays kDenoising, or kCanvasDone once the canvas is done.
  // FAILED_PRECONDITION in another phase; the denoiser's error otherwise (state unchanged).
  absl::StatusOr<StepOutcome> ApplyStep();

  // The argmax canvas of the last step applied (the initial canvas before the first); empty
  // outside kDenoising / kCanvasDone.
  std::span<const int32_t> argmax() const;

  // kCanvasDone → kCommit or kFinished: finalizes the canvas (FinalizeCanvas), cuts its
  // completion tokens (CutCompletion), feeds them to the stop sequences, and ends the sample at
  // a stop token, a stop sequence or the last canvas. FAILED_PRECONDITION in another phase.
  absl::StatusOr<FinishedCanvas> FinishCanvas();

  // kCommit: the raw argmax canvas (not the padded one) to encode into the KV before the next
  // canvas (spec §4.1 step 3a); empty in other phases.
  std::span<const int32_t> to_commit() const;
  // kCommit → kStartCanvas once the driver encoded to_commit(). FAILED_PRECONDITION otherwise.
  absl::Status CommitDone();

  // Decoder passes over all canvases of this run.
  int total_steps() const { return total_steps_; }
  // The completion so far: tokens before the first stop token, at most max_new_tokens.
  const std::vector<int32_t>& completion() const { return completion_; }
  // "stop" once a stop token or stop sequence ended the completion, else "length".
  std::string_view finish_reason() const { return stop_found_ ? "stop" : "length"; }

 private:
  SampleRun(const ModelConfig& config, SampleSpec spec);

  SampleSpec spec_;
  int canvas_length_, vocab_, num_canvases_;
  std::unique_ptr<CounterDrawSource> draws_;  // stable address: the denoiser keeps a pointer
  Phase phase_ = Phase::kStartCanvas;
  int canvas_ = 0;
  std::optional<CanvasDenoiser> den_;
  // [C, D] self-conditioning input of this step and the next; empty with it off (ablation).
  std::vector<float> soft_, next_soft_;
  bool have_sc_ = false;
  std::vector<RowResult> rows_;  // [C] the last step's rows (sparse SC reads them)
  float last_mean_entropy_ = 0;
  int total_steps_ = 0;
  std::vector<int32_t> raw_, finalized_;  // the finished canvas, as committed / as reported
  std::vector<int32_t> completion_;
  bool stop_found_ = false;
  std::optional<StreamDecoder> decoder_;
  std::optional<StopMatcher> stop_matcher_;
};

}  // namespace dgserve
