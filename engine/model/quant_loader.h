// Loading the quantized tensors of a compressed-tensors or ModelOpt NVFP4 checkpoint (issue 37;
// layouts and module selection in quant_config.h) into the CPU backend's weights: FP8, W4A16 and
// NVFP4 Linear modules become quantized PackedMatrix entries (cpu::QuantMatrix), unfused per-expert
// Linears are joined per expert into the [2F, D] gate_up / [D, F] down matrices the backend runs.
// Internal to the checkpoint loader (checkpoint.cc calls it); everything it does not take stays
// on the bf16 path.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/model/config.h"
#include "engine/model/quant_config.h"
#include "engine/model/safetensors.h"

namespace dgserve {

struct QuantizedLoadPlan {
  std::set<std::string> handled_specs;  // ExpectedTensors names loaded here (not on the bf16 path)
  std::set<std::string> used;           // checkpoint tensors consumed here
  std::vector<std::function<absl::Status()>> jobs;  // run after every check passed
};

// Where an ExpectedTensors matrix goes: a matrix, or (3-D expert tensors) a vector of them.
struct MatrixSeat {
  cpu::PackedMatrix* matrix = nullptr;
  std::vector<cpu::PackedMatrix>* experts = nullptr;
};

// Plans the quantized part of the load. Problems (missing or mis-shaped or mis-typed tensors,
// each naming the tensor and file) are appended to `problems`; nothing is loaded until the jobs
// run. `seat(spec_name)` gives the destination of an ExpectedTensors name.
QuantizedLoadPlan PlanQuantizedLoad(const ModelConfig& config, const QuantizationConfig& quant,
                                    const SafetensorsReader& reader,
                                    const std::function<MatrixSeat(const std::string&)>& seat,
                                    std::vector<std::string>* problems);

}  // namespace dgserve
