// The fixture of the CUDA backend's quantized-checkpoint tests (cuda_backend_w4a16_test.cc,
// cuda_backend_nvfp4_test.cc, cuda_backend_fp8_test.cc; issue 37): the tiny-v512 golden shape
// with random weights, quantized by QuantizeCheckpoint (dgserve-quantize) as the test asks, and the
// CPU and CUDA backends on that one checkpoint in one GEMM input mode (the test's parameter), with
// the helpers that compare them.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/model/random_checkpoint.h"

namespace dgserve::quant_testing {

// One GEMM input mode of both backends and what a test allows in it.
struct Mode {
  const char* name;
  cuda::GemmInput gpu;
  cpu::GemmInput cpu;
  float logit;  // max |Δlogit|: relative (times max |CPU logit|) or absolute
  bool relative;
  float kv_rel;  // max |ΔK|, |ΔV| ÷ the checked rows' max |value|
  bool own_projections;
};

inline std::string ModeName(const ::testing::TestParamInfo<Mode>& info) { return info.param.name; }

// The tiny-v512 shape (its config changed by `tweak` where not null) with random weights (seed
// 512), written as bf16 and quantized with `options` into a temporary directory, loaded back.
// Null, with a test failure added, when a step fails.
inline std::unique_ptr<Checkpoint> QuantizedTinyCheckpoint(const QuantizeOptions& options,
                                                           void (*tweak)(ModelConfig*)) {
  namespace fs = std::filesystem;
  const fs::path golden = fs::path(::dgserve::testing::GoldenDir()) / "tiny-v512";
  auto cfgs = LoadConfigsFromModelDir(golden.string());
  if (!cfgs.ok()) {
    ADD_FAILURE() << cfgs.status();
    return nullptr;
  }
  if (tweak != nullptr) tweak(&cfgs->config);
  const fs::path root = fs::temp_directory_path() /
                        ("dgserve_cuda_quant_" + std::string(WeightFormatName(options.format)) +
                         "_" + std::to_string(::getpid()));
  const std::string bf16_dir = (root / "bf16").string(), q_dir = (root / "quantized").string();
  absl::StatusOr<Checkpoint> ckpt = absl::InternalError("not made");
  if (absl::Status st = WriteRandomCheckpoint(cfgs->config, cfgs->generation, 512, bf16_dir);
      !st.ok()) {
    ckpt = st;
  } else if (auto summary = QuantizeCheckpoint(bf16_dir, q_dir, options); !summary.ok()) {
    ckpt = summary.status();
  } else {
    ckpt = LoadCheckpoint(q_dir);
  }
  fs::remove_all(root);
  if (!ckpt.ok()) {
    ADD_FAILURE() << ckpt.status();
    return nullptr;
  }
  return std::make_unique<Checkpoint>(*std::move(ckpt));
}

// CRTP: `Derived` gives `static QuantizeOptions Options()` and `static void Tweak(ModelConfig*)`
// (the config change, or nothing). The checkpoint is made once per test suite; every test skips
// without a device (under gpu-emu the emulation is the device).
template <class Derived>
class CudaBackendQuantTest : public cuda::CudaTest, public ::testing::WithParamInterface<Mode> {
 protected:
  static void SetUpTestSuite() {
    if (cuda::DeviceCount() == 0) return;  // every test skips
    checkpoint_ = QuantizedTinyCheckpoint(Derived::Options(), &Derived::Tweak).release();
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }
  void SetUp() override {
    cuda::CudaTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_NE(checkpoint_, nullptr);
    CpuBackendOptions cpu_options;
    cpu_options.gemm_input = GetParam().cpu;
    cpu_ = CreateCpuBackend(config(), checkpoint_->weights, cpu_options);
    CudaBackendOptions gpu_options;
    gpu_options.gemm_input = GetParam().gpu;
    gpu_options.batch_invariant_projections = GetParam().own_projections;
    auto gpu = CreateCudaBackend(config(), checkpoint_->weights, gpu_options);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
  }

  const ModelConfig& config() const { return checkpoint_->config; }
  // n token ids that differ with `salt`.
  std::vector<int32_t> Tokens(int n, int salt) const {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = (i * 37 + 11 + salt * 101) % config().vocab_size;
    return p;
  }
  static void Encode(ModelBackend& b, KvCache& kv, const std::vector<int32_t>& tokens) {
    EncodeInput in{tokens, &kv};
    const absl::Status st = b.Encode({&in, 1});
    ASSERT_TRUE(st.ok()) << st;
  }
  // The canvas's logits [rows, V] decoded against `kv`.
  std::vector<float> Logits(ModelBackend& b, const KvCache& kv,
                            const std::vector<int32_t>& canvas) const {
    std::vector<float> logits(canvas.size() * config().vocab_size);
    DecodeInput in{canvas, nullptr, &kv, logits.data()};
    const absl::Status st = b.Decode({&in, 1});
    EXPECT_TRUE(st.ok()) << st;
    return logits;
  }
  // max |cpu − gpu| (infinite where gpu is not finite); raises *scale to max |cpu|.
  static float Worst(const std::vector<float>& cpu, const std::vector<float>& gpu, float* scale) {
    float worst = 0.0f;
    for (float x : cpu) *scale = std::max(*scale, std::fabs(x));
    for (size_t i = 0; i < cpu.size(); ++i) {
      worst = std::isfinite(gpu[i]) ? std::max(worst, std::fabs(cpu[i] - gpu[i]))
                                    : std::numeric_limits<float>::infinity();
    }
    return worst;
  }

  static inline Checkpoint* checkpoint_ = nullptr;
  std::unique_ptr<ModelBackend> cpu_, gpu_;
};

}  // namespace dgserve::quant_testing
