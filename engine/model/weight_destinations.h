// Where each checkpoint tensor goes in ModelWeights (spec §2.2 names): shared by the checkpoint
// loader (checkpoint.cc) and the synthetic weights (synthetic_weights.cc), so both fill the same
// fields from the same names.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "engine/model/config.h"
#include "engine/model/weights.h"

namespace dgserve {

// A float32 vector (resized to numel), a scalar, a bf16 matrix packed for the GEMM, one packed
// matrix per expert ([E, rows, cols] tensors), or the embedding (row-major bf16 and packed for
// the LM head): exactly one field is set.
struct Destination {
  std::vector<float>* vec = nullptr;
  float* scalar = nullptr;
  cpu::PackedMatrix* matrix = nullptr;
  std::vector<cpu::PackedMatrix>* experts = nullptr;
  ModelWeights* embedding = nullptr;
};

// Every tensor name of `c`'s model (decoder backbone under "model.decoder.", the encoder's
// layer_scalar buffers) → its place in `*w`, whose layers are resized to c.num_layers.
std::unordered_map<std::string, Destination> Destinations(const ModelConfig& c, ModelWeights* w);

}  // namespace dgserve
