#include "worker/kv_metrics.h"

#include <optional>
#include <string_view>

namespace dgserve {

KvMetrics::KvMetrics(prometheus::Registry& r, const std::string& c, bool prefix_cache)
    : blocks_(prometheus::BuildGauge()
                  .Name("dgserve_" + c + "_kv_blocks")
                  .Help(prefix_cache
                            ? "KV blocks by layer kind and state (used: referenced; cached: "
                              "unreferenced prefix-cache blocks; free: not referenced, "
                              "cached included)"
                            : "KV blocks by layer kind and state (used: referenced; free: "
                              "not referenced)")
                  .Register(r)),
      transfer_bytes_(prometheus::BuildCounter()
                          .Name("dgserve_" + c + "_kv_transfer_bytes_total")
                          .Help("KV payload bytes moved, by transport")
                          .Register(r)),
      transfer_seconds_(prometheus::BuildHistogram()
                            .Name("dgserve_" + c + "_kv_transfer_duration_seconds")
                            .Help("Wall time of one request's KV transfer, by transport")
                            .Register(r)),
      transfer_failures_(prometheus::BuildCounter()
                             .Name("dgserve_" + c + "_kv_transfer_failures_total")
                             .Help("Failed KV transfers, by transport")
                             .Register(r)),
      registry_(r),
      component_(c) {
  if (prefix_cache) {
    prefix_queries_ = &prometheus::BuildCounter()
                           .Name("dgserve_" + c + "_prefix_cache_queries_total")
                           .Help("Prefix-cache lookups since start")
                           .Register(r)
                           .Add({});
    prefix_hits_ = &prometheus::BuildCounter()
                        .Name("dgserve_" + c + "_prefix_cache_hits_total")
                        .Help("Served prefills that reused at least one prefix-cache block")
                        .Register(r)
                        .Add({});
    prefix_hit_tokens_ = &prometheus::BuildCounter()
                              .Name("dgserve_" + c + "_prefix_cache_hit_tokens_total")
                              .Help("Prompt tokens of served prefills reused from the prefix cache")
                              .Register(r)
                              .Add({});
  }
  for (const char* kind : {"sliding", "full"}) {
    for (const char* state : {"used", "cached", "free"}) {
      if (prefix_cache || std::string_view(state) != "cached") {
        blocks_.Add({{"kind", kind}, {"state", state}});
      }
    }
  }
  for (const char* t : {"tcp", "inprocess"}) {
    transfer_bytes_.Add({{"transport", t}});
    transfer_failures_.Add({{"transport", t}});
  }
}

void KvMetrics::Update(const kv::PoolStats& s) {
  absl::MutexLock lock(&mu_);
  const char* kinds[] = {"sliding", "full"};
  for (int k = 0; k < kv::kNumKinds; ++k) {
    blocks_.Add({{"kind", kinds[k]}, {"state", "used"}}).Set(double(s.used[k]));
    if (prefix_queries_ != nullptr) {
      blocks_.Add({{"kind", kinds[k]}, {"state", "cached"}}).Set(double(s.cached[k]));
    }
    blocks_.Add({{"kind", kinds[k]}, {"state", "free"}}).Set(double(s.free_blocks[k]));
  }
  if (prefix_queries_ != nullptr) {
    prefix_queries_->Increment(double(s.prefix_queries - last_.prefix_queries));
  }
  last_ = s;
}

void KvMetrics::RecordPrefixHit(int64_t tokens) {
  if (tokens <= 0 || prefix_hits_ == nullptr) return;
  prefix_hits_->Increment();
  prefix_hit_tokens_->Increment(double(tokens));
}

void KvMetrics::RecordTransfer(const std::string& transport, int64_t bytes, double seconds) {
  transfer_bytes_.Add({{"transport", transport}}).Increment(double(bytes));
  transfer_seconds_
      .Add({{"transport", transport}},
           prometheus::Histogram::BucketBoundaries{0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10})
      .Observe(seconds);
}

void KvMetrics::UpdateReceived(const std::string& transport, int64_t total_bytes) {
  absl::MutexLock lock(&mu_);
  int64_t& last = last_received_[transport];
  if (total_bytes > last) {
    transfer_bytes_.Add({{"transport", transport}}).Increment(double(total_bytes - last));
    last = total_bytes;
  }
}

void KvMetrics::UpdateDevice(const ModelBackend& backend) {
  if (const std::optional<DeviceKvStats> s = GetDeviceKvStats(backend); s.has_value()) {
    UpdateDevice(*s);
  }
}

void KvMetrics::UpdateDevice(const DeviceKvStats& s) {
  absl::MutexLock lock(&mu_);
  const std::string& c = component_;
  if (device_blocks_ == nullptr) {
    device_blocks_ = &prometheus::BuildGauge()
                          .Name("dgserve_" + c + "_device_kv_blocks")
                          .Help(
                              "Device K/V blocks by layer kind and state (in_use: held by a "
                              "sequence; cached: held by none, kept for their rows; free: "
                              "allocated, neither)")
                          .Register(registry_);
    device_bytes_ = &prometheus::BuildGauge()
                         .Name("dgserve_" + c + "_device_kv_bytes")
                         .Help("Device memory the K/V block pools hold (every allocated block)")
                         .Register(registry_)
                         .Add({});
    device_max_bytes_ = &prometheus::BuildGauge()
                             .Name("dgserve_" + c + "_device_kv_max_bytes")
                             .Help(
                                 "The device K/V block pools' bound in bytes (--cuda_kv_pool_gb, "
                                 "else --cuda_memory_utilization's share; 0: none)")
                             .Register(registry_)
                             .Add({});
    auto counter = [&](const std::string& name, const std::string& help) {
      return &prometheus::BuildCounter()
                  .Name("dgserve_" + c + "_device_kv_" + name + "_total")
                  .Help(help)
                  .Register(registry_)
                  .Add({});
    };
    device_shared_blocks_ =
        counter("shared_blocks",
                "Device K/V blocks a sequence took from another or from the device "
                "cache instead of uploading their rows");
    device_swap_outs_ = counter("swap_outs",
                                "Idle sequences whose device-only K/V rows were copied to the "
                                "host to free their device blocks");
    device_compactions_ = counter("compactions",
                                  "Device K/V pools compacted to give the other layer kind's "
                                  "pool the memory of their unheld blocks (one shared bound)");
    device_growths_ = counter("growths",
                              "Device K/V pool growths (each maps more device memory, at most "
                              "1 GiB; the mapping stalls the pass that grows the pool)");
    device_upload_bytes_ =
        counter("upload_bytes", "K/V bytes uploaded from host caches to the device");
    device_sync_bytes_ =
        counter("sync_to_host_bytes", "K/V bytes copied from the device to host caches");
  }
  const char* kinds[2];
  kinds[DeviceKvStats::kFull] = "full";
  kinds[DeviceKvStats::kSliding] = "sliding";
  for (int k : {DeviceKvStats::kFull, DeviceKvStats::kSliding}) {
    device_blocks_->Add({{"kind", kinds[k]}, {"state", "in_use"}}).Set(double(s.in_use[k]));
    device_blocks_->Add({{"kind", kinds[k]}, {"state", "cached"}}).Set(double(s.cached[k]));
    device_blocks_->Add({{"kind", kinds[k]}, {"state", "free"}}).Set(double(s.free_blocks(k)));
  }
  device_bytes_->Set(double(s.device_bytes));
  device_max_bytes_->Set(double(s.max_bytes));
  // Running totals of one backend: they only grow (a smaller one is not counted back).
  auto advance = [](prometheus::Counter* counter, int64_t now, int64_t before) {
    if (now > before) counter->Increment(double(now - before));
  };
  advance(device_shared_blocks_, s.shared_blocks_taken, last_device_.shared_blocks_taken);
  advance(device_swap_outs_, s.swap_outs, last_device_.swap_outs);
  advance(device_compactions_, s.compactions, last_device_.compactions);
  advance(device_growths_, s.growths, last_device_.growths);
  advance(device_upload_bytes_, s.upload_bytes, last_device_.upload_bytes);
  advance(device_sync_bytes_, s.sync_to_host_bytes, last_device_.sync_to_host_bytes);
  last_device_ = s;
}

void KvMetrics::RecordTransferFailure(const std::string& transport) {
  transfer_failures_.Add({{"transport", transport}}).Increment();
}

}  // namespace dgserve
