// Deterministic random DiffusionGemma checkpoints: the normative generator of golden README §2.3
// (bit for bit) and a writer producing the real HF directory layout (config.json,
// generation_config.json, model.safetensors or shards + index, optional tokenizer files).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/hash.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "engine/model/tensor_names.h"

namespace dgserve {

// Per-tensor stream key: fnv1a64(name) ^ (seed · 0x9E3779B97F4A7C15).
uint64_t TensorKey(std::string_view name, uint64_t seed);

// w = c + v·a (float32) for a tensor's family; `has_offset` false means w = v·a (EMBED, LINEAR,
// ROUTER). For LINEAR, a = sqrtf(3.0f / (float)fan_in) with fan_in = the LAST dim of the shape.
struct InitConstants {
  float a = 0.0f;
  float c = 0.0f;
  bool has_offset = false;
};
// The constants of `spec`'s family. A LINEAR tensor with an empty shape or zero last dim gets a=0.
InitConstants FamilyConstants(const TensorSpec& spec);

// Element i (row-major flat index over the HF shape, 0 ≤ i < numel) of tensor `spec` for `seed`,
// as bf16 bits (round-to-nearest-even of the float32 value).
uint16_t RandomBf16(const TensorSpec& spec, uint64_t seed, int64_t i);
// Fills out[0 .. spec.numel()) with RandomBf16(spec, seed, i) (OpenMP-parallel over elements).
void FillRandomBf16(const TensorSpec& spec, uint64_t seed, uint16_t* out);
// As FillRandomBf16, returning a vector of numel values.
std::vector<uint16_t> RandomTensorBf16(const TensorSpec& spec, uint64_t seed);

struct WriteOptions {
  // Shard threshold in bytes of tensor data (HF default 5 GB); above it the checkpoint is sharded.
  int64_t max_shard_bytes = kDefaultMaxShardBytes;
  // tokenizer.json to copy into the checkpoint (with tokenizer_config.json when it sits next to
  // it); empty = none.
  std::string tokenizer_path;
  // Outer config.json `eos_token_id` (the real checkpoint's [1, 106]); text_config.eos_token_id
  // is the first entry.
  std::vector<int32_t> config_eos_token_ids = {1, 106};
};

// config.json text for `config` in the HF layout of the golden tiny-g3/config.json (outer
// DiffusionGemmaForBlockDiffusion config + text_config, keys sorted, 2-space indent). Parsing it
// with ParseModelConfig gives back `config`.
std::string ModelConfigToJson(const ModelConfig& config,
                              const std::vector<int32_t>& eos_token_ids = {1, 106});
// generation_config.json text in the layout of the golden generation_config.json.
std::string GenerationConfigToJson(const GenerationConfig& generation);

// Writes a complete random checkpoint into `out_dir` (created if needed): config.json,
// generation_config.json, model.safetensors (BF16, every tensor of ExpectedTensors(config)
// generated with `seed`; sharded + index above options.max_shard_bytes) and the tokenizer files
// if options.tokenizer_path is set. Tensors are generated one at a time (peak memory ≈ the
// largest tensor). Errors: NOT_FOUND if the tokenizer file is missing; FAILED_PRECONDITION naming
// `out_dir` and the OS's reason if it cannot be created or written to (CheckWritableDirectory);
// RESOURCE_EXHAUSTED if its file system has too little free space; INTERNAL on I/O failure.
absl::Status WriteRandomCheckpoint(const ModelConfig& config, const GenerationConfig& generation,
                                   uint64_t seed, const std::string& out_dir,
                                   const WriteOptions& options = {});

// OK when a file can be created in the existing directory `dir` (one is made and removed), else
// FAILED_PRECONDITION "cannot write to directory DIR: <the OS's reason>".
absl::Status CheckWritableDirectory(const std::string& dir);

// The two configs of a model directory (e.g. a golden model dir): config.json (required) and
// generation_config.json (absent → defaults). Errors as LoadModelConfig / LoadGenerationConfig.
struct ModelDirConfigs {
  ModelConfig config;
  GenerationConfig generation;
};
absl::StatusOr<ModelDirConfigs> LoadConfigsFromModelDir(const std::string& dir);

}  // namespace dgserve
