#include "engine/denoise/stopping.h"

#include <algorithm>

namespace dgserve {

float MeanEntropy(std::span<const float> entropy) {
  if (entropy.empty()) return 0.0f;
  float sum = 0.0f;
  for (float h : entropy) sum += h;
  return sum / static_cast<float>(entropy.size());
}

StableAndConfidentStop::StableAndConfidentStop(int stability_threshold, float confidence_threshold)
    : stability_threshold_(std::max(0, stability_threshold)),
      confidence_threshold_(confidence_threshold) {}

bool StableAndConfidentStop::Update(std::span<const int32_t> argmax_canvas, float mean_entropy) {
  if (stability_threshold_ > 0 && history_.empty()) {
    history_.assign(stability_threshold_, std::vector<int32_t>(argmax_canvas.size(), -1));
  }
  stable_ = std::all_of(history_.begin(), history_.end(), [&](const std::vector<int32_t>& h) {
    return std::equal(h.begin(), h.end(), argmax_canvas.begin(), argmax_canvas.end());
  });
  if (stability_threshold_ > 0) {
    history_.pop_front();
    history_.emplace_back(argmax_canvas.begin(), argmax_canvas.end());
  }
  argmax_unchanged_ = !previous_.empty() && std::equal(previous_.begin(), previous_.end(),
                                                       argmax_canvas.begin(), argmax_canvas.end());
  previous_.assign(argmax_canvas.begin(), argmax_canvas.end());
  confident_ = mean_entropy < confidence_threshold_;
  return stop();
}

}  // namespace dgserve
