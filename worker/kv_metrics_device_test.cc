// KvMetrics' device K/V pool series (UpdateDevice) on a real CUDA backend: label gpu-emu (the
// backend's host code over the emulated kernels; GetDeviceKvStats compiled with the CUDA backend
// linked in), and gpu in a CUDA build. On the tiny-v512 random checkpoint (full layers: 1 K/V
// head of 32, bf16 on the device; sliding layers: 2 heads of 16, float32; W = 8) with device
// blocks of 16 positions: an encode of 50 tokens, the deferred host copy, and an upload of a
// cache the CPU backend filled, each followed by an update; every exported value equals the
// backend's own stats (GetCudaKvPoolStats / GetCudaKvCopyStats), and the block counts and bytes
// equal what is computed here by hand from the shape.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/model/backend.h"
#include "engine/model/backend_select.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "prometheus/registry.h"
#include "worker/kv_metrics.h"
#include "worker/kv_metrics_test_util.h"

namespace dgserve {
namespace {

using kv_metrics_testing::SeriesCount;
using kv_metrics_testing::Value;

constexpr int kBlock = 16;  // CudaBackendOptions::kv_block_size

class KvMetricsCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<Checkpoint> ckpt = testing::LoadRandomTinyV512("kv_metrics_device_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ckpt_ = std::make_unique<Checkpoint>(*std::move(ckpt));
    ASSERT_EQ(config().sliding_window, 8);
    CudaBackendOptions options;
    options.kv_block_size = kBlock;
    auto gpu = CreateCudaBackend(config(), ckpt_->weights, options);
    if (!gpu.ok() && gpu.status().code() == absl::StatusCode::kFailedPrecondition) {
      GTEST_SKIP() << gpu.status();  // a CUDA build on a machine without a GPU
    }
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = *std::move(gpu);
    cpu_ = CreateCpuBackend(config(), ckpt_->weights);
  }
  const ModelConfig& config() const { return ckpt_->config; }
  std::vector<int32_t> Tokens(int n, int salt) const {
    std::vector<int32_t> t(n);
    for (int i = 0; i < n; ++i) t[i] = (i * 37 + 11 + salt * 101) % config().vocab_size;
    return t;
  }
  static void Encode(ModelBackend& b, KvCache& kv, const std::vector<int32_t>& tokens) {
    EncodeInput in{tokens, &kv};
    const absl::Status st = b.Encode({&in, 1});
    ASSERT_TRUE(st.ok()) << st;
  }
  // Device bytes of `rows` positions of every layer of `full` (or sliding) kind, K and V, as the
  // device stores them: bf16 where the tensor cores read them (head_dim a multiple of 32, the
  // default options), else float32.
  int64_t KindBytes(bool full, int64_t rows) const {
    int64_t bytes = 0;
    for (int l = 0; l < config().num_layers; ++l) {
      if (config().IsFull(l) != full) continue;
      const int elem = config().HeadDim(l) % 32 == 0 ? 2 : 4;
      bytes += 2 * rows * config().KvHeads(l) * config().HeadDim(l) * elem;
    }
    return bytes;
  }
  std::optional<double> Blocks(const std::string& kind, const std::string& state) {
    return Value(registry_, "dgserve_prefill_device_kv_blocks", {{"kind", kind}, {"state", state}});
  }
  std::optional<double> Metric(const std::string& suffix) {
    return Value(registry_, "dgserve_prefill_device_kv_" + suffix);
  }
  // Every exported value against the backend's stats, read here directly.
  void ExpectEqualsStats(const std::string& when) {
    SCOPED_TRACE(when);
    const CudaKvPoolStats p = GetCudaKvPoolStats(*gpu_).value();
    const CudaKvCopyStats c = GetCudaKvCopyStats(*gpu_).value();
    EXPECT_EQ(SeriesCount(registry_, "dgserve_prefill_device_kv_blocks"), 6u);
    EXPECT_EQ(Blocks("full", "in_use"), p.full_blocks_in_use);
    EXPECT_EQ(Blocks("full", "cached"), p.full_blocks_cached);
    EXPECT_EQ(Blocks("full", "free"), p.full_blocks - p.full_blocks_in_use - p.full_blocks_cached);
    EXPECT_EQ(Blocks("sliding", "in_use"), p.sliding_blocks_in_use);
    EXPECT_EQ(Blocks("sliding", "cached"), p.sliding_blocks_cached);
    EXPECT_EQ(Blocks("sliding", "free"),
              p.sliding_blocks - p.sliding_blocks_in_use - p.sliding_blocks_cached);
    EXPECT_EQ(Metric("bytes"), double(p.device_bytes));
    // The bound memory_utilization's default (0.9) gives: below 0.9 of the device, above 0.
    EXPECT_EQ(Metric("max_bytes"), double(p.max_bytes));
    EXPECT_GT(p.max_bytes, 0);
    EXPECT_EQ(Metric("shared_blocks_total"), double(p.shared_blocks_taken));
    EXPECT_EQ(Metric("swap_outs_total"), double(p.swap_outs));
    EXPECT_EQ(Metric("upload_bytes_total"), double(c.upload_bytes));
    EXPECT_EQ(Metric("sync_to_host_bytes_total"), double(c.sync_to_host_bytes));
  }

  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<ModelBackend> gpu_, cpu_;
  prometheus::Registry registry_;
};

TEST_F(KvMetricsCudaTest, ExportsThePoolsOfTheCudaBackend) {
  ASSERT_TRUE(GetDeviceKvStats(*gpu_).has_value());
  EXPECT_FALSE(GetDeviceKvStats(*cpu_).has_value());
  KvMetrics metrics(registry_, "prefill", /*prefix_cache=*/true);
  EXPECT_EQ(SeriesCount(registry_, "dgserve_prefill_device_kv_blocks"), 0u);  // none before

  // A fresh backend: the series exist, every one 0 (no block allocated yet).
  metrics.UpdateDevice(*gpu_);
  ExpectEqualsStats("fresh");
  EXPECT_EQ(Blocks("full", "in_use"), 0);
  EXPECT_EQ(Blocks("full", "free"), 0);
  EXPECT_EQ(Metric("bytes"), 0);
  EXPECT_EQ(Metric("upload_bytes_total"), 0);

  // 50 tokens encoded: the full layers hold ⌈50 / 16⌉ = 4 blocks; the sliding layers the blocks
  // of positions [50 − 7, 50) = [43, 50), blocks 2 and 3: 2 blocks.
  constexpr int kTokens = 50;
  ContiguousKvCache kv(config(), 64);
  Encode(*gpu_, kv, Tokens(kTokens, 1));
  metrics.UpdateDevice(*gpu_);
  ExpectEqualsStats("after the encode");
  EXPECT_EQ(Blocks("full", "in_use"), (kTokens + kBlock - 1) / kBlock);
  EXPECT_EQ(Blocks("sliding", "in_use"), 2);
  EXPECT_EQ(Blocks("full", "cached"), 0);
  const CudaKvPoolStats p = GetCudaKvPoolStats(*gpu_).value();
  EXPECT_GE(p.full_blocks, 4);
  EXPECT_EQ(Metric("bytes"), double(KindBytes(true, int64_t(p.full_blocks) * kBlock) +
                                    KindBytes(false, int64_t(p.sliding_blocks) * kBlock)));
  EXPECT_EQ(Metric("upload_bytes_total"), 0);        // the encoder wrote the rows on the device
  EXPECT_EQ(Metric("sync_to_host_bytes_total"), 0);  // deferred: not yet on the host

  // The deferred host copy: every position of the full layers and the last W − 1 = 7 of the
  // sliding ones (the rows the cache keeps), as stored on the device.
  ASSERT_TRUE(gpu_->SyncKvToHost(kv).ok());
  metrics.UpdateDevice(*gpu_);
  ExpectEqualsStats("after SyncKvToHost");
  EXPECT_EQ(Metric("sync_to_host_bytes_total"),
            double(KindBytes(true, kTokens) + KindBytes(false, 7)));

  // A cache the CPU backend filled (20 tokens), then 4 more on the device: the backend uploads
  // its host rows first, and the counter advances by the stats' difference.
  const double sync_before = *Metric("sync_to_host_bytes_total");
  ContiguousKvCache host(config(), 64);
  Encode(*cpu_, host, Tokens(20, 2));
  Encode(*gpu_, host, Tokens(4, 3));
  metrics.UpdateDevice(*gpu_);
  ExpectEqualsStats("after the upload");
  EXPECT_GT(*Metric("upload_bytes_total"), 0);
  EXPECT_EQ(Metric("sync_to_host_bytes_total"), sync_before);
  // The second sequence, 24 positions: ⌈24 / 16⌉ = 2 more full blocks in use, and on the
  // sliding layers the block of positions [24 − 7, 24) = [17, 24): block 1, 1 more.
  EXPECT_EQ(Blocks("full", "in_use"), 4 + 2);
  EXPECT_EQ(Blocks("sliding", "in_use"), 2 + 1);
}

}  // namespace
}  // namespace dgserve
