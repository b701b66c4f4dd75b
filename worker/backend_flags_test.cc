// BackendSelectionFromFlags: the flag values it accepts and refuses (messages naming the flag),
// and the environment variables it reads (backend_env.h).
#include "worker/backend_flags.h"

#include <cstdlib>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "common/testing/status_matchers.h"
#include "gtest/gtest.h"
#include "worker/backend_env.h"

ABSL_DECLARE_FLAG(std::string, cuda_gemm_input);
ABSL_DECLARE_FLAG(std::string, cpu_gemm_input);

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

class BackendSelectFlagsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("DGSERVE_GEMM_ISA");
    unsetenv("DGSERVE_DENSE_SC");
  }
  void TearDown() override {
    absl::SetFlag(&FLAGS_cuda_gemm_input, "bf16");  // the defaults
    absl::SetFlag(&FLAGS_cpu_gemm_input, "float32");
    unsetenv("DGSERVE_GEMM_ISA");
    unsetenv("DGSERVE_DENSE_SC");
  }
};

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
