#include "worker/backend_env.h"

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace dgserve {
namespace {

constexpr cpu::GemmIsa kBestFirst[] = {cpu::GemmIsa::kAvx512Bf16, cpu::GemmIsa::kAvx512,
                                       cpu::GemmIsa::kAvx2, cpu::GemmIsa::kPortable};

cpu::GemmIsa BestIsa() {
  for (cpu::GemmIsa isa : kBestFirst) {
    if (cpu::GemmIsaSupported(isa)) return isa;
  }
  return cpu::GemmIsa::kPortable;
}

}  // namespace

std::optional<cpu::GemmIsa> GemmIsaFromEnvironment() {
  const char* env = std::getenv("DGSERVE_GEMM_ISA");
  if (env == nullptr || *env == '\0') return std::nullopt;
  const std::string_view v(env);
  for (cpu::GemmIsa isa : kBestFirst) {
    if (v != cpu::GemmIsaName(isa)) continue;
    if (cpu::GemmIsaSupported(isa)) return isa;
    std::fprintf(stderr, "DGSERVE_GEMM_ISA=%s: this CPU lacks it; using %s\n", env,
                 cpu::GemmIsaName(BestIsa()));
    return std::nullopt;
  }
  std::fprintf(stderr,
               "DGSERVE_GEMM_ISA=%s: not one of avx512bf16, avx512, avx2, portable; using %s\n",
               env, cpu::GemmIsaName(BestIsa()));
  return std::nullopt;
}

void ApplyGemmIsaFromEnvironment() {
  // Supported by construction: SetGemmIsa cannot fail here.
  if (const std::optional<cpu::GemmIsa> isa = GemmIsaFromEnvironment()) (void)cpu::SetGemmIsa(*isa);
}

bool DenseSelfConditioningFromEnvironment() {
  const char* env = std::getenv("DGSERVE_DENSE_SC");
  return env != nullptr && std::string_view(env) == "1";
}

}  // namespace dgserve
