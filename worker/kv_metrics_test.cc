// KvMetrics' device K/V pool series (UpdateDevice) without a GPU: none at all for the CPU
// backend, and the series of a snapshot sequence set and advanced as the values written out by
// hand below. The CUDA backend's own values: kv_metrics_device_test.cc (label gpu-emu).
#include "worker/kv_metrics.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/model/backend.h"
#include "engine/model/backend_select.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "kvstore/block_pool.h"
#include "prometheus/registry.h"
#include "worker/kv_metrics_test_util.h"

namespace dgserve {
namespace {

using kv_metrics_testing::FamilyNames;
using kv_metrics_testing::SeriesCount;
using kv_metrics_testing::Value;

// A CPU worker: its backend has no device pools, so after an encode and any number of updates
// not one device_kv series exists (no series that never move), for either component.
TEST(KvMetricsDeviceTest, CpuBackendExportsNoDeviceSeries) {
  absl::StatusOr<Checkpoint> ckpt = testing::LoadRandomTinyV512("kv_metrics_test");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::unique_ptr<ModelBackend> cpu = CreateCpuBackend(ckpt->config, ckpt->weights);
  ContiguousKvCache kv(ckpt->config, 64);
  const std::vector<int32_t> tokens = {2, 17, 33, 5, 9, 41, 12, 7, 3, 30};
  EncodeInput in{tokens, &kv};
  ASSERT_TRUE(cpu->Encode({&in, 1}).ok());
  EXPECT_FALSE(GetDeviceKvStats(*cpu).has_value());

  prometheus::Registry registry;
  KvMetrics prefill(registry, "prefill", /*prefix_cache=*/true);
  KvMetrics denoise(registry, "denoise", /*prefix_cache=*/false);
  for (int i = 0; i < 3; ++i) {
    prefill.Update(kv::PoolStats{});
    prefill.UpdateDevice(*cpu);
    denoise.UpdateDevice(*cpu);
  }
  const std::vector<std::string> names = FamilyNames(registry);
  ASSERT_FALSE(names.empty());  // the host pool's series are there
  for (const std::string& name : names) {
    EXPECT_EQ(name.find("device_kv"), std::string::npos) << name;
  }
  EXPECT_EQ(SeriesCount(registry, "dgserve_prefill_device_kv_blocks"), 0u);
  EXPECT_FALSE(Value(registry, "dgserve_denoise_device_kv_bytes").has_value());
}

// Two snapshots by hand: the gauges are the latest snapshot's (free = allocated − in_use −
// cached), the counters its running totals (first snapshot: the whole total; then the
// difference; a total that went down is not counted back).
TEST(KvMetricsDeviceTest, SnapshotsSetGaugesAndAdvanceCounters) {
  prometheus::Registry registry;
  KvMetrics m(registry, "denoise", /*prefix_cache=*/false);
  EXPECT_EQ(SeriesCount(registry, "dgserve_denoise_device_kv_blocks"), 0u);

  DeviceKvStats s;
  s.block_size = 64;
  s.blocks[DeviceKvStats::kFull] = 16;
  s.in_use[DeviceKvStats::kFull] = 5;
  s.cached[DeviceKvStats::kFull] = 3;
  s.blocks[DeviceKvStats::kSliding] = 8;
  s.in_use[DeviceKvStats::kSliding] = 2;
  s.cached[DeviceKvStats::kSliding] = 0;
  s.device_bytes = 123456;
  s.max_bytes = 5000000;
  s.shared_blocks_taken = 7;
  s.swap_outs = 1;
  s.growths = 2;
  s.upload_bytes = 4096;
  s.sync_to_host_bytes = 1000;
  m.UpdateDevice(s);

  const std::string b = "dgserve_denoise_device_kv_blocks";
  EXPECT_EQ(SeriesCount(registry, b), 6u);
  EXPECT_EQ(Value(registry, b, {{"kind", "full"}, {"state", "in_use"}}), 5);
  EXPECT_EQ(Value(registry, b, {{"kind", "full"}, {"state", "cached"}}), 3);
  EXPECT_EQ(Value(registry, b, {{"kind", "full"}, {"state", "free"}}), 8);  // 16 − 5 − 3
  EXPECT_EQ(Value(registry, b, {{"kind", "sliding"}, {"state", "in_use"}}), 2);
  EXPECT_EQ(Value(registry, b, {{"kind", "sliding"}, {"state", "cached"}}), 0);
  EXPECT_EQ(Value(registry, b, {{"kind", "sliding"}, {"state", "free"}}), 6);  // 8 − 2 − 0
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_bytes"), 123456);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_max_bytes"), 5000000);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_shared_blocks_total"), 7);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_swap_outs_total"), 1);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_growths_total"), 2);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_upload_bytes_total"), 4096);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_sync_to_host_bytes_total"), 1000);

  s.blocks[DeviceKvStats::kFull] = 32;  // the pool doubled
  s.in_use[DeviceKvStats::kFull] = 20;
  s.cached[DeviceKvStats::kFull] = 0;
  s.device_bytes = 246912;
  s.shared_blocks_taken = 10;
  s.swap_outs = 1;
  s.growths = 3;
  s.upload_bytes = 4096 + 512;
  s.sync_to_host_bytes = 900;  // went down (not a real backend's): not counted back
  m.UpdateDevice(s);
  m.UpdateDevice(s);  // the same snapshot again: nothing moves
  EXPECT_EQ(Value(registry, b, {{"kind", "full"}, {"state", "in_use"}}), 20);
  EXPECT_EQ(Value(registry, b, {{"kind", "full"}, {"state", "cached"}}), 0);
  EXPECT_EQ(Value(registry, b, {{"kind", "full"}, {"state", "free"}}), 12);  // 32 − 20
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_bytes"), 246912);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_shared_blocks_total"), 10);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_swap_outs_total"), 1);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_growths_total"), 3);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_upload_bytes_total"), 4608);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_sync_to_host_bytes_total"), 1000);
  s.sync_to_host_bytes = 950;  // counted from the last snapshot (900): +50
  m.UpdateDevice(s);
  EXPECT_EQ(Value(registry, "dgserve_denoise_device_kv_sync_to_host_bytes_total"), 1050);
  // The host pool's families are untouched by the device ones.
  EXPECT_EQ(SeriesCount(registry, "dgserve_denoise_kv_blocks"), 4u);  // no "cached" state
}

}  // namespace
}  // namespace dgserve
