#include "gateway/request_run.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/hash.h"
#include "common/logging.h"
#include "common/status_convert.h"
#include "engine/denoise/finalize.h"
#include "engine/denoise/sampler_params.h"
#include "engine/generation/stop_matcher.h"
#include "engine/tokenizer/chat_template.h"
#include "gateway/request_ids.h"
#include "service/canvas_template_proto.h"

namespace dgserve {
namespace gateway_internal {

int CoveringTokens(const Tokenizer& tokenizer, const std::vector<int32_t>& ids, size_t bytes,
                   size_t lo, size_t hi) {
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    // The prefix's text as it streams: an unfinished character at its end is held back.
    // Tokenizer::Decode would end it with one U+FFFD (3 bytes) per byte, longer than the
    // finished character (a 2-byte é), so the search would stop one token short of it.
    StreamDecoder decoder(tokenizer, /*skip_special=*/true);
    if (decoder.Push(std::span<const int32_t>(ids.data(), mid)).size() >= bytes) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return int(lo);
}

}  // namespace gateway_internal

using gateway_internal::CancelWatcher;
using gateway_internal::CoveringTokens;
using gateway_internal::HideWorkers;
using gateway_internal::SampleStream;
using gateway_internal::ToChrono;
using gateway_internal::WorkerCallStatus;

namespace gateway_internal {

absl::Status WorkerCallStatus(absl::Status status, bool client_cancelled, absl::Time deadline,
                              absl::Time now) {
  if (absl::IsCancelled(status) && !client_cancelled && now < deadline) {
    return absl::UnavailableError(status.message());
  }
  return status;
}

}  // namespace gateway_internal

absl::Status Gateway::RequestRun::Run() {
  int attempts = 0;  // started before any output
  for (;;) {
    if (!output_sent_) {
      ResetStream();
      ++attempts;
    }
    log_cause_.clear();
    const absl::Status status = RunAttempt();
    if (status.ok()) return status;
    failures_.push_back(
        {std::string(status.message()),
         log_cause_.empty() ? std::string(status.message()) : std::move(log_cause_)});
    if (!absl::IsUnavailable(status)) return Fail(status);
    if (absl::Now() >= deadline_ || (is_cancelled_ && is_cancelled_())) return Fail(status);
    if (!output_sent_) {
      if (attempts >= gw_.options_.max_attempts) return Fail(status);
      if (gw_.metrics_) gw_.metrics_->retries.Increment();
      continue;
    }
    // Output was sent. Parallel samples (n > 1) do not resume: the client gets the error.
    if (req_.n != 1 || open_ == 0) return Fail(status);
    SampleStream& s = *samples_[0];
    const int C = gw_.config_.canvas_length;
    if (s.done || s.awaiting_worker_finish || s.completion != int(s.block_ids.size()) ||
        s.block_ids.size() != size_t(s.canvases) * C) {
      return Fail(status);  // not a run of whole raw canvases (cannot happen while it runs on)
    }
    if (s.completion >= req_.max_tokens) {
      // The last block arrived, only the worker's Finished is missing.
      s.finish_reason = "length";
      EndSample(s);
      return FinishSamples();
    }
    if (resumes_ >= gw_.options_.max_resumes) {
      if (gw_.options_.max_resumes == 0) return Fail(status);
      return Fail(absl::UnavailableError(absl::StrCat(
          status.message(), "; gave up after ", resumes_, " resumes (the gateway's --max_resumes)")));
    }
    ++resumes_;
    if (gw_.metrics_) gw_.metrics_->resumes.Increment();
    DGSERVE_LOG_WARNING("request %s: resuming at canvas %d (resume %d of %d) after: %s",
                        req_.request_id, s.canvases, resumes_, gw_.options_.max_resumes,
                        status.message());
  }
}

absl::Status Gateway::RequestRun::Fail(const absl::Status& last) {
  if (failures_.size() <= 1) return last;  // a worker's failure is logged where it happens
  std::string log, earlier;
  for (size_t i = 0; i < failures_.size(); ++i) {
    absl::StrAppend(&log, i > 0 ? "; " : "", "attempt ", i + 1, ": ", failures_[i].log);
    if (i + 1 < failures_.size()) {
      absl::StrAppend(&earlier, i > 0 ? "; " : "", i + 1, ": ", failures_[i].client);
    }
  }
  DGSERVE_LOG_WARNING("request %s failed after %d attempts (%d resumes): %s", req_.request_id,
                      int(failures_.size()), resumes_, log);
  return absl::Status(last.code(), absl::StrCat(last.message(), " (attempt ", failures_.size(),
                                                "; earlier attempts: ", earlier, ")"));
}

void Gateway::RequestRun::ResetStream() {
  samples_.clear();
  for (int i = 0; i < req_.n; ++i) {
    samples_.push_back(std::make_unique<SampleStream>(gw_.tokenizer_, req_.stop));
  }
  open_ = req_.n;
  first_step_ = first_block_ = true;
  first_step_s_ = first_block_s_ = 0;
  client_gone_ = false;
}

const std::vector<int32_t>& Gateway::RequestRun::Committed() const {
  static const std::vector<int32_t> kNone;
  return req_.n == 1 ? samples_[0]->block_ids : kNone;
}

absl::StatusOr<Gateway::RequestRun::Workers> Gateway::RequestRun::PickWorkers() const {
  Workers w;
  const std::optional<std::string> d = gw_.denoise_->Pick(0, bad_denoise_);
  if (!d) {
    return absl::UnavailableError(
        absl::StrCat("no healthy denoise worker (", gw_.denoise_->total_count(), " known)"));
  }
  w.denoise = *d;
  w.denoise_hold = WorkerHold(gw_.denoise_, *d);
  const size_t key_len = std::min<size_t>(req_.prompt.size(), 64);
  const uint64_t key = Fnv1a64(std::string_view(reinterpret_cast<const char*>(req_.prompt.data()),
                                                key_len * sizeof(int32_t))) |
                       1;
  const std::optional<std::string> p = gw_.prefill_->Pick(key, bad_prefill_);
  if (!p) {
    return absl::UnavailableError(
        absl::StrCat("no healthy prefill worker (", gw_.prefill_->total_count(), " known)"));
  }
  w.prefill = *p;
  w.prefill_hold = WorkerHold(gw_.prefill_, *p);
  // A pair whose KV layouts differ would fail every transfer: refuse before prefilling.
  if (std::string m = KvLayoutMismatch(w.prefill, gw_.prefill_->KvLayoutOf(w.prefill), w.denoise,
                                       gw_.denoise_->KvLayoutOf(w.denoise));
      !m.empty()) {
    return absl::FailedPreconditionError(m);
  }
  // The workers know an attempt by an id of its own, not derived from the public request id (a
  // client that knows its id, or guesses another's, cannot address the request inside the
  // cluster), and fresh for every attempt.
  absl::StatusOr<std::string> internal_id = NewInternalId();
  if (!internal_id.ok()) return internal_id.status();
  w.attempt_id = *std::move(internal_id);
  return w;
}

absl::Status Gateway::RequestRun::RunAttempt() {
  absl::StatusOr<Workers> w = PickWorkers();
  if (!w.ok()) return w.status();
  CancelWatcher watcher(is_cancelled_);
  absl::Status prefilled = Prefill(*w, watcher);
  w->prefill_hold.Release();
  if (!prefilled.ok()) return prefilled;
  if (gw_.metrics_) {
    gw_.metrics_->prefill_seconds.Observe(absl::ToDoubleSeconds(absl::Now() - start_));
  }
  if (gw_.options_.testing_delay_before_denoise > absl::ZeroDuration()) {
    absl::SleepFor(gw_.options_.testing_delay_before_denoise);
  }
  if (absl::Status s = Denoise(*w, watcher); !s.ok()) {
    // A denoise call that ended by the deadline or the client may never have reached the
    // worker (a deadline that passed as the prefill returned fails the call at once), and then
    // nothing claims the KV the prefill sent: drop it.
    if (absl::IsDeadlineExceeded(s) || absl::IsCancelled(s)) CancelOnDenoiseWorker(*w);
    return s;
  }
  return FinishSamples();
}

absl::Status Gateway::RequestRun::Prefill(const Workers& w, CancelWatcher& watcher) {
  v1::PrefillRequest preq;
  preq.set_request_id(w.attempt_id);
  preq.mutable_tokens()->Assign(req_.prompt.begin(), req_.prompt.end());
  const std::vector<int32_t>& committed = Committed();
  preq.mutable_tokens()->Add(committed.begin(), committed.end());
  preq.set_kv_target(w.denoise);
  preq.set_lease_ms(gw_.options_.kv_lease_ms);
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChrono(deadline_));
  watcher.Watch(&ctx);
  v1::PrefillResponse response;
  grpc::Status s = v1::PrefillService::NewStub(gw_.prefill_->Channel(w.prefill))
                       ->Prefill(&ctx, preq, &response);
  watcher.Watch(nullptr);
  if (s.ok()) {
    if (!output_sent_) prefill_ = response;  // a resume's prefill is not the prompt's usage
    return absl::OkStatus();
  }
  // The KV may already sit on the denoise worker (the transfer can finish after this call
  // gave up).
  CancelOnDenoiseWorker(w);
  if (watcher.cancelled()) return absl::CancelledError("request cancelled by the client");
  absl::Status st =
      WorkerCallStatus(FromGrpcStatus(s), watcher.cancelled(), deadline_, absl::Now());
  if (absl::IsUnavailable(st)) {
    // Either the prefill worker or the transfer to the denoise worker failed.
    if (s.error_message().find("KV transfer to") != std::string::npos) {
      bad_denoise_.insert(w.denoise);
      gw_.denoise_->MarkUnhealthy(w.denoise, std::string(st.message()));
    } else {
      bad_prefill_.insert(w.prefill);
      gw_.prefill_->MarkUnhealthy(w.prefill, std::string(st.message()));
    }
  }
  // Worker addresses are for the log, not for clients.
  log_cause_ = absl::StrCat("prefill on ", w.prefill, " (KV to ", w.denoise, "): ", st.message());
  DGSERVE_LOG_WARNING("request %s: %s", w.attempt_id, log_cause_);
  return absl::Status(st.code(),
                      absl::StrCat("prefill: ", HideWorkers(st.message(), w.prefill, w.denoise)));
}

void Gateway::RequestRun::CancelOnDenoiseWorker(const Workers& w) const {
  grpc::ClientContext cctx;
  cctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::CancelRequest creq;
  creq.set_request_id(w.attempt_id);
  creq.set_deadline_exceeded(EndedByDeadline(deadline_, absl::Now()));
  v1::CancelResponse cresp;
  v1::DenoiseService::NewStub(gw_.denoise_->Channel(w.denoise))->Cancel(&cctx, creq, &cresp);
}

v1::DenoiseRequest Gateway::RequestRun::MakeDenoiseRequest(const std::string& attempt_id) const {
  v1::DenoiseRequest dreq;
  dreq.set_request_id(attempt_id);
  // A resume continues after the committed canvases, which are part of its prompt KV.
  const int committed = int(Committed().size());
  dreq.set_prompt_tokens(int(req_.prompt.size()) + committed);
  dreq.set_max_new_tokens(req_.max_tokens - committed);
  dreq.set_first_canvas(committed / gw_.config_.canvas_length);
  dreq.set_seed(req_.seed);
  *dreq.mutable_sampler() = req_.sampler;
  dreq.mutable_stop_token_ids()->Assign(gw_.generation_.stop_token_ids.begin(),
                                        gw_.generation_.stop_token_ids.end());
  dreq.set_pad_token_id(gw_.generation_.pad_token_id);
  // Step 0 and the last step of every canvas always come back (for the TTFT metrics); more
  // only when the client asked for canvas steps.
  dreq.set_canvas_step_interval(req_.canvas_step_interval > 0 ? req_.canvas_step_interval
                                                              : (1 << 30));
  dreq.set_kv_wait_ms(gw_.options_.kv_lease_ms);
  if (req_.canvas_template) *dreq.mutable_canvas_template() = *req_.canvas_template;
  dreq.set_num_samples(req_.n);
  // The worker ends a sample at a stop sequence itself (no further step or commit, finished
  // OK); on a resume it needs the completion so far for a stop sequence spanning the canvases.
  dreq.mutable_stop_sequences()->Assign(req_.stop.begin(), req_.stop.end());
  if (committed > 0) {
    const std::vector<int32_t>& ids = samples_[0]->all_ids;
    dreq.mutable_completion_token_ids()->Assign(ids.begin(), ids.end());
  }
  return dreq;
}

bool Gateway::RequestRun::Emit(const v1::GenerateEvent& ev) {
  output_sent_ = true;
  if (!on_event_(ev)) {
    client_gone_ = true;
    if (denoise_ctx_) denoise_ctx_->TryCancel();
    return false;
  }
  return true;
}

absl::Status Gateway::RequestRun::Denoise(const Workers& w, CancelWatcher& watcher) {
  const v1::DenoiseRequest dreq = MakeDenoiseRequest(w.attempt_id);
  grpc::ClientContext ctx;
  ctx.set_deadline(ToChrono(deadline_));
  // The context goes with this scope: neither the watcher (its thread cancels on the client's
  // behalf) nor Emit may reach it after.
  struct Forget {
    CancelWatcher& watcher;
    grpc::ClientContext*& ctx;
    ~Forget() {
      watcher.Watch(nullptr);
      ctx = nullptr;
    }
  } forget{watcher, denoise_ctx_};
  watcher.Watch(&ctx);
  denoise_ctx_ = &ctx;
  auto reader = v1::DenoiseService::NewStub(gw_.denoise_->Channel(w.denoise))->Denoise(&ctx, dreq);

  const int n = req_.n;
  absl::Status bad_event;  // the worker named a sample the request does not have
  v1::DenoiseEvent ev;
  while (open_ > 0 && !client_gone_ && reader->Read(&ev)) {
    if (ev.sample() < 0 || ev.sample() >= n) {
      bad_event = absl::InternalError(absl::StrCat("the denoise worker sent an event of sample ",
                                                   ev.sample(), " for a request of ", n));
      break;
    }
    const int index = ev.sample();
    SampleStream& s = *samples_[index];
    if (s.done) continue;  // ended; the worker runs the others on
    if (s.awaiting_worker_finish && !ev.has_finished()) {
      EndSample(s);  // the worker went on with this sample (it should not): stopped below
      continue;
    }
    if (ev.has_step()) {
      OnStep(index, ev.step());
    } else if (ev.has_block()) {
      if (!OnBlock(index, ev.block())) break;
    } else if (ev.has_finished()) {
      s.worker_finished = ev.finished();
      s.worker_done = true;
      if (s.finish_reason.empty()) s.finish_reason = s.worker_finished.finish_reason();
      EndSample(s);
      // Reported now: the other samples may run for many more canvases (or be cut by the
      // deadline).
      if (!FinishSample(index)) break;
    }
  }
  // The stream ended right after a completion's last block: nothing is missing.
  if (!client_gone_ && bad_event.ok()) {
    for (auto& s : samples_) {
      if (s->awaiting_worker_finish) EndSample(*s);
    }
  }
  if (client_gone_) {
    return absl::CancelledError("the client went away");
  }
  if (open_ > 0 || !bad_event.ok()) {
    if (!bad_event.ok()) ctx.TryCancel();
    grpc::Status s = reader->Finish();
    if (watcher.cancelled()) return absl::CancelledError("request cancelled by the client");
    absl::Status st = bad_event.ok() ? WorkerCallStatus(FromGrpcStatus(s), watcher.cancelled(),
                                                        deadline_, absl::Now())
                                     : bad_event;
    if (st.ok()) st = absl::InternalError("denoise stream ended without a result");
    if (absl::IsUnavailable(st)) {
      bad_denoise_.insert(w.denoise);
      gw_.denoise_->MarkUnhealthy(w.denoise, std::string(st.message()));
    }
    log_cause_ = absl::StrCat("denoise on ", w.denoise, ": ", st.message());
    DGSERVE_LOG_WARNING("request %s: %s", w.attempt_id, log_cause_);
    return absl::Status(
        st.code(), absl::StrCat("denoise: ", HideWorkers(st.message(), w.prefill, w.denoise)));
  }
  // Every sample finished (by the worker, a stop token or sequence, or max_tokens): stop the
  // worker if it is still running.
  const bool worker_done = std::all_of(samples_.begin(), samples_.end(),
                                       [](const auto& s) { return s->worker_done; });
  if (!worker_done) ctx.TryCancel();  // a worker that sent every Finished ends its stream itself
  reader->Finish();
  return absl::OkStatus();
}

bool Gateway::RequestRun::OnStep(int index, const v1::DenoiseStepEvent& step) {
  if (first_step_) {
    first_step_ = false;
    first_step_s_ = absl::ToDoubleSeconds(absl::Now() - start_);
    if (gw_.metrics_) gw_.metrics_->first_step_seconds.Observe(first_step_s_);
  }
  if (req_.canvas_step_interval <= 0) return true;
  SampleStream& s = *samples_[index];
  if (step.canvas() < s.sent_step_canvas ||
      (step.canvas() == s.sent_step_canvas && step.step() <= s.sent_step)) {
    return true;  // sent before a resume
  }
  s.sent_step_canvas = step.canvas();
  s.sent_step = step.step();
  v1::GenerateEvent out;
  out.set_request_id(req_.request_id);
  out.set_index(index);
  v1::CanvasStep* cs = out.mutable_canvas_step();
  cs->set_canvas(step.canvas());
  cs->set_step(step.step());
  *cs->mutable_token_ids() = step.token_ids();
  if (req_.canvas_text) {
    cs->set_text(gw_.tokenizer_.Decode(
        std::span<const int32_t>(step.token_ids().data(), size_t(step.token_ids_size())),
        /*skip_special=*/true));
  }
  cs->set_accepted(step.accepted());
  cs->set_mean_entropy(step.mean_entropy());
  cs->set_temperature(step.temperature());
  return Emit(out);
}

bool Gateway::RequestRun::OnBlock(int index, const v1::DenoiseBlockEvent& block) {
  SampleStream& s = *samples_[index];
  if (first_block_) {
    first_block_ = false;
    first_block_s_ = absl::ToDoubleSeconds(absl::Now() - start_);
    if (gw_.metrics_) gw_.metrics_->first_block_seconds.Observe(first_block_s_);
  }
  ++s.canvases;
  s.block_ids.insert(s.block_ids.end(), block.token_ids().begin(), block.token_ids().end());
  s.steps += block.steps();
  s.last_index = block.index();
  if (gw_.metrics_) gw_.metrics_->steps_per_canvas.Observe(block.steps());
  v1::GenerateEvent out;
  out.set_request_id(req_.request_id);
  out.set_index(index);
  v1::BlockCommitted* b = out.mutable_block();
  b->set_index(block.index());
  b->set_steps(block.steps());
  // Completion tokens of this block: up to the first stop token, at most max_tokens in
  // all (per sample). Decoded as one piece (as `dgserve generate` streams it), then through
  // the stop sequences; a stop sequence cuts the text, the block's ids stay whole.
  const std::span<const int32_t> ids(block.token_ids().data(), size_t(block.token_ids_size()));
  const CompletionCut cut =
      CutCompletion(ids, gw_.generation_.stop_token_ids, s.completion, req_.max_tokens);
  if (cut.length) s.finish_reason = "length";
  if (cut.stop_token) s.finish_reason = "stop";
  const std::vector<int32_t> take(ids.begin(), ids.begin() + cut.take);
  s.completion += cut.take;
  b->mutable_token_ids()->Assign(take.begin(), take.end());
  s.all_ids.insert(s.all_ids.end(), take.begin(), take.end());
  StopMatcher::Result r = s.matcher.Push(s.decoder.Push(take));
  std::string text = std::move(r.emit);
  s.emitted_bytes += text.size();
  if (r.stopped) {
    s.finish_reason = "stop";
    // The completion is the shortest prefix of the generated ids whose text covers the emitted
    // text (which ends where the stop sequence begins, possibly in an earlier canvas): a token
    // that holds both returned text and the start of the stop sequence is counted and kept,
    // so usage and ids account for every returned byte; tokens wholly inside or past the stop
    // text are not (as with OpenAI, the stop text is not returned). Ids already streamed in
    // earlier blocks cannot be taken back; usage and the unary response's ids are cut to it.
    const int keep_total =
        CoveringTokens(gw_.tokenizer_, s.all_ids, s.emitted_bytes, 0, s.all_ids.size());
    const int before_block = s.completion - int(take.size());
    b->mutable_token_ids()->Truncate(std::max(0, keep_total - before_block));
    s.completion = keep_total;
  }
  b->set_text(text);
  if (req_.continuous_usage) {
    // After a stop sequence the completion is already the covering count; otherwise count the
    // tokens the text emitted so far covers (held-back bytes of a possible stop sequence or an
    // unfinished character are not returned yet), from the last count on: it never decreases.
    s.covered =
        r.stopped ? s.completion
                  : CoveringTokens(gw_.tokenizer_, s.all_ids, s.emitted_bytes,
                                   size_t(std::min(s.covered, s.completion)), size_t(s.completion));
    SetTokenUsage(s.covered, b->mutable_usage());
  }
  if (!Emit(out)) return false;
  // The worker ends the sample at this block too (a stop token, max_tokens, or the stop
  // sequence it matches itself): its Finished, with the denoise and commit timings, comes next.
  // A worker that goes on instead is stopped in Denoise().
  if (!s.finish_reason.empty()) s.awaiting_worker_finish = true;
  return true;
}

absl::Status Gateway::RequestRun::FinishSamples() {
  if (GatewayMetrics* metrics = gw_.metrics_) {
    metrics->prompt_tokens.Increment(double(req_.prompt.size()));
    metrics->cached_prompt_tokens.Increment(prefill_.cached_tokens());
  }
  for (int i = 0; i < req_.n; ++i) {
    if (!FinishSample(i)) return absl::CancelledError("the client went away");
  }
  return absl::OkStatus();
}

void Gateway::RequestRun::SetTokenUsage(int completion, v1::Usage* u) const {
  const int prompt = int(req_.prompt.size());
  u->set_prompt_tokens(prompt);
  u->set_completion_tokens(completion);
  u->set_total_tokens(prompt + completion);
  u->set_cached_prompt_tokens(prefill_.cached_tokens());
}

bool Gateway::RequestRun::FinishSample(int index) {
  SampleStream& s = *samples_[index];
  if (s.finished_sent) return true;
  s.finished_sent = true;
  if (!s.matcher.stopped()) {
    std::string tail = s.matcher.Push(s.decoder.Finish()).emit;
    if (!s.matcher.stopped()) tail += s.matcher.Flush();
    if (!tail.empty()) {
      v1::GenerateEvent out;
      out.set_request_id(req_.request_id);
      out.set_index(index);
      out.mutable_block()->set_index(s.last_index);
      out.mutable_block()->set_text(tail);
      if (req_.continuous_usage) {
        s.covered = CoveringTokens(gw_.tokenizer_, s.all_ids, s.emitted_bytes + tail.size(),
                                   size_t(std::min(s.covered, s.completion)), size_t(s.completion));
        SetTokenUsage(s.covered, out.mutable_block()->mutable_usage());
      }
      if (!Emit(out)) return false;
    }
  }
  v1::GenerateEvent out;
  out.set_request_id(req_.request_id);
  out.set_index(index);
  v1::Finished* f = out.mutable_finished();
  f->set_finish_reason(s.finish_reason.empty() ? "length" : s.finish_reason);
  v1::Usage* u = f->mutable_usage();
  SetTokenUsage(s.completion, u);
  u->set_canvases(s.canvases);
  u->set_denoising_steps(s.steps);
  v1::Timings* t = u->mutable_timings();
  // Waiting before any work: in the gateway's admission queue, then in the prefill worker's.
  t->set_queue_seconds(absl::ToDoubleSeconds(admission_wait_) + prefill_.queue_seconds());
  t->set_prefill_seconds(prefill_.prefill_seconds());
  t->set_transfer_seconds(prefill_.transfer_seconds());
  t->set_first_step_seconds(first_step_s_);
  t->set_first_block_seconds(first_block_s_);
  t->set_denoise_seconds(s.worker_finished.denoise_seconds());
  t->set_commit_seconds(s.worker_finished.commit_seconds());
  t->set_total_seconds(absl::ToDoubleSeconds(absl::Now() - start_));
  if (GatewayMetrics* metrics = gw_.metrics_) {
    metrics->completion_tokens.Increment(s.completion);
    metrics->samples.Increment();
  }
  return Emit(out);
}

}  // namespace dgserve
