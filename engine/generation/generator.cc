#include "engine/generation/generator.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/denoise/canvas_state.h"
#include "engine/denoise/finalize.h"
#include "engine/denoise/rng.h"
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
  const int64_t canvases = (int64_t(r.max_new_tokens) + c.canvas_length - 1) / c.canvas_length;
  const int64_t total = int64_t(r.prompt.size()) + canvases * c.canvas_length;
  if (total > c.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: prompt (", r.prompt.size(), " tokens) + ", canvases, " canvases of ",
        c.canvas_length, " exceed the context limit of ", c.max_position_embeddings, " positions"));
  }
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
  const int C = c.canvas_length, V = c.vocab_size, D = c.hidden_size;
  const int num_canvases = (r.max_new_tokens + C - 1) / C;

  GenerationResult result;
  result.prompt_tokens = r.prompt.size();
  ContiguousKvCache kv(c, int(r.prompt.size()) + num_canvases * C);
  auto t0 = std::chrono::steady_clock::now();
  // Prompt prefill in chunks of kPrefillChunkTokens (the chunking changes no bit of the KV).
  for (size_t pos = 0; pos < r.prompt.size(); pos += kPrefillChunkTokens) {
    const size_t n = std::min<size_t>(kPrefillChunkTokens, r.prompt.size() - pos);
    EncodeInput in{std::span<const int32_t>(r.prompt).subspan(pos, n), &kv};
    DGSERVE_RETURN_IF_ERROR(backend_.Encode({&in, 1}));
  }
  result.prefill_seconds = SecondsSince(t0);

  CounterDrawSource draws(r.seed, V);
  // Self-conditioning input of this step and the next; no vocabulary-sized buffer is needed
  // (the backend's fused step never materialises [C, V] logits). With self-conditioning off
  // (ablation) every step takes the step-0 path: no SC input, and none is computed.
  const bool self_conditioning = r.sampler.self_conditioning;
  std::vector<float> soft, next_soft;
  if (self_conditioning) {
    soft.resize(size_t(C) * D);
    next_soft.resize(size_t(C) * D);
  }
  std::vector<RowResult> rows(C);
  std::vector<int32_t> committed;
  for (int n = 0; n < num_canvases; ++n) {
    if (n > 0) {  // commit pass: encode the previous canvas (spec §4.1 step 3a)
      auto tc = std::chrono::steady_clock::now();
      EncodeInput in{committed, &kv};
      DGSERVE_RETURN_IF_ERROR(backend_.Encode({&in, 1}));
      result.commit_seconds += SecondsSince(tc);
    }
    auto td = std::chrono::steady_clock::now();
    const bool clamped = r.canvas_template && (n == 0 || r.template_every_canvas);
    DGSERVE_ASSIGN_OR_RETURN(
        CanvasDenoiser den,
        clamped ? CanvasDenoiser::CreateWithTemplate(r.sampler, r.canvas_template, n, &draws)
                : CanvasDenoiser::Create(r.sampler, C, V, n, &draws));
    bool have_sc = false;
    while (!den.done()) {
      const bool last = den.step() + 1 == r.sampler.max_denoising_steps;
      DenoiseStepInput in;
      in.canvas = den.canvas();
      in.sc_soft = have_sc ? soft.data() : nullptr;
      in.kv = &kv;
      in.temperature = den.temperature();
      in.uniforms = den.uniforms();
      in.rows = rows.data();
      in.next_soft = (last || !self_conditioning) ? nullptr : next_soft.data();
      in.row_masks = den.row_masks();
      in.sparse_sc = UseSparseSelfConditioning(den.step(), rows);  // rows: the previous step's
      DGSERVE_RETURN_IF_ERROR(backend_.DenoiseStep({&in, 1}));
      DGSERVE_ASSIGN_OR_RETURN(StepOutcome out, den.ApplyStep(rows));
      ++result.decoder_passes;
      if (observer.on_step) {
        StepEvent ev{n,
                     out.step,
                     out.temperature,
                     den.committed(),
                     int(out.accepted.size()),
                     out.mean_entropy,
                     out.stop};
        observer.on_step(ev);
      }
      // This step's tempered probabilities condition the next step (spec §3.5 step 2), unless
      // self-conditioning is off: then the next step's SC input stays zero, as at step 0.
      std::swap(soft, next_soft);
      have_sc = self_conditioning;
    }
    result.denoise_seconds += SecondsSince(td);
    committed.assign(den.committed().begin(), den.committed().end());
    std::vector<int32_t> finalized = committed;
    const bool found = FinalizeCanvas(finalized, r.stop_token_ids, r.pad_token_id);
    result.tokens.insert(result.tokens.end(), finalized.begin(), finalized.end());
    result.steps_per_canvas.push_back(den.step());
    ++result.canvases;
    if (observer.on_canvas) {
      observer.on_canvas(CanvasEvent{n, finalized, den.step(), den.stopped_early(), found});
    }
    if (found) break;
  }
  // The completion: up to (not including) the first stop token, at most max_new_tokens. A stop
  // token past max_new_tokens does not count: the request ended on its length.
  result.finish_reason = "length";
  for (int32_t id : result.tokens) {
    if (int(result.completion.size()) == r.max_new_tokens) break;
    if (std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), id) != r.stop_token_ids.end()) {
      result.finish_reason = "stop";
      break;
    }
    result.completion.push_back(id);
  }
  return result;
}

}  // namespace dgserve
