// The fixture of the CUDA backend's deferred host copy tests (cuda_kv_authority_test.cc) and device
// K/V block-pool tests (cuda_kv_pool_test.cc): one test suite, CudaKvAuthorityTest, in two files
// of cuda_backend_test / cuda_backend_emu_test, instantiated once (in cuda_kv_authority_test.cc)
// over the AuthorityMode values there. On the tiny-v512 random checkpoint (W = 8): gpu_ with the
// deferred host copy (CudaBackendOptions::defer_kv_host_copy, the default), copy_ with the same
// options copying the rows to the host in every pass, and the checks the tests share.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_backend_testing.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/kv_cache.h"

// Not in an anonymous namespace: both files' tests must see one fixture type (gtest refuses a
// test suite whose TEST_Ps name different types).
namespace dgserve::kv::authority_test {

struct AuthorityMode {
  const char* name;
  cuda::GemmInput gpu;
  cpu::GemmInput cpu;
  bool own_projections;
  bool tensor_core_attention;  // bf16 mirrors on the full layers of this shape (head_dim 32)
  int kv_block_size;           // CudaBackendOptions::kv_block_size (0: per-sequence mirrors)
};
inline void PrintTo(const AuthorityMode& m, std::ostream* os) { *os << m.name; }

class CudaKvAuthorityTest : public backend_testing::CpuGpuTest<CudaKvAuthorityTest, AuthorityMode> {
 public:
  static std::unique_ptr<Checkpoint> MakeCheckpoint() {
    return backend_testing::TinyV512Checkpoint("cuda_kv_authority_test");
  }

 protected:
  CudaBackendOptions GpuOptions() const override {
    CudaBackendOptions options = CpuGpuTest::GpuOptions();
    options.tensor_core_attention = GetParam().tensor_core_attention;
    options.kv_block_size = GetParam().kv_block_size;
    return options;
  }
  void SetUp() override {
    CpuGpuTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(GpuOptions().defer_kv_host_copy);  // gpu_: the default
    ASSERT_EQ(config().sliding_window, 8);
    CudaBackendOptions copy_options = GpuOptions();
    copy_options.defer_kv_host_copy = false;
    auto copy = CreateCudaBackend(config(), checkpoint_->weights, copy_options);
    ASSERT_TRUE(copy.ok()) << copy.status();
    copy_ = std::move(*copy);
  }
  void TearDown() override {
    copy_.reset();
    CpuGpuTest::TearDown();
  }

  // Whether layer l's mirror stores bf16 (CudaBackendOptions::bf16_kv_mirror on the tensor-core
  // layers: head_dim a multiple of 32).
  bool Bf16Layer(int l) const {
    return GetParam().tensor_core_attention && config().HeadDim(l) % 32 == 0;
  }
  // Device bytes SyncKvToHost moves for rows [from_full, n) of the full layers and
  // [from_sliding, n) of the sliding ones, as the mirror stores them.
  int64_t MirrorBytes(int from_full, int from_sliding, int n) const {
    int64_t bytes = 0;
    for (int l = 0; l < config().num_layers; ++l) {
      const int rows = n - (config().IsFull(l) ? from_full : from_sliding);
      bytes +=
          2 * int64_t(rows) * config().KvHeads(l) * config().HeadDim(l) * (Bf16Layer(l) ? 2 : 4);
    }
    return bytes;
  }
  // `got`'s rows [from_full | from_sliding, n) equal `want`'s (rounded to bf16 on the bf16
  // layers) bit for bit.
  void ExpectRowsOf(const KvCache& want, const KvCache& got, int from_full, int from_sliding,
                    const std::string& what) const {
    const int n = got.num_tokens();
    ASSERT_EQ(want.num_tokens(), n) << what;
    for (int l = 0; l < config().num_layers; ++l) {
      const size_t w = size_t(config().KvHeads(l)) * config().HeadDim(l);
      for (int p = config().IsFull(l) ? from_full : from_sliding; p < n; ++p) {
        for (const auto& [g, x] : {std::pair{got.KeyRow(l, p), want.KeyRow(l, p)},
                                   std::pair{got.ValueRow(l, p), want.ValueRow(l, p)}}) {
          for (size_t i = 0; i < w; ++i) {
            const float y = Bf16Layer(l) ? RoundToBf16(x[i]) : x[i];
            ASSERT_EQ(std::memcmp(&g[i], &y, sizeof(float)), 0)
                << what << ": layer " << l << " position " << p << " element " << i;
          }
        }
      }
    }
  }
  static void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                             const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    size_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], 4) != 0;
    EXPECT_EQ(differ, 0u) << what;
  }

#if defined(DGSERVE_CUDA_EMULATION)
  // A third sequence's pass with the device itself short of memory (`spare` bytes free): the
  // helper of the emulation-only pool tests, defined in cuda_kv_pool_test.cc.
  CudaKvPoolStats RunThirdSequenceShortOfMemory(size_t spare, bool* first_kept, bool* first_stale);
#endif

  std::unique_ptr<ModelBackend> copy_;
};

}  // namespace dgserve::kv::authority_test
