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
#include <vector>

#include "absl/synchronization/notification.h"
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
  for (int i = 0; i < 2; ++i) {
    const kv::PagedKvCache &a = *shared.received[i], &b = *plain.received[i];
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

}  // namespace
}  // namespace dgserve
