// The checkpoint's tensor list for a given config: HF names and shapes (spec §2.2), and the
// initialisation family the random-checkpoint generator uses for each (golden README §2.3).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/model/config.h"

namespace dgserve {

// Random-initialisation family of a tensor (golden README §2.3).
enum class InitFamily { kEmbed, kLinear, kRouter, kGain, kQkNorm, kScalar };

// One expected checkpoint tensor: full HF name, PyTorch shape ([out, in] for linear weights).
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  InitFamily family;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// Every text tensor of a DiffusionGemma checkpoint with this config, sorted by name (the order
// of the golden model.json): backbone under `model.decoder.`, the encoder's per-layer
// `model.encoder.language_model.layers.i.layer_scalar`, the self-conditioning MLP. No lm_head
// (tied to the embedding), no vision tensors.
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// True for tensors a text-only loader skips (vision tower, vision embedder).
bool IsVisionTensor(const std::string& name);

}  // namespace dgserve
