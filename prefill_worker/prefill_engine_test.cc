// PrefillEngine in one process, no gRPC: the real CPU backend on random tiny-v512 weights, its
// KV shipped by the in-process transport to a KvReceiver. Checked: chunked, batched prefill
// gives the KV of one encoder pass (the decoder's logits over it are bit-equal), the prefix
// cache serves whole shared blocks, admission (validation, the target check, duplicates, a full
// queue, draining), cancellation, and a transfer to an unknown target.
#include "prefill_worker/prefill_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/testing/status_matchers.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "kvstore/paged_kv_cache.h"
#include "kvstore/transfer.h"
#include "worker/worker_model.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;

// The outcome of one Submit: the callback's result, once it ran.
struct Pending {
  absl::Notification done;
  absl::StatusOr<v1::PrefillResponse> result = absl::UnknownError("not done");
  bool Wait() { return done.WaitForNotificationWithTimeout(absl::Seconds(120)); }
};

class PrefillEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("prefill_engine_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }

  void SetUp() override {
    backend_ = CreateCpuBackend(config(), checkpoint_->weights);
    test_backend_ = CreateCpuBackend(config(), checkpoint_->weights);
    auto pool = CreateKvPool(config(), "tiny", 32, 16);
    ASSERT_THAT(pool.status(), IsOk());
    pool_ = *std::move(pool);
    auto receiver_pool = CreateKvPool(config(), "tiny", 32, 16);
    ASSERT_THAT(receiver_pool.status(), IsOk());
    receiver_pool_ = *std::move(receiver_pool);
    receiver_ =
        std::make_unique<kv::KvReceiver>(receiver_pool_.get(), config().max_position_embeddings);
    target_ = "prefill-engine-test-" +
              std::string(::testing::UnitTest::GetInstance()->current_test_info()->name());
    kv::RegisterInProcessReceiver(target_, receiver_.get());
  }
  void TearDown() override {
    engine_.reset();
    kv::UnregisterInProcessReceiver(target_);
  }

  const ModelConfig& config() const { return checkpoint_->config; }

  void StartEngine(PrefillEngineOptions o = {}) {
    engine_ =
        std::make_unique<PrefillEngine>(backend_.get(), pool_.get(), kv::CreateInProcessTransport(),
                                        std::move(o), nullptr, nullptr);
  }

  std::vector<int32_t> Prompt(int n, int salt) const {
    std::vector<int32_t> p;
    for (int i = 0; i < n; ++i) p.push_back((i * 59 + salt) % config().vocab_size);
    return p;
  }

  v1::PrefillRequest Request(const std::string& id, const std::vector<int32_t>& tokens) const {
    v1::PrefillRequest r;
    r.set_request_id(id);
    r.mutable_tokens()->Assign(tokens.begin(), tokens.end());
    r.set_kv_target(target_);
    return r;
  }

  absl::Status Submit(const v1::PrefillRequest& r, Pending* p) {
    return engine_->Submit(r, [p](absl::StatusOr<v1::PrefillResponse> res) {
      p->result = std::move(res);
      p->done.Notify();
    });
  }

  // The KV the receiver holds for `id`.
  std::unique_ptr<kv::PagedKvCache> Received(const std::string& id) {
    absl::Notification got;
    std::unique_ptr<kv::PagedKvCache> kv;
    receiver_->Expect(id, absl::Now() + absl::Seconds(30),
                      [&](absl::StatusOr<std::unique_ptr<kv::PagedKvCache>> r) {
                        EXPECT_THAT(r.status(), IsOk());
                        if (r.ok()) kv = *std::move(r);
                        got.Notify();
                      });
    got.WaitForNotification();
    return kv;
  }

  // The decoder's logits for a fixed canvas over `kv`.
  std::vector<float> Logits(const KvCache& kv) {
    const int C = config().canvas_length;
    std::vector<int32_t> canvas(C);
    for (int j = 0; j < C; ++j) canvas[j] = (j * 31 + 7) % config().vocab_size;
    std::vector<float> logits(size_t(C) * config().vocab_size);
    DecodeInput in{canvas, nullptr, &kv, logits.data()};
    EXPECT_THAT(test_backend_->Decode({&in, 1}), IsOk());
    return logits;
  }

  // The logits over the KV of `tokens` encoded in one pass.
  std::vector<float> OnePassLogits(const std::vector<int32_t>& tokens) {
    ContiguousKvCache kv(config(), 1024);
    EncodeInput in{tokens, &kv};
    EXPECT_THAT(test_backend_->Encode({&in, 1}), IsOk());
    return Logits(kv);
  }

  static Checkpoint* checkpoint_;
  std::unique_ptr<ModelBackend> backend_, test_backend_;
  std::unique_ptr<kv::BlockPool> pool_, receiver_pool_;
  std::unique_ptr<kv::KvReceiver> receiver_;
  std::string target_;
  std::unique_ptr<PrefillEngine> engine_;
};
Checkpoint* PrefillEngineTest::checkpoint_ = nullptr;

TEST_F(PrefillEngineTest, ChunkedBatchedPrefillGivesTheKvOfOnePass) {
  PrefillEngineOptions o;
  o.chunk_tokens = 8;
  o.step_token_budget = 12;  // two requests share steps, one chunk each at most
  StartEngine(o);
  const std::vector<int32_t> a = Prompt(37, 1), b = Prompt(29, 2);
  Pending pa, pb;
  ASSERT_THAT(Submit(Request("a", a), &pa), IsOk());
  ASSERT_THAT(Submit(Request("b", b), &pb), IsOk());
  ASSERT_TRUE(pa.Wait());
  ASSERT_TRUE(pb.Wait());
  ASSERT_THAT(pa.result.status(), IsOk());
  ASSERT_THAT(pb.result.status(), IsOk());
  EXPECT_EQ(pa.result->prompt_tokens(), 37);
  EXPECT_EQ(pa.result->cached_tokens(), 0);
  EXPECT_EQ(pa.result->transport(), "inprocess");
  EXPECT_GT(pa.result->transfer_bytes(), 0);
  EXPECT_EQ(pb.result->prompt_tokens(), 29);
  auto kva = Received("a"), kvb = Received("b");
  ASSERT_NE(kva, nullptr);
  ASSERT_NE(kvb, nullptr);
  EXPECT_EQ(kva->num_tokens(), 37);
  EXPECT_EQ(kvb->num_tokens(), 29);
  EXPECT_EQ(Logits(*kva), OnePassLogits(a));
  EXPECT_EQ(Logits(*kvb), OnePassLogits(b));
  EXPECT_NE(Logits(*kva), Logits(*kvb));
  EXPECT_EQ(engine_->stats().queued, 0);
}

TEST_F(PrefillEngineTest, PrefixCacheServesWholeSharedBlocks) {
  StartEngine();
  const std::vector<int32_t> first = Prompt(37, 3);
  std::vector<int32_t> second(first.begin(), first.begin() + 34);  // shares 2 blocks of 16
  for (int i = 0; i < 6; ++i) second.push_back((i * 13 + 400) % config().vocab_size);
  Pending p1, p2;
  ASSERT_THAT(Submit(Request("first", first), &p1), IsOk());
  ASSERT_TRUE(p1.Wait());
  ASSERT_THAT(p1.result.status(), IsOk());
  EXPECT_EQ(p1.result->cached_tokens(), 0);
  Received("first");
  ASSERT_THAT(Submit(Request("second", second), &p2), IsOk());
  ASSERT_TRUE(p2.Wait());
  ASSERT_THAT(p2.result.status(), IsOk());
  EXPECT_EQ(p2.result->cached_tokens(), 32);
  auto kv = Received("second");
  ASSERT_NE(kv, nullptr);
  EXPECT_EQ(kv->num_tokens(), 40);
  EXPECT_EQ(Logits(*kv), OnePassLogits(second));  // a cached prefix gives the same bits
}

TEST_F(PrefillEngineTest, Admission) {
  PrefillEngineOptions o;
  o.max_queue = 1;
  o.chunk_tokens = 16;
  o.step_token_budget = 16;
  o.check_kv_target = [this](const std::string& t) {
    return t == target_ ? absl::OkStatus() : absl::PermissionDeniedError("not allowed: " + t);
  };
  StartEngine(o);
  Pending unused;
  v1::PrefillRequest r = Request("", Prompt(5, 1));
  EXPECT_EQ(Submit(r, &unused).code(), absl::StatusCode::kInvalidArgument);
  r = Request("x", {});
  EXPECT_EQ(Submit(r, &unused).code(), absl::StatusCode::kInvalidArgument);
  r = Request("x", {1, config().vocab_size});
  EXPECT_EQ(Submit(r, &unused).code(), absl::StatusCode::kInvalidArgument);
  r = Request("x", Prompt(5, 1));
  r.set_lease_ms(-1);
  EXPECT_EQ(Submit(r, &unused).code(), absl::StatusCode::kInvalidArgument);
  r = Request("x", Prompt(5, 1));
  r.clear_kv_target();
  EXPECT_EQ(Submit(r, &unused).code(), absl::StatusCode::kInvalidArgument);
  r = Request("x", Prompt(5, 1));
  r.set_kv_target("elsewhere");
  EXPECT_EQ(Submit(r, &unused).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_FALSE(unused.done.HasBeenNotified());

  // A long prompt (125 steps of 16 tokens) holds the only queue place while the rest arrive.
  Pending big;
  ASSERT_THAT(Submit(Request("big", Prompt(2000, 4)), &big), IsOk());
  Pending dup, more;
  EXPECT_EQ(Submit(Request("big", Prompt(5, 1)), &dup).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Submit(Request("more", Prompt(5, 1)), &more).code(),
            absl::StatusCode::kResourceExhausted);
  engine_->SetDraining(true);
  EXPECT_TRUE(engine_->draining());
  EXPECT_EQ(Submit(Request("late", Prompt(5, 1)), &more).code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(big.Wait());
  EXPECT_THAT(big.result.status(), IsOk());  // draining lets running requests finish
  EXPECT_FALSE(dup.done.HasBeenNotified());
  EXPECT_FALSE(more.done.HasBeenNotified());
}

// A prompt the KV pool can never hold is refused at once as OUT_OF_RANGE (a 400, naming the
// pool), not failed later as RESOURCE_EXHAUSTED (a 429 that clients retry forever); one that
// fits is accepted.
TEST_F(PrefillEngineTest, PromptLargerThanThePoolIsOutOfRange) {
  auto small = CreateKvPool(config(), "tiny", 1, 16);
  ASSERT_THAT(small.status(), IsOk());
  pool_ = *std::move(small);
  const kv::PoolStats st = pool_->stats();
  const int64_t full_tokens = st.total[int(kv::LayerKind::kFull)] * 16;
  ASSERT_GT(full_tokens, 0);
  ASSERT_LT(full_tokens + 1, config().max_position_embeddings);
  StartEngine();
  Pending too_big, fits;
  const absl::Status s = Submit(Request("too-big", Prompt(int(full_tokens) + 1, 3)), &too_big);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_NE(s.message().find("KV pool holds"), std::string::npos) << s;
  EXPECT_FALSE(too_big.done.HasBeenNotified());
  ASSERT_THAT(Submit(Request("fits", Prompt(40, 3)), &fits), IsOk());
  ASSERT_TRUE(fits.Wait());
  EXPECT_THAT(fits.result.status(), IsOk());
}

TEST_F(PrefillEngineTest, DuplicateIdIsRefused) {
  PrefillEngineOptions o;
  o.chunk_tokens = 16;
  o.step_token_budget = 16;
  StartEngine(o);
  Pending big, dup;
  ASSERT_THAT(Submit(Request("big", Prompt(2000, 4)), &big), IsOk());
  EXPECT_EQ(Submit(Request("big", Prompt(5, 1)), &dup).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(big.Wait());
  EXPECT_THAT(big.result.status(), IsOk());
}

TEST_F(PrefillEngineTest, CancelEndsTheRequestWithItsCode) {
  PrefillEngineOptions o;
  o.chunk_tokens = 16;
  o.step_token_budget = 16;
  StartEngine(o);
  Pending a, b;
  ASSERT_THAT(Submit(Request("a", Prompt(2000, 5)), &a), IsOk());
  ASSERT_THAT(Submit(Request("b", Prompt(2000, 6)), &b), IsOk());
  EXPECT_TRUE(engine_->Cancel("a"));
  EXPECT_TRUE(engine_->Cancel("b", absl::StatusCode::kDeadlineExceeded));
  EXPECT_FALSE(engine_->Cancel("nobody"));
  ASSERT_TRUE(a.Wait());
  ASSERT_TRUE(b.Wait());
  EXPECT_EQ(a.result.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(b.result.status().code(), absl::StatusCode::kDeadlineExceeded);
  // The id is free again, and a fresh request runs.
  Pending again;
  ASSERT_THAT(Submit(Request("a", Prompt(20, 5)), &again), IsOk());
  ASSERT_TRUE(again.Wait());
  EXPECT_THAT(again.result.status(), IsOk());
}

// Issue kvq51: three prompts whose KV each fits the denoise worker's pool alone, not two at
// once. The pushes that find the pool full wait for room (each counted once) and every prompt
// is served, its KV that of one encoder pass, as the denoise worker frees the KV it used. With
// no wait (kv_push_wait_ms 0, the behaviour before) the refused ones fail at once, the cause
// said once.
class PrefillEnginePoolFullTest : public PrefillEngineTest {
 protected:
  // A receiver whose pool holds `blocks` blocks of each kind, in place of the fixture's.
  void UseSmallReceiver(int blocks) {
    kv::UnregisterInProcessReceiver(target_);
    auto pool = kv::BlockPool::Create(pool_->layout(), blocks, blocks);
    ASSERT_THAT(pool.status(), IsOk());
    receiver_.reset();
    receiver_pool_ = *std::move(pool);
    receiver_ =
        std::make_unique<kv::KvReceiver>(receiver_pool_.get(), config().max_position_embeddings);
    kv::RegisterInProcessReceiver(target_, receiver_.get());
  }
  int TokensOfThreeBlocks() const { return 3 * pool_->layout().block_size - 5; }
};

TEST_F(PrefillEnginePoolFullTest, PushesWaitForRoomAndAllAreServed) {
  const int n = TokensOfThreeBlocks();
  ASSERT_EQ(pool_->layout().BlocksFor(n), 3);
  UseSmallReceiver(5);  // one prompt's 3 blocks fit; two prompts' 6 do not
  PrefillEngineOptions o;
  o.kv_push_wait_ms = 600000;  // bounds nothing here: room comes as the KV is consumed
  StartEngine(o);
  const std::vector<std::vector<int32_t>> prompts = {Prompt(n, 1), Prompt(n, 2), Prompt(n, 3)};
  const std::vector<std::string> ids = {"p0", "p1", "p2"};
  Pending p[3];
  for (int i = 0; i < 3; ++i) ASSERT_THAT(Submit(Request(ids[i], prompts[i]), &p[i]), IsOk());
  // The first push takes 3 of the 5 blocks; the other two find the pool full and wait (the
  // KV on the receiver is not consumed before both have waited).
  auto failed = [&] {
    for (Pending& q : p) {
      if (q.done.HasBeenNotified() && !q.result.ok()) return true;
    }
    return false;
  };
  for (int spins = 0; engine_->stats().kv_push_waits < 2 && !failed() && spins < 12000; ++spins) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  for (int i = 0; i < 3; ++i) {
    if (p[i].done.HasBeenNotified()) EXPECT_THAT(p[i].result.status(), IsOk()) << ids[i];
  }
  ASSERT_EQ(engine_->stats().kv_push_waits, 2);
  int served = 0;
  bool consumed[3] = {false, false, false};
  while (served < 3) {
    bool progressed = false;
    for (int i = 0; i < 3; ++i) {
      if (consumed[i] || !p[i].done.HasBeenNotified()) continue;
      ASSERT_THAT(p[i].result.status(), IsOk()) << ids[i];
      EXPECT_EQ(p[i].result->prompt_tokens(), n);
      // The denoise worker takes the KV, uses it, and frees its blocks: room for the next.
      std::unique_ptr<kv::PagedKvCache> kv = Received(ids[i]);
      ASSERT_NE(kv, nullptr);
      EXPECT_EQ(Logits(*kv), OnePassLogits(prompts[i])) << ids[i];
      kv.reset();
      consumed[i] = true;
      ++served;
      progressed = true;
    }
    if (!progressed) {
      ASSERT_TRUE(p[0].done.HasBeenNotified() || p[1].done.HasBeenNotified() ||
                  p[2].done.HasBeenNotified());
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  EXPECT_EQ(engine_->stats().kv_push_waits, 2) << "each waiting prompt counted once";
  EXPECT_EQ(receiver_pool_->stats().used[int(kv::LayerKind::kFull)], 0);
  engine_.reset();
}

TEST_F(PrefillEnginePoolFullTest, WithoutWaitTheRefusalSaysItsCauseOnce) {
  const int n = TokensOfThreeBlocks();
  UseSmallReceiver(5);
  PrefillEngineOptions o;
  o.kv_push_wait_ms = 0;
  StartEngine(o);
  Pending first, second;
  ASSERT_THAT(Submit(Request("first", Prompt(n, 1)), &first), IsOk());
  ASSERT_TRUE(first.Wait());
  ASSERT_THAT(first.result.status(), IsOk());
  ASSERT_THAT(Submit(Request("second", Prompt(n, 2)), &second), IsOk());
  ASSERT_TRUE(second.Wait());
  const absl::Status& st = second.result.status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(absl::StartsWith(st.message(), "KV transfer to " + target_ +
                                                 " failed: denoise worker KV cache full: no free "))
      << st;
  EXPECT_FALSE(absl::StrContains(st.message(), "KV transfer for")) << st;
  EXPECT_EQ(engine_->stats().kv_push_waits, 0);
  engine_.reset();
}

// A wait that ends without room fails the request with RESOURCE_EXHAUSTED, its cause said once;
// a waiting request cancelled ends with its own code. Neither leaves blocks on the receiver.
TEST_F(PrefillEnginePoolFullTest, WaitBoundAndCancelEndAWaitingPush) {
  const int n = TokensOfThreeBlocks();
  UseSmallReceiver(5);
  PrefillEngineOptions o;
  o.kv_push_wait_ms = 50;
  StartEngine(o);
  Pending held, bounded;
  ASSERT_THAT(Submit(Request("held", Prompt(n, 1)), &held), IsOk());
  ASSERT_TRUE(held.Wait());
  ASSERT_THAT(held.result.status(), IsOk());  // its KV stays on the receiver, unclaimed
  ASSERT_THAT(Submit(Request("bounded", Prompt(n, 2)), &bounded), IsOk());
  ASSERT_TRUE(bounded.Wait());
  const absl::Status& st = bounded.result.status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(absl::StartsWith(
      st.message(), "KV transfer to " + target_ +
                        " failed: denoise worker KV cache still full after waiting 50 ms "
                        "(--kv_push_wait_ms): no free "))
      << st;
  EXPECT_FALSE(absl::StrContains(st.message(), "KV transfer for")) << st;
  EXPECT_EQ(engine_->stats().kv_push_waits, 1);
  engine_.reset();

  o.kv_push_wait_ms = 600000;
  StartEngine(o);
  Pending cancelled;
  ASSERT_THAT(Submit(Request("cancelled", Prompt(n, 3)), &cancelled), IsOk());
  for (int spins = 0; engine_->stats().kv_push_waits < 1 && spins < 12000; ++spins) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(engine_->stats().kv_push_waits, 1);
  EXPECT_TRUE(engine_->Cancel("cancelled", absl::StatusCode::kDeadlineExceeded));
  ASSERT_TRUE(cancelled.Wait());
  EXPECT_EQ(cancelled.result.status().code(), absl::StatusCode::kDeadlineExceeded)
      << cancelled.result.status();
  engine_.reset();
  // Only the unclaimed KV of "held" is on the receiver.
  EXPECT_EQ(receiver_pool_->stats().used[int(kv::LayerKind::kFull)], 3);
}

// The in-process transport, whose first `refusals` pushes are refused as the TCP and GPU
// transports refuse one beyond --max_kv_pushes_per_target (kv::KvPushLimitError).
class PushLimitTransport : public kv::KvTransport {
 public:
  explicit PushLimitTransport(int refusals)
      : inner_(kv::CreateInProcessTransport()), refusals_(refusals) {}
  std::string name() const override { return inner_->name(); }
  void Send(const std::string& target, const std::string& request_id,
            std::shared_ptr<const kv::PagedKvCache> kv, int64_t lease_ms,
            kv::TransferCallback done) override {
    if (refusals_.fetch_sub(1) > 0) {
      done(kv::KvPushLimitError(request_id, target, 64));
      return;
    }
    inner_->Send(target, request_id, std::move(kv), lease_ms, std::move(done));
  }

 private:
  std::unique_ptr<kv::KvTransport> inner_;
  std::atomic<int> refusals_;
};

// A push refused by this worker's own limit of pushes outstanding to the target fails the
// request at once with RESOURCE_EXHAUSTED (HTTP 429), not waiting as for a full target pool, its
// cause naming the flag (it said only "64 transfers to that target are already outstanding").
TEST_F(PrefillEngineTest, PushRefusedAtTheOutstandingLimitNamesTheFlag) {
  engine_ = std::make_unique<PrefillEngine>(backend_.get(), pool_.get(),
                                            std::make_unique<PushLimitTransport>(1),
                                            PrefillEngineOptions{}, nullptr, nullptr);
  Pending refused;
  ASSERT_THAT(Submit(Request("refused", Prompt(20, 4)), &refused), IsOk());
  ASSERT_TRUE(refused.Wait());
  EXPECT_EQ(refused.result.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.result.status().message(),
            "KV transfer to " + target_ +
                " failed: this prefill worker's limit of KV pushes to one target "
                "(--max_kv_pushes_per_target): 64 transfers to that target are already "
                "outstanding");
  EXPECT_EQ(engine_->stats().kv_push_waits, 0);
  engine_.reset();
}

TEST_F(PrefillEngineTest, TransferToAnUnknownTargetFails) {
  StartEngine();
  Pending p;
  v1::PrefillRequest r = Request("lost", Prompt(20, 7));
  r.set_kv_target("no-such-receiver");
  ASSERT_THAT(Submit(r, &p), IsOk());
  ASSERT_TRUE(p.Wait());
  EXPECT_EQ(p.result.status().code(), absl::StatusCode::kUnavailable) << p.result.status();
  EXPECT_NE(p.result.status().message().find("no in-process KV receiver"), absl::string_view::npos)
      << p.result.status();
}

}  // namespace
}  // namespace dgserve
