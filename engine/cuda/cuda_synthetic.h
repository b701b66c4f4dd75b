// Synthetic weights generated on the device (issue 33: the full 26B shape measured without a
// 52 GB checkpoint on disk or in host memory). Element i of a tensor is the element formula of
// dgserve-mkmodel's random checkpoint (engine/model/random_checkpoint.h, golden README §2.3):
//   x = SplitMix64(key + i), q = (x >> 40) − 2²³, v = q · 2⁻²³, w = c + v·a (or v·a), bf16(w)
// with key = TensorKey(name, seed) and (a, c) the tensor family's constants, so a tensor filled
// here is bit for bit the tensor RandomBf16 gives on the host (and the one the checkpoint
// writer stores): the same distributions, activations as sane as the random checkpoints'.
// The float arithmetic is written with explicit round-to-nearest intrinsics (no FMA contraction).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cuda {

struct SyntheticTensor {
  uint64_t key = 0;  // TensorKey(name, seed)
  float a = 0, c = 0;
  bool has_offset = false;
};

// out[i] = the element's bf16 bits, i in [0, n). Device pointer; runs on `stream`.
absl::Status FillSyntheticBf16(const SyntheticTensor& t, int64_t n, uint16_t* out,
                               void* stream = nullptr);
// out[i] = the element widened to float32 (exact), as the loader widens bf16 tensors.
absl::Status FillSyntheticFloat(const SyntheticTensor& t, int64_t n, float* out,
                                void* stream = nullptr);

}  // namespace dgserve::cuda
