// The denoise worker's Prometheus metrics (design §4), all named dgserve_denoise_*.
#pragma once

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dgserve {

struct DenoiseMetrics {
  explicit DenoiseMetrics(prometheus::Registry& registry);

  prometheus::Family<prometheus::Counter>& requests;  // {status}
  prometheus::Counter& requests_ok;
  prometheus::Histogram& steps_per_canvas;
  prometheus::Histogram& canvas_seconds;
  prometheus::Histogram& accepted_per_step;
  prometheus::Histogram& commit_mean_entropy;
  prometheus::Histogram& batch_canvases;
  prometheus::Histogram& step_seconds;
  prometheus::Histogram& commit_seconds;
  prometheus::Histogram& first_step_seconds;
  prometheus::Histogram& kv_wait_seconds;
  prometheus::Counter& output_tokens;
  prometheus::Counter& canvases;
  prometheus::Counter& samples;  // samples started (num_samples of each request)
  prometheus::Counter& decoder_passes;
  // Steps and commit passes the backend refused for want of K/V memory and ran in parts.
  prometheus::Counter& passes_in_parts;
  prometheus::Gauge& active_canvases;
  prometheus::Gauge& queue_depth;
  // Samples held in the queue by the admission check on K/V memory (admit_by_kv_memory).
  prometheus::Gauge& queued_for_kv_memory;

  prometheus::Counter& RequestsWithStatus(const std::string& status) {
    return requests.Add({{"status", status}});
  }
};

}  // namespace dgserve
