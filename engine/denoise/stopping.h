// The StableAndConfident early-stop rule of the denoising loop (spec §4.2 step 7, golden README
// §4).
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <vector>

namespace dgserve {

// Mean of the per-position float32 entropies as the golden data computes it: a float32 running
// sum in position order, divided by (float)size in float32 (reproduces every recorded
// `mean_entropy` bit for bit). Empty input → 0.
float MeanEntropy(std::span<const float> entropy);

// Tracks the stop rule for one canvas: after each step,
//   stable    = the argmax canvas equals each of the last S argmax canvases (S =
//               stability_threshold; the history starts as S canvases of −1, so step 0 is never
//               stable when S ≥ 1; S = 0 → always stable); then the canvas is pushed (oldest
//               dropped);
//   confident = mean_entropy < κ (strict);
//   stop      = stable ∧ confident.
class StableAndConfidentStop {
 public:
  // `stability_threshold` S ≥ 0, `confidence_threshold` κ > 0 (see ValidateSamplerParams).
  StableAndConfidentStop(int stability_threshold, float confidence_threshold);

  // Records one step: `argmax_canvas` (length C, the same C on every call) and its mean entropy
  // (nats, see MeanEntropy). Returns stop.
  bool Update(std::span<const int32_t> argmax_canvas, float mean_entropy);

  // Results of the last Update (false before the first).
  bool stable() const { return stable_; }
  // Whether the last Update's argmax canvas equalled the previous Update's (false at the first),
  // whatever S is. This is what the golden traces record as `stable` (README §5): for S = 1 it
  // equals stable(); for S = 0 the rule's stable() is always true while this may be false.
  bool argmax_unchanged() const { return argmax_unchanged_; }
  bool confident() const { return confident_; }
  bool stop() const { return stable_ && confident_; }

 private:
  int stability_threshold_;
  float confidence_threshold_;
  std::deque<std::vector<int32_t>> history_;  // the last S argmax canvases, oldest first
  std::vector<int32_t> previous_;             // the last argmax canvas (empty before the first)
  bool stable_ = false;
  bool argmax_unchanged_ = false;
  bool confident_ = false;
};

}  // namespace dgserve
