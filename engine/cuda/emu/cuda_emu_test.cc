// The emulator itself (label `gpu-emu`): warp collectives and block barriers give CUDA's
// results, and the kernel bugs it promises to report fail the launch.
#include "engine/cuda/emu/cuda_emu.h"

#include <cuda.h>  // the emulated driver API (include/cuda.h)

#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_mma.cuh"
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

// SetDeviceMemoryLimit: cudaMalloc beyond the limit fails as CUDA's does (the error also left as
// the last error), cudaMemGetInfo reports the limit and what is left; freeing gives it back.
TEST(CudaEmuTest, DeviceMemoryLimit) {
  size_t free_bytes = 0, total = 0;
  emu::SetDeviceMemoryLimit(size_t(1) << 40);
  emu::DeviceMemoryInfo(&free_bytes, &total);
  const size_t in_use = total - free_bytes;
  emu::SetDeviceMemoryLimit(in_use + 4096);
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  EXPECT_EQ(free_bytes, 4096u);
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, 3000), cudaSuccess);
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  EXPECT_EQ(free_bytes, 1096u);
  EXPECT_EQ(cudaMalloc(&b, 2000), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaFree(a), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, 2000), cudaSuccess);
  ASSERT_EQ(cudaFree(b), cudaSuccess);
  emu::SetDeviceMemoryLimit(0);
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  EXPECT_EQ(free_bytes, total);
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

// The matrix-core instructions (cuda_mma.cuh): their fragment layouts are tested in
// cuda_mma_test.cc; here what the emulation promises to report.
__global__ void MmaExitedLaneKernel(float* out) {
  if (threadIdx.x == 31) return;  // mma.sync.aligned needs the whole warp
  uint32_t a[4] = {}, b[2] = {};
  float d[4] = {};
  mma::MmaBf16M16N8K16(d, a, b);
  out[threadIdx.x] = d[0];
}

__global__ void MmaAndShuffleKernel(float* out) {
  uint32_t a[4] = {}, b[2] = {};
  float d[4] = {};
  if (threadIdx.x < 16)
    mma::MmaBf16M16N8K16(d, a, b);
  else
    d[0] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  out[threadIdx.x] = d[0];
}

__global__ void LdMatrixMisalignedKernel(uint32_t* out) {
  __shared__ uint16_t rows[40 * 8 + 8];
  uint32_t r[4];
  // Rows 16-byte aligned except lane 9's, 2 bytes off.
  const uintptr_t base = (reinterpret_cast<uintptr_t>(rows) + 15) & ~uintptr_t(15);
  const uint16_t* row =
      reinterpret_cast<const uint16_t*>(base) + threadIdx.x * 8 + (threadIdx.x == 9 ? 1 : 0);
  mma::LdMatrixX4(r, row);
  out[threadIdx.x] = r[0];
}

// Thread t copies 16 bytes to shared row t; out[t] = row t's first word read before the wait
// and row (t + 1) % n's read after the thread's wait and a barrier.
__global__ void CpAsyncKernel(const uint32_t* src, uint32_t* before, uint32_t* after) {
  uint32_t* s = DynamicShared<uint32_t>();
  const int t = threadIdx.x, n = blockDim.x;
  mma::CpAsync16(s + 4 * t, src + 4 * t);
  mma::CpAsyncCommit();
  before[t] = s[4 * t];  // not landed yet: 0xFFFFFFFF from fresh dynamic shared memory
  mma::CpAsyncWaitGroup<0>();
  __syncthreads();
  after[t] = s[4 * ((t + 1) % n)];
}

// Two groups: wait_group 1 completes the older one only; wait_all the rest.
__global__ void CpAsyncGroupsKernel(const uint32_t* src, uint32_t* out) {
  uint32_t* s = DynamicShared<uint32_t>();
  mma::CpAsync16(s, src);
  mma::CpAsyncCommit();
  mma::CpAsync16(s + 4, src + 4);
  mma::CpAsyncCommit();
  mma::CpAsync16(s + 8, src + 8);  // never committed: only wait_all covers it
  mma::CpAsyncWaitGroup<1>();
  out[0] = s[0];
  out[1] = s[4];
  out[2] = s[8];
  mma::CpAsyncWaitAll();
  out[3] = s[4];
  out[4] = s[8];
}

TEST(CudaEmuMmaTest, CpAsyncLandsAtItsWait) {
  const int n = 64;
  std::vector<uint32_t> src(4 * n), before(n, 0), after(n, 0);
  for (int i = 0; i < 4 * n; ++i) src[i] = uint32_t(1000 + i);
  // 16-byte aligned source: vector storage of uint32 is only 4-byte aligned by contract.
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, src.size() * 4), cudaSuccess);
  std::memcpy(dev, src.data(), src.size() * 4);
  LaunchKernel(CpAsyncKernel, 1, n, n * 16, nullptr, static_cast<const uint32_t*>(dev),
               before.data(), after.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (int t = 0; t < n; ++t) {
    EXPECT_EQ(before[t], 0xFFFFFFFFu) << t;
    EXPECT_EQ(after[t], src[4 * ((t + 1) % n)]) << t;
  }
  std::vector<uint32_t> out(5, 0);
  LaunchKernel(CpAsyncGroupsKernel, 1, 1, 64, nullptr, static_cast<const uint32_t*>(dev),
               out.data());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(out[0], src[0]);
  EXPECT_EQ(out[1], 0xFFFFFFFFu);
  EXPECT_EQ(out[2], 0xFFFFFFFFu);
  EXPECT_EQ(out[3], src[4]);
  EXPECT_EQ(out[4], src[8]);
  cudaFree(dev);
}

TEST_F(CudaEmuFaultTest, MmaWithAnExitedLaneFails) {
  std::vector<float> out(32, 0);
  LaunchKernel(MmaExitedLaneKernel, 1, 32, 0, nullptr, out.data());
  ExpectLaunchFailure();
}

TEST_F(CudaEmuFaultTest, MmaInAWarpOfFewerThan32ThreadsFails) {
  std::vector<float> out(32, 0);
  LaunchKernel(MmaAndShuffleKernel, 1, 16, 0, nullptr, out.data());
  ExpectLaunchFailure();
}

TEST_F(CudaEmuFaultTest, MmaAndAShuffleInOneWarpFail) {
  std::vector<float> out(32, 0);
  LaunchKernel(MmaAndShuffleKernel, 1, 32, 0, nullptr, out.data());
  ExpectLaunchFailure();
}

TEST_F(CudaEmuFaultTest, LdMatrixRowNotAlignedTo16BytesFails) {
  std::vector<uint32_t> out(32, 0);
  LaunchKernel(LdMatrixMisalignedKernel, 1, 32, 0, nullptr, out.data());
  ExpectLaunchFailure();
}

// The emulated driver API's virtual memory management, reached as the backend reaches it
// (cudaGetDriverEntryPointByVersion): the driver's rules that cuda_reserved_memory.cc relies on
// are enforced (whole mappings only, no mapping over another, no freeing a range still mapped,
// nothing during a capture), and a handle's memory counts until it is both released and
// unmapped.
TEST(CudaEmuVmmTest, TheDriversRulesHold) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSuccess;
  ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuMemMap", &fn, 12000, cudaEnableDefault, &found),
            cudaSuccess);
  EXPECT_EQ(found, cudaDriverEntryPointSuccess);
  EXPECT_EQ(fn, reinterpret_cast<void*>(&cuMemMap));
  ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuNoSuch", &fn, 12000, cudaEnableDefault, &found),
            cudaSuccess);
  EXPECT_EQ(found, cudaDriverEntryPointSymbolNotFound);
  EXPECT_EQ(fn, nullptr);

  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  size_t g = 0;
  ASSERT_EQ(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            CUDA_SUCCESS);
  ASSERT_EQ(g, 256u);
  emu::SetDeviceMemoryLimit(size_t(1) << 40);
  size_t free_bytes = 0, total = 0;
  emu::DeviceMemoryInfo(&free_bytes, &total);
  const size_t used = total - free_bytes;
  const auto in_use = [&] {
    emu::DeviceMemoryInfo(&free_bytes, &total);
    return total - free_bytes - used;
  };
  CUdeviceptr base = 0;
  ASSERT_EQ(cuMemAddressReserve(&base, 4 * g, 0, 0, 0), CUDA_SUCCESS);
  EXPECT_TRUE(emu::IsDeviceMemory(reinterpret_cast<void*>(base), 4 * g));
  CUmemGenericAllocationHandle a = 0, b = 0;
  ASSERT_EQ(cuMemCreate(&a, 2 * g, &prop, 0), CUDA_SUCCESS);
  ASSERT_EQ(cuMemCreate(&b, g, &prop, 0), CUDA_SUCCESS);
  EXPECT_EQ(in_use(), 3 * g);
  ASSERT_EQ(cuMemMap(base, 2 * g, 0, a, 0), CUDA_SUCCESS);
  EXPECT_EQ(cuMemMap(base + g, g, 0, b, 0), CUDA_ERROR_INVALID_VALUE);      // over a
  EXPECT_EQ(cuMemMap(base + 4 * g, g, 0, b, 0), CUDA_ERROR_INVALID_VALUE);  // past the range
  ASSERT_EQ(cuMemMap(base + 2 * g, g, 0, b, 0), CUDA_SUCCESS);
  CUmemAccessDesc rw = {};
  rw.location = prop.location;
  rw.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EXPECT_EQ(cuMemSetAccess(base, 4 * g, &rw, 1), CUDA_ERROR_INVALID_VALUE);  // 4th unmapped
  ASSERT_EQ(cuMemSetAccess(base, 3 * g, &rw, 1), CUDA_SUCCESS);
  auto* p = reinterpret_cast<uint8_t*>(base);
  EXPECT_EQ(p[0], 0xFF);  // unspecified contents
  p[3 * g - 1] = 7;
  EXPECT_EQ(cuMemUnmap(base, g), CUDA_ERROR_INVALID_VALUE);            // half of a's mapping
  EXPECT_EQ(cuMemAddressFree(base, 4 * g), CUDA_ERROR_INVALID_VALUE);  // still mapped
  // Released while mapped: counted until unmapped.
  ASSERT_EQ(cuMemRelease(a), CUDA_SUCCESS);
  EXPECT_EQ(cuMemRelease(a), CUDA_ERROR_INVALID_VALUE);
  EXPECT_EQ(in_use(), 3 * g);
  ASSERT_EQ(cuMemUnmap(base, 3 * g), CUDA_SUCCESS);  // both mappings at once
  EXPECT_EQ(in_use(), g);
  ASSERT_EQ(cuMemRelease(b), CUDA_SUCCESS);
  EXPECT_EQ(in_use(), 0u);
  // Beyond the limit: refused.
  emu::SetDeviceMemoryLimit(used + g);
  EXPECT_EQ(cuMemCreate(&a, 2 * g, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
  emu::SetDeviceMemoryLimit(0);
  // Refused during a capture, as cudaMalloc.
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cuMemCreate(&a, g, &prop, 0), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
  cudaStreamDestroy(s);
  ASSERT_EQ(cuMemAddressFree(base, 4 * g), CUDA_SUCCESS);
  EXPECT_FALSE(emu::IsDeviceMemory(reinterpret_cast<void*>(base), g));
}

}  // namespace
}  // namespace dgserve::cuda
