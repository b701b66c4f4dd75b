// The flags that choose and tune the model backend, defined once here for every program that
// takes --device (the workers, dgserve, dgserve-server, engine_bench): --cpu_gemm_input,
// --cuda_gemm_input, --cuda_kv_pool_gb and --cuda_memory_utilization (--device itself stays with
// each program, whose help text differs).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/backend_select.h"

namespace dgserve {

// The BackendSelection of --device `device` with --cpu_gemm_input ("float32", the default, or
// "bf16"), --cuda_gemm_input ("bf16", the default, or "float32") and the environment
// (DGSERVE_GEMM_ISA, DGSERVE_DENSE_SC: backend_env.h). INVALID_ARGUMENT naming the flag, checked
// in this order whatever the device: "--cpu_gemm_input 'x': must be 'float32' or 'bf16'", the
// same for --cuda_gemm_input, "--cuda_kv_pool_gb x: must be a number of GB in [0, 1e6]",
// "--cuda_memory_utilization x: must be a fraction in [0, 1]", then
// "--device x: must be 'cpu' or 'cuda'". Loads nothing: call it
// before a checkpoint load. Logs one warning naming every flag UnusedBackendFlags names.
absl::StatusOr<BackendSelection> BackendSelectionFromFlags(const std::string& device);

// The backend flags set to something other than their default, or given on the command line at
// all, that --device `device` does not use (--cuda_gemm_input, --cuda_kv_pool_gb and
// --cuda_memory_utilization with cpu, --cpu_gemm_input with cuda), one message each naming the
// flag: they change nothing, and a user who set one expected them to. Empty when none.
std::vector<std::string> UnusedBackendFlags(const std::string& device);

}  // namespace dgserve
