// PrefillEngine on the CUDA backend (label `gpu-emu`: built against engine/cuda/emu's emulation,
// which is the device here), its default device K/V pool (blocks of 64 positions) over the
// worker's host pool (blocks of 16). A 150-token prompt is prefilled, synced, indexed, shipped
// and its cache destroyed, as the worker does; a second prompt sharing its first 140 tokens is a
// prefix hit on the host at 128 (8 whole host blocks) and finds the first prompt's device blocks
// still cached: it takes the full layers' two whole device blocks (positions 0 … 127) instead of
// uploading them, and uploads only its sliding window's rows [121, 128) (the first prompt's
// sliding block of 64 … 127 was written from 112 on only, so it is not shared). Against the same
// engine on a backend with share_kv_blocks off (which uploads all 128 rows of the hit): the
// shipped KV of both prompts is the same bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/testing/status_matchers.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "kvstore/paged_kv_cache.h"
#include "kvstore/transfer.h"
#include "prefill_worker/prefill_engine.h"
#include "worker/worker_model.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;

class PrefillEngineCudaTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("prefill_engine_cuda_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }
  const ModelConfig& config() const { return checkpoint_->config; }

  std::vector<int32_t> Prompt(int n, int salt) const {
    std::vector<int32_t> p;
    for (int i = 0; i < n; ++i) p.push_back((i * 59 + salt) % config().vocab_size);
    return p;
  }

  // What one run of the two prompts gave: the shipped caches, the backend's counters.
  struct Run {
    std::vector<std::unique_ptr<kv::PagedKvCache>> received;
    std::vector<int> cached_tokens;
    int64_t hit_upload_bytes = 0;  // uploaded while the second prompt was prefilled
    int64_t hit_blocks_taken = 0;
  };
  // Prefills `prompts` one after the other through an engine on a CUDA backend with
  // share_kv_blocks = `share`; the receiver's pool (and so the shipped caches) outlives it.
  void Prefill(bool share, const std::vector<std::vector<int32_t>>& prompts, Run* run) {
    CudaBackendOptions options;
    options.share_kv_blocks = share;
    auto backend = CreateCudaBackend(config(), checkpoint_->weights, options);
    if (backend.status().code() == absl::StatusCode::kUnavailable) GTEST_SKIP() << backend.status();
    ASSERT_THAT(backend.status(), IsOk());
    auto pool = CreateKvPool(config(), "tiny", 32, 16);
    ASSERT_THAT(pool.status(), IsOk());
    receiver_pools_.push_back(*CreateKvPool(config(), "tiny", 32, 16));
    kv::KvReceiver receiver(receiver_pools_.back().get(), config().max_position_embeddings);
    const std::string target = std::string("prefill-engine-cuda-test-") + (share ? "1" : "0");
    kv::RegisterInProcessReceiver(target, &receiver);
    PrefillEngineOptions o;
    o.chunk_tokens = 512;
    o.step_token_budget = 512;
    auto engine = std::make_unique<PrefillEngine>(
        backend->get(), pool->get(), kv::CreateInProcessTransport(), o, nullptr, nullptr);
    for (size_t i = 0; i < prompts.size(); ++i) {
      const std::string id = "p" + std::to_string(i);
      const CudaKvCopyStats copies = GetCudaKvCopyStats(**backend).value();
      const CudaKvPoolStats blocks = GetCudaKvPoolStats(**backend).value();
      v1::PrefillRequest r;
      r.set_request_id(id);
      r.mutable_tokens()->Assign(prompts[i].begin(), prompts[i].end());
      r.set_kv_target(target);
      absl::Notification done;
      absl::StatusOr<v1::PrefillResponse> result = absl::UnknownError("not done");
      ASSERT_THAT(engine->Submit(r,
                                 [&](absl::StatusOr<v1::PrefillResponse> res) {
                                   result = std::move(res);
                                   done.Notify();
                                 }),
                  IsOk());
      ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(120)));
      ASSERT_THAT(result.status(), IsOk());
      run->cached_tokens.push_back(result->cached_tokens());
      absl::Notification got;
      receiver.Expect(id, absl::Now() + absl::Seconds(30),
                      [&](absl::StatusOr<std::unique_ptr<kv::PagedKvCache>> kv) {
                        EXPECT_THAT(kv.status(), IsOk());
                        if (kv.ok()) run->received.push_back(*std::move(kv));
                        got.Notify();
                      });
      got.WaitForNotification();
      run->hit_upload_bytes = GetCudaKvCopyStats(**backend)->upload_bytes - copies.upload_bytes;
      run->hit_blocks_taken =
          GetCudaKvPoolStats(**backend)->shared_blocks_taken - blocks.shared_blocks_taken;
    }
    engine.reset();
    kv::UnregisterInProcessReceiver(target);
  }

  // Every row the receiver's caches of the two runs hold, bit for bit.
  void ExpectSameKv(const Run& x, const Run& y) const {
    ASSERT_EQ(x.received.size(), y.received.size());
    for (size_t i = 0; i < x.received.size(); ++i) {
      const kv::PagedKvCache &a = *x.received[i], &b = *y.received[i];
      ASSERT_EQ(a.num_tokens(), b.num_tokens());
      const int n = a.num_tokens(), W = config().sliding_window;
      for (int l = 0; l < config().num_layers; ++l) {
        const size_t bytes = sizeof(float) * config().KvHeads(l) * config().HeadDim(l);
        for (int p = config().IsFull(l) ? 0 : n - (W - 1); p < n; ++p) {
          ASSERT_EQ(std::memcmp(a.KeyRow(l, p), b.KeyRow(l, p), bytes), 0)
              << i << " " << l << " " << p;
          ASSERT_EQ(std::memcmp(a.ValueRow(l, p), b.ValueRow(l, p), bytes), 0)
              << i << " " << l << " " << p;
        }
      }
    }
  }

  // Two 150-token prompts at a 256 KiB bound (below), prefilled with admission by K/V memory on
  // or off.
  void TwoPromptsAtTheBound(bool admit_by_kv_memory);

  static inline Checkpoint* checkpoint_ = nullptr;
  std::vector<std::unique_ptr<kv::BlockPool>> receiver_pools_;  // outlive the received caches
};

TEST_F(PrefillEngineCudaTest, PrefixHitTakesTheFinishedPromptsDeviceBlocks) {
  const std::vector<int32_t> first = Prompt(150, 3);
  std::vector<int32_t> second(first.begin(), first.begin() + 140);
  for (int i = 0; i < 12; ++i) second.push_back((i * 13 + 400) % config().vocab_size);
  Run shared, plain;
  ASSERT_NO_FATAL_FAILURE(Prefill(true, {first, second}, &shared));
  if (IsSkipped()) return;
  ASSERT_NO_FATAL_FAILURE(Prefill(false, {first, second}, &plain));
  ASSERT_EQ(shared.received.size(), 2u);
  ASSERT_EQ(plain.received.size(), 2u);
  EXPECT_EQ(shared.cached_tokens, (std::vector<int>{0, 128}));
  EXPECT_EQ(plain.cached_tokens, (std::vector<int>{0, 128}));
  // The hit's upload: K and V of the sliding layers' rows [121, 128) (float32: head_dim 16 is
  // not on the tensor cores), none of the full layers'; without sharing, all 128 rows of the full
  // layers too (bf16: head_dim 32).
  int64_t sliding = 0, full = 0;
  for (int l = 0; l < config().num_layers; ++l) {
    const int64_t row = 2 * int64_t(config().KvHeads(l)) * config().HeadDim(l);
    if (config().IsFull(l)) {
      full += row * 128 * 2;
    } else {
      sliding += row * 7 * 4;
    }
  }
  EXPECT_EQ(shared.hit_upload_bytes, sliding);
  EXPECT_EQ(shared.hit_blocks_taken, 2);
  EXPECT_EQ(plain.hit_upload_bytes, sliding + full);
  EXPECT_EQ(plain.hit_blocks_taken, 0);
  // The shipped K/V, bit for bit: every row the receiver's caches hold.
  ExpectSameKv(shared, plain);
}

// The device pool's bound (kv_pool_max_bytes 256 KiB; blocks of 64: a full-layer block 16 KiB, a
// sliding one 64 KiB). A 150-token prompt holds at most 3 full blocks and the 2 sliding blocks of
// the rows the host still lacks ([112, 150): W + 2·16 − 2 rows): 176 KiB, so each prompt fits
// alone and two do not. Submitted together with admission by K/V memory off and prefilled in
// chunks of 32 tokens, their encoder
// passes overlap (the second is queued microseconds after the first, whose 5 chunks take far
// longer); a pass over both is refused and runs as one prompt after the other (PrefillEngine's
// RunInParts, the other prompt's device-only rows swapped out to its cache), where before every
// request of the pass failed with RESOURCE_EXHAUSTED; then one prompt a step until it ships. The
// shipped K/V equals an unbounded run's bit for bit. A prompt one chunk of which needs more than
// the bound alone is refused at Submit with OUT_OF_RANGE: 712 tokens, whose last chunk (704 → 712)
// holds 12 full blocks and the sliding blocks of the rows the host keeps and lacks (from the paged
// host cache's SlidingRetainedFrom(704) on) and of the new rows: blocks 10 and 11, 327,680 bytes
// (admitted before by the window alone, 256 KiB, it failed in that chunk); 769 tokens, 13 full
// and 2 sliding blocks, 344,064 bytes.
// With admission by K/V memory (the default) the second prompt waits in the queue until the first
// ships: no pass is refused, nothing is swapped out, the same K/V.
void PrefillEngineCudaTest::TwoPromptsAtTheBound(bool admit_by_kv_memory) {
  const std::vector<std::vector<int32_t>> prompts = {Prompt(150, 5), Prompt(150, 6)};
  Run plain;
  ASSERT_NO_FATAL_FAILURE(Prefill(true, prompts, &plain));
  if (IsSkipped()) return;
  CudaBackendOptions options;
  options.kv_pool_max_bytes = 256 * 1024;
  auto backend = CreateCudaBackend(config(), checkpoint_->weights, options);
  ASSERT_THAT(backend.status(), IsOk());
  auto pool = CreateKvPool(config(), "tiny", 32, 16);
  ASSERT_THAT(pool.status(), IsOk());
  receiver_pools_.push_back(*CreateKvPool(config(), "tiny", 32, 16));
  kv::KvReceiver receiver(receiver_pools_.back().get(), config().max_position_embeddings);
  const std::string target = "prefill-engine-cuda-test-bound";
  kv::RegisterInProcessReceiver(target, &receiver);
  PrefillEngineOptions o;
  o.chunk_tokens = 32;
  o.step_token_budget = 512;
  o.admit_by_kv_memory = admit_by_kv_memory;
  auto engine = std::make_unique<PrefillEngine>(
      backend->get(), pool->get(), kv::CreateInProcessTransport(), o, nullptr, nullptr);
  v1::PrefillRequest r;
  r.set_kv_target(target);
  r.set_request_id("too-long");
  for (const auto& [tokens, what] : {std::pair{712, "712 positions needs 327680 bytes"},
                                     std::pair{769, "769 positions needs 344064 bytes"}}) {
    const std::vector<int32_t> long_prompt = Prompt(tokens, 7);
    r.mutable_tokens()->Assign(long_prompt.begin(), long_prompt.end());
    const absl::Status refused = engine->Submit(r, [](absl::StatusOr<v1::PrefillResponse>) {});
    EXPECT_EQ(refused.code(), absl::StatusCode::kOutOfRange) << refused;
    EXPECT_NE(refused.message().find(std::string("tokens: a sequence of ") + what),
              std::string::npos)
        << refused;
  }
  absl::Notification done[2];
  absl::Status result[2];
  for (int i = 0; i < 2; ++i) {
    r.set_request_id("p" + std::to_string(i));
    r.mutable_tokens()->Assign(prompts[i].begin(), prompts[i].end());
    ASSERT_THAT(engine->Submit(r,
                               [&, i](absl::StatusOr<v1::PrefillResponse> res) {
                                 result[i] = res.status();
                                 done[i].Notify();
                               }),
                IsOk());
  }
  if (admit_by_kv_memory) {
    // The second prompt is seen held while the first is prefilled (polled every ms).
    bool held = false;
    for (int i = 0; i < 300000 && !held && !done[0].HasBeenNotified(); ++i) {
      held = engine->stats().held_for_kv_memory == 1;
      if (!held) absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_TRUE(held);
    // A third prompt queued behind the held one and cancelled there gets its reply at the next
    // step, while the second still waits in the queue (before, only a cancelled head of the
    // queue did: this one waited for the first to ship and the second to start).
    absl::Notification cancelled;
    absl::Status cancelled_status;
    int queued_then = -1;
    r.set_request_id("p2");
    const std::vector<int32_t> third = Prompt(150, 8);
    r.mutable_tokens()->Assign(third.begin(), third.end());
    ASSERT_THAT(engine->Submit(r,
                               [&](absl::StatusOr<v1::PrefillResponse> res) {
                                 cancelled_status = res.status();
                                 queued_then = engine->stats().queued;
                                 cancelled.Notify();
                               }),
                IsOk());
    EXPECT_TRUE(engine->Cancel("p2"));
    ASSERT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(300)));
    EXPECT_EQ(cancelled_status.code(), absl::StatusCode::kCancelled) << cancelled_status;
    EXPECT_EQ(queued_then, 1);  // the second, held
  }
  Run bounded;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(done[i].WaitForNotificationWithTimeout(absl::Seconds(300)));
    ASSERT_THAT(result[i], IsOk());
    absl::Notification got;
    receiver.Expect("p" + std::to_string(i), absl::Now() + absl::Seconds(30),
                    [&](absl::StatusOr<std::unique_ptr<kv::PagedKvCache>> kv) {
                      EXPECT_THAT(kv.status(), IsOk());
                      if (kv.ok()) bounded.received.push_back(*std::move(kv));
                      got.Notify();
                    });
    got.WaitForNotification();
  }
  if (admit_by_kv_memory) {
    EXPECT_EQ(engine->stats().passes_in_parts, 0);
    EXPECT_EQ(GetCudaKvPoolStats(**backend)->swap_outs, 0);
    EXPECT_EQ(engine->stats().held_for_kv_memory, 0);  // nothing waits now
  } else {
    EXPECT_GE(engine->stats().passes_in_parts, 1);
    EXPECT_GE(GetCudaKvPoolStats(**backend)->swap_outs, 1);
  }
  EXPECT_LE(GetCudaKvPoolStats(**backend)->device_bytes, 256 * 1024);
  engine.reset();
  kv::UnregisterInProcessReceiver(target);
  ExpectSameKv(bounded, plain);
}

TEST_F(PrefillEngineCudaTest, PromptsThatFitOnlyAloneRunInParts) {
  TwoPromptsAtTheBound(/*admit_by_kv_memory=*/false);
}

TEST_F(PrefillEngineCudaTest, PromptsThatFitOnlyAloneWaitForKvMemory) {
  TwoPromptsAtTheBound(/*admit_by_kv_memory=*/true);
}

}  // namespace
}  // namespace dgserve
