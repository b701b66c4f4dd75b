#include "engine/generation/sample_run.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/denoise/finalize.h"

namespace dgserve {
namespace {

const char* PhaseName(SampleRun::Phase p) {
  switch (p) {
    case SampleRun::Phase::kStartCanvas:
      return "start-canvas";
    case SampleRun::Phase::kDenoising:
      return "denoising";
    case SampleRun::Phase::kCanvasDone:
      return "canvas-done";
    case SampleRun::Phase::kCommit:
      return "commit";
    case SampleRun::Phase::kFinished:
      return "finished";
  }
  return "?";
}

absl::Status WrongPhase(const char* call, SampleRun::Phase p) {
  return absl::FailedPreconditionError(
      absl::StrCat("SampleRun::", call, " called in phase ", PhaseName(p)));
}

}  // namespace

absl::StatusOr<SampleRun> SampleRun::Create(const ModelConfig& c, SampleSpec spec) {
  if (spec.max_new_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: must be > 0, got ", spec.max_new_tokens));
  }
  if (spec.first_canvas < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_canvas: must be >= 0, got ", spec.first_canvas));
  }
  for (int32_t id : spec.stop_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop_token_ids: ", id, " is outside [0, ", c.vocab_size, ")"));
    }
  }
  if (spec.pad_token_id < 0 || spec.pad_token_id >= c.vocab_size) {
    return absl::InvalidArgumentError("pad_token_id: outside the vocabulary");
  }
  if (spec.canvas_template && (spec.canvas_template->canvas_length() != c.canvas_length ||
                               spec.canvas_template->vocab() != c.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "canvas_template: built for canvas length ", spec.canvas_template->canvas_length(),
        " and vocabulary ", spec.canvas_template->vocab(), ", the model has ", c.canvas_length,
        " and ", c.vocab_size));
  }
  if (absl::Status s = ValidateSamplerParams(spec.sampler); !s.ok()) return s;
  return SampleRun(c, std::move(spec));
}

SampleRun::SampleRun(const ModelConfig& c, SampleSpec spec)
    : spec_(std::move(spec)),
      canvas_length_(c.canvas_length),
      vocab_(c.vocab_size),
      num_canvases_(spec_.first_canvas +
                    (spec_.max_new_tokens + c.canvas_length - 1) / c.canvas_length),
      draws_(std::make_unique<CounterDrawSource>(spec_.seed, c.vocab_size)),
      canvas_(spec_.first_canvas),
      rows_(c.canvas_length) {
  // No vocabulary-sized buffer: the backend's fused step never materialises [C, V] logits.
  if (spec_.sampler.self_conditioning) {
    soft_.resize(size_t(c.canvas_length) * c.hidden_size);
    next_soft_.resize(size_t(c.canvas_length) * c.hidden_size);
  }
  if (spec_.tokenizer != nullptr && !spec_.stop_sequences.empty()) {
    decoder_.emplace(*spec_.tokenizer);
    stop_matcher_.emplace(spec_.stop_sequences);
    // A resume: the completion before first_canvas, as the gateway matched it.
    stop_matcher_->Push(decoder_->Push(spec_.completion_before));
  }
  spec_.tokenizer = nullptr;  // neither is kept
  spec_.completion_before = {};
}

SampleRun::SampleRun(SampleRun&&) noexcept = default;
SampleRun& SampleRun::operator=(SampleRun&&) noexcept = default;
SampleRun::~SampleRun() = default;

absl::Status SampleRun::StartCanvas() {
  if (phase_ != Phase::kStartCanvas) return WrongPhase("StartCanvas", phase_);
  const bool clamped = spec_.canvas_template && (canvas_ == 0 || spec_.template_every_canvas);
  absl::StatusOr<CanvasDenoiser> den =
      clamped
          ? CanvasDenoiser::CreateWithTemplate(spec_.sampler, spec_.canvas_template, canvas_,
                                               draws_.get())
          : CanvasDenoiser::Create(spec_.sampler, canvas_length_, vocab_, canvas_, draws_.get());
  if (!den.ok()) return den.status();
  den_.emplace(*std::move(den));
  have_sc_ = false;  // step 0 of a canvas has no self-conditioning input
  last_mean_entropy_ = 0;
  phase_ = den_->done() ? Phase::kCanvasDone : Phase::kDenoising;
  return absl::OkStatus();
}

absl::StatusOr<DenoiseStepInput> SampleRun::StepInput(const KvCache& kv) {
  if (phase_ != Phase::kDenoising) return WrongPhase("StepInput", phase_);
  const CanvasDenoiser& den = *den_;
  const bool last = den.step() + 1 == spec_.sampler.max_denoising_steps;
  DenoiseStepInput in;
  in.canvas = den.canvas();
  in.sc_soft = have_sc_ ? soft_.data() : nullptr;
  in.kv = &kv;
  in.temperature = den.temperature();
  in.uniforms = den.uniforms();
  in.rows = rows_.data();
  // The last step's soft embedding would condition nothing; with self-conditioning off
  // (ablation) every step takes the step-0 path (no SC input, none computed).
  in.next_soft = (last || !spec_.sampler.self_conditioning) ? nullptr : next_soft_.data();
  in.row_masks = den.row_masks();
  in.sparse_sc = UseSparseSelfConditioning(den.step(), rows_);  // rows_: the previous step's
  return in;
}

absl::StatusOr<StepOutcome> SampleRun::ApplyStep() {
  if (phase_ != Phase::kDenoising) return WrongPhase("ApplyStep", phase_);
  absl::StatusOr<StepOutcome> out = den_->ApplyStep(rows_);
  if (!out.ok()) return out.status();
  ++total_steps_;
  last_mean_entropy_ = out->mean_entropy;
  // This step's tempered probabilities condition the next step (spec §3.5 step 2), unless
  // self-conditioning is off: then the next step's SC input stays zero, as at step 0.
  std::swap(soft_, next_soft_);
  have_sc_ = spec_.sampler.self_conditioning;
  if (den_->done()) phase_ = Phase::kCanvasDone;
  return out;
}

std::span<const int32_t> SampleRun::argmax() const {
  if (!den_) return {};
  return den_->committed();
}

absl::StatusOr<FinishedCanvas> SampleRun::FinishCanvas() {
  if (phase_ != Phase::kCanvasDone) return WrongPhase("FinishCanvas", phase_);
  raw_.assign(den_->committed().begin(), den_->committed().end());
  finalized_ = raw_;
  FinishedCanvas f;
  f.index = canvas_;
  f.steps = den_->step();
  f.stopped_early = den_->stopped_early();
  f.stop_token = FinalizeCanvas(finalized_, spec_.stop_token_ids, spec_.pad_token_id);
  f.mean_entropy = last_mean_entropy_;
  f.tokens = finalized_;
  const size_t before = completion_.size();
  if (!stop_found_) {
    const CompletionCut cut = CutCompletion(finalized_, spec_.stop_token_ids,
                                            int(completion_.size()), spec_.max_new_tokens);
    completion_.insert(completion_.end(), finalized_.begin(), finalized_.begin() + cut.take);
    stop_found_ = cut.stop_token;
  }
  f.completion = std::span<const int32_t>(completion_).subspan(before);
  // A stop sequence in the completion's text ends the sample here, as the gateway ends it: the
  // canvas is not committed and no further step runs.
  if (stop_matcher_ && !f.completion.empty()) {
    f.stop_sequence = stop_matcher_->Push(decoder_->Push(f.completion)).stopped;
    if (f.stop_sequence) stop_found_ = true;
  }
  den_.reset();
  ++canvas_;
  f.last = f.stop_token || f.stop_sequence || canvas_ == num_canvases_;
  phase_ = f.last ? Phase::kFinished : Phase::kCommit;
  return f;
}

std::span<const int32_t> SampleRun::to_commit() const {
  if (phase_ != Phase::kCommit) return {};
  return raw_;
}

absl::Status SampleRun::CommitDone() {
  if (phase_ != Phase::kCommit) return WrongPhase("CommitDone", phase_);
  phase_ = Phase::kStartCanvas;
  return absl::OkStatus();
}

}  // namespace dgserve
