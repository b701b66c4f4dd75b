// The checkpoint a benchmark runs (engine_bench): a checkpoint directory as it is, or a random
// one of a given config.json shape, written to a temporary directory and loaded back, or
// synthetic weights made in memory (on the device for --device cuda, by the backend).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/checkpoint.h"

namespace dgserve::bench {

struct BenchModelSpec {
  std::string model_dir;    // --model: a checkpoint directory (then config_* and layers unused)
  std::string config_json;  // --config_json text, or
  std::string config_path;  // --config: a config.json file
  int layers = 0;           // > 0: keep only the first `layers` layers of the config (a slice)
  bool synthetic = false;   // weights made in memory instead of a written checkpoint
  bool on_device = false;   // --device cuda: synthetic weights are made there (host: norms only)
  uint64_t seed = 3;
};

// The checkpoint of `spec`. With `synthetic` and `on_device` its weights hold no matrices (the
// CUDA backend makes them, CreateCudaBackendSynthetic). Prints progress lines (generation, load
// and resident memory) to stdout. Errors: INVALID_ARGUMENT for flags that do not go together or
// are out of range (a caller exits 2), RESOURCE_EXHAUSTED when the shape's weights exceed the
// available host memory, and the loader's errors.
absl::StatusOr<Checkpoint> BenchCheckpoint(const BenchModelSpec& spec);

}  // namespace dgserve::bench
