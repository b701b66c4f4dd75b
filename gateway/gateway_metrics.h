// The gateway's Prometheus metrics (design §4), all named dgserve_gateway_*.
#pragma once

#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dgserve {

struct GatewayMetrics {
  explicit GatewayMetrics(prometheus::Registry& registry);

  prometheus::Family<prometheus::Counter>& requests;  // {status}
  prometheus::Histogram& prefill_seconds;        // TTFT part 1: prefill + KV transfer
  prometheus::Histogram& first_step_seconds;     // TTFT part 2: request start → first canvas step
  prometheus::Histogram& first_block_seconds;    // TTFT part 3: → first committed block
  prometheus::Histogram& request_seconds;        // end to end
  prometheus::Histogram& steps_per_canvas;
  prometheus::Counter& prompt_tokens;
  // Ids the tokenizer and the chat template produced for prompts (text and chat), counted as
  // they are made: also for requests refused afterwards (over the context limit).
  prometheus::Counter& tokenized_tokens;
  prometheus::Counter& completion_tokens;
  prometheus::Counter& samples;  // completed samples (a request with n = 3 counts 3)
  prometheus::Counter& cached_prompt_tokens;
  prometheus::Counter& retries;
  prometheus::Counter& resumes;  // requests continued from their next canvas (--max_resumes)
  prometheus::Gauge& inflight;
  prometheus::Gauge& queued;                // waiting for admission
  prometheus::Histogram& queue_seconds;     // time waited for admission (0 when not queued)
  prometheus::Family<prometheus::Gauge>& workers;  // {role, state}

  prometheus::Counter& RequestsWithStatus(const std::string& status) {
    return requests.Add({{"status", status}});
  }
};

}  // namespace dgserve
