// engine_bench's flags, read by bench/engine_bench.cc and defined with their help text in
// engine_bench_flags.cc, and the checks main() runs on them before any model is made or loaded.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, config);
ABSL_DECLARE_FLAG(std::string, config_json);
ABSL_DECLARE_FLAG(int, layers);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(int, canvas);
ABSL_DECLARE_FLAG(int, steps);
ABSL_DECLARE_FLAG(int, context);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(int, prefill_chunk);
ABSL_DECLARE_FLAG(double, logit_scale);
ABSL_DECLARE_FLAG(std::optional<int>, batch);
ABSL_DECLARE_FLAG(std::string, cpu_gemm_inputs);
ABSL_DECLARE_FLAG(int, repeats);
ABSL_DECLARE_FLAG(double, mem_bandwidth_gbs);
ABSL_DECLARE_FLAG(bool, synthetic);
ABSL_DECLARE_FLAG(bool, synthetic_kv);
ABSL_DECLARE_FLAG(std::string, batches);
ABSL_DECLARE_FLAG(double, step_budget_s);
ABSL_DECLARE_FLAG(bool, phase_timing);
ABSL_DECLARE_FLAG(bool, cuda_graphs);
ABSL_DECLARE_FLAG(int, calibrate_copy_mb);
ABSL_DECLARE_FLAG(int, calibrate_gemm_n);
ABSL_DECLARE_FLAG(bool, cuda_tensor_core_attention);
ABSL_DECLARE_FLAG(bool, cuda_defer_kv_host_copy);
ABSL_DECLARE_FLAG(int32_t, cuda_kv_block_size);
ABSL_DECLARE_FLAG(bool, calibrate_only);

namespace dgserve::bench {

// The numeric flags a loop or a ratio would otherwise take silently as something else:
// --repeats ≥ 1, and 1 without --cpu_gemm_inputs (only that loop repeats); --canvas ≥ 0,
// --steps ≥ 1, --context ≥ 1, --prefill_chunk ≥ 0 (each message names the flag and its value);
// --mem_bandwidth_gbs, --step_budget_s, --calibrate_copy_mb and
// --calibrate_gemm_n finite and ≥ 0. 0 when they are; else the message on stderr and 2 (the
// exit status).
int CheckEngineBenchNumericFlags();

}  // namespace dgserve::bench
