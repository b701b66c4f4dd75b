// CUDA graph capture as the backend will use it (issue 33 item 6), and what capture refuses
// (label `gpu` on a device, where it checks that the emulation's rules are CUDA's; and `gpu-emu`,
// where it tests the emulation's capture, engine/cuda/emu/cuda_emu_async.cc): kernels, cuBLAS
// and copies recorded and replayed; a synchronisation, an allocation, a pageable copy or work on
// the legacy stream inside a capture fails it.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "engine/cuda/cuda_backend_kernels.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

class CudaGraphTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    x_ = Alloc<float>(kN);
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(stream_, &status) == cudaSuccess &&
          status != cudaStreamCaptureStatusNone) {
        cudaGraph_t g = nullptr;
        cudaStreamEndCapture(stream_, &g);
        if (g != nullptr) cudaGraphDestroy(g);
      }
      cudaStreamDestroy(stream_);
    }
    cudaGetLastError();  // capture errors are not sticky; leave no last error behind
    CudaTest::TearDown();
  }
  // Ends the capture, which must have been invalidated: no graph.
  void ExpectInvalidated() {
    cudaGraph_t graph = reinterpret_cast<cudaGraph_t>(this);
    EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(graph, nullptr);
    cudaGetLastError();
  }

  static constexpr int kN = 1000;
  cudaStream_t stream_ = nullptr;
  float* x_ = nullptr;
};

// upload (pinned) → x *= 2 → x += x (AddInPlace) → download (pinned), captured once and
// replayed twice: nothing runs at capture, and each replay reads the host buffer as it is then.
TEST_F(CudaGraphTest, CapturedKernelsAndCopiesReplay) {
  float *in = nullptr, *out = nullptr;
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&in), kN * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&out), kN * sizeof(float)), cudaSuccess);
  for (int i = 0; i < kN; ++i) {
    in[i] = float(i);
    out[i] = -1.0f;
  }
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  ASSERT_EQ(cudaStreamIsCapturing(stream_, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  ASSERT_EQ(cudaMemcpyAsync(x_, in, kN * sizeof(float), cudaMemcpyHostToDevice, stream_),
            cudaSuccess);
  ASSERT_TRUE(Scale(x_, kN, 2.0f, stream_).ok());
  ASSERT_TRUE(AddInPlace(x_, x_, kN, stream_).ok());
  ASSERT_EQ(cudaMemcpyAsync(out, x_, kN * sizeof(float), cudaMemcpyDeviceToHost, stream_),
            cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_NE(graph, nullptr);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  EXPECT_EQ(out[7], -1.0f);  // nothing ran
  for (const float factor : {1.0f, 3.0f}) {
    for (int i = 0; i < kN; ++i) in[i] = float(i) * factor;
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (int i = 0; i < kN; ++i) ASSERT_EQ(out[i], 4.0f * float(i) * factor) << i;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(in), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(out), cudaSuccess);
}

// A cuBLAS GEMM on the capturing stream is recorded too (the backend's projections).
TEST_F(CudaGraphTest, CapturedCublasGemmReplays) {
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(handle, stream_), CUBLAS_STATUS_SUCCESS);
  const std::vector<float> a = {1, 2, 3, 4}, b = {5, 6, 7, 8};  // 2×2 column-major
  float* da = Upload(a);
  float* db = Upload(b);
  float* dc = Alloc<float>(4, 0xFF);
  const float one = 1.0f, zero = 0.0f;
  // Once outside the capture first: cuBLAS may set itself up (allocate) on its first call.
  ASSERT_EQ(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, da, 2, db, 2, &zero, dc,
                        2),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaMemsetAsync(dc, 0xFF, 4 * sizeof(float), stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_EQ(
      cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, da, 2, db, 2, &zero, dc, 2),
      CUBLAS_STATUS_SUCCESS);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const std::vector<float> c = Download(dc, 4);
  EXPECT_EQ(c, (std::vector<float>{23, 34, 31, 46}));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cublasDestroy(handle);
}

TEST_F(CudaGraphTest, StreamSynchronizeInCaptureFails) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_TRUE(Scale(x_, kN, 2.0f, stream_).ok());
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidated();
}

TEST_F(CudaGraphTest, DeviceSynchronizeInCaptureFails) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidated();
}

TEST_F(CudaGraphTest, AllocationInCaptureFails) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 256), cudaErrorStreamCaptureUnsupported);
  ExpectInvalidated();
}

TEST_F(CudaGraphTest, PageableCopyInCaptureFails) {
  std::vector<float> pageable(kN, 1.0f);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(
      cudaMemcpyAsync(x_, pageable.data(), kN * sizeof(float), cudaMemcpyHostToDevice, stream_),
      cudaErrorStreamCaptureUnsupported);
  ExpectInvalidated();
}

TEST_F(CudaGraphTest, SynchronousCopyInCaptureFails) {
  std::vector<float> host(kN, 1.0f);
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(x_, host.data(), kN * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorStreamCaptureUnsupported);
  ExpectInvalidated();
}

// A kernel launched on the legacy stream (a forgotten stream argument) while a blocking stream
// captures: cudaErrorStreamCaptureImplicit, and the capture is invalidated.
TEST_F(CudaGraphTest, LegacyStreamLaunchInCaptureFails) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  const absl::Status s = Scale(x_, kN, 2.0f, nullptr);
  EXPECT_FALSE(s.ok());
  ExpectInvalidated();
}

// Relaxed mode tolerates the potentially unsafe calls (an allocation), not a sync of the
// capturing stream.
TEST_F(CudaGraphTest, RelaxedCaptureAllowsAllocation) {
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, 256), cudaSuccess);
  ASSERT_TRUE(Scale(x_, kN, 2.0f, stream_).ok());
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  EXPECT_NE(graph, nullptr);
  if (graph != nullptr) cudaGraphDestroy(graph);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
}

}  // namespace
}  // namespace dgserve::cuda
