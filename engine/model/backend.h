// The seam between the model math and the device: one interface, implementations chosen at
// run time (CPU now; CUDA behind the same calls). Model code above this line never branches on
// the device.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "engine/model/config.h"
#include "engine/model/kv_cache.h"
#include "engine/model/weights.h"

namespace dgserve {

// One sequence's encoder pass: `tokens` at positions kv->num_tokens() …, appended to `kv`.
struct EncodeInput {
  std::span<const int32_t> tokens;
  KvCache* kv = nullptr;
};

// One canvas's decoder pass (spec §3.5). The canvas sits at positions P … P+C−1 with
// P = kv->num_tokens(); it attends to the context in `kv` (read only) and to itself.
struct DecodeInput {
  std::span<const int32_t> canvas;  // [C] token ids in [0, V)
  // Self-conditioning soft embedding [C, D] = (softmax(ℓ_prev / T_prev) · E) · bf16(√D), the
  // input of the SC pre_norm; nullptr at step 0 (no self-conditioning: the SC branch is skipped
  // and the canvas input is rms_noscale(E[c]·bf16(√D))).
  const float* sc_soft = nullptr;
  const KvCache* kv = nullptr;
  float* logits = nullptr;  // out: [C, V] float32, softcapped (spec §3.1.6)
};

class ModelBackend {
 public:
  virtual ~ModelBackend() = default;
  virtual const ModelConfig& config() const = 0;

  // Encoder passes (spec §3.4): causal over each sequence's cached + new tokens (sliding layers:
  // keys q−W < k ≤ q), encoder layer_scalar; writes K/V of the new tokens into each kv and
  // commits them. INVALID_ARGUMENT for a token id outside [0, V); RESOURCE_EXHAUSTED when a
  // cache cannot grow (that cache is left unchanged).
  virtual absl::Status Encode(std::span<const EncodeInput> batch) = 0;

  // Decoder passes (spec §3.5) for a batch of canvases (each with its own context), decoder
  // layer_scalar, bidirectional over the canvas; sliding layers see the last W−1 context
  // tokens, full layers all of them. INVALID_ARGUMENT for a token id outside [0, V).
  virtual absl::Status Decode(std::span<const DecodeInput> batch) = 0;

  // Self-conditioning soft embedding: soft[rows, D] = (probs[rows, V] · E) · bf16(√D), with
  // probs the softmax of the previous step's tempered logits (spec §3.5 step 2).
  virtual void SoftEmbedding(const float* probs, int rows, float* soft) = 0;
};

// The CPU backend: float32 compute, OpenBLAS GEMMs, OpenMP over rows/heads. `weights` must
// outlive the backend.
std::unique_ptr<ModelBackend> CreateCpuBackend(const ModelConfig& config,
                                               const ModelWeights& weights);

}  // namespace dgserve
