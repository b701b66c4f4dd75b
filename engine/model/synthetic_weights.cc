#include "engine/model/synthetic_weights.h"

#include <stdexcept>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/weight_destinations.h"

namespace dgserve {
namespace {


}  // namespace

std::vector<TensorSpec> SyntheticMatrixSpecs(const ModelConfig& config) {
  std::vector<TensorSpec> out;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    if (spec.shape.size() >= 2) out.push_back(spec);
  }
  return out;
}

ModelWeights SyntheticModelWeights(const ModelConfig& config, uint64_t seed, bool matrices) {
  ModelWeights w;
  const std::unordered_map<std::string, Destination> dest = Destinations(config, &w);
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    auto it = dest.find(spec.name);
    if (it == dest.end()) {
      throw std::logic_error(absl::StrCat("SyntheticModelWeights: no destination for ", spec.name));
    }
    const Destination& d = it->second;
    if (d.vec != nullptr || d.scalar != nullptr) {
      const int64_t n = spec.numel();
      std::vector<float> f(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) f[i] = Bf16ToFloat(RandomBf16(spec, seed, i));
      if (d.scalar != nullptr) {
        *d.scalar = n > 0 ? f[0] : 0.0f;
      } else {
        *d.vec = std::move(f);
      }
      continue;
    }
    if (!matrices) continue;
    std::vector<uint16_t> bits = RandomTensorBf16(spec, seed);
    if (d.experts != nullptr) {
      const int experts = int(spec.shape[0]), rows = int(spec.shape[1]), cols = int(spec.shape[2]);
      d.experts->clear();
      for (int e = 0; e < experts; ++e) {
        d.experts->push_back(
            cpu::PackedMatrix::FromBf16(bits.data() + size_t(e) * rows * cols, rows, cols));
      }
    } else if (d.embedding) {
      w.lm_head = cpu::PackedMatrix::FromBf16(bits.data(), int(spec.shape[0]), int(spec.shape[1]));
      w.embed_tokens = std::move(bits);
    } else {
      *d.matrix = cpu::PackedMatrix::FromBf16(bits.data(), int(spec.shape[0]), int(spec.shape[1]));
    }
  }
  return w;
}

}  // namespace dgserve
