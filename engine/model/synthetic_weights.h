// The weights of dgserve-mkmodel's random checkpoint built in memory, without writing or reading
// a checkpoint (engine_bench --synthetic): the tensors of WriteRandomCheckpoint(config, seed)
// converted as LoadCheckpoint converts them, so SyntheticModelWeights(config, seed) equals
// LoadCheckpoint(a checkpoint written with that config and seed).weights, bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/model/config.h"
#include "engine/model/tensor_names.h"
#include "engine/model/weights.h"

namespace dgserve {

// With matrices = false every matrix (rank ≥ 2: projections, router, experts, the embedding) is
// left empty and only the norms, scales and scalars are filled (a few MB at the real shape): the
// CUDA backend's synthetic path (CreateCudaBackendSynthetic) fills the matrices on the device.
ModelWeights SyntheticModelWeights(const ModelConfig& config, uint64_t seed, bool matrices = true);

// The matrices (rank ≥ 2) of ExpectedTensors(config): what the synthetic path fills on the
// device, and their bytes in bf16 (the embedding once).
std::vector<TensorSpec> SyntheticMatrixSpecs(const ModelConfig& config);

}  // namespace dgserve
