// The emulator itself (label `gpu-emu`): warp collectives and block barriers give CUDA's
// results, and the kernel bugs it promises to report fail the launch.
#include "engine/cuda/emu/cuda_emu.h"

#include <cstdint>
#include <vector>

#include "engine/cuda/cuda_device.cuh"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

// One value per thread: the collectives of one warp.
__global__ void WarpKernel(int* out) {
  const int t = threadIdx.x, lane = t % 32;
  const int xor_sum = [&] {
    int v = t;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  }();
  const int up = __shfl_up_sync(0xffffffffu, t, 3);
  const int down = __shfl_down_sync(0xffffffffu, t, 5);
  const int bcast = __shfl_sync(0xffffffffu, t * 10, 7);
  const unsigned ballot = __ballot_sync(0xffffffffu, lane % 3 == 0);
  const int any = __any_sync(0xffffffffu, lane == 31), all = __all_sync(0xffffffffu, lane < 31);
  int* o = out + t * 7;
  o[0] = xor_sum;
  o[1] = up;
  o[2] = down;
  o[3] = bcast;
  o[4] = int(ballot);
  o[5] = any;
  o[6] = all;
}

TEST(CudaEmuTest, WarpCollectivesMatchCuda) {
  std::vector<int> out(64 * 7, -1);
  LaunchKernel(WarpKernel, 1, 64, 0, nullptr, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  unsigned every_third = 0;
  for (int l = 0; l < 32; l += 3) every_third |= 1u << l;
  for (int t = 0; t < 64; ++t) {
    const int w = t / 32 * 32, lane = t % 32;
    const int* o = &out[t * 7];
    EXPECT_EQ(o[0], 32 * w + 31 * 32 / 2) << t;  // Σ of the warp's thread ids
    EXPECT_EQ(o[1], lane >= 3 ? t - 3 : t) << t;
    EXPECT_EQ(o[2], lane + 5 < 32 ? t + 5 : t) << t;
    EXPECT_EQ(o[3], (w + 7) * 10) << t;
    EXPECT_EQ(unsigned(o[4]), every_third) << t;
    EXPECT_EQ(o[5], 1) << t;
    EXPECT_EQ(o[6], 0) << t;
  }
}

// Shuffles over groups of 16 lanes (width 16).
__global__ void Width16Kernel(int* out) {
  const int t = threadIdx.x;
  out[t * 4] = __shfl_sync(0xffffffffu, t, 3, 16);
  out[t * 4 + 1] = __shfl_up_sync(0xffffffffu, t, 2, 16);
  out[t * 4 + 2] = __shfl_down_sync(0xffffffffu, t, 2, 16);
  out[t * 4 + 3] = __shfl_xor_sync(0xffffffffu, t, 16, 16);
}

TEST(CudaEmuTest, ShufflesOfWidth16StayInTheirGroup) {
  std::vector<int> out(32 * 4, -1);
  LaunchKernel(Width16Kernel, 1, 32, 0, nullptr, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < 32; ++t) {
    const int base = t / 16 * 16, in_group = t % 16;
    EXPECT_EQ(out[t * 4], base + 3) << t;
    EXPECT_EQ(out[t * 4 + 1], in_group >= 2 ? t - 2 : t) << t;
    EXPECT_EQ(out[t * 4 + 2], in_group + 2 < 16 ? t + 2 : t) << t;
    // xor 16 reads the other group: allowed into an earlier group only.
    EXPECT_EQ(out[t * 4 + 3], t >= 16 ? t - 16 : t) << t;
  }
}

// Block votes after whole warps have exited count only the threads still running.
__global__ void VotesAfterExitKernel(int* out) {
  if (threadIdx.x >= 64) return;
  const int all = __syncthreads_and(1);
  const int count = __syncthreads_count(threadIdx.x % 4 == 0);
  if (threadIdx.x == 0) {
    out[0] = all;
    out[1] = count;
  }
}

TEST(CudaEmuTest, BlockVotesIgnoreExitedThreads) {
  std::vector<int> out(2, -1);
  LaunchKernel(VotesAfterExitKernel, 1, 128, 0, nullptr, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(out[0], 1);
  EXPECT_EQ(out[1], 16);
}

// A shared-memory tree reduction and the block votes, over a 2-D block and a 2-D grid.
__global__ void BlockKernel(const int* in, int* sums, int* votes) {
  __shared__ int partial[256];
  const int t = threadIdx.y * blockDim.x + threadIdx.x, n = blockDim.x * blockDim.y;
  const int b = blockIdx.y * gridDim.x + blockIdx.x;
  partial[t] = in[b * n + t];
  __syncthreads();
  for (int s = n / 2; s > 0; s >>= 1) {
    if (t < s) partial[t] += partial[t + s];
    __syncthreads();
  }
  const int count = __syncthreads_count(in[b * n + t] % 2);
  const int any = __syncthreads_or(t == n - 1);
  const int all = __syncthreads_and(t >= 0);
  if (t == 0) {
    sums[b] = partial[0];
    votes[b * 3] = count;
    votes[b * 3 + 1] = any;
    votes[b * 3 + 2] = all;
  }
  atomicAdd(&sums[6], 1);
}

TEST(CudaEmuTest, BlockBarriersAndVotesMatchCuda) {
  const int n = 256, blocks = 6;
  std::vector<int> in(n * blocks), sums(blocks + 1, 0), votes(3 * blocks, -1);
  for (size_t i = 0; i < in.size(); ++i) in[i] = int(i * 7 % 11);
  LaunchKernel(BlockKernel, dim3(3, 2), dim3(32, 8), 0, nullptr, in.data(), sums.data(),
               votes.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int b = 0; b < blocks; ++b) {
    int sum = 0, odd = 0;
    for (int t = 0; t < n; ++t) {
      sum += in[b * n + t];
      odd += in[b * n + t] % 2;
    }
    EXPECT_EQ(sums[b], sum) << b;
    EXPECT_EQ(votes[b * 3], odd) << b;
    EXPECT_EQ(votes[b * 3 + 1], 1) << b;
    EXPECT_EQ(votes[b * 3 + 2], 1) << b;
  }
  EXPECT_EQ(sums[6], n * blocks);  // every thread's atomicAdd
}

// Kernel bugs the emulator reports as a failed launch (cudaErrorLaunchFailure, sticky until
// cudaDeviceReset, as a device fault).
__global__ void DivergentBarrierKernel(int* out) {
  if (threadIdx.x < 40) __syncthreads();  // threads 40.. never arrive, and do not exit first
  if (threadIdx.x >= 40) __syncwarp();
  out[threadIdx.x] = 1;
}

__global__ void ExitedLaneKernel(int* out) {
  if (threadIdx.x % 32 == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

__global__ void MixedCollectivesKernel(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x % 2 == 0)
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  else
    v = int(__ballot_sync(0xffffffffu, v > 3));
  out[threadIdx.x] = v;
}

__global__ void DynamicSharedKernel(int* out) {
  int* s = DynamicShared<int>();
  s[threadIdx.x] = int(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

class CudaEmuFaultTest : public ::testing::Test {
 protected:
  void TearDown() override { cudaDeviceReset(); }
  static void ExpectLaunchFailure() {
    EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorLaunchFailure);  // sticky
  }
};

TEST_F(CudaEmuFaultTest, BarrierNotReachedByEveryThreadFails) {
  std::vector<int> out(64, 0);
  LaunchKernel(DivergentBarrierKernel, 1, 64, 0, nullptr, out.data());
  ExpectLaunchFailure();
}

TEST_F(CudaEmuFaultTest, ShuffleWithAnExitedLaneFails) {
  std::vector<int> out(64, 0);
  LaunchKernel(ExitedLaneKernel, 1, 64, 0, nullptr, out.data());
  ExpectLaunchFailure();
}

TEST_F(CudaEmuFaultTest, LanesAtDifferentCollectivesFail) {
  std::vector<int> out(32, 0);
  LaunchKernel(MixedCollectivesKernel, 1, 32, 0, nullptr, out.data());
  ExpectLaunchFailure();
}

TEST_F(CudaEmuFaultTest, DynamicSharedMemoryNeedsTheOptInAbove48KiB) {
  std::vector<int> out(128, -1);
  LaunchKernel(DynamicSharedKernel, 1, 128, 64 * 1024, nullptr, out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(out[0], -1);  // not run
  ASSERT_EQ(cudaFuncSetAttribute(DynamicSharedKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 64 * 1024),
            cudaSuccess);
  LaunchKernel(DynamicSharedKernel, 1, 128, 64 * 1024, nullptr, out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < 128; ++t) EXPECT_EQ(out[t], 127 - t);
}

TEST_F(CudaEmuFaultTest, TooManyThreadsPerBlockIsAConfigurationError) {
  std::vector<int> out(2048, 0);
  LaunchKernel(DynamicSharedKernel, 1, 2048, 0, nullptr, out.data());
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // not sticky: nothing ran
}

}  // namespace
}  // namespace dgserve::cuda
