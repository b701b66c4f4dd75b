#include "worker/kv_metrics.h"

#include <string_view>

namespace dgserve {

KvMetrics::KvMetrics(prometheus::Registry& r, const std::string& c, bool prefix_cache)
    : blocks_(prometheus::BuildGauge()
                  .Name("dgserve_" + c + "_kv_blocks")
                  .Help(prefix_cache ? "KV blocks by layer kind and state (used: referenced; cached: "
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
                             .Register(r)) {
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

void KvMetrics::RecordTransferFailure(const std::string& transport) {
  transfer_failures_.Add({{"transport", transport}}).Increment();
}

}  // namespace dgserve
