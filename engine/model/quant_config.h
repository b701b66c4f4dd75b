// The `quantization_config` of a quantized DiffusionGemma checkpoint (issue 37), as
// compressed-tensors writes it into config.json (compressed-tensors documentation, "Quantization
// config" / QuantizationConfig, QuantizationScheme and QuantizationArgs in
// compressed_tensors/quantization/quant_{config,scheme,args}.py; vLLM's reader:
// vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py):
//
//   "quantization_config": {
//     "quant_method": "compressed-tensors",
//     "format": "float-quantized" | "pack-quantized",
//     "quantization_status": "compressed",
//     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {...},
//                                   "input_activations": {...} | null}},
//     "ignore": ["lm_head", "re:.*router.*", ...],
//     "kv_cache_scheme": null }
//
// Supported schemes (anything else is an error naming the field):
//  * FP8 ("FP8_DYNAMIC", format float-quantized): weights {num_bits 8, type float, symmetric,
//    strategy channel, dynamic false}; input_activations {num_bits 8, type float, symmetric,
//    strategy token, dynamic true}. Tensors of a quantized Linear M: `M.weight` F8_E4M3
//    [out, in], `M.weight_scale` BF16/F16/F32 [out, 1].
//  * W4A16 (format pack-quantized): weights {num_bits 4, type int, symmetric, strategy group
//    with group_size G (or channel: one group per row), dynamic false, actorder null}; no
//    input_activations. Tensors: `M.weight_packed` I32 [out, ceil(in/8)] (eight 4-bit values per
//    int32 along the input dimension, value 8j+i in bits 4i..4i+3, stored as q + 8: compressed-
//    tensors' pack_to_int32), `M.weight_scale` BF16/F16/F32 [out, ceil(in/G)], `M.weight_shape`
//    I32/I64 [2] = [out, in].
//
// Which modules are quantized: those matched by a group's `targets` and not by `ignore`. A
// target or ignore entry is a module class ("Linear": every nn.Linear — the projections, the
// dense and self-conditioning MLPs, the router, the unfused experts) or a module name, exactly or
// as "re:REGEX" matched from the start of the name (Python's re.match, as compressed-tensors
// does). Module names are the tensor names without ".weight" (e.g.
// "model.decoder.layers.0.self_attn.q_proj"). The embedding (an nn.Embedding) and the tied LM
// head are never quantized.
//
// ModelOpt NVFP4 (NVIDIA TensorRT Model Optimizer's unified HF export, modelopt/torch/export/
// unified_export_hf.py; read as vLLM's ModelOptNvFp4Config.from_config in
// vllm/model_executor/layers/quantization/modelopt.py): config.json's
//
//   "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
//                           "group_size": 16, "kv_cache_quant_algo": null,
//                           "exclude_modules": ["lm_head", "*router*", ...]}
//
// (the exclude list may also be called "ignore"; the fields may sit in a nested "quantization"
// object), or, with no quantization_config in config.json, the checkpoint's hf_quant_config.json
// {"producer": {...}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
// "kv_cache_quant_algo": null, "exclude_modules": [...]}}. Every Linear module not excluded is
// quantized; exclude entries are fnmatch patterns ('*', '?') matched against the whole module
// name, or a module's ancestor name. Tensors of a quantized Linear M (ModelOpt's
// NVFP4QTensor, modelopt/torch/quantization/qtensor/nvfp4_tensor.py):
//    `M.weight` U8 [out, in/2] — two e2m1 codes per byte along the input dimension, element 2i in
//        the low nibble and 2i+1 in the high nibble (`(q[..., 1::2] << 4) | q[..., 0::2]`);
//    `M.weight_scale` F8_E4M3 [out, in/16] — one scale per 16 inputs;
//    `M.weight_scale_2` F32 [] or [1] — the per-tensor scale, amax(W) / (6 · 448);
//    `M.input_scale` F32 [] or [1] — the static activation scale, amax(x) / (6 · 448);
// W = e2m1(q) · weight_scale · weight_scale_2; activations are quantized to NVFP4 at run time
// (W4A4; engine/cpu/gemm_quant.h). `in` must be a multiple of 16. Only quant_algo "NVFP4"
// with group_size 16 and no KV-cache quantization is loaded.
//
// compressed-tensors NVFP4 (format "nvfp4-pack-quantized", as llm-compressor's NVFP4 scheme and
// the RedHatAI/...-NVFP4 checkpoints write it). Documents read: compressed-tensors'
// NVFP4PackedCompressor, pack_fp4_to_uint8 / unpack_fp4_from_uint8 in
// src/compressed_tensors/compressors/quantized_compressors/fp4_quantized.py; _quantize /
// _dequantize in src/compressed_tensors/quantization/lifecycle/forward.py (a global scale
// divides the local one: scale / global_scale); vLLM's CompressedTensorsW4A4Fp4 in
// vllm/model_executor/layers/quantization/compressed_tensors/schemes/
// compressed_tensors_w4a4_nvfp4.py ("CT stores [global scales] as divisors, i.e. 1/scale") and
// CompressedTensorsConfig._is_fp4a4_nvfp4 in .../compressed_tensors/compressed_tensors.py.
//   config_groups.G.weights {num_bits 4, type float, symmetric, strategy tensor_group,
//     group_size 16, dynamic false}; input_activations {num_bits 4, type float, symmetric,
//     strategy tensor_group, group_size 16, dynamic "local"} (dynamic per-16 block scales under a
//     static per-tensor global scale: W4A4), or input_activations null: NVFP4A16, weight-only
//     (llm-compressor's NVFP4A16 preset, compressed_tensors/quantization/quant_scheme.py: the
//     same weights args, no activation scheme; vLLM's CompressedTensorsConfig._is_fp4a16_nvfp4
//     and CompressedTensorsW4A16Fp4, schemes/compressed_tensors_w4a16_nvfp4.py, which registers
//     weight_packed, weight_scale and weight_global_scale only). Every group must use the same
//     activation scheme. `ignore` and `targets` as for the other compressed-tensors formats.
// Tensors of a quantized Linear M:
//    `M.weight_packed` U8 [out, in/2] — the same nibble order as ModelOpt: element 2i in the low
//        nibble, 2i+1 in the high (pack_fp4_to_uint8: `indices[:, 0] | (indices[:, 1] << 4)`),
//        codes sign bit 3, magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6};
//    `M.weight_scale` F8_E4M3 [out, in/16];
//    `M.weight_global_scale` F32 [1] (or []) — a divisor: W = e2m1(q) · weight_scale /
//        weight_global_scale, so ModelOpt's weight_scale_2 = 1 / weight_global_scale;
//    `M.input_global_scale` F32 [1] (or []) — the activations' global scale, also a divisor:
//        ModelOpt's input_scale = 1 / input_global_scale. W4A4 only: NVFP4A16 checkpoints have
//        none (one present is refused as an unexpected tensor).
// Mapped onto the ModelOpt in-memory form as vLLM does: weight_scale_2 = float32(1 / wgs),
// input_scale = float32(1 / igs), alpha = input_scale · weight_scale_2, and the activation
// quantization's g = igs itself (vLLM's input_global_scale_inv), not 1 / float32(1 / igs).
// NVFP4A16: weight_scale_2 = float32(1 / wgs) as vLLM's CompressedTensorsW4A16Fp4 computes it,
// alpha = weight_scale_2, activations unquantized (cpu::QuantMatrix::FromNvfp4WeightOnly).
//
// The MoE experts: the bf16 checkpoint holds them fused (`experts.gate_up_proj` [E, 2F, D],
// `experts.down_proj` [E, D, F]), which are parameters, not Linear modules, so quantizers skip
// them. A quantized checkpoint carries them as the standard compressed-tensors MoE layout does,
// one Linear per expert and projection: `experts.{e}.gate_proj` [F, D], `experts.{e}.up_proj`
// [F, D], `experts.{e}.down_proj` [D, F] (the layout of the published Gemma 4 26B-A4B
// compressed-tensors checkpoints, e.g. the FP8-Dynamic ones made with llm-compressor's
// model_free_ptq) — so per-channel scales are per (expert, output row). The loader accepts either
// layout; the fused one only unquantized.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dgserve {

enum class WeightFormat { kBf16, kFp8, kW4A16, kNvfp4 };

// "bf16", "fp8", "w4a16", "nvfp4" (the names of engine_bench's format= and dgserve-quantize
// --format).
const char* WeightFormatName(WeightFormat f);

struct QuantizationConfig;
// The checkpoint's format as engine_bench's format= and dgserve-quantize's summary name it:
// WeightFormatName(q.format), except "nvfp4a16" for weight-only NVFP4.
const char* QuantizationName(const QuantizationConfig& q);

struct QuantizationConfig {
  WeightFormat format = WeightFormat::kBf16;  // kBf16: no quantization_config
  int group_size = 0;  // W4A16: G (0 until parsed; "channel" strategy: the row length, see GroupFor)
  bool channel_groups = false;  // W4A16 strategy "channel": one group per row
  std::vector<std::string> targets;
  std::vector<std::string> ignore;
  bool glob_ignore = false;  // ModelOpt: ignore entries are fnmatch patterns (exclude_modules)
  // kNvfp4 from compressed-tensors "nvfp4-pack-quantized": its tensor names (weight_packed,
  // weight_global_scale, input_global_scale) and reciprocal global scales; else ModelOpt's.
  bool nvfp4_compressed_tensors = false;
  // kNvfp4 from compressed-tensors with input_activations null (NVFP4A16): weights NVFP4,
  // activations unquantized; no input_global_scale tensors.
  bool nvfp4_weight_only = false;

  bool quantized() const { return format != WeightFormat::kBf16; }
  // True when the Linear module `module` (name without ".weight") is quantized.
  bool Quantizes(const std::string& module) const;
  // The W4A16 group size for a row of `in` elements.
  int GroupFor(int in) const { return channel_groups ? in : group_size; }
};

// The largest W4A16 group size a quantization_config may give (inputs per scale group).
inline constexpr int kMaxW4a16GroupSize = 1 << 20;

// OK when every "re:" entry of `patterns` (an ignore or targets list) is a regular expression
// std::regex compiles; else INVALID_ARGUMENT naming `what` (e.g. "--ignore") and the entry.
absl::Status CheckModulePatterns(const std::vector<std::string>& patterns, const std::string& what);

// Parses the root object's "quantization_config" of config.json text (absent: bf16). `source`
// names the file. INVALID_ARGUMENT naming the field for malformed JSON, an unsupported
// quant_method or format, a scheme this build does not run, or bad targets / ignore entries.
absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(const std::string& config_json,
                                                           const std::string& source);

// Parses ModelOpt's hf_quant_config.json text (see above; `source` names the file): NVFP4, or
// INVALID_ARGUMENT naming the field ("quantization.quant_algo" etc.).
absl::StatusOr<QuantizationConfig> ParseHfQuantConfig(const std::string& text,
                                                      const std::string& source);

// The "quantization_config" object dgserve-quantize writes for `q` (JSON text).
std::string QuantizationConfigJson(const QuantizationConfig& q);

// NVFP4: the hf_quant_config.json dgserve-quantize writes next to config.json (JSON text).
std::string HfQuantConfigJson(const QuantizationConfig& q);

// Whether a compressed-tensors ignore entry (a module name, or "re:REGEX" matched from the
// name's start) names `module` ("Linear", a target class, names none here).
bool IgnoreEntryMatches(const std::string& entry, const std::string& module);

}  // namespace dgserve
