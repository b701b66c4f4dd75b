// The environment variables that tune the CPU backend, read here (by the programs) rather than in
// the engine, which takes them as plain options (engine/model/backend_select.h). Without flags of
// its own, so that a benchmark can read them without taking on --cpu_gemm_input.
#pragma once

#include <optional>

#include "engine/cpu/gemm.h"

namespace dgserve {

// DGSERVE_GEMM_ISA=avx512bf16|avx512|avx2|portable: the CPU GEMM path it forces. nullopt when it
// is unset or empty, or (after a line on stderr naming the path used instead, the best this CPU
// has) when it names another value or a path this CPU lacks.
std::optional<cpu::GemmIsa> GemmIsaFromEnvironment();

// Applies GemmIsaFromEnvironment() (cpu::SetGemmIsa) when it names a path; for programs that run
// the GEMM without CreateBackend (benchmarks).
void ApplyGemmIsaFromEnvironment();

// DGSERVE_DENSE_SC=1: the dense self-conditioning product for every canvas
// (CpuBackendOptions::dense_self_conditioning). False when unset or any other value.
bool DenseSelfConditioningFromEnvironment();

}  // namespace dgserve
