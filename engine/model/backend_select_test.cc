// CreateBackendForDevice: the --device and --cuda_gemm_input values it accepts and refuses.
#include "engine/model/backend_select.h"

#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "common/testing/status_matchers.h"
#include "engine/model/checkpoint_testing.h"
#include "gtest/gtest.h"

ABSL_DECLARE_FLAG(std::string, cuda_gemm_input);
ABSL_DECLARE_FLAG(std::string, cpu_gemm_input);

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

class BackendSelectTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("backend_select_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = std::make_unique<Checkpoint>(std::move(*ckpt));
  }
  void TearDown() override {
    absl::SetFlag(&FLAGS_cuda_gemm_input, "bf16");  // the defaults
    absl::SetFlag(&FLAGS_cpu_gemm_input, "float32");
  }
  absl::Status Create(const std::string& device) {
    return CreateBackendForDevice(device, checkpoint_->config, checkpoint_->weights).status();
  }
  std::unique_ptr<Checkpoint> checkpoint_;
};

TEST_F(BackendSelectTest, CpuWithEitherGemmInput) {
  EXPECT_THAT(Create("cpu"), IsOk());
  absl::SetFlag(&FLAGS_cuda_gemm_input, "float32");
  EXPECT_THAT(Create("cpu"), IsOk());
}

TEST_F(BackendSelectTest, UnknownDeviceOrGemmInputIsInvalidArgument) {
  EXPECT_THAT(Create("tpu"), StatusIs(absl::StatusCode::kInvalidArgument));
  for (const char* bad : {"fp8", "", "Float32", "bf16 "}) {
    absl::SetFlag(&FLAGS_cuda_gemm_input, bad);
    const absl::Status st = Create("cpu");
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << "'" << bad << "'";
    EXPECT_NE(st.message().find("--cuda_gemm_input"), std::string::npos) << st;
    EXPECT_THAT(Create("cuda"), StatusIs(absl::StatusCode::kInvalidArgument)) << "'" << bad << "'";
  }
}

TEST_F(BackendSelectTest, CpuGemmInputFlag) {
  absl::SetFlag(&FLAGS_cpu_gemm_input, "bf16");
  EXPECT_THAT(Create("cpu"), IsOk());
  for (const char* bad : {"fp8", "", "BF16"}) {
    absl::SetFlag(&FLAGS_cpu_gemm_input, bad);
    const absl::Status st = CheckDeviceFlags("cpu");
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << "'" << bad << "'";
    EXPECT_NE(st.message().find("--cpu_gemm_input"), std::string::npos) << st;
    EXPECT_THAT(Create("cpu"), StatusIs(absl::StatusCode::kInvalidArgument)) << "'" << bad << "'";
  }
}

}  // namespace
}  // namespace dgserve
