#include "engine/model/kv_cache.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace dgserve {

ContiguousKvCache::ContiguousKvCache(const ModelConfig& config, int max_tokens)
    : keys_(config.num_layers),
      values_(config.num_layers),
      sliding_window_(config.sliding_window),
      max_tokens_(max_tokens) {
  for (int l = 0; l < config.num_layers; ++l) {
    row_width_.push_back(config.KvHeads(l) * config.HeadDim(l));
  }
}

absl::Status ContiguousKvCache::Reserve(int count) {
  if (count < 0 || num_tokens_ + count > max_tokens_) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache holds at most ", max_tokens_,
                                                     " tokens; ", num_tokens_, " used, ", count,
                                                     " more requested"));
  }
  reserved_ = count;
  const size_t need = size_t(num_tokens_) + size_t(count);
  for (size_t l = 0; l < keys_.size(); ++l) {
    const size_t w = row_width_[l];
    if (keys_[l].size() < need * w) {
      // Grow geometrically so repeated commits stay amortised O(1).
      size_t cap = std::max(need, keys_[l].size() / w * 2);
      cap = std::min(cap, size_t(max_tokens_));
      keys_[l].resize(cap * w);
      values_[l].resize(cap * w);
    }
  }
  return absl::OkStatus();
}

float* ContiguousKvCache::MutableKeyRow(int layer, int pos) {
  return keys_[layer].data() + size_t(pos) * row_width_[layer];
}
float* ContiguousKvCache::MutableValueRow(int layer, int pos) {
  return values_[layer].data() + size_t(pos) * row_width_[layer];
}
const float* ContiguousKvCache::KeyRow(int layer, int pos) const {
  return keys_[layer].data() + size_t(pos) * row_width_[layer];
}
const float* ContiguousKvCache::ValueRow(int layer, int pos) const {
  return values_[layer].data() + size_t(pos) * row_width_[layer];
}

void ContiguousKvCache::Commit(int count) {
  num_tokens_ += std::min(count, reserved_);
  reserved_ = 0;
}

absl::Status CheckHostRowsCurrent(const KvCache& kv, std::string_view who) {
  if (!kv.host_rows_stale()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(std::string(who),
                   ": the KV cache's newest rows are still only in a device backend's memory "
                   "(call that backend's SyncKvToHost first)"));
}

int ContiguousKvCache::SlidingRetainedFrom(int num_tokens) const {
  return std::max(0, num_tokens - (sliding_window_ - 1));
}

}  // namespace dgserve
