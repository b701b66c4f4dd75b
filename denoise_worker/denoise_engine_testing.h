// What the DenoiseEngine tests share (denoise_engine_test.cc on the CPU backend,
// denoise_engine_cuda_test.cc on the CUDA backend): the request they send, the prompt K/V they
// ship through the in-process transport, and the events a job streams back.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "denoise_worker/denoise_engine.h"
#include "engine/model/backend.h"
#include "engine/model/config.h"
#include "kvstore/block_pool.h"
#include "kvstore/paged_kv_cache.h"
#include "kvstore/transfer.h"

namespace dgserve::denoise_testing {

// A request for `prompt_tokens` of prompt K/V and `max_new_tokens`, seed 5, pad token 0, the
// sampler of `g` with at most `max_denoising_steps` steps, a step event every
// `canvas_step_interval` steps (0: none).
inline v1::DenoiseRequest Request(const GenerationConfig& g, const std::string& id,
                                  int prompt_tokens, int max_new_tokens, int max_denoising_steps,
                                  int canvas_step_interval) {
  v1::DenoiseRequest r;
  r.set_request_id(id);
  r.set_prompt_tokens(prompt_tokens);
  r.set_max_new_tokens(max_new_tokens);
  r.set_seed(5);
  v1::SamplerSettings* s = r.mutable_sampler();
  s->set_max_denoising_steps(max_denoising_steps);
  s->set_t_min(g.t_min);
  s->set_t_max(g.t_max);
  s->set_entropy_bound(g.entropy_bound);
  s->set_stability_threshold(g.stability_threshold);
  s->set_confidence_threshold(g.confidence_threshold);
  r.set_pad_token_id(0);
  r.set_canvas_step_interval(canvas_step_interval);
  return r;
}

// Encodes `prompt` on `backend` into a paged cache of `pool`, syncs it to the host (a device
// backend's rows: what the prefill worker does before it ships) and sends it to `target` as
// request `id`; the transfer's status.
inline absl::Status SendPromptKv(ModelBackend& backend, kv::BlockPool* pool,
                                 kv::KvTransport& transport, const std::string& target,
                                 const std::string& id, const std::vector<int32_t>& prompt) {
  auto kv = std::make_shared<kv::PagedKvCache>(pool, int(prompt.size()));
  EncodeInput in{prompt, kv.get()};
  if (absl::Status s = backend.Encode({&in, 1}); !s.ok()) return s;
  if (absl::Status s = backend.SyncKvToHost(*kv); !s.ok()) return s;
  absl::Notification sent;
  absl::Status status;
  transport.Send(target, id, kv, 10000, [&](absl::StatusOr<kv::TransferResult> r) {
    status = r.status();
    sent.Notify();
  });
  sent.WaitForNotification();
  return status;
}

// Everything one job sent, by sample.
struct JobEvents {
  std::vector<std::vector<v1::DenoiseBlockEvent>> blocks;  // [sample]
  std::vector<int> step_events;                            // [sample]
  std::vector<std::optional<v1::DenoiseFinished>> finished;
  absl::Status final;
  // Sample s's committed tokens, block after block.
  std::vector<int32_t> Tokens(int s) const {
    std::vector<int32_t> t;
    for (const v1::DenoiseBlockEvent& b : blocks[s]) {
      t.insert(t.end(), b.token_ids().begin(), b.token_ids().end());
    }
    return t;
  }
};

// Pops the job's events until it ends (a test failure after `limit`).
inline JobEvents Collect(DenoiseJob& job, int samples, absl::Duration limit) {
  JobEvents e;
  e.blocks.resize(samples);
  e.step_events.resize(samples);
  e.finished.resize(samples);
  const absl::Time deadline = absl::Now() + limit;
  for (;;) {
    v1::DenoiseEvent ev;
    std::optional<absl::Status> final;
    if (job.Pop(&ev, &final, absl::Milliseconds(100))) {
      const int s = ev.sample();
      EXPECT_LT(s, samples);
      if (s >= samples) continue;
      if (ev.has_block()) e.blocks[s].push_back(ev.block());
      if (ev.has_step()) ++e.step_events[s];
      if (ev.has_finished()) e.finished[s] = ev.finished();
      continue;
    }
    if (final) {
      e.final = *final;
      return e;
    }
    if (absl::Now() > deadline) {
      ADD_FAILURE() << "job " << job.id() << " did not end";
      return e;
    }
  }
}

}  // namespace dgserve::denoise_testing
