// The CUDA kernels against the CPU ops they mirror (label `gpu`; skipped without a GPU).
#include "engine/cuda/cuda_ops.h"

#include <cuda_runtime.h>

#include <cmath>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/cpu/cpu_ops.h"
#include "engine/model/model_math.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
    buffers_.push_back(p);
    return static_cast<T*>(p);
  }
  std::vector<float> Download(const float* device, size_t n) {
    std::vector<float> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }
  void TearDown() override {
    for (void* p : buffers_) cudaFree(p);
  }
  static std::vector<float> Values(size_t n, float scale) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = scale * std::sin(0.37f * float(i) + 0.1f);
    return v;
  }
  static float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
    float m = 0;
    for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
    return m;
  }
  std::vector<void*> buffers_;
};

TEST_F(CudaOpsTest, RmsNormMatchesCpu) {
  const int rows = 37, dim = 704;
  const std::vector<float> x = Values(size_t(rows) * dim, 3.0f), w = Values(dim, 1.5f);
  for (const bool with_weight : {true, false}) {
    std::vector<float> want(x.size());
    cpu::RmsNorm(x.data(), with_weight ? w.data() : nullptr, rows, dim, 1e-6f, want.data());
    float* dx = Upload(x);
    float* dw = Upload(w);
    float* dy = Upload(std::vector<float>(x.size()));
    ASSERT_THAT(RmsNorm(dx, with_weight ? dw : nullptr, rows, dim, 1e-6f, dy), IsOk());
    EXPECT_LT(MaxAbsDiff(Download(dy, x.size()), want), 1e-5f);
  }
}

TEST_F(CudaOpsTest, SoftcapAndGeluGateMatchCpu) {
  const size_t n = 100003;
  std::vector<float> x = Values(n, 80.0f), want = x;
  cpu::Softcap(want.data(), int64_t(n), 30.0f);
  float* dx = Upload(x);
  ASSERT_THAT(Softcap(dx, int64_t(n), 30.0f), IsOk());
  EXPECT_LT(MaxAbsDiff(Download(dx, n), want), 5e-5f);

  const std::vector<float> g = Values(n, 4.0f), u = Values(n, 2.0f);
  std::vector<float> gelu(n);
  cpu::GeluGate(g.data(), u.data(), int64_t(n), gelu.data());
  float* dg = Upload(g);
  float* du = Upload(u);
  float* dout = Upload(std::vector<float>(n));
  ASSERT_THAT(GeluGate(dg, du, int64_t(n), dout), IsOk());
  EXPECT_LT(MaxAbsDiff(Download(dout, n), gelu), 1e-5f);
}

TEST_F(CudaOpsTest, RopeMatchesCpuForBothVariants) {
  const int rows = 9, heads = 4;
  for (const auto& [head_dim, rotated] : {std::pair{32, 16}, std::pair{64, 8}}) {
    const std::vector<float> inv_freq = RopeInvFreq(10000.0f, head_dim, rotated);
    std::vector<float> x = Values(size_t(rows) * heads * head_dim, 1.0f), want = x;
    std::vector<int32_t> pos(rows);
    for (int r = 0; r < rows; ++r) {
      pos[r] = 1000 * r + 7;
      cpu::ApplyRope(want.data() + size_t(r) * heads * head_dim, heads, head_dim, pos[r],
                     inv_freq);
    }
    float* dx = Upload(x);
    ASSERT_THAT(ApplyRope(dx, rows, heads, head_dim, Upload(pos), Upload(inv_freq)), IsOk());
    EXPECT_LT(MaxAbsDiff(Download(dx, x.size()), want), 2e-4f) << "head_dim " << head_dim;
  }
}

TEST(CudaDeviceTest, DeviceCountIsNeverNegative) { EXPECT_GE(DeviceCount(), 0); }

}  // namespace
}  // namespace dgserve::cuda
