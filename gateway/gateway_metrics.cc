#include "gateway/gateway_metrics.h"

#include "service/metric_builders.h"

namespace dgserve {
namespace {

prometheus::Histogram::BucketBoundaries Seconds() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800};
}

}  // namespace

GatewayMetrics::GatewayMetrics(prometheus::Registry& r)
    : requests(prometheus::BuildCounter()
                   .Name("dgserve_gateway_requests_total")
                   .Help("Generation requests by final status (gRPC code name)")
                   .Register(r)),
      prefill_seconds(MakeHistogram(r, "dgserve_gateway_prefill_duration_seconds",
                                    "Prefill and KV transfer of a request (TTFT, part 1)",
                                    Seconds())),
      first_step_seconds(MakeHistogram(r, "dgserve_gateway_time_to_first_step_seconds",
                                       "Request start to its first canvas step", Seconds())),
      first_block_seconds(MakeHistogram(r, "dgserve_gateway_time_to_first_block_seconds",
                                        "Request start to its first committed block (TTFT)",
                                        Seconds())),
      request_seconds(MakeHistogram(r, "dgserve_gateway_request_duration_seconds",
                                    "End-to-end latency of a request", Seconds())),
      steps_per_canvas(MakeHistogram(r, "dgserve_gateway_steps_per_canvas",
                                     "Denoising steps per committed canvas",
                                     StepsPerCanvasBuckets())),
      prompt_tokens(MakeCounter(r, "dgserve_gateway_prompt_tokens_total", "Prompt tokens")),
      tokenized_tokens(MakeCounter(
          r, "dgserve_gateway_tokenized_tokens_total",
          "Token ids produced by the tokenizer and chat template for prompts, also for requests "
          "refused afterwards (tokenizing stops at the context limit)")),
      completion_tokens(MakeCounter(r, "dgserve_gateway_completion_tokens_total",
                                    "Completion tokens returned to clients")),
      samples(MakeCounter(r, "dgserve_gateway_samples_total",
                          "Samples (choices) completed; a request with n = 3 counts 3")),
      cached_prompt_tokens(MakeCounter(r, "dgserve_gateway_cached_prompt_tokens_total",
                                       "Prompt tokens served from a prefix cache")),
      retries(MakeCounter(r, "dgserve_gateway_retries_total",
                          "Attempts repeated on another worker after UNAVAILABLE")),
      resumes(MakeCounter(r, "dgserve_gateway_resumes_total",
                          "Requests continued from their next canvas on other workers after "
                          "the denoise worker failed mid-request")),
      inflight(
          MakeGauge(r, "dgserve_gateway_inflight_requests", "Requests admitted and not finished")),
      queued(MakeGauge(r, "dgserve_gateway_queued_requests",
                       "Requests waiting for admission (--max_queued_requests)")),
      queue_seconds(MakeHistogram(r, "dgserve_gateway_queue_duration_seconds",
                                  "Time a request waited for admission",
                                  {0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                                   60})),
      workers(prometheus::BuildGauge()
                  .Name("dgserve_gateway_workers")
                  .Help("Known workers by role and health")
                  .Register(r)) {}

}  // namespace dgserve
