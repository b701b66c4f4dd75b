// KV metrics both workers export (design §4): pool blocks by kind and state, and transfers by
// transport (bytes, seconds, failures); with the CUDA backend also its device K/V block pools.
#pragma once

#include <map>
#include <string>

#include "absl/synchronization/mutex.h"
#include "engine/model/backend.h"
#include "engine/model/backend_select.h"
#include "kvstore/block_pool.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dgserve {

class KvMetrics {
 public:
  // `component` is "prefill" or "denoise": names are dgserve_<component>_kv_*. With
  // `prefix_cache` (the prefill worker: its pool indexes prompts) it also exports
  // dgserve_<component>_prefix_cache_{queries,hits,hit_tokens}_total and the kv_blocks state
  // "cached"; without (the denoise worker, which has no prefix cache) neither exists, rather
  // than series that never move.
  KvMetrics(prometheus::Registry& registry, const std::string& component, bool prefix_cache);

  // Sets the block gauges {kind=sliding|full, state=used|cached|free} (free: not referenced, so
  // it includes the evictable cached blocks; used + free = the pool) and advances the prefix
  // lookup counter (prefix_cache_queries_total).
  void Update(const kv::PoolStats& stats);  // thread-safe
  // A served prefill that reused `tokens` > 0 prompt tokens from the prefix cache (the
  // response's cached_tokens): prefix_cache_hits_total +1, prefix_cache_hit_tokens_total
  // +tokens. A lookup whose blocks no response reused (the prefill failed or was cancelled)
  // is not a hit. Thread-safe.
  void RecordPrefixHit(int64_t tokens);  // no-op without a prefix cache
  void RecordTransfer(const std::string& transport, int64_t bytes, double seconds);
  void RecordTransferFailure(const std::string& transport);
  // The receiving side: advances kv_transfer_bytes_total{transport} to `total_bytes` (the
  // receiver's running total of that transport, KvReceiver::received_bytes_by_path); each
  // transport label keeps its own total. Thread-safe.
  void UpdateReceived(const std::string& transport, int64_t total_bytes);
  // The device K/V block pools of `backend` (GetDeviceKvStats: a CUDA backend's; vLLM's
  // gpu_cache_usage_perc and prefix-cache counters in our terms). The first call that finds
  // them registers
  //   dgserve_<component>_device_kv_blocks{kind=full|sliding, state=in_use|cached|free}
  //     (gauge; free = allocated − in_use − cached),
  //   dgserve_<component>_device_kv_bytes (gauge: device bytes the pools hold),
  //   dgserve_<component>_device_kv_max_bytes (gauge: the pools' bound, 0 for none),
  //   dgserve_<component>_device_kv_{shared_blocks,swap_outs,compactions,growths,upload_bytes,
  //     sync_to_host_bytes}_total (counters, advanced by the difference between snapshots);
  // for any other backend (GetDeviceKvStats nullopt) it does nothing, so a CPU worker exports
  // none of these series. Thread-safe.
  void UpdateDevice(const ModelBackend& backend);
  // The same from a snapshot already taken (the first call registers the series).
  void UpdateDevice(const DeviceKvStats& stats);

 private:
  prometheus::Family<prometheus::Gauge>& blocks_;
  prometheus::Family<prometheus::Counter>& transfer_bytes_;
  prometheus::Family<prometheus::Histogram>& transfer_seconds_;
  prometheus::Family<prometheus::Counter>& transfer_failures_;
  // Null without a prefix cache.
  prometheus::Counter* prefix_queries_ = nullptr;
  prometheus::Counter* prefix_hits_ = nullptr;
  prometheus::Counter* prefix_hit_tokens_ = nullptr;
  prometheus::Registry& registry_;
  const std::string component_;
  // Null until UpdateDevice first finds device pools (guarded by mu_).
  prometheus::Family<prometheus::Gauge>* device_blocks_ = nullptr;
  prometheus::Gauge* device_bytes_ = nullptr;
  prometheus::Gauge* device_max_bytes_ = nullptr;
  prometheus::Counter* device_shared_blocks_ = nullptr;
  prometheus::Counter* device_swap_outs_ = nullptr;
  prometheus::Counter* device_compactions_ = nullptr;
  prometheus::Counter* device_growths_ = nullptr;
  prometheus::Counter* device_upload_bytes_ = nullptr;
  prometheus::Counter* device_sync_bytes_ = nullptr;
  DeviceKvStats last_device_;  // the counters' previous snapshot
  absl::Mutex mu_;
  kv::PoolStats last_;  // counters advance by the difference between snapshots
  std::map<std::string, int64_t> last_received_;  // per transport label
};

}  // namespace dgserve
