// The block-autoregressive generation loop (spec §4.1) over a ModelBackend: prompt prefill,
// per canvas the entropy-bound denoising loop (spec §4.2) with self-conditioning, commit passes
// between canvases, stop tokens and padding. One request at a time; the cluster's denoise worker
// batches canvases with the same pieces.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/denoise/canvas_template.h"
#include "engine/denoise/sampler_params.h"
#include "engine/model/backend.h"
#include "engine/model/config.h"

namespace dgserve {

// Prompt tokens per encoder pass of the CPU backend's prefill (ModelBackend::
// prefill_chunk_tokens gives each backend's; the prefill worker's --chunk_tokens default).
inline constexpr int kPrefillChunkTokens = kCpuPrefillChunkTokens;

// A generation request in token ids. Build one with DefaultRequest() so that every parameter
// left alone takes the checkpoint's generation_config.json value.
struct GenerationRequest {
  std::vector<int32_t> prompt;          // non-empty, ids in [0, V)
  int max_new_tokens = 256;             // > 0; ceil(max_new_tokens / C) canvases at most
  uint64_t seed = 0;                    // keys the counter-based RNG: same seed → same result
  SamplerParams sampler;                // per-request diffusion controls
  std::vector<int32_t> stop_token_ids;  // a committed canvas is cut after the first of these
  int32_t pad_token_id = 0;
  // Infilling: the first canvas (every canvas with template_every_canvas) is clamped by this
  // template (canvas_template.h); null = none. Its length and vocabulary must be the model's.
  std::shared_ptr<const CanvasTemplate> canvas_template;
  bool template_every_canvas = false;
};

// A request whose parameters are the checkpoint's defaults.
GenerationRequest DefaultRequest(const GenerationConfig& defaults);

// What the loop reports after each denoising step.
struct StepEvent {
  int canvas = 0;  // canvas index (0-based)
  int step = 0;    // step index within the canvas (0-based)
  float temperature = 0;
  std::span<const int32_t> argmax;  // [C] the argmax canvas of this step
  int accepted = 0;                 // positions accepted by the entropy bound
  float mean_entropy = 0;           // nats
  bool stop = false;                // the stop rule fired after this step
};

// What the loop reports after each committed canvas.
struct CanvasEvent {
  int canvas = 0;
  std::span<const int32_t> tokens;  // [C] committed (argmax) canvas, padded after a stop token
  int steps = 0;                    // decoder passes spent on it
  bool stopped_early = false;
  bool stop_token = false;  // a stop token ended the generation here
};

struct GenerationObserver {
  std::function<void(const StepEvent&)> on_step;
  std::function<void(const CanvasEvent&)> on_canvas;
};

struct GenerationResult {
  std::vector<int32_t> tokens;      // all committed canvases (whole canvases, as HF returns)
  std::vector<int32_t> completion;  // tokens before the first stop token, at most max_new_tokens
  std::string finish_reason;        // "stop" (a stop token) or "length"
  int prompt_tokens = 0;
  int canvases = 0;
  std::vector<int> steps_per_canvas;
  double prefill_seconds = 0;  // prompt encoder pass
  double denoise_seconds = 0;  // decoder passes + sampling
  double commit_seconds = 0;   // encoder passes over committed canvases
  int64_t decoder_passes = 0;
};

class Generator {
 public:
  // `backend` must outlive the generator.
  explicit Generator(ModelBackend& backend) : backend_(backend) {}

  // INVALID_ARGUMENT, naming the field, for an empty prompt, an id outside [0, V), a
  // max_new_tokens ≤ 0, a prompt + generation longer than max_position_embeddings, any
  // out-of-range sampler parameter, or a canvas template of another canvas length or vocabulary.
  absl::Status Validate(const GenerationRequest& request) const;

  // Runs the request to completion, calling the observer's hooks as it goes.
  absl::StatusOr<GenerationResult> Generate(const GenerationRequest& request,
                                            const GenerationObserver& observer = {});

 private:
  ModelBackend& backend_;
};

}  // namespace dgserve
