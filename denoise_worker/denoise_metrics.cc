#include "denoise_worker/denoise_metrics.h"

#include "service/metric_builders.h"

namespace dgserve {
namespace {

using prometheus::Histogram;

Histogram::BucketBoundaries Seconds() {
  return {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

// A canvas can take up to 1,024 steps of a large batch: minutes on a CPU.
Histogram::BucketBoundaries LongSeconds() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800};
}

}  // namespace

DenoiseMetrics::DenoiseMetrics(prometheus::Registry& r)
    : requests(prometheus::BuildCounter()
                   .Name("dgserve_denoise_requests_total")
                   .Help("Denoise requests by final status (gRPC code name)")
                   .Register(r)),
      requests_ok(requests.Add({{"status", "OK"}})),
      steps_per_canvas(MakeHistogram(r, "dgserve_denoise_steps_per_canvas",
                                     "Denoising steps (decoder passes) spent per canvas",
                                     StepsPerCanvasBuckets())),
      canvas_seconds(MakeHistogram(r, "dgserve_denoise_canvas_duration_seconds",
                                   "Wall time of one canvas from its first step to commit",
                                   LongSeconds())),
      accepted_per_step(MakeHistogram(r, "dgserve_denoise_accepted_tokens_per_step",
                                      "Canvas positions accepted by the entropy bound per step",
                                      {0, 1, 2, 4, 8, 16, 32, 64, 128, 256})),
      commit_mean_entropy(MakeHistogram(r, "dgserve_denoise_commit_mean_entropy_nats",
                                        "Mean per-position entropy of the last step of a canvas",
                                        {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10})),
      batch_canvases(MakeHistogram(r, "dgserve_denoise_batch_canvases",
                                   "Canvases in one batched decoder pass",
                                   {1, 2, 4, 8, 16, 32, 64})),
      step_seconds(MakeHistogram(r, "dgserve_denoise_step_duration_seconds",
                                 "Wall time of one batched denoising step", Seconds())),
      commit_seconds(MakeHistogram(r, "dgserve_denoise_commit_duration_seconds",
                                   "Wall time of one batched commit (encoder) pass", Seconds())),
      first_step_seconds(MakeHistogram(r, "dgserve_denoise_time_to_first_step_seconds",
                                       "Denoise request arrival to its first canvas step",
                                       Seconds())),
      kv_wait_seconds(MakeHistogram(r, "dgserve_denoise_kv_wait_seconds",
                                    "Denoise request arrival to its prompt KV being complete",
                                    Seconds())),
      output_tokens(MakeCounter(r, "dgserve_denoise_output_tokens_total",
                                "Committed canvas tokens (whole canvases, before stop handling)")),
      canvases(MakeCounter(r, "dgserve_denoise_canvases_total", "Canvases committed")),
      samples(MakeCounter(r, "dgserve_denoise_samples_total",
                          "Samples started (a request with num_samples = n counts n)")),
      decoder_passes(MakeCounter(r, "dgserve_denoise_decoder_passes_total",
                                 "Per-canvas decoder passes (denoising steps)")),
      passes_in_parts(MakeCounter(
          r, "dgserve_denoise_passes_in_parts_total",
          "Denoising steps and commit passes the backend refused for want of K/V memory "
          "(RESOURCE_EXHAUSTED: the device block pool full) and ran in parts")),
      active_canvases(
          MakeGauge(r, "dgserve_denoise_active_canvases", "Canvases in the running batch")),
      queue_depth(MakeGauge(r, "dgserve_denoise_queue_depth",
                            "Requests waiting for their prompt KV or a batch slot")),
      queued_for_kv_memory(
          MakeGauge(r, "dgserve_denoise_queued_for_kv_memory",
                    "Samples whose KV has arrived waiting to join the batch because the device K/V "
                    "memory would not hold the first of them beside the running ones")) {}

}  // namespace dgserve
