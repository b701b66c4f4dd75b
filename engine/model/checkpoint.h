// Loading a DiffusionGemma HF checkpoint directory into ModelWeights (spec §2): matrices in bf16
// packed for the CPU GEMM, norms and scalars in float32.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "engine/model/config.h"
#include "engine/model/quant_config.h"
#include "engine/model/safetensors.h"
#include "engine/model/weights.h"

namespace dgserve {

// A loaded checkpoint. Owns only vectors and strings (no mapping), so moving it is cheap.
struct Checkpoint {
  ModelConfig config;
  GenerationConfig generation;
  ModelWeights weights;
  std::string dir;
  QuantizationConfig quant;  // issue 37: config.json's quantization_config (bf16 when absent)
};

// Loads `dir`: config.json (required), generation_config.json (absent → defaults), and the weights
// from model.safetensors or model.safetensors.index.json + shards: matrices as bf16 (BF16 tensors
// bit for bit; F16/F32 rounded to nearest even) packed for the GEMM, vectors as float32.
// Name resolution: backbone tensors under `model.decoder.` (preferred) or
// `model.encoder.language_model.` (fallback; the encoder layer_scalar is always
// `model.encoder.language_model.layers.i.layer_scalar`); vision tensors are skipped; a tied
// `lm_head.weight` of shape [V, D] is ignored.
// Errors: NOT_FOUND when config.json or the weights file(s) are missing; INVALID_ARGUMENT (naming
// the file and the tensor, and expected vs actual shape where relevant) for a missing tensor, an
// unexpected extra tensor, a mis-shaped tensor (including lm_head.weight and the encoder copies),
// and any safetensors / index / config error (see SafetensorsReader).
absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& dir);

// Validates `reader`'s tensors against ExpectedTensors(config) with the rules above and converts
// them (see LoadCheckpoint). Same errors as LoadCheckpoint, naming reader.source() or the tensor's file.
// Bytes of memory the loaded weights of `config` take (bf16 matrices, the embedding twice,
// float32 vectors).
int64_t WeightBytes(const ModelConfig& config);
// The same for a quantized checkpoint (issue 37): quantized matrices at their bytes (FP8 one per
// weight, W4A16 half, plus float32 scales; rows padded to 16 as cpu::QuantMatrix holds them).
int64_t WeightBytes(const ModelConfig& config, const QuantizationConfig& quant);

absl::StatusOr<ModelWeights> LoadModelWeights(const ModelConfig& config,
                                              const SafetensorsReader& reader);
// Issue 37: with a quantization_config (quant_config.h): the modules it quantizes are loaded
// quantized (FP8, W4A16; unfused experts joined per expert), the rest as above. A quantized
// tensor the config does not name, or a tensor whose shape or dtype disagrees with the config,
// is INVALID_ARGUMENT naming it.
absl::StatusOr<ModelWeights> LoadModelWeights(const ModelConfig& config,
                                              const QuantizationConfig& quant,
                                              const SafetensorsReader& reader);

}  // namespace dgserve
