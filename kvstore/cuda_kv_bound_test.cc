// The device K/V pools' bound from CudaBackendOptions::memory_utilization (vLLM's
// --gpu-memory-utilization): the fraction of the device's memory less the backend's own once its
// weights are on it, at most the memory then free, unless kv_pool_max_bytes gives the bound
// (label gpu, and gpu-emu under the emulation, whose device memory limit makes the numbers exact;
// built into cuda_backend_test / cuda_backend_emu_test beside cuda_kv_authority_test.cc). On the
// tiny-v512 random checkpoint.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_backend_testing.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/kv_cache.h"
#if defined(DGSERVE_CUDA_EMULATION)
#include <cuda_runtime.h>  // the emulation's device memory limit (cuda_emu.h)
#endif

namespace dgserve::kv {
namespace {

class CudaKvBoundTest : public cuda::CudaTest {
 protected:
  static void SetUpTestSuite() {
    if (cuda::DeviceCount() == 0) return;  // every test skips
    checkpoint_ = backend_testing::TinyV512Checkpoint("cuda_kv_bound_test").release();
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }
  void SetUp() override {
    cuda::CudaTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_NE(checkpoint_, nullptr);
  }
  static absl::StatusOr<std::unique_ptr<ModelBackend>> Create(const CudaBackendOptions& o) {
    return CreateCudaBackend(checkpoint_->config, checkpoint_->weights, o);
  }
  static int64_t Bound(const ModelBackend& b) { return GetCudaKvPoolStats(b).value().max_bytes; }
  static inline Checkpoint* checkpoint_ = nullptr;
};

// The default (0.9) on whatever device runs the test: a bound above 0, at most 0.9 of the device
// and at most what is free once the backend is made.
TEST_F(CudaKvBoundTest, TheDefaultBoundIsBelowTheFractionOfTheDevice) {
  CudaBackendOptions options;
  ASSERT_EQ(options.memory_utilization, 0.9);
  auto gpu = Create(options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  EXPECT_GT(Bound(**gpu), 0);
  EXPECT_LE(double(Bound(**gpu)), 0.9 * double(total));
  EXPECT_LE(Bound(**gpu), int64_t(free_bytes));
}

// An explicit bound wins (three blocks of each kind and a byte, as mapped: a device's granules
// make that 2 MiB an array); 0 turns the fraction off; a fraction outside [0, 1] is refused.
TEST_F(CudaKvBoundTest, AnExplicitBoundWinsAndZeroMeansNone) {
  CudaBackendOptions options;
  auto probe = Create(options);
  ASSERT_TRUE(probe.ok()) << probe.status();
  const int64_t one_each = GetCudaKvPoolStats(**probe).value().min_bytes;
  ASSERT_GT(one_each, 0);
  (*probe).reset();
  options.kv_pool_max_bytes = size_t(3 * one_each + 1);
  options.memory_utilization = 0.5;
  auto explicit_bound = Create(options);
  ASSERT_TRUE(explicit_bound.ok()) << explicit_bound.status();
  EXPECT_EQ(Bound(**explicit_bound), 3 * one_each + 1);
  options.kv_pool_max_bytes = 0;
  options.memory_utilization = 0;
  auto none = Create(options);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(Bound(**none), 0);
  for (const double bad : {-0.5, 1.5}) {
    options.memory_utilization = bad;
    auto refused = Create(options);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

#if defined(DGSERVE_CUDA_EMULATION)
// Blocks of one position: each layer's K and V array holds one row of KvHeads × HeadDim elements
// a block, at most 256 bytes here, so a pool of one block maps a whole granule (the emulation's:
// 256 bytes) per array. One block of each kind is 2 · num_layers · 256 bytes, more than its rows;
// a bound one byte below that is refused at creation.
TEST_F(CudaKvBoundTest, PoolArraysAreWholeGranules) {
  const ModelConfig& c = checkpoint_->config;
  for (int l = 0; l < c.num_layers; ++l) {
    ASSERT_LE(c.KvHeads(l) * c.HeadDim(l) * 4, 256) << "layer " << l;  // the premise
  }
  CudaBackendOptions options;
  options.kv_block_size = 1;
  options.memory_utilization = 0;
  auto gpu = Create(options);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const int64_t want = 2 * int64_t(c.num_layers) * 256;
  EXPECT_EQ(GetCudaKvPoolStats(**gpu).value().min_bytes, want);
  EXPECT_LT(CudaKvBytesPerSequence(c, 1, options), want);  // the rows alone
  options.kv_pool_max_bytes = size_t(want - 1);
  const auto refused = Create(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find(absl::StrCat("(", want, " bytes, ")), std::string::npos)
      << refused.status();
  options.kv_pool_max_bytes = size_t(want);
  EXPECT_TRUE(Create(options).ok());
}

// Under a device limit L with the backend's own memory W (its weights and buffers, measured here
// by a backend with no bound, whose creation allocates what the next one's does), nothing else
// in use, and a fraction of 0.5:
//   L = 2W + 160 KiB: the bound is 0.5 L − W = 80 KiB (the free memory, W + 160 KiB, is more);
//     CheckKvFits refuses a sequence beyond it naming the flag;
//   L = 10 W at 0.9: the bound is 8 W, more than half of the 9 W free (the pools grow in place:
//     they once had to fit twice, old arrays beside new, and the bound was at most 4.5 W);
//   memory another backend holds is not this one's: with W / 2 taken first (L grown by W), the
//     bound is still 0.5 L − W;
//   L = 2 (W + one block of each kind, as mapped: CudaKvPoolStats::min_bytes) gives exactly one
//     block of each kind; 2 bytes less, one byte less than that: FAILED_PRECONDITION naming the
//     fraction.
TEST_F(CudaKvBoundTest, TheFractionLessTheBackendsOwnMemoryIsTheBound) {
  struct Unlimited {  // the limit lifted however the test ends (it is process-wide)
    ~Unlimited() { cuda::emu::SetDeviceMemoryLimit(0); }
  } unlimited;
  cuda::emu::SetDeviceMemoryLimit(size_t(1) << 40);
  size_t free_bytes = 0, total = 0;
  cuda::emu::DeviceMemoryInfo(&free_bytes, &total);
  ASSERT_EQ(total - free_bytes, 0u);  // nothing else in use
  size_t own = 0;
  int64_t one_each = 0;
  {
    CudaBackendOptions none;
    none.memory_utilization = 0;
    auto gpu = Create(none);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    cuda::emu::DeviceMemoryInfo(&free_bytes, &total);
    own = total - free_bytes;
    ASSERT_GT(own, 0u);
    one_each = GetCudaKvPoolStats(**gpu).value().min_bytes;
  }
  // One block of each kind as mapped: each layer's K and V array rounded up to whole granules
  // (the emulation's are 256 bytes, which the tiny model's arrays already are: no rounding).
  EXPECT_EQ(one_each, CudaKvBytesPerSequence(checkpoint_->config, 1, CudaBackendOptions{}));
  EXPECT_EQ(one_each % 256, 0);
  CudaBackendOptions half;
  half.memory_utilization = 0.5;
  cuda::emu::SetDeviceMemoryLimit(2 * own + 160 * 1024);
  {
    auto gpu = Create(half);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_EQ(Bound(**gpu), 80 * 1024);
    ContiguousKvCache like(checkpoint_->config, 16);
    KvPassPlan plan;
    plan.positions = 16;
    EXPECT_TRUE((*gpu)->CheckKvFits(like, plan).ok());
    plan.positions = 1 << 20;
    const absl::Status refused = (*gpu)->CheckKvFits(like, plan);
    EXPECT_EQ(refused.code(), absl::StatusCode::kOutOfRange) << refused;
    EXPECT_NE(refused.message().find("bound is 81920 bytes"), std::string::npos) << refused;
    EXPECT_NE(refused.message().find("--cuda_memory_utilization"), std::string::npos) << refused;
  }
  {
    // W / 2 held by someone else: the bound is 0.5 L − W = W / 2 + 80 KiB (the free memory,
    // 1.5 W + 160 KiB, is more); subtracting all memory in use would give 80 KiB.
    const size_t other = own / 512 * 256;
    const size_t limit = 2 * own + 2 * other + 160 * 1024;
    cuda::emu::SetDeviceMemoryLimit(limit);
    void* held = nullptr;
    ASSERT_EQ(cudaMalloc(&held, other), cudaSuccess);
    auto gpu = Create(half);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_EQ(Bound(**gpu), int64_t(other + 80 * 1024));
    (*gpu).reset();
    cudaFree(held);
  }
  {
    // L = 10 W at 0.9: 8 W, more than half the free memory.
    CudaBackendOptions most;
    most.memory_utilization = 0.9;
    cuda::emu::SetDeviceMemoryLimit(10 * own);
    auto gpu = Create(most);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_NEAR(double(Bound(**gpu)), 8.0 * double(own), 1.0);
    cuda::emu::DeviceMemoryInfo(&free_bytes, &total);
    EXPECT_EQ(free_bytes, 9 * own);
    EXPECT_GT(Bound(**gpu), int64_t(free_bytes / 2));
  }
  cuda::emu::SetDeviceMemoryLimit(2 * (own + size_t(one_each)));
  {
    auto gpu = Create(half);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_EQ(Bound(**gpu), one_each);
  }
  cuda::emu::SetDeviceMemoryLimit(2 * (own + size_t(one_each)) - 2);
  auto refused = Create(half);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("memory_utilization 0.5"), std::string::npos)
      << refused.status();
}
#endif

}  // namespace
}  // namespace dgserve::kv
