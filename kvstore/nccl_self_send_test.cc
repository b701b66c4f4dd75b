// NCCL on one GPU (label gpu; tools/gpu_check.sh runs it where only one GPU exists, since NCCL
// refuses two ranks of one communicator on one device): a 1-rank communicator whose rank 0
// sends KV-block-sized buffers to itself with grouped ncclSend/ncclRecv on a dedicated stream,
// the received bytes compared with the sent ones. Standalone: it checks the NCCL library, the
// driver and the grouped point-to-point pattern the NCCL KV transport uses, not kvstore code.
// Skipped without a GPU. Every wait is bounded: a transfer that does not finish within 20 s
// aborts the communicator (ncclCommAbort) and fails the test instead of hanging.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace {

#define ASSERT_CUDA(expr)                                                      \
  do {                                                                         \
    cudaError_t e_ = (expr);                                                   \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);     \
  } while (0)
#define ASSERT_NCCL(expr)                                                      \
  do {                                                                         \
    ncclResult_t r_ = (expr);                                                  \
    ASSERT_TRUE(r_ == ncclSuccess || r_ == ncclInProgress)                     \
        << #expr << ": " << ncclGetErrorString(r_);                            \
  } while (0)

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Waits until `stream` has finished the grouped transfer or `comm` reports an error, at most
// `timeout`; aborts the communicator on error or timeout. Returns "" on success.
std::string WaitBounded(ncclComm_t comm, cudaStream_t stream, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &async) != ncclSuccess ||
        (async != ncclSuccess && async != ncclInProgress)) {
      ncclCommAbort(comm);
      return std::string("NCCL async error: ") + ncclGetErrorString(async);
    }
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess && async == ncclSuccess) return "";
    if (q != cudaSuccess && q != cudaErrorNotReady) {
      ncclCommAbort(comm);
      return std::string("stream error: ") + cudaGetErrorString(q);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      ncclCommAbort(comm);
      return "timed out; communicator aborted";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// One 1-rank non-blocking communicator on device 0.
class NcclSelfSendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
    ASSERT_CUDA(cudaSetDevice(0));
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclUniqueId id;
    ASSERT_NCCL(ncclGetUniqueId(&id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ASSERT_NCCL(ncclCommInitRankConfig(&comm_, 1, id, 0, &config));
    // A non-blocking init returns ncclInProgress until it completes.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) {
      ASSERT_EQ(ncclCommGetAsyncError(comm_, &state), ncclSuccess);
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "ncclCommInitRankConfig hangs";
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(state, ncclSuccess) << ncclGetErrorString(state);
    int count = 0;
    ASSERT_NCCL(ncclCommCount(comm_, &count));
    ASSERT_EQ(count, 1);
  }
  void TearDown() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Sends `blocks` buffers of `block_bytes` each from rank 0 to rank 0 in one group and checks
  // every received byte.
  void SendBlocks(int blocks, size_t block_bytes) {
    std::vector<uint8_t*> src(blocks, nullptr), dst(blocks, nullptr);
    std::vector<uint8_t> host(block_bytes), back(block_bytes);
    for (int b = 0; b < blocks; ++b) {
      ASSERT_CUDA(cudaMalloc(&src[b], block_bytes));
      ASSERT_CUDA(cudaMalloc(&dst[b], block_bytes));
      for (size_t i = 0; i < block_bytes; ++i) host[i] = uint8_t((i * 131 + b * 17 + 7) & 0xff);
      ASSERT_CUDA(cudaMemcpy(src[b], host.data(), block_bytes, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemset(dst[b], 0, block_bytes));
    }
    ASSERT_NCCL(ncclGroupStart());
    for (int b = 0; b < blocks; ++b) {
      ASSERT_NCCL(ncclSend(src[b], block_bytes, ncclUint8, /*peer=*/0, comm_, stream_));
      ASSERT_NCCL(ncclRecv(dst[b], block_bytes, ncclUint8, /*peer=*/0, comm_, stream_));
    }
    ASSERT_NCCL(ncclGroupEnd());
    const std::string err = WaitBounded(comm_, stream_, std::chrono::seconds(20));
    if (!err.empty()) comm_ = nullptr;  // aborted
    ASSERT_EQ(err, "");
    for (int b = 0; b < blocks; ++b) {
      for (size_t i = 0; i < block_bytes; ++i) host[i] = uint8_t((i * 131 + b * 17 + 7) & 0xff);
      ASSERT_CUDA(cudaMemcpy(back.data(), dst[b], block_bytes, cudaMemcpyDeviceToHost));
      size_t bad = 0;
      while (bad < block_bytes && back[bad] == host[bad]) ++bad;
      EXPECT_EQ(bad, block_bytes) << "block " << b << " differs first at byte " << bad;
      cudaFree(src[b]);
      cudaFree(dst[b]);
    }
  }

  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
};

// One block of the real-width checkpoint (bench/configs/real-width-2-layers.json): 16 token
// positions × (sliding layer: K and V, 8 heads × 256; full layer: shared K=V, 2 heads × 512)
// float32 = 16 × 5120 × 4 bytes.
constexpr size_t kRealWidthBlockBytes = size_t(16) * 5120 * 4;

TEST_F(NcclSelfSendTest, OneBlock) { SendBlocks(1, kRealWidthBlockBytes); }

TEST_F(NcclSelfSendTest, ManyBlocksInOneGroup) { SendBlocks(64, kRealWidthBlockBytes); }

TEST_F(NcclSelfSendTest, OddSizedBlocks) { SendBlocks(7, 1000003); }

}  // namespace
