#include "engine/generation/generator.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/generation/sample_run.h"
#include "engine/model/kv_cache.h"

namespace dgserve {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

GenerationRequest DefaultRequest(const GenerationConfig& g) {
  GenerationRequest r;
  r.max_new_tokens = g.max_new_tokens;
  r.sampler.max_denoising_steps = g.max_denoising_steps;
  r.sampler.t_min = g.t_min;
  r.sampler.t_max = g.t_max;
  r.sampler.entropy_bound = g.entropy_bound;
  r.sampler.stability_threshold = g.stability_threshold;
  r.sampler.confidence_threshold = g.confidence_threshold;
  r.stop_token_ids = g.stop_token_ids;
  r.pad_token_id = g.pad_token_id;
  return r;
}

absl::Status Generator::Validate(const GenerationRequest& r) const {
  const ModelConfig& c = backend_.config();
  if (r.prompt.empty()) return absl::InvalidArgumentError("prompt: must not be empty");
  for (int32_t id : r.prompt) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt: token id ", id, " is outside [0, ", c.vocab_size, ")"));
    }
  }
  if (r.max_new_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: must be > 0, got ", r.max_new_tokens));
  }
  DGSERVE_RETURN_IF_ERROR(CheckContextFits(int64_t(r.prompt.size()), r.max_new_tokens, c));
  for (int32_t id : r.stop_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop_token_ids: ", id, " is outside [0, ", c.vocab_size, ")"));
    }
  }
  if (r.pad_token_id < 0 || r.pad_token_id >= c.vocab_size) {
    return absl::InvalidArgumentError("pad_token_id: outside the vocabulary");
  }
  if (r.canvas_template && (r.canvas_template->canvas_length() != c.canvas_length ||
                            r.canvas_template->vocab() != c.vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "canvas_template: built for canvas length ", r.canvas_template->canvas_length(),
        " and vocabulary ", r.canvas_template->vocab(), ", the model has ", c.canvas_length,
        " and ", c.vocab_size));
  }
  return ValidateSamplerParams(r.sampler);
}

absl::StatusOr<GenerationResult> Generator::Generate(const GenerationRequest& r,
                                                     const GenerationObserver& observer) {
  DGSERVE_RETURN_IF_ERROR(Validate(r));
  const ModelConfig& c = backend_.config();
  const int C = c.canvas_length;
  const int num_canvases = (r.max_new_tokens + C - 1) / C;
  SampleSpec spec;
  spec.sampler = r.sampler;
  spec.seed = r.seed;
  spec.max_new_tokens = r.max_new_tokens;
  spec.stop_token_ids = r.stop_token_ids;
  spec.pad_token_id = r.pad_token_id;
  spec.canvas_template = r.canvas_template;
  spec.template_every_canvas = r.template_every_canvas;
  DGSERVE_ASSIGN_OR_RETURN(SampleRun run, SampleRun::Create(c, std::move(spec)));

  GenerationResult result;
  result.prompt_tokens = r.prompt.size();
  ContiguousKvCache kv(c, int(r.prompt.size()) + num_canvases * C);
  auto t0 = std::chrono::steady_clock::now();
  // Prompt prefill in the backend's chunks (on the CPU the chunking changes no bit of the KV).
  const size_t chunk = size_t(std::max(1, backend_.prefill_chunk_tokens()));
  for (size_t pos = 0; pos < r.prompt.size(); pos += chunk) {
    const size_t n = std::min(chunk, r.prompt.size() - pos);
    EncodeInput in{std::span<const int32_t>(r.prompt).subspan(pos, n), &kv};
    DGSERVE_RETURN_IF_ERROR(backend_.Encode({&in, 1}));
  }
  result.prefill_seconds = SecondsSince(t0);

  while (run.phase() != SampleRun::Phase::kFinished) {
    if (run.phase() == SampleRun::Phase::kCommit) {  // spec §4.1 step 3a
      auto tc = std::chrono::steady_clock::now();
      EncodeInput in{run.to_commit(), &kv};
      DGSERVE_RETURN_IF_ERROR(backend_.Encode({&in, 1}));
      DGSERVE_RETURN_IF_ERROR(run.CommitDone());
      result.commit_seconds += SecondsSince(tc);
    }
    auto td = std::chrono::steady_clock::now();
    DGSERVE_RETURN_IF_ERROR(run.StartCanvas());
    while (run.phase() == SampleRun::Phase::kDenoising) {
      DGSERVE_ASSIGN_OR_RETURN(DenoiseStepInput in, run.StepInput(kv));
      DGSERVE_RETURN_IF_ERROR(backend_.DenoiseStep({&in, 1}));
      DGSERVE_ASSIGN_OR_RETURN(StepOutcome out, run.ApplyStep());
      ++result.decoder_passes;
      if (observer.on_step) {
        observer.on_step(StepEvent{run.canvas(), out.step, out.temperature, run.argmax(),
                                   int(out.accepted.size()), out.mean_entropy, out.stop});
      }
    }
    result.denoise_seconds += SecondsSince(td);
    DGSERVE_ASSIGN_OR_RETURN(FinishedCanvas f, run.FinishCanvas());
    result.tokens.insert(result.tokens.end(), f.tokens.begin(), f.tokens.end());
    result.steps_per_canvas.push_back(f.steps);
    ++result.canvases;
    if (observer.on_canvas) {
      observer.on_canvas(CanvasEvent{f.index, f.tokens, f.steps, f.stopped_early, f.stop_token});
    }
  }
  // The completion: up to (not including) the first stop token, at most max_new_tokens
  // (CutCompletion). A stop token past max_new_tokens does not count: it ended on its length.
  result.completion = run.completion();
  result.finish_reason = std::string(run.finish_reason());
  return result;
}

}  // namespace dgserve
