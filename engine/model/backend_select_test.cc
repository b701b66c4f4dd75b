// CreateBackend: the BackendSelection values it accepts and refuses (the flags that fill one:
// worker/backend_flags_test.cc).
#include "engine/model/backend_select.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/model/checkpoint_testing.h"
#include "gtest/gtest.h"

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
  absl::Status Create(const BackendSelection& selection) {
    return CreateBackend(selection, checkpoint_->config, checkpoint_->weights).status();
  }
  std::unique_ptr<Checkpoint> checkpoint_;
};

TEST_F(BackendSelectTest, CpuWithEitherGemmInput) {
  BackendSelection s;
  EXPECT_THAT(Create(s), IsOk());
  s.cuda_gemm_input = CudaGemmInput::kFloat32;  // not the device's: no effect
  EXPECT_THAT(Create(s), IsOk());
  s.cpu_gemm_input = cpu::GemmInput::kBf16;
  EXPECT_THAT(Create(s), IsOk());
  s.cpu_dense_self_conditioning = true;
  EXPECT_THAT(Create(s), IsOk());
}

TEST_F(BackendSelectTest, UnknownDeviceIsInvalidArgument) {
  BackendSelection s;
  for (const char* bad : {"tpu", "", "CPU", "cuda "}) {
    s.device = bad;
    const absl::Status st = CheckBackendSelection(s);
    EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument)) << "'" << bad << "'";
    EXPECT_EQ(st.message(), absl::StrCat("--device ", bad, ": must be 'cpu' or 'cuda'"));
    EXPECT_THAT(Create(s), StatusIs(absl::StatusCode::kInvalidArgument)) << "'" << bad << "'";
  }
  s.device = "cuda";
  EXPECT_THAT(CheckBackendSelection(s), IsOk());
}

// --device cuda in a binary built without the CUDA backend is refused naming how to get a build
// that has it; every program that refuses the flag prints this one message.
TEST_F(BackendSelectTest, CudaWithoutTheBackendNamesTheCMakeOption) {
  const std::string message = CudaBackendMissingMessage();
  EXPECT_EQ(message.rfind("--device cuda: this binary was built without the CUDA backend", 0), 0u)
      << message;
  EXPECT_NE(message.find("-DDGSERVE_CUDA_BACKEND=ON"), std::string::npos) << message;
#ifndef DGSERVE_HAVE_CUDA
  BackendSelection s;
  s.device = "cuda";
  const absl::Status st = Create(s);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(st.message(), message);
#endif
}

TEST_F(BackendSelectTest, GemmIsaIsAppliedAndAnUnsupportedOneRefused) {
  const cpu::GemmIsa before = cpu::ActiveGemmIsa();
  BackendSelection s;
  s.cpu_gemm_isa = cpu::GemmIsa::kPortable;
  EXPECT_THAT(Create(s), IsOk());
  EXPECT_EQ(cpu::ActiveGemmIsa(), cpu::GemmIsa::kPortable);
  for (cpu::GemmIsa isa : {cpu::GemmIsa::kAvx2, cpu::GemmIsa::kAvx512, cpu::GemmIsa::kAvx512Bf16}) {
    if (cpu::GemmIsaSupported(isa)) continue;
    s.cpu_gemm_isa = isa;
    EXPECT_THAT(Create(s), StatusIs(absl::StatusCode::kInvalidArgument)) << cpu::GemmIsaName(isa);
  }
  ASSERT_THAT(cpu::SetGemmIsa(before), IsOk());
}

// --device cuda takes every format (issue 37; bf16, FP8, W4A16 and NVFP4 stay in their formats
// on the device; W4A16 in both GEMM modes, its activations float32 as the CPU backend's) but
// refuses an NVFP4 checkpoint whose self-conditioning MLP is quantized, before touching a device.
// (The weights here are bf16 with only the format tag changed: enough for the checks, which come
// first.)
TEST_F(BackendSelectTest, CudaRefusesFormatsItDoesNotRun) {
  BackendSelection s;
  s.device = "cuda";
  checkpoint_->weights.format = WeightFormat::kW4A16;
  for (CudaGemmInput input : {CudaGemmInput::kBf16, CudaGemmInput::kFloat32}) {
    // Not refused for its format in either mode (without the CUDA backend compiled in, or
    // without a device, refused for that).
    s.cuda_gemm_input = input;
    const absl::Status st = Create(s);
    EXPECT_EQ(st.message().find("float32 only"), std::string::npos) << st;
    EXPECT_EQ(st.message().find("W4A16"), std::string::npos) << st;
    EXPECT_EQ(st.message().find("self-conditioning MLP"), std::string::npos) << st;
  }
  checkpoint_->weights.format = WeightFormat::kNvfp4;
  const std::vector<uint8_t> codes(16 * 16, 1), scales(16, 0x38);
  const std::vector<float> global(16, 1.0f);
  checkpoint_->weights.sc_up_proj = cpu::PackedMatrix::Quantized(
      cpu::QuantMatrix::FromNvfp4(codes.data(), scales.data(), global.data(), 1.0f, 16, 16));
  const absl::Status st = Create(s);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_NE(st.message().find("self-conditioning MLP"), std::string::npos) << st;
}

}  // namespace
}  // namespace dgserve
