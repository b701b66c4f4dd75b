// One-line builders of unlabelled Prometheus metrics, shared by every service's metrics struct.
#pragma once

#include <string>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dgserve {

inline prometheus::Histogram& MakeHistogram(prometheus::Registry& r, const std::string& name,
                                            const std::string& help,
                                            prometheus::Histogram::BucketBoundaries buckets) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(r).Add({}, buckets);
}

// Buckets of a steps-per-canvas histogram: up to 1,024, the most steps a request may ask for
// (kMaxDenoisingStepsCap in engine/denoise/sampler_params.h).
inline prometheus::Histogram::BucketBoundaries StepsPerCanvasBuckets() {
  return {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024};
}

inline prometheus::Counter& MakeCounter(prometheus::Registry& r, const std::string& name,
                                        const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
}

inline prometheus::Gauge& MakeGauge(prometheus::Registry& r, const std::string& name,
                                    const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
}

}  // namespace dgserve
