// The prefill worker's Prometheus metrics (design §4), all named dgserve_prefill_*.
#pragma once

#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dgserve {

struct PrefillMetrics {
  explicit PrefillMetrics(prometheus::Registry& registry);

  prometheus::Family<prometheus::Counter>& requests;  // {status}
  prometheus::Counter& computed_tokens;   // prompt tokens run through the encoder
  prometheus::Counter& cached_tokens;     // prompt tokens reused from the prefix cache
  prometheus::Histogram& chunk_tokens;    // tokens of one request's chunk
  prometheus::Histogram& step_tokens;     // tokens of one batched encoder step
  prometheus::Histogram& step_seconds;
  prometheus::Histogram& request_seconds;  // queue + encode of one prompt
  prometheus::Gauge& queue_depth;
  prometheus::Gauge& tokens_per_second;    // of the last encoder step
  // Prompts held in the queue by the admission check on K/V memory (admit_by_kv_memory).
  prometheus::Gauge& queued_for_kv_memory;
  // Encoder passes the backend refused for want of K/V memory and ran in parts (RunInParts).
  prometheus::Counter& passes_in_parts;
  // Prompts whose KV push found the denoise worker's pool full and waited for room.
  prometheus::Counter& kv_push_waits;

  prometheus::Counter& RequestsWithStatus(const std::string& status) {
    return requests.Add({{"status", status}});
  }
};

}  // namespace dgserve
