// QuantizeCheckpoint (dgserve-quantize): writes a quantized compressed-tensors or ModelOpt NVFP4
// checkpoint (issue 37; layouts in engine/model/quant_config.h) from a bf16 (or F16/F32)
// DiffusionGemma checkpoint.
//
//   dgserve-quantize --in DIR --out DIR --format fp8
//   dgserve-quantize --in DIR --out DIR --format w4a16 --group_size 128
//   dgserve-quantize --in DIR --out DIR --format nvfp4 [--nvfp4_layout modelopt]
//   dgserve-quantize --in DIR --out DIR --format nvfp4 --nvfp4_layout compressed-tensors
//   dgserve-quantize --in DIR --out DIR --format nvfp4 --nvfp4_layout compressed-tensors
//                    --nvfp4_activations none
//   dgserve-quantize --in DIR --out DIR --format nvfp4 [--nvfp4_layout ...]
//                    --calibration PROMPTS.jsonl | --calibration_sudoku PUZZLES.jsonl
//                    [--calibration_limit N] [--calibration_steps N]
//   dgserve-quantize --in DIR --out DIR --format w4a16 --group_size 32 --gptq
//                    --calibration PROMPTS.jsonl | --calibration_sudoku PUZZLES.jsonl
//                    [--gptq_sequential]   (layer by layer: QuantizeOptions::w4a16_modules)
//
// Every Linear module not in the ignore list is quantized with round-to-nearest (w4a16 also with
// GPTQ against calibrated input Hessians: QuantizeOptions::gptq_hessians, --gptq):
//  * fp8 (compressed-tensors FP8_DYNAMIC, format float-quantized): per output channel
//    s = absmax(row) / 448 (float32; an all-zero row takes s = 1), w_q = e4m3_rne(w / s)
//    (saturating at ±448); `M.weight` F8_E4M3 [out, in], `M.weight_scale` F32 [out, 1].
//  * w4a16 (format pack-quantized, int4 symmetric per group of G inputs): compressed-tensors'
//    calculate_qparams, s = absmax(group) / 7.5 (bit range 15 over 2) rounded to bf16 (the
//    model's dtype; an all-zero group takes s = 1), q = clamp(rne(w / s), −8, 7);
//    `M.weight_packed` I32 [out, ceil(in/8)] (pack_to_int32 order, q + 8),
//    `M.weight_scale` BF16 [out, ceil(in/G)], `M.weight_shape` I64 [2].
//  * nvfp4 (ModelOpt NVFP4, quant_method "modelopt", quant_algo "NVFP4"; also written to
//    hf_quant_config.json as ModelOpt's export does), as ModelOpt's NVFP4QTensor.quantize
//    (modelopt/torch/quantization/qtensor/nvfp4_tensor.py), float32 steps: per module
//    weight_scale_2 g = amax(W) / (6 · 448) (an all-zero module: 1); per 16-input block
//    s = amax_b / (6 · g) (0 → 1), clamped to [2⁻⁹, 448], e4m3_rne; codes
//    e2m1_rne(w / (e4m3(s) · g)) (saturating at ±6), packed two per byte (element 2i in the low
//    nibble); `M.weight` U8 [out, in/2], `M.weight_scale` F8_E4M3 [out, in/16],
//    `M.weight_scale_2` F32 [], `M.input_scale` F32 []. input_scale is data-free by default: 1/6,
//    the value ModelOpt's calibration (amax(x) / (6 · 448)) gives for amax 448 — block scales are
//    normal e4m3 for block absmax in [2⁻⁶, 448]. With activation calibration
//    (QuantizeOptions::input_amax, --calibration: engine/generation/calibrate.h) it is ModelOpt's
//    amax(x) / (6 · 448), float32, amax(|x|) of the module's inputs over the calibration
//    prompts' encoder passes and denoising steps of the bf16 model. The ignore list
//    is written as fnmatch patterns ("re:.*X.*" becomes "*X*"); modules whose input width is not
//    a multiple of 16 stay in their dtype and are added to it (experts: one pattern per tensor).
//  * nvfp4 with Nvfp4Layout::kCompressedTensors (compressed-tensors "nvfp4-pack-quantized", as
//    llm-compressor's NVFP4 scheme writes it; read by vLLM's CompressedTensorsW4A4Fp4), with
//    compressed-tensors' arithmetic (generate_gparam and calculate_qparams in
//    src/compressed_tensors/quantization/utils/helpers.py, _quantize in
//    .../quantization/lifecycle/forward.py), float32 steps: a global scale — a divisor —
//    gs = 448 · 6 / amax, amax taken over the module and, as llm-compressor's
//    update_fused_layer_weight_global_scales (src/llmcompressor/modifiers/utils/helpers.py)
//    does for vLLM's fused layers, over its fused siblings (q/k/v_proj of one attention, gate/up
//    of one MLP or expert: the smallest gs of the set); an all-zero set: gs = 1. Per 16-input
//    block s = gs · (amax_b / 6), clamped to ≤ 448, e4m3_rne; a code that is 0 (amax_b 0 or an
//    underflow) becomes 0.125 (calculate_qparams' replacement). Codes
//    e2m1_rne(clamp(w / (e4m3(s) / gs), ±6)), packed as ModelOpt's. `M.weight_packed` U8
//    [out, in/2], `M.weight_scale` F8_E4M3 [out, in/16], `M.weight_global_scale` F32 [1],
//    `M.input_global_scale` F32 [1] = 6 (data-free: 448 · 6 / 448, the reciprocal of the
//    ModelOpt layout's input_scale 1/6); calibrated: 448 · 6 / amax(x), float32 (fused siblings
//    — q/k/v, gate/up — see one input, so their amax and input scales are equal, which is what
//    llm-compressor's and vLLM's shared input global scale of a fused set requires). The same
//    mathematics as ModelOpt's up to float32 rounding (gs · x vs x / g, 1/gs vs g), the zero-scale
//    rule (ModelOpt: 1) and the smallest scales (ModelOpt clamps to 2⁻⁹) — and the fused global
//    scale, which ModelOpt's layout here does not share. Not checked against a Python run: given
//    bf16 weights, torch evaluates 448 · 6 / amax and amax_b / 6 in bf16 (a Python float and a bf16
//    tensor), so llm-compressor's scales can differ from these float32 ones by that rounding. The
//    ignore list is written as it is given (compressed-tensors syntax); modules whose input width
//    is not a multiple of 16 are added by name (experts: one "re:BASE\.[0-9]+\.PROJ$" per tensor).
//  * nvfp4 weight-only (Nvfp4Activations::kNone; compressed-tensors layout only): llm-compressor's
//    NVFP4A16 preset (compressed_tensors/quantization/quant_scheme.py: the NVFP4 weights args and
//    no input_activations), run by vLLM as CompressedTensorsW4A16Fp4. The same weight tensors
//    as above, computed the same way, no `M.input_global_scale`, and config_groups'
//    input_activations null. ModelOpt's layout is refused: ModelOpt's exporter names a
//    W4A16_NVFP4 algorithm in recent versions (modelopt/torch/export/model_config.py) but its
//    export layout is not checked here, so dgserve-quantize does not write one.
// Activation calibration, input_amax (both NVFP4 layouts; any other format or NVFP4A16 is
// refused: no static activation scale; w4a16 takes calibration as GPTQ's Hessians instead,
// gptq_hessians): a module whose amax is 0 gets the data-free value; a quantized module with
// no amax is refused. Measured on the Sudoku model (engine/model/QUANTIZED.md): with per-16
// dynamic e4m3 block scales the static scale only moves where blocks saturate (448) or go
// subnormal (2⁻⁶), so calibration changes little there.
// The fused experts (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]) are
// written unfused, one Linear per expert and projection (`experts.{e}.gate_proj` etc.), the
// standard compressed-tensors MoE layout. Everything else is copied as it is. config.json gets
// the quantization_config; the other files of --in (generation config, tokenizer) are copied,
// except the model card README.md, which gets a note first naming the format and the source
// checkpoint's directory name (after its YAML front matter, if any): the rest of the card
// describes the source weights.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/config.h"
#include "engine/model/gptq.h"
#include "engine/model/quant_config.h"
#include "engine/model/safetensors.h"

namespace dgserve {

// The default ignore list: the LM head and the embedding, the MoE router, the norms, and the
// self-conditioning MLP (0.07 % of the real model's weights, read by every denoising step of
// every canvas row: its error would reach every step's input for a negligible saving).
std::vector<std::string> DefaultQuantizeIgnore();

// Which checkpoint layout --format nvfp4 writes (--nvfp4_layout: the quant_method names).
enum class Nvfp4Layout { kModelOpt, kCompressedTensors };

// What --format nvfp4 does with the activations (--nvfp4_activations): kNvfp4 quantizes them at
// run time (W4A4, the NVFP4 preset), kNone leaves them unquantized (weight-only NVFP4A16).
enum class Nvfp4Activations { kNvfp4, kNone };

struct QuantizeOptions {
  WeightFormat format = WeightFormat::kFp8;
  // nvfp4 only (another format with kCompressedTensors is refused).
  Nvfp4Layout nvfp4_layout = Nvfp4Layout::kModelOpt;
  // nvfp4 only; kNone needs Nvfp4Layout::kCompressedTensors (refused otherwise).
  Nvfp4Activations nvfp4_activations = Nvfp4Activations::kNvfp4;
  // w4a16: inputs per scale group; 0: one group per row (channel). nvfp4: 16 or the default
  // (anything else is refused: the format's blocks are 16).
  int group_size = 128;
  std::vector<std::string> ignore = DefaultQuantizeIgnore();
  int64_t max_shard_bytes = kDefaultMaxShardBytes;
  bool progress = true;  // a progress line on stderr (every 2 s and at the end)
  // nvfp4 W4A4 only (another format or NVFP4A16 is refused): the activation calibration's
  // amax(|x|) per module (engine/generation/calibrate.h: decoder module names; an encoder alias
  // takes its decoder module's). Empty (default): the data-free input scale. Each quantized
  // module must have one (INVALID_ARGUMENT naming it otherwise); amax 0 gives the data-free
  // value.
  std::map<std::string, float> input_amax;
  // w4a16 only (another format is refused): the calibration's input Hessian per module
  // (engine/generation/calibrate.h: decoder module names; an encoder alias takes its decoder
  // module's), each module that has one quantized by GPTQ (engine/model/gptq.h) with dampening
  // gptq_dampening; a module without one (an expert no calibration row reached, a module the
  // calibration does not observe) by round-to-nearest. Empty (default): round-to-nearest. The
  // Hessian of every quantized module is factored (FactorGptqHessian, once per Hessian) before
  // anything is written: a null one, a width that is not the module's or a refused factor fails
  // the call naming a module, with no --out written.
  std::map<std::string, std::shared_ptr<const InputHessian>> gptq_hessians;
  double gptq_dampening = 0.01;
  // w4a16 only, not with gptq_hessians: modules already quantized (decoder module names; an
  // encoder alias takes its decoder module's), written as given — layer-by-layer GPTQ
  // (QuantizeW4a16GptqByLayer, engine/generation/calibrate.h) makes them. Each must have the
  // module's shape and the format's group (else INVALID_ARGUMENT naming it, nothing written); a
  // quantized module not given is rounded to nearest. Counted in QuantizeSummary::gptq or
  // rtn_without_hessian by W4a16Packed::gptq.
  std::map<std::string, std::shared_ptr<const W4a16Packed>> w4a16_modules;
};

struct QuantizeSummary {
  QuantizationConfig quant;  // as written into config.json
  int quantized = 0, kept = 0;  // Linear modules quantized / kept in their dtype
  // With QuantizeOptions::gptq_hessians (or w4a16_modules): w4a16 modules quantized by GPTQ, and by
  // round-to-nearest for want of a Hessian (experts no calibration row reached; routers and the
  // self-conditioning MLP, which the calibration does not observe, if --ignore lets them be
  // quantized).
  int gptq = 0, rtn_without_hessian = 0;
  // Entries of QuantizeOptions::ignore that name no module of the checkpoint (a tensor's name
  // without its last component, or a Linear module the quantizer visits, experts one by one):
  // most likely a typo, whose modules are then quantized.
  std::vector<std::string> unmatched_ignore;
  double seconds = 0;
};

// The paths' own checks, before anything is read: both given, `out` is not `in` (the same
// directory by any path), `out` is not inside `in` (by any path: relative, "..", symlinks; each
// existing directory above out's resolved path compared with `in` as a file), and `out` can be
// written: it, or else its nearest existing parent (the missing directories are created), is a
// directory writable by this process (access(2) W_OK and X_OK). INVALID_ARGUMENT naming --out
// otherwise. QuantizeCheckpoint runs it first.
// `in` inside `out` (--in m/bf16 --out m) is allowed: the writer touches only files directly in
// `out` (config.json, README.md and the other copied files, the safetensors shards and index it
// replaces, hf_quant_config.json) and never recurses into its subdirectories, so `in` is left
// as it was.
absl::Status CheckQuantizePaths(const std::string& in, const std::string& out);

// The decoder name of a module: the encoder alias `model.encoder.language_model.X` of a backbone
// module is `model.decoder.X` (it shares its weights; calibration names are the decoder's).
std::string QuantizeDecoderModuleName(const std::string& module);

// The Linear modules QuantizeCheckpoint visits in a checkpoint of `config` whose tensors (names
// and shapes only: no data is read) are `tensors`: each 2-D Linear or router weight's module
// (an encoder alias as itself), and the fused experts unfused, `BASE.{e}.gate_proj`,
// `BASE.{e}.up_proj` and `BASE.{e}.down_proj`.
std::vector<std::string> QuantizableModules(const ModelConfig& config,
                                            std::span<const TensorView> tensors);

// Whether QuantizeCheckpoint writes `options.ignore` as ModelOpt exclude_modules (--format nvfp4
// in the ModelOpt layout): fnmatch patterns, which the loader matches by fnmatch or as a module
// prefix followed by '.' (so "model" and "*" keep every module, and "Linear" none).
bool WritesModelOptIgnore(const QuantizeOptions& options);
// The ignore list QuantizeCheckpoint writes for `options`: with WritesModelOptIgnore, each
// entry's ModelOptIgnoreGlob (its error for an entry that has none); otherwise the entries as
// they are.
absl::StatusOr<std::vector<std::string>> WrittenIgnoreList(const QuantizeOptions& options);

// The ignore list's checks against the checkpoint's modules (QuantizableModules: the headers
// only), run by dgserve-quantize before any calibration and by QuantizeCheckpoint. The list is
// `options.ignore` matched as the loader will match the written one (WrittenIgnoreList, by
// options.format and options.nvfp4_layout: ModelOpt's fnmatch patterns, else compressed-tensors'
// names and regexes). INVALID_ARGUMENT when an entry is not a regular expression or has no
// ModelOpt pattern (ModelOptIgnoreGlob), or the list quantizes one of an expert's gate_proj and
// up_proj only (the loader runs them as one matrix), leaves no module to quantize (naming the
// list), or, with `layer_by_layer` (layer-by-layer GPTQ, which quantizes by decoder name),
// treats an encoder alias unlike its decoder module. `amax_calibration_steps` > 0: an
// activation (amax) calibration of at most that many denoising steps per canvas follows
// (engine/generation/calibrate.h); with one step and --format nvfp4 W4A4 (nvfp4_activations
// kNvfp4, whose static input scales need every quantized module's amax), also INVALID_ARGUMENT
// when the list quantizes the self-conditioning MLP: it runs from a canvas's second step on
// only (its input is the previous step's probabilities), so such a calibration never observes
// it and QuantizeCheckpoint would refuse the result after the calibration.
absl::Status CheckIgnoreList(const ModelConfig& config, std::span<const TensorView> tensors,
                             const QuantizeOptions& options, bool layer_by_layer,
                             int amax_calibration_steps = 0);
// The same from checkpoint directory `in`: its config.json and safetensors headers (errors as
// ParseModelConfig and SafetensorsReader::OpenDir).
absl::Status CheckIgnoreList(const std::string& in, const QuantizeOptions& options,
                             bool layer_by_layer, int amax_calibration_steps = 0);

// The entries of `options.ignore` that name no module of the checkpoint of `config` whose
// tensors are `tensors` (headers only): no tensor's name without its last component and no
// Linear module QuantizableModules lists (experts one by one) matches the entry as written
// (WrittenIgnoreList: ModelOpt's fnmatch patterns, else names and regexes), in the list's order.
// QuantizeCheckpoint reports these as QuantizeSummary::unmatched_ignore; dgserve-quantize warns
// of them before calibrating. Errors as WrittenIgnoreList.
absl::StatusOr<std::vector<std::string>> UnmatchedIgnoreEntries(const ModelConfig& config,
                                                                std::span<const TensorView> tensors,
                                                                const QuantizeOptions& options);
// The same from checkpoint directory `in`: its config.json and safetensors headers (errors as
// ParseModelConfig and SafetensorsReader::OpenDir).
absl::StatusOr<std::vector<std::string>> UnmatchedIgnoreEntries(const std::string& in,
                                                                const QuantizeOptions& options);

// --in's own check (dgserve-quantize, before anything else reads it): a directory holding
// config.json. INVALID_ARGUMENT naming --in otherwise (a file, such as a checkpoint's
// model.safetensors, is told to give its directory).
absl::Status CheckQuantizeInput(const std::string& in);

// A compressed-tensors ignore entry as the ModelOpt NVFP4 layout's exclude pattern (fnmatch):
// "re:.*X.*" → "*X*", "re:X" → "X*" (compressed-tensors matches from the start), a plain name
// as it is; any other regular expression is INVALID_ARGUMENT naming the entry (dgserve-quantize
// checks every entry before calibrating).
absl::StatusOr<std::string> ModelOptIgnoreGlob(const std::string& entry);

// Reads the bf16 checkpoint `in` and writes the quantized one to `out` (created if needed).
// INVALID_ARGUMENT for a checkpoint that is already quantized or holds non-finite weights, a bad
// format or group size, an NVFP4 layout or weight-only NVFP4 with another format, weight-only
// NVFP4 in ModelOpt's layout, an ignore entry the ModelOpt nvfp4 layout cannot write as a
// pattern, an ignore list CheckIgnoreList refuses (layer_by_layer when w4a16_modules are given)
// before anything is quantized; I/O errors name the path.
absl::StatusOr<QuantizeSummary> QuantizeCheckpoint(const std::string& in, const std::string& out,
                                                   const QuantizeOptions& options);

}  // namespace dgserve
