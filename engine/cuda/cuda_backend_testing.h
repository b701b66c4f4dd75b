// The fixture base of the CUDA backend's tests against the CPU backend (cuda_backend_test.cc and
// the quantized-checkpoint tests through cuda_backend_quant_testing.h): one checkpoint per test
// suite, the CPU and CUDA backends on it in the GEMM input mode of the test's parameter, and the
// inputs and calls the tests share.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_reserved_memory.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"

namespace dgserve::backend_testing {

// The random tiny-v512 checkpoint (engine/model/checkpoint_testing.h) for a MakeCheckpoint below,
// written under a directory named after `name`; null, with a test failure added, when it cannot.
// Whether the device's allocation granule is as small as the emulation's (256 bytes). The tests
// that bound the K/V pools at a few KiB (exact block counts of the tiny model) need it: a GPU's
// granule (2 MiB on Hopper) rounds each array of a pool up to more than their whole bound, so
// they skip there (the pools' bookkeeping they check is host code, run under gpu-emu).
inline bool SmallKvGranules() {
  const absl::StatusOr<size_t> g = cuda::ReservedMemoryGranularity();
  return g.ok() && *g <= 256;
}

inline std::unique_ptr<Checkpoint> TinyV512Checkpoint(const char* name) {
  auto ckpt = ::dgserve::testing::LoadRandomTinyV512(name);
  if (!ckpt.ok()) {
    ADD_FAILURE() << ckpt.status();
    return nullptr;
  }
  return std::make_unique<Checkpoint>(std::move(*ckpt));
}

// CRTP: `Derived` gives `static std::unique_ptr<Checkpoint> MakeCheckpoint()` (null, with a test
// failure added, when it cannot). `Param` has the GEMM input modes `cpu` and `gpu` and
// `own_projections` (CudaBackendOptions::batch_invariant_projections). Every test skips without a
// device (under gpu-emu the emulation is the device).
template <class Derived, class Param>
class CpuGpuTest : public cuda::CudaTest, public ::testing::WithParamInterface<Param> {
 protected:
  static void SetUpTestSuite() {
    if (cuda::DeviceCount() == 0) return;  // every test skips
    checkpoint_ = Derived::MakeCheckpoint().release();
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
    cpu_options.gemm_input = this->GetParam().cpu;
    cpu_ = CreateCpuBackend(config(), checkpoint_->weights, cpu_options);
    auto gpu = CreateCudaBackend(config(), checkpoint_->weights, GpuOptions());
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
  }
  // The CUDA backend's options for the parameter (gpu_ is made with these).
  virtual CudaBackendOptions GpuOptions() const {
    CudaBackendOptions options;
    options.gemm_input = this->GetParam().gpu;
    options.batch_invariant_projections = this->GetParam().own_projections;
    return options;
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
  // The canvas's logits [rows, V] decoded against `kv` (sc: the self-conditioning input
  // [rows, D], or none).
  std::vector<float> Logits(ModelBackend& b, const KvCache& kv, const std::vector<int32_t>& canvas,
                            const float* sc = nullptr) const {
    std::vector<float> logits(canvas.size() * config().vocab_size);
    DecodeInput in{canvas, sc, &kv, logits.data()};
    const absl::Status st = b.Decode({&in, 1});
    EXPECT_TRUE(st.ok()) << st;
    return logits;
  }

  static inline Checkpoint* checkpoint_ = nullptr;
  std::unique_ptr<ModelBackend> cpu_, gpu_;
};

}  // namespace dgserve::backend_testing
