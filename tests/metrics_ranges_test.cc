// The histograms' ranges cover what requests may ask for: a canvas of up to 1,024 steps
// (kMaxDenoisingStepsCap) and canvases of minutes land in a finite bucket, not only in +Inf.
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <string>

#include "denoise_worker/denoise_metrics.h"
#include "engine/denoise/sampler_params.h"
#include "gateway/gateway_metrics.h"

namespace dgserve {
namespace {

// The smallest finite upper bound of histogram `name` whose cumulative count is ≥ 1 (the one
// observation made), or -1 when the observation is only in +Inf.
double BucketOf(prometheus::Registry& registry, const std::string& name) {
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != name) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      for (const prometheus::ClientMetric::Bucket& b : m.histogram.bucket) {
        if (b.upper_bound != std::numeric_limits<double>::infinity() && b.cumulative_count >= 1) {
          return b.upper_bound;
        }
      }
    }
  }
  return -1;
}

TEST(MetricsRangesTest, GatewayStepsPerCanvasReachTheStepCap) {
  prometheus::Registry registry;
  GatewayMetrics m(registry);
  m.steps_per_canvas.Observe(kMaxDenoisingStepsCap);
  EXPECT_EQ(BucketOf(registry, "dgserve_gateway_steps_per_canvas"), kMaxDenoisingStepsCap);
}

TEST(MetricsRangesTest, DenoiseStepsPerCanvasAndCanvasDuration) {
  prometheus::Registry registry;
  DenoiseMetrics m(registry);
  m.steps_per_canvas.Observe(kMaxDenoisingStepsCap);
  EXPECT_EQ(BucketOf(registry, "dgserve_denoise_steps_per_canvas"), kMaxDenoisingStepsCap);
  m.steps_per_canvas.Observe(600);
  m.canvas_seconds.Observe(500);  // a long canvas on a CPU: minutes
  EXPECT_EQ(BucketOf(registry, "dgserve_denoise_canvas_duration_seconds"), 600);
}

}  // namespace
}  // namespace dgserve
