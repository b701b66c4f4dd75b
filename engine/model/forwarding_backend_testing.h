// Test helper: a ModelBackend that forwards every call to another one, for tests that observe or
// check one call (override it) and leave the rest alone.
#pragma once

#include "engine/model/backend.h"

namespace dgserve::testing {

class ForwardingBackend : public ModelBackend {
 public:
  explicit ForwardingBackend(ModelBackend& inner) : inner_(inner) {}

  const ModelConfig& config() const override { return inner_.config(); }
  absl::Status Encode(std::span<const EncodeInput> batch) override { return inner_.Encode(batch); }
  absl::Status Decode(std::span<const DecodeInput> batch) override { return inner_.Decode(batch); }
  absl::Status SoftEmbedding(const float* probs, int rows, float* soft) override {
    return inner_.SoftEmbedding(probs, rows, soft);
  }
  absl::Status DenoiseStep(std::span<const DenoiseStepInput> batch) override {
    return inner_.DenoiseStep(batch);
  }
  DecodeTimings last_decode_timings() const override { return inner_.last_decode_timings(); }
  absl::Status SyncKvToHost(KvCache& kv) override { return inner_.SyncKvToHost(kv); }

 protected:
  ModelBackend& inner() { return inner_; }

 private:
  ModelBackend& inner_;
};

}  // namespace dgserve::testing
