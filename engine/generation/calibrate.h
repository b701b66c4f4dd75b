// NVFP4 activation calibration for dgserve-quantize (issue 37): the bf16 model runs the
// generation loop (engine/generation/generator.h) on the CPU backend over calibration prompts —
// the encoder pass of each prompt and the denoising steps of its canvas (plus the commit pass),
// since a diffusion model's decoder sees other activations than its encoder — while a
// LinearInputObserver (engine/model/backend.h) records amax(|x|) of every Linear's input per
// module. QuantizeOptions::input_amax (engine/model/quantize_checkpoint.h) turns the result into
// the static activation scales: ModelOpt input_scale = amax / (6 · 448), compressed-tensors
// input_global_scale = 448 · 6 / amax.
//
// Per module: q/k/v_proj of one attention see one input (one amax, which is also what
// llm-compressor's fused input global scale and ModelOpt's fused-layer export give them), so do
// gate/up_proj of an MLP or expert. An expert's amax is taken over the rows routed to it only;
// an expert no calibration row was routed to takes the largest amax of its layer's experts (for
// each of its projections). The calibration runs in the float32 GEMM input mode: the observed
// inputs are the float32 activations (the bf16 mode would round them to bf16 inside the GEMM,
// which moves an amax by at most 2⁻⁹ relative).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/denoise/canvas_template.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/config.h"
#include "engine/model/gptq.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/tokenizer/tokenizer.h"

namespace dgserve {

// One calibration request: a prompt in token ids (with <bos>) and, optionally, the canvas
// template the served requests will carry (the Sudoku givens).
struct CalibrationPrompt {
  std::vector<int32_t> prompt;
  std::shared_ptr<const CanvasTemplate> canvas_template;  // null: none
};

// Records amax(|x|) per Linear input (see the top of this file). Module names are the decoder
// names of the checkpoint (e.g. "model.decoder.layers.0.self_attn.q_proj",
// "model.decoder.layers.0.experts.3.down_proj", "model.decoder.self_conditioning.up_proj").
class ActivationAmaxObserver final : public LinearInputObserver {
 public:
  explicit ActivationAmaxObserver(const ModelConfig& config);
  void Observe(LinearSite site, int layer, int expert, bool encoder, const float* x, int rows,
               int cols) override;
  // Module name → amax over every row observed (≥ 0). Modules never observed are absent, except
  // experts, which take their layer's largest expert amax (absent when no expert of the layer saw
  // a row). Every site's modules: q/k/v (v_proj also on full layers, whose V is the k projection),
  // o, the dense MLP, the router, the experts (unfused names) and the self-conditioning MLP.
  std::map<std::string, float> ModuleAmax() const;
  // Rows observed by encoder and decoder passes at the q/k/v input (all layers summed).
  int64_t encoder_rows() const { return encoder_rows_; }
  int64_t decoder_rows() const { return decoder_rows_; }
  // Experts (over all layers) that saw no row.
  int experts_without_rows() const;

 private:
  int layers_ = 0, experts_ = 0;
  // Per layer [kQkv .. kRouter] (5 sites); per layer and expert {gate_up, down}; the SC MLP's two.
  // −1: never observed.
  std::vector<float> dense_, expert_;
  float sc_[2] = {-1.0f, -1.0f};
  int64_t encoder_rows_ = 0, decoder_rows_ = 0;
};

// Records the input Hessian Σ x·xᵀ (engine/model/gptq.h) of every Linear module dgserve-quantize
// quantizes by default, for GPTQ: q/k/v_proj share one (one input), so do gate/up_proj of an MLP
// or expert; an expert's over the rows routed to it only. Encoder and decoder passes' rows both
// count (a diffusion model's decoder sees other activations than its encoder). All come from the
// run of the model the observer is given to: CalibrateInputHessians runs the unquantized model
// once; QuantizeW4a16GptqByLayer gives one observer per layer (`layer`) to a run of the model
// whose earlier layers are quantized, as llm-compressor's sequential pipeline does. The router and
// the self-conditioning MLP are not observed (DefaultQuantizeIgnore keeps them in bf16; quantized
// by another --ignore, they are rounded to nearest). Each Hessian is float64 [cols, cols],
// allocated at its module's first row: InputHessianBytes in all.
class InputHessianObserver final : public LinearInputObserver {
 public:
  // `layer` ≥ 0: records that layer's modules only (layer-by-layer GPTQ; the row counts still
  // count every layer's); −1: every layer's.
  explicit InputHessianObserver(const ModelConfig& config, int layer = -1);
  void Observe(LinearSite site, int layer, int expert, bool encoder, const float* x, int rows,
               int cols) override;
  // Module name (decoder names, as ActivationAmaxObserver::ModuleAmax) → its Hessian, shared by
  // the modules of one input; modules that saw no row (experts no row was routed to) are absent.
  // Consumes the observer (each Hessian moves into the result: no second copy).
  std::map<std::string, std::shared_ptr<const InputHessian>> ModuleHessians() &&;
  int64_t encoder_rows() const { return encoder_rows_; }
  int64_t decoder_rows() const { return decoder_rows_; }
  int experts_without_rows() const;  // over all layers (`layer` ≥ 0: that layer's)

 private:
  ModelConfig config_;
  // Per layer [kQkv, kOProj, kMlpGateUp, kMlpDown] and per layer and expert {gate_up, down}: the
  // lower triangle only until ModuleHessians.
  std::vector<InputHessian> dense_, expert_;
  int layer_ = -1;
  int64_t encoder_rows_ = 0, decoder_rows_ = 0;
};

// Bytes of every Hessian InputHessianObserver may hold for `config` (float64); with `layer` ≥ 0,
// of that layer's only.
int64_t InputHessianBytes(const ModelConfig& config, int layer = -1);

// The most bytes QuantizeW4a16GptqByLayer holds for GPTQ at once: over the layers, a layer's
// Hessians plus the factor being made or FactorGptqHessian's working copies (up to three
// [cols, cols] float64 matrices of the layer's widest input, gptq.h).
int64_t LayerGptqBytes(const ModelConfig& config);

struct CalibrationOptions {
  // Denoising steps per canvas at most (SamplerParams::max_denoising_steps: the schedule is
  // spread over them); 0: the checkpoint's generation_config value.
  int max_denoising_steps = 0;
  // New tokens per prompt (canvases = ceil(max_new_tokens / canvas_length)); 0: one canvas.
  int max_new_tokens = 0;
  bool progress = true;  // one line per prompt on stderr
};

// Runs `checkpoint` (bf16: a quantized one is refused with INVALID_ARGUMENT) on the CPU backend
// in the float32 GEMM mode over `prompts` (seed i + 1 for prompt i, the checkpoint's sampler
// defaults) and returns ActivationAmaxObserver::ModuleAmax. INVALID_ARGUMENT for no prompts or a
// prompt the generator refuses (naming its index, 1-based).
absl::StatusOr<std::map<std::string, float>> CalibrateActivationAmax(
    const Checkpoint& checkpoint, std::span<const CalibrationPrompt> prompts,
    const CalibrationOptions& options = {});

// As CalibrateActivationAmax, recording InputHessianObserver::ModuleHessians instead (GPTQ,
// QuantizeOptions::gptq_hessians). RESOURCE_EXHAUSTED, before anything runs, when
// InputHessianBytes exceeds `max_bytes` (> 0): the Hessians of every module are held at once, and
// QuantizeCheckpoint then holds a factor of each beside it (twice InputHessianBytes, plus the
// working copies of the one being factored; QuantizeW4a16GptqByLayer holds one layer's at a
// time, which real-width models need).
absl::StatusOr<std::map<std::string, std::shared_ptr<const InputHessian>>> CalibrateInputHessians(
    const Checkpoint& checkpoint, std::span<const CalibrationPrompt> prompts,
    const CalibrationOptions& options, int64_t max_bytes);

struct LayerGptqOptions {
  int group_size = 128;     // inputs per scale group (QuantizeOptions::group_size); 0: per row
  double dampening = 0.01;  // FactorGptqHessian's, in [0, 1e6]
  // Which modules are quantized (QuantizationConfig::ignore of --format w4a16).
  std::vector<std::string> ignore = DefaultQuantizeIgnore();
  // > 0: RESOURCE_EXHAUSTED before anything runs when LayerGptqBytes exceeds it.
  int64_t max_bytes = 0;
};

// Layer-by-layer (sequential) GPTQ for W4A16: for each layer in turn, runs the calibration
// (as CalibrateInputHessians) on the model whose earlier layers are already quantized,
// records that layer's input Hessians only, and quantizes the layer's modules by GPTQ
// against them (round-to-nearest where a module has none: an expert no row reached). Each
// quantized module's weights in `checkpoint` are replaced by its W4A16 matrix as they are made
// (cpu::QuantMatrix::FromInt4, which the CPU backend runs), so the next layer's calibration sees
// the quantized layers' outputs, as the quantized model will serve them: llm-compressor's
// sequential pipeline, except that here each layer's calibration reruns the whole generation
// loop (the canvases follow the partly quantized model's samples) where llm-compressor replays
// the captured inputs of the layer. Costs one calibration run per layer; holds one layer's
// Hessians at a time (LayerGptqBytes) instead of every layer's. The modules quantized are those
// of the decoder layers that `gptq.ignore` does not name, with the checkpoint's weights as
// loaded (bf16; an F16/F32 checkpoint's are rounded to bf16 first, where QuantizeCheckpoint's
// own GPTQ reads the file's values). The routers (never observed) and the self-conditioning MLP
// (outside the layers), kept in bf16 by the default ignore list, are left to QuantizeCheckpoint
// (rounded to nearest if another list quantizes them; the calibration runs them in bf16).
// Returns the modules (decoder names) for QuantizeOptions::w4a16_modules; the packed modules
// of the whole model are held until then (about half a byte per quantized weight). Errors:
// CalibrateInputHessians' (naming the layer), INVALID_ARGUMENT for a group size < 0, a
// dampening not in [0, 1e6], an ignore entry that is not a regular expression or an ignore
// list that quantizes only one of an expert's gate and up (from the names, before any
// calibration runs: the loader refuses such a checkpoint), and FactorGptqHessian's and
// QuantizeW4a16Gptq's naming the module. The ignore list's other checks against the checkpoint
// (CheckIgnoreList, engine/model/quantize_checkpoint.h, with layer_by_layer: an encoder alias
// unlike its decoder module, nothing left to quantize) are the caller's, before this:
// dgserve-quantize runs them, and QuantizeCheckpoint refuses the result otherwise.
absl::StatusOr<std::map<std::string, std::shared_ptr<const W4a16Packed>>> QuantizeW4a16GptqByLayer(
    Checkpoint& checkpoint, std::span<const CalibrationPrompt> prompts,
    const CalibrationOptions& options, const LayerGptqOptions& gptq);

// Reads a calibration file: JSONL, one object per line with a string "prompt" (blank lines
// skipped), each prompt tokenized as the gateway tokenizes a text prompt (Tokenizer::EncodeText
// with <bos>); the first `limit` prompts only (0: all; the file is read no further). Every prompt
// is checked as it is read, so a bad line is reported before anything is calibrated:
// INVALID_ARGUMENT naming the file and line for a line that is not such an object, an empty
// prompt, or one of more than `max_prompt_tokens` tokens (0: no bound; the caller passes what the
// model's context leaves beside the canvas a calibration request denoises), and for a file with
// no prompt; NOT_FOUND for a file that cannot be read.
absl::StatusOr<std::vector<CalibrationPrompt>> ReadCalibrationPrompts(const std::string& path,
                                                                      const Tokenizer& tokenizer,
                                                                      int max_prompt_tokens = 0,
                                                                      int limit = 0);

}  // namespace dgserve
