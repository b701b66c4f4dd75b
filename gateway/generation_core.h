// What the gateway's front ends (gRPC GenerationService and the OpenAI HTTP API) call: one
// request in, a stream of events out. The implementation (gateway.cc) validates, renders the
// chat template, tokenizes, routes to a prefill and a denoise worker, applies stop sequences and
// max_tokens, and owns admission, deadlines, cancellation and retries.
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "dgserve/v1/generation.pb.h"

namespace dgserve {

// Adds the usage of one more sample (not the first) to `total`, which starts as the first
// sample's: completion tokens, canvases and denoising steps are summed, the prompt counts once,
// timings are the later sample's.
inline void AddSampleUsage(const v1::Usage& sample, v1::Usage* total) {
  total->set_completion_tokens(total->completion_tokens() + sample.completion_tokens());
  total->set_total_tokens(total->prompt_tokens() + total->completion_tokens());
  total->set_canvases(total->canvases() + sample.canvases());
  total->set_denoising_steps(total->denoising_steps() + sample.denoising_steps());
  *total->mutable_timings() = sample.timings();
}

class GenerationCore {
 public:
  virtual ~GenerationCore() = default;

  // Called with each event in order: CanvasStep (if asked for), BlockCommitted (text already
  // cut at a stop sequence / max_tokens), then exactly one Finished on success. With n > 1
  // samples every event carries its sample's index and the samples' events interleave; each
  // sample's Finished (one per sample, with that sample's usage) comes when that sample ends,
  // possibly before other samples' last blocks.
  // Return false from the callback when the client is gone: the request is cancelled on the
  // workers.
  using EventCallback = std::function<bool(const v1::GenerateEvent&)>;
  // Called at most once, with the request's id, when the request has passed validation and
  // starts on the workers, before its first event (which may come minutes later, behind other
  // requests' canvases): a front end sends its response head then (HTTP status, headers and
  // SSE keep-alives; gRPC initial metadata), so that a waiting stream is visibly alive. Not
  // called for a request refused before that (its front end answers with the error's status).
  using AcceptedCallback = std::function<void(const std::string& request_id)>;

  // Runs the request to the end. Returns OK after Finished was delivered, or the error
  // (INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED when admission is full, UNAVAILABLE,
  // DEADLINE_EXCEEDED at `deadline`, CANCELLED when the callback returned false or
  // `is_cancelled` turned true). A front end that already sent events reports the error in-stream.
  virtual absl::Status Generate(const v1::GenerateRequest& request, absl::Time deadline,
                                const std::function<bool()>& is_cancelled,
                                const EventCallback& on_event,
                                const AcceptedCallback& on_accepted = {}) = 0;

  // OK when a new request could start (or queue) now; UNAVAILABLE when the core is draining, else
  // RESOURCE_EXHAUSTED when every slot and queue place is taken (both counted as refused
  // requests), so that a front end can answer 503 or 429 without starting any work. Advisory:
  // Generate decides.
  virtual absl::Status CheckAdmission() { return absl::OkStatus(); }

  // Counts a generation request that a front end refused before calling Generate (bad HTTP
  // method, failed authentication, unparsable or too large body…) in the core's request
  // metrics, so that every refusal shows with its status.
  virtual void CountRefused(const absl::Status& status) {}

  virtual v1::ListModelsResponse ListModels() const = 0;
  // The served model's id (`model` in requests must be empty or equal to it).
  virtual std::string model_id() const = 0;
  // Ready: at least one healthy prefill and one healthy denoise worker, every healthy prefill
  // worker's KV layout equal to every healthy denoise worker's, and not draining.
  virtual bool Ready() const = 0;
  // Why Ready() is false, for the /ready body (empty when ready or when there is nothing more
  // to say than "not_ready").
  virtual std::string NotReadyReason() const { return ""; }
  // OK, or UNAUTHENTICATED when API keys are configured and `bearer` (the token after
  // "Bearer ") is not one of them.
  virtual absl::Status CheckApiKey(const std::string& bearer) const = 0;
};

}  // namespace dgserve
