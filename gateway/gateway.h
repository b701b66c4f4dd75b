// The gateway's core (design §1.1): request validation, chat template and tokenizer, admission,
// routing to a prefill and a denoise worker, event conversion with stop sequences and
// max_tokens across canvas boundaries, usage, deadlines, cancellation, retries and resumes.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/model/config.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/admission.h"
#include "gateway/gateway_metrics.h"
#include "gateway/generation_core.h"
#include "gateway/worker_pool.h"

namespace dgserve {

// The longest stop sequence a request may give, in bytes.
inline constexpr size_t kMaxStopSequenceBytes = 1024;

// --max_prompt_tokens' default: 32,768 tokens (a few seconds of prefill on one GPU, minutes on a
// CPU); a long-context deployment raises it, up to the model's context limit.
inline constexpr int64_t kDefaultMaxPromptTokens = 32768;

struct GatewayOptions {
  std::string model_id;
  int max_concurrent_requests = 64;  // running at once (gRPC and HTTP together)
  int max_queued_requests = 0;       // waiting for a slot; beyond → RESOURCE_EXHAUSTED at once
  int max_attempts = 3;              // per request, on UNAVAILABLE before any output
  // Per request (n = 1), after output: the denoise call failed with UNAVAILABLE (the worker
  // died, its stream broke) and the request continues from its next canvas on other workers.
  int max_resumes = 2;
  int64_t kv_lease_ms = 30000;
  std::vector<std::string> api_keys;  // empty: no authentication
  int max_stop_sequences = 4;
  int max_n = 16;  // samples per request (GenerateRequest.n) at most
  // Prompt tokens per request at most (after the chat template); 0: only the model's context
  // limit. Bounds how long one request can hold a prefill worker.
  int64_t max_prompt_tokens = kDefaultMaxPromptTokens;
  // Fault injection for tests: a pause between an attempt's prefill and its denoise call.
  absl::Duration testing_delay_before_denoise = absl::ZeroDuration();
};

// A request after validation: what the workers need.
struct PreparedRequest {
  std::string request_id;
  std::vector<int32_t> prompt;
  int max_tokens = 0;  // per sample
  int n = 1;           // samples sharing the prefill (sample i uses seed + i)
  std::vector<std::string> stop;
  uint64_t seed = 0;
  v1::SamplerSettings sampler;
  int canvas_step_interval = 0;
  bool canvas_text = false;
  // Every block carries its sample's usage so far (stream_options.continuous_usage).
  bool continuous_usage = false;
  // Infilling, in the token-id form (validated); unset when the request has no template.
  std::optional<v1::CanvasTemplate> canvas_template;
};

class Gateway final : public GenerationCore {
 public:
  // `tokenizer` must cover config.vocab_size ids. Pools must be started by the caller.
  Gateway(ModelConfig config, GenerationConfig generation, Tokenizer tokenizer,
          GatewayOptions options, WorkerPool* prefill, WorkerPool* denoise,
          GatewayMetrics* metrics);

  // Admission: at most max_concurrent_requests run, max_queued_requests more wait (FIFO, until
  // their deadline or cancellation); beyond, RESOURCE_EXHAUSTED at once.
  absl::Status Generate(const v1::GenerateRequest& request, absl::Time deadline,
                        const std::function<bool()>& is_cancelled, const EventCallback& on_event,
                        const AcceptedCallback& on_accepted = {}) override;
  absl::Status CheckAdmission() override;
  void CountRefused(const absl::Status& status) override;
  v1::ListModelsResponse ListModels() const override;
  std::string model_id() const override { return options_.model_id; }
  bool Ready() const override;
  // The KV layout mismatch (KvLayoutMismatch), or "no healthy prefill/denoise worker (N known)";
  // empty when ready apart from draining.
  std::string NotReadyReason() const override;
  absl::Status CheckApiKey(const std::string& bearer) const override;
  void SetDraining(bool draining) { draining_ = draining; }
  // Stops admitting (UNAVAILABLE) and waits until no request is in flight or `grace` has passed.
  void Drain(absl::Duration grace);
  // Sets the dgserve_gateway_workers{role, state} gauges from the worker pools.
  void UpdateWorkerGauges();
  int inflight() const { return admission_.running(); }

  // Validation and tokenization only (INVALID_ARGUMENT naming the field, NOT_FOUND for an
  // unknown model). Public for tests.
  absl::StatusOr<PreparedRequest> Prepare(const v1::GenerateRequest& request) const;

 private:
  // The request's template in the token-id form, validated against the model (text form
  // tokenized piece by piece). INVALID_ARGUMENT naming the field.
  absl::StatusOr<v1::CanvasTemplate> ResolveTemplate(const v1::CanvasTemplate& t) const;
  // KvLayoutMismatch of the pools; logs a warning when it changes (not on every probe).
  std::string LayoutMismatch() const;
  // One request's attempts and client-facing stream (gateway.cc).
  class RequestRun;

  const ModelConfig config_;
  const GenerationConfig generation_;
  const Tokenizer tokenizer_;
  const GatewayOptions options_;
  WorkerPool* prefill_;
  WorkerPool* denoise_;
  GatewayMetrics* metrics_;
  Admission admission_;
  std::atomic<bool> draining_{false};
  mutable absl::Mutex mismatch_mu_;
  mutable std::string logged_mismatch_ ABSL_GUARDED_BY(mismatch_mu_);
};

}  // namespace dgserve
