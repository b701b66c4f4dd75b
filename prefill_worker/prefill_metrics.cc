#include "prefill_worker/prefill_metrics.h"

#include "service/metric_builders.h"

namespace dgserve {

PrefillMetrics::PrefillMetrics(prometheus::Registry& r)
    : requests(prometheus::BuildCounter()
                   .Name("dgserve_prefill_requests_total")
                   .Help("Prefill requests by final status (gRPC code name)")
                   .Register(r)),
      computed_tokens(MakeCounter(r, "dgserve_prefill_computed_tokens_total",
                                  "Prompt tokens run through the encoder")),
      cached_tokens(MakeCounter(r, "dgserve_prefill_cached_tokens_total",
                                "Prompt tokens reused from the prefix cache")),
      chunk_tokens(MakeHistogram(r, "dgserve_prefill_chunk_tokens",
                                 "Tokens of one request's chunk in an encoder step",
                                 {16, 32, 64, 128, 256, 512, 1024, 2048, 4096})),
      step_tokens(MakeHistogram(r, "dgserve_prefill_step_tokens",
                                "Tokens of one batched encoder step",
                                {16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192})),
      step_seconds(MakeHistogram(r, "dgserve_prefill_step_duration_seconds",
                                 "Wall time of one batched encoder step",
                                 {0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10})),
      request_seconds(MakeHistogram(r, "dgserve_prefill_duration_seconds",
                                    "Queue and encoder time of one prompt",
                                    {0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30})),
      queue_depth(MakeGauge(r, "dgserve_prefill_queue_depth", "Prompts queued or running")),
      tokens_per_second(MakeGauge(r, "dgserve_prefill_tokens_per_second",
                                  "Encoder throughput of the last step (tokens/s)")),
      queued_for_kv_memory(MakeGauge(
          r, "dgserve_prefill_queued_for_kv_memory",
          "Prompts waiting to start because the device K/V memory would not hold the first of "
          "them beside the running ones")),
      passes_in_parts(MakeCounter(
          r, "dgserve_prefill_passes_in_parts_total",
          "Encoder passes refused for want of K/V memory (RESOURCE_EXHAUSTED: the device block "
          "pool or the host KV pool full) and ran in parts")),
      kv_push_waits(MakeCounter(
          r, "dgserve_prefill_kv_push_waits_total",
          "Prompts whose KV push the denoise worker refused for want of free blocks and that "
          "waited for room (--kv_push_wait_ms), each counted once")) {}

}  // namespace dgserve
