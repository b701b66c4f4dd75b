// Test helpers for the KV metrics tests (kv_metrics_test.cc, kv_metrics_device_test.cc): read one
// series of a registry the way a scrape would.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace dgserve::kv_metrics_testing {

// The names of the families `registry` exports now.
inline std::vector<std::string> FamilyNames(prometheus::Registry& registry) {
  std::vector<std::string> names;
  for (const prometheus::MetricFamily& f : registry.Collect()) names.push_back(f.name);
  return names;
}

// The value of the gauge or counter series `name`{labels} (labels exactly these); nullopt when
// the registry has no such series.
inline std::optional<double> Value(prometheus::Registry& registry, const std::string& name,
                                   const std::map<std::string, std::string>& labels = {}) {
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != name) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      std::map<std::string, std::string> have;
      for (const prometheus::ClientMetric::Label& l : m.label) have[l.name] = l.value;
      if (have != labels) continue;
      return f.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
    }
  }
  return std::nullopt;
}

// The number of series of family `name` (0 when absent).
inline size_t SeriesCount(prometheus::Registry& registry, const std::string& name) {
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name == name) return f.metric.size();
  }
  return 0;
}

}  // namespace dgserve::kv_metrics_testing
