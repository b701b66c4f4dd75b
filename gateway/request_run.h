// Internal to the gateway (gateway.cc, request_run.cc): one request's run from its first
// attempt to its Finished events (Gateway::RequestRun), and what it is made of.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "engine/generation/stop_matcher.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/gateway.h"
#include "grpcpp/grpcpp.h"

namespace dgserve {
namespace gateway_internal {

inline std::chrono::system_clock::time_point ToChrono(absl::Time t) {
  if (t == absl::InfiniteFuture()) return std::chrono::system_clock::time_point::max();
  return absl::ToChronoTime(t);
}

// Calls TryCancel on the current call's context while `is_cancelled` is true, from a small
// watcher thread (gRPC's blocking reads cannot poll).
class CancelWatcher {
 public:
  explicit CancelWatcher(const std::function<bool()>& is_cancelled)
      : is_cancelled_(is_cancelled), thread_([this] { Run(); }) {}
  ~CancelWatcher() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Watch(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    ctx_ = ctx;
    if (cancelled_ && ctx_) ctx_->TryCancel();
  }
  bool cancelled() const {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

 private:
  void Run() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      if (!cancelled_ && is_cancelled_ && is_cancelled_()) {
        cancelled_ = true;
        if (ctx_) ctx_->TryCancel();
      }
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(20));
    }
  }
  const std::function<bool()>& is_cancelled_;
  mutable absl::Mutex mu_;
  bool stop_ = false;
  bool cancelled_ = false;
  grpc::ClientContext* ctx_ = nullptr;
  std::thread thread_;
};

// `message` with the addresses of the request's workers replaced by their roles.
inline std::string HideWorkers(absl::string_view message, const std::string& prefill,
                        const std::string& denoise) {
  return absl::StrReplaceAll(message,
                             {{prefill, "the prefill worker"}, {denoise, "the denoise worker"}});
}

// The stream state of one sample of a request: stop sequences and max_tokens apply per sample.
struct SampleStream {
  SampleStream(const Tokenizer& tokenizer, const std::vector<std::string>& stop)
      : decoder(tokenizer), matcher(stop) {}
  StreamDecoder decoder;
  StopMatcher matcher;
  int completion = 0, canvases = 0, steps = 0, last_index = 0;
  std::vector<int32_t> all_ids;  // completion tokens so far
  // Every block's token ids, whole. While the completion runs on, these are the raw canvases the
  // worker committed (a block is padded only after a stop token, which ends the completion):
  // what a resume prefills after the prompt.
  std::vector<int32_t> block_ids;
  // The last CanvasStep sent: a resumed canvas's steps up to it are not sent again.
  int sent_step_canvas = -1, sent_step = -1;
  size_t emitted_bytes = 0;      // completion text emitted so far
  // The fewest of all_ids whose text covers the text emitted so far (continuous usage only).
  int covered = 0;
  // The completion ended at a block by max_tokens, a stop token or a stop sequence: the worker
  // ends this sample there too and its Finished (with the denoise and commit timings) comes
  // next.
  bool awaiting_worker_finish = false;
  bool worker_done = false;  // the worker's Finished of this sample arrived
  bool done = false;         // the completion has ended
  bool finished_sent = false;  // its Finished event went to the client
  std::string finish_reason;
  v1::DenoiseFinished worker_finished;
};

// The status of a call the gateway made to a worker, as the retry logic sees it. A call that
// ended CANCELLED though neither the client (`client_cancelled`) nor the request's deadline
// (`now` >= `deadline`) ended it was ended by the worker's side: a gRPC server that shuts down
// cancels the calls it still runs or has not started, and a prefill worker reports a KV transfer
// its draining target cancelled with the transfer's code. The worker failed, not the request, so
// that is UNAVAILABLE (same message): retried on another worker, or resumed. Any other status is
// returned as it is.
absl::Status WorkerCallStatus(absl::Status status, bool client_cancelled, absl::Time deadline,
                              absl::Time now);

// The fewest of `ids`, at least `lo` and at most `hi`, whose streamed text (an unfinished
// character at the end held back, as StreamDecoder does) covers `bytes` bytes of completion text
// (`hi` when none does): what usage counts as the completion of that text.
int CoveringTokens(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, size_t bytes,
                   size_t lo, size_t hi);

}  // namespace gateway_internal

// One request from its first attempt to its Finished events. An attempt has three phases —
// picking the workers and prefilling (the KV goes to the denoise worker), the denoise call, and
// the relay of the denoise stream to the client (stop matching, max_tokens, usage) — followed,
// once every sample has ended, by the flush of held-back text and the Finished events.
class Gateway::RequestRun {
 public:
  RequestRun(Gateway& gateway, const PreparedRequest& req, absl::Time deadline,
             const std::function<bool()>& is_cancelled, const EventCallback& on_event,
             absl::Time start, absl::Duration admission_wait)
      : gw_(gateway),
        req_(req),
        deadline_(deadline),
        is_cancelled_(is_cancelled),
        on_event_(on_event),
        start_(start),
        admission_wait_(admission_wait) {}

  // Runs attempts until one succeeds or fails for good. On UNAVAILABLE before any output the
  // request starts again (at most max_attempts in all) on other workers. On UNAVAILABLE after
  // output (n = 1 only) it resumes (at most max_resumes times): prefill of the prompt and the
  // committed canvases on healthy workers, then denoising from the next canvas with the same
  // seed; what the client already has is not sent again.
  absl::Status Run();

 private:
  // The workers of one attempt, and the id they know it by.
  // An attempt's workers, each counted against its pool from the pick (WorkerPool::Pick) until
  // its hold is released: the prefill worker's after the prefill, the denoise worker's when the
  // attempt ends.
  struct Workers {
    std::string prefill, denoise, attempt_id;
    WorkerHold prefill_hold, denoise_hold;
  };

  absl::Status RunAttempt();
  // The request's final error after `failures_.size()` failed attempts (the last is `last`):
  // with more than one, logged in one line with every attempt's cause (worker addresses
  // included) and returned with the earlier attempts' causes appended (without them).
  absl::Status Fail(const absl::Status& last);
  // A fresh client-facing stream (before any output).
  void ResetStream();
  // The committed canvases' raw tokens that a resume prefills after the prompt (empty unless
  // n = 1 and blocks arrived).
  const std::vector<int32_t>& Committed() const;
  // A healthy denoise worker, then a healthy prefill worker (by prompt prefix, for its cache),
  // neither of them failed earlier in this request; and a fresh internal id.
  absl::StatusOr<Workers> PickWorkers() const;
  // Phase 1: prefill on the prefill worker, the KV sent to the denoise worker (held there under
  // a lease until the denoise call claims it). Sets prefill_.
  absl::Status Prefill(const Workers& w, gateway_internal::CancelWatcher& watcher);
  // Tells the attempt's denoise worker to drop it (best effort, at most 1 s): KV it holds or
  // is still receiving for the attempt is freed now instead of at the end of its lease.
  void CancelOnDenoiseWorker(const Workers& w) const;
  // Phase 2: the denoise call's request.
  v1::DenoiseRequest MakeDenoiseRequest(const std::string& attempt_id) const;
  // Phases 2–3: calls Denoise and relays its events until every sample has ended (OK), the
  // client went away (CANCELLED), or the call failed.
  absl::Status Denoise(const Workers& w, gateway_internal::CancelWatcher& watcher);
  // Relays one step / block event of sample `index`; false when the client went away.
  bool OnStep(int index, const v1::DenoiseStepEvent& step);
  bool OnBlock(int index, const v1::DenoiseBlockEvent& block);
  // Every sample has ended: the prompt's usage counted, and FinishSample for each sample (by
  // index) whose Finished has not been sent.
  absl::Status FinishSamples();
  // Sample `index` has ended: flushes its held-back text, then sends its Finished event with
  // its usage (once), so a choice that ends early is reported when it ends, not when the last
  // one does. False when the client went away.
  bool FinishSample(int index);
  // The token counts of `usage`: the prompt's (and its cached ones) and `completion`
  // (a sample's Finished; a block's usage so far with continuous usage).
  void SetTokenUsage(int completion, v1::Usage* usage) const;
  // Sends one event to the client; false (and the denoise call cancelled) when it went away.
  bool Emit(const v1::GenerateEvent& ev);
  void EndSample(gateway_internal::SampleStream& s) {
    if (s.done) return;
    s.done = true;
    --open_;
  }

  Gateway& gw_;
  const PreparedRequest& req_;
  const absl::Time deadline_;
  const std::function<bool()>& is_cancelled_;
  const EventCallback& on_event_;
  const absl::Time start_;
  const absl::Duration admission_wait_;  // in the gateway's admission queue (Timings.queue_seconds)
  std::set<std::string> bad_prefill_, bad_denoise_;  // failed in this request
  // Why each failed attempt (or resume) failed, for the client (no worker addresses) and for
  // the log (naming the workers); log_cause_ is the current attempt's, set where it fails.
  struct Failure {
    std::string client, log;
  };
  std::vector<Failure> failures_;
  std::string log_cause_;
  bool output_sent_ = false;
  int resumes_ = 0;
  v1::PrefillResponse prefill_;  // the prompt's (the first attempt that reached the client)
  // The client-facing stream of each sample, and how many have not ended yet.
  std::vector<std::unique_ptr<gateway_internal::SampleStream>> samples_;
  int open_ = 0;
  bool first_step_ = true, first_block_ = true;
  double first_step_s_ = 0, first_block_s_ = 0;
  bool client_gone_ = false;
  grpc::ClientContext* denoise_ctx_ = nullptr;  // the denoise call in flight, if any
};

}  // namespace dgserve
