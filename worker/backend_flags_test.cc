// BackendSelectionFromFlags: the flag values it accepts and refuses (messages naming the flag),
// and the environment variables it reads (backend_env.h).
#include "worker/backend_flags.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/backend_env.h"

ABSL_DECLARE_FLAG(std::string, cuda_gemm_input);
ABSL_DECLARE_FLAG(std::string, cpu_gemm_input);
ABSL_DECLARE_FLAG(double, cuda_kv_pool_gb);
ABSL_DECLARE_FLAG(double, cuda_memory_utilization);

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class BackendSelectFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("DGSERVE_GEMM_ISA");
    unsetenv("DGSERVE_DENSE_SC");
  }
  void TearDown() override {
    absl::SetFlag(&FLAGS_cuda_gemm_input, "bf16");  // the defaults
    absl::SetFlag(&FLAGS_cpu_gemm_input, "float32");
    absl::SetFlag(&FLAGS_cuda_kv_pool_gb, 0);
    absl::SetFlag(&FLAGS_cuda_memory_utilization, 0.9);
    unsetenv("DGSERVE_GEMM_ISA");
    unsetenv("DGSERVE_DENSE_SC");
  }
};

// --cuda_kv_pool_gb: GB (1e9 B) into the selection's bound; negative, NaN or absurd values are
// refused naming the flag; with --device cpu it is named as unused.
TEST_F(BackendSelectFlagsTest, KvPoolBound) {
  EXPECT_EQ(BackendSelectionFromFlags("cuda")->cuda_kv_pool_bytes, 0u);
  absl::SetFlag(&FLAGS_cuda_kv_pool_gb, 2.5);
  EXPECT_EQ(BackendSelectionFromFlags("cuda")->cuda_kv_pool_bytes, size_t{2500000000});
  EXPECT_TRUE(UnusedBackendFlags("cuda").empty());
  EXPECT_THAT(UnusedBackendFlags("cpu"),
              ElementsAre("--cuda_kv_pool_gb=2.5 has no effect with --device cpu"));
  for (const double bad : {-1.0, std::nan(""), 2e6}) {
    absl::SetFlag(&FLAGS_cuda_kv_pool_gb, bad);
    const absl::Status st = BackendSelectionFromFlags("cuda").status();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
    EXPECT_THAT(std::string(st.message()), HasSubstr("--cuda_kv_pool_gb ")) << bad;
  }
}

// --cuda_memory_utilization: a fraction in [0, 1] into the selection (0.9 by default, as vLLM's
// --gpu-memory-utilization); others refused naming the flag; with --device cpu named as unused.
TEST_F(BackendSelectFlagsTest, MemoryUtilization) {
  EXPECT_EQ(BackendSelectionFromFlags("cuda")->cuda_memory_utilization, 0.9);
  EXPECT_TRUE(UnusedBackendFlags("cpu").empty());
  for (const double ok : {0.0, 0.45, 1.0}) {
    absl::SetFlag(&FLAGS_cuda_memory_utilization, ok);
    EXPECT_EQ(BackendSelectionFromFlags("cuda")->cuda_memory_utilization, ok);
  }
  absl::SetFlag(&FLAGS_cuda_memory_utilization, 0.45);
  EXPECT_TRUE(UnusedBackendFlags("cuda").empty());
  EXPECT_THAT(UnusedBackendFlags("cpu"),
              ElementsAre("--cuda_memory_utilization=0.45 has no effect with --device cpu"));
  absl::SetFlag(&FLAGS_cuda_kv_pool_gb, 2);
  EXPECT_THAT(UnusedBackendFlags("cuda"),
              ElementsAre("--cuda_memory_utilization=0.45 has no effect with --cuda_kv_pool_gb "
                          "(the pool's bound given)"));
  absl::SetFlag(&FLAGS_cuda_kv_pool_gb, 0);
  for (const double bad : {-0.1, 1.5, std::nan("")}) {
    absl::SetFlag(&FLAGS_cuda_memory_utilization, bad);
    const absl::Status st = BackendSelectionFromFlags("cuda").status();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << bad;
    EXPECT_THAT(std::string(st.message()), HasSubstr("--cuda_memory_utilization ")) << bad;
  }
}

TEST_F(BackendSelectFlagsTest, DefaultsAndBothGemmInputs) {
  absl::StatusOr<BackendSelection> s = BackendSelectionFromFlags("cpu");
  ASSERT_THAT(s, IsOk());
  EXPECT_EQ(s->device, "cpu");
  EXPECT_EQ(s->cpu_gemm_input, cpu::GemmInput::kFloat32);
  EXPECT_EQ(s->cuda_gemm_input, CudaGemmInput::kBf16);
  EXPECT_FALSE(s->cpu_dense_self_conditioning);
  EXPECT_FALSE(s->cpu_gemm_isa.has_value());
  absl::SetFlag(&FLAGS_cpu_gemm_input, "bf16");
  absl::SetFlag(&FLAGS_cuda_gemm_input, "float32");
  s = BackendSelectionFromFlags("cuda");
  ASSERT_THAT(s, IsOk());
  EXPECT_EQ(s->device, "cuda");
  EXPECT_EQ(s->cpu_gemm_input, cpu::GemmInput::kBf16);
  EXPECT_EQ(s->cuda_gemm_input, CudaGemmInput::kFloat32);
}

TEST_F(BackendSelectFlagsTest, BadValuesAreInvalidArgumentNamingTheFlag) {
  for (const char* bad : {"fp8", "", "Float32", "bf16 "}) {
    absl::SetFlag(&FLAGS_cuda_gemm_input, bad);
    for (const char* device : {"cpu", "cuda"}) {
      const absl::Status st = BackendSelectionFromFlags(device).status();
      EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << "'" << bad << "'";
      EXPECT_EQ(st.message(),
                std::string("--cuda_gemm_input '") + bad + "': must be 'float32' or 'bf16'");
    }
  }
  absl::SetFlag(&FLAGS_cuda_gemm_input, "bf16");
  for (const char* bad : {"fp8", "", "BF16"}) {
    absl::SetFlag(&FLAGS_cpu_gemm_input, bad);
    const absl::Status st = BackendSelectionFromFlags("cpu").status();
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << "'" << bad << "'";
    EXPECT_EQ(st.message(),
              std::string("--cpu_gemm_input '") + bad + "': must be 'float32' or 'bf16'");
  }
  absl::SetFlag(&FLAGS_cpu_gemm_input, "float32");
  const absl::Status st = BackendSelectionFromFlags("tpu").status();
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(st.message(), "--device tpu: must be 'cpu' or 'cuda'");
}

// A GEMM-input flag the device does not use is named (it was accepted without a word); its
// default, or the device's own flag, is not.
TEST_F(BackendSelectFlagsTest, UnusedGemmInputFlagsAreNamed) {
  EXPECT_TRUE(UnusedBackendFlags("cpu").empty());
  EXPECT_TRUE(UnusedBackendFlags("cuda").empty());
  absl::SetFlag(&FLAGS_cuda_gemm_input, "float32");
  EXPECT_THAT(UnusedBackendFlags("cpu"),
              ElementsAre("--cuda_gemm_input=float32 has no effect with --device cpu (see "
                          "--cpu_gemm_input)"));
  EXPECT_TRUE(UnusedBackendFlags("cuda").empty());
  absl::SetFlag(&FLAGS_cpu_gemm_input, "bf16");
  EXPECT_THAT(UnusedBackendFlags("cuda"),
              ElementsAre("--cpu_gemm_input=bf16 has no effect with --device cuda (see "
                          "--cuda_gemm_input)"));
  EXPECT_THAT(UnusedBackendFlags("cpu"), ElementsAre(HasSubstr("--cuda_gemm_input=float32")));
  // Still a valid selection: the flags warn, they do not refuse.
  EXPECT_THAT(BackendSelectionFromFlags("cpu"), IsOk());
}

TEST_F(BackendSelectFlagsTest, EnvironmentVariables) {
  setenv("DGSERVE_DENSE_SC", "1", 1);
  setenv("DGSERVE_GEMM_ISA", "portable", 1);
  absl::StatusOr<BackendSelection> s = BackendSelectionFromFlags("cpu");
  ASSERT_THAT(s, IsOk());
  EXPECT_TRUE(s->cpu_dense_self_conditioning);
  EXPECT_EQ(s->cpu_gemm_isa, cpu::GemmIsa::kPortable);
  setenv("DGSERVE_DENSE_SC", "0", 1);
  setenv("DGSERVE_GEMM_ISA", "avx9000", 1);  // not a path: a warning, then the best
  s = BackendSelectionFromFlags("cpu");
  ASSERT_THAT(s, IsOk());
  EXPECT_FALSE(s->cpu_dense_self_conditioning);
  EXPECT_FALSE(s->cpu_gemm_isa.has_value());
  for (cpu::GemmIsa isa : {cpu::GemmIsa::kAvx2, cpu::GemmIsa::kAvx512, cpu::GemmIsa::kAvx512Bf16}) {
    setenv("DGSERVE_GEMM_ISA", cpu::GemmIsaName(isa), 1);
    EXPECT_EQ(GemmIsaFromEnvironment().has_value(), cpu::GemmIsaSupported(isa))
        << cpu::GemmIsaName(isa);
  }
}

}  // namespace
}  // namespace dgserve
