// The receiving side and the in-process transport: a real sequence moves row for row; every
// failure (descriptor, block, lease, Forget, deadline) fails the waiting request and leaks
// nothing.
#include "kvstore/transfer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>

#include "absl/synchronization/notification.h"
#include "common/hash.h"
#include "common/testing/status_matchers.h"
#include "kvstore/test_util.h"
#include "kvstore/transfer_internal.h"

namespace dgserve::kv {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int S = 0, F = 1;
constexpr int kTokens = 23;  // W = 6, blocks of 4: full blocks 0..5, sliding blocks 4..5
constexpr absl::Duration kWait = absl::Seconds(10);

using KvWaiter = testing::KvWaiter;
using SendWaiter = testing::Waiter<TransferResult>;

class KvTransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = KvLayout::FromConfig(testing::MixedConfig(), 4, "mixed");
    sender_pool_ = std::move(*BlockPool::Create(layout_, 32, 32));
    receiver_pool_ = std::move(*BlockPool::Create(layout_, 32, 32));
    receiver_ = std::make_unique<KvReceiver>(receiver_pool_.get(), 256);
    auto kv = std::make_shared<PagedKvCache>(sender_pool_.get(), 256);
    testing::AppendPattern(*kv, layout_, kTokens, 9);
    src_ = kv;
  }
  void TearDown() override {
    receiver_.reset();
    src_.reset();
    EXPECT_EQ(receiver_pool_->stats().used[S], 0);
    EXPECT_EQ(receiver_pool_->stats().used[F], 0);
  }

  v1::KvTransferHeader Header(const std::string& id, int64_t lease_ms = 10000) const {
    return internal::MakeHeader(id, *src_, lease_ms);
  }
  std::vector<v1::KvBlockPayload> Payloads() const {
    std::vector<v1::KvBlockPayload> out;
    const v1::KvTransferHeader h = Header("x");
    for (const auto& b : internal::BlocksToSend(h.kv_descriptor(), *src_)) {
      internal::FillPayload(*src_, b, &out.emplace_back());
    }
    return out;
  }
  // Begin + every block + Finish through the receiver's interface.
  void Deliver(const std::string& id) {
    ASSERT_THAT(receiver_->Begin(Header(id)), IsOk());
    const auto payloads = Payloads();
    for (const auto& p : payloads) ASSERT_THAT(receiver_->WriteBlock(id, p), IsOk());
    v1::KvTransferTrailer trailer;
    trailer.set_blocks(int(payloads.size()));
    ASSERT_THAT(receiver_->Finish(id, trailer), IsOk());
  }
  void ExpectNothingHeld() {
    EXPECT_EQ(receiver_pool_->stats().used[S], 0);
    EXPECT_EQ(receiver_pool_->stats().used[F], 0);
    EXPECT_EQ(receiver_->pending_transfers(), 0);
  }
  absl::Time Later() const { return absl::Now() + absl::Hours(1); }

  KvLayout layout_;
  std::unique_ptr<BlockPool> sender_pool_, receiver_pool_;
  std::unique_ptr<KvReceiver> receiver_;
  std::shared_ptr<const PagedKvCache> src_;
};

TEST_F(KvTransferTest, DescriptorOfASequence) {
  const v1::KvDescriptor d = DescribeSequence(layout_, *src_);
  EXPECT_EQ(d.model_id(), "mixed");
  ASSERT_EQ(d.layers_size(), 5);
  EXPECT_TRUE(d.layers(0).sliding());
  EXPECT_FALSE(d.layers(2).sliding());
  EXPECT_EQ(d.layers(0).kv_heads(), 2);
  EXPECT_EQ(d.layers(0).head_dim(), 8);
  EXPECT_EQ(d.layers(4).kv_heads(), 1);
  EXPECT_EQ(d.layers(4).head_dim(), 16);
  EXPECT_EQ(d.dtype(), "f32");
  EXPECT_EQ(d.block_size(), 4);
  EXPECT_EQ(d.token_count(), kTokens);
  EXPECT_EQ(d.sliding_window(), 6);
  EXPECT_EQ(d.full_block_count(), 6);
  EXPECT_EQ(d.first_sliding_block(), 4);  // SlidingKeepFrom(23) = 18 is in block 4
  EXPECT_EQ(d.sliding_block_count(), 2);
  EXPECT_THAT(CheckDescriptor(layout_, d), IsOk());
}

// The layout part (what workers report in Stats.kv_layout): the sequence's descriptor without
// its counts, a valid descriptor of 0 tokens; another block size fails the check.
TEST_F(KvTransferTest, DescriptorOfTheLayout) {
  v1::KvDescriptor d = DescribeLayout(layout_);
  v1::KvDescriptor seq = DescribeSequence(layout_, *src_);
  seq.clear_token_count();
  seq.clear_full_block_count();
  seq.clear_first_sliding_block();
  seq.clear_sliding_block_count();
  EXPECT_EQ(d.SerializeAsString(), seq.SerializeAsString());
  EXPECT_EQ(d.block_size(), 4);
  EXPECT_EQ(d.token_count(), 0);
  EXPECT_THAT(CheckDescriptor(layout_, d), IsOk());
  d.set_block_size(7);
  EXPECT_THAT(CheckDescriptor(layout_, d), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(KvTransferTest, InProcessTransferMovesEveryRow) {
  RegisterInProcessReceiver("denoise-0", receiver_.get());
  auto transport = CreateInProcessTransport();
  EXPECT_EQ(transport->name(), "inprocess");
  auto sent = SendWaiter::Make();
  transport->Send("denoise-0", "req-1", src_, 10000, sent->Callback());
  ASSERT_TRUE(sent->Wait());
  ASSERT_THAT(sent->result, IsOk());
  EXPECT_EQ(sent->result->blocks, 8);
  EXPECT_EQ(sent->result->bytes, int64_t(6 * layout_.BlockBytes(LayerKind::kFull) +
                                        2 * layout_.BlockBytes(LayerKind::kSliding)));
  EXPECT_EQ(receiver_pool_->stats().used[F], 6);
  EXPECT_EQ(receiver_pool_->stats().used[S], 2);
  // Arrived before Expect: handed over at once.
  auto got = KvWaiter::Make();
  receiver_->Expect("req-1", Later(), got->Callback());
  ASSERT_TRUE(got->Wait());
  ASSERT_THAT(got->result, IsOk());
  PagedKvCache& kv = **got->result;
  EXPECT_EQ(kv.num_tokens(), kTokens);
  EXPECT_EQ(kv.pool(), receiver_pool_.get());
  testing::ExpectPattern(kv, layout_, 9);
  // The received sequence grows like a local one.
  testing::AppendPattern(kv, layout_, 3, 9);
  testing::ExpectPattern(kv, layout_, 9);
  got->result = absl::CancelledError("dropped");
  ExpectNothingHeld();
  UnregisterInProcessReceiver("denoise-0");
}

TEST_F(KvTransferTest, ExpectBeforeArrival) {
  RegisterInProcessReceiver("denoise-1", receiver_.get());
  auto got = KvWaiter::Make();
  receiver_->Expect("req-2", Later(), got->Callback());
  auto transport = CreateInProcessTransport();
  auto sent = SendWaiter::Make();
  transport->Send("denoise-1", "req-2", src_, 10000, sent->Callback());
  ASSERT_TRUE(got->Wait());
  ASSERT_TRUE(sent->Wait());
  ASSERT_THAT(sent->result, IsOk());
  ASSERT_THAT(got->result, IsOk());
  testing::ExpectPattern(**got->result, layout_, 9);
  UnregisterInProcessReceiver("denoise-1");
}

// A sequence whose newest rows are still only in a device backend's memory is refused before
// anything moves (its host rows are stale until ModelBackend::SyncKvToHost).
TEST_F(KvTransferTest, StaleHostRowsAreRefused) {
  RegisterInProcessReceiver("denoise-stale", receiver_.get());
  auto kv = std::make_shared<PagedKvCache>(sender_pool_.get(), 256);
  testing::AppendPattern(*kv, layout_, kTokens, 9);
  kv->set_host_rows_stale(true);
  auto sent = SendWaiter::Make();
  CreateInProcessTransport()->Send("denoise-stale", "req-stale", kv, 1000, sent->Callback());
  ASSERT_TRUE(sent->Wait());
  EXPECT_THAT(sent->result,
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("SyncKvToHost")));
  EXPECT_EQ(receiver_pool_->stats().used[F], 0);
  EXPECT_EQ(receiver_pool_->stats().used[S], 0);
  UnregisterInProcessReceiver("denoise-stale");
}

TEST_F(KvTransferTest, UnknownTargetIsUnavailable) {
  auto sent = SendWaiter::Make();
  CreateInProcessTransport()->Send("nobody", "req-3", src_, 1000, sent->Callback());
  ASSERT_TRUE(sent->Wait());
  EXPECT_THAT(sent->result, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("nobody")));
}

TEST_F(KvTransferTest, DescriptorMismatchFailsTheRequest) {
  using Mutation = std::function<void(v1::KvDescriptor&)>;
  const std::vector<std::pair<std::string, Mutation>> cases = {
      {"model_id", [](auto& d) { d.set_model_id("other"); }},
      {"layers", [](auto& d) { d.mutable_layers()->RemoveLast(); }},
      {"layers[2] is sliding", [](auto& d) { d.mutable_layers(2)->set_sliding(true); }},
      {"kv_heads", [](auto& d) { d.mutable_layers(1)->set_kv_heads(4); }},
      {"head_dim", [](auto& d) { d.mutable_layers(4)->set_head_dim(32); }},
      {"dtype", [](auto& d) { d.set_dtype("bf16"); }},
      {"block_size", [](auto& d) { d.set_block_size(8); }},
      {"sliding_window", [](auto& d) { d.set_sliding_window(7); }},
      {"full_block_count", [](auto& d) { d.set_token_count(30); }},
      {"full_block_count", [](auto& d) { d.set_full_block_count(5); }},
      {"first_sliding_block", [](auto& d) { d.set_first_sliding_block(5); }},
      {"sliding_block_count", [](auto& d) { d.set_sliding_block_count(3); }},
      {"token_count", [](auto& d) { d.set_token_count(-1); }},
  };
  int i = 0;
  for (const auto& [field, mutate] : cases) {
    const std::string id = "bad-" + std::to_string(i++);
    v1::KvTransferHeader h = Header(id);
    mutate(*h.mutable_kv_descriptor());
    EXPECT_THAT(CheckDescriptor(layout_, h.kv_descriptor()),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(field)));
    auto got = KvWaiter::Make();
    receiver_->Expect(id, Later(), got->Callback());
    EXPECT_THAT(receiver_->Begin(h),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(field)));
    ASSERT_TRUE(got->Wait());
    EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(field)));
    ExpectNothingHeld();
  }
  EXPECT_EQ(receiver_->failed_transfers(), int64_t(cases.size()));
}

// Issue #15 item 8: a PushBlocks header with token_count 2147483647 reached the block
// arithmetic (signed overflow). The token count is range-checked first now, and the descriptor
// check computes the right block counts for any int.
TEST_F(KvTransferTest, HugeTokenCountIsRefusedBeforeBlockArithmetic) {
  v1::KvTransferHeader h = Header("huge");
  h.mutable_kv_descriptor()->set_token_count(2147483647);
  auto got = KvWaiter::Make();
  receiver_->Expect("huge", Later(), got->Callback());
  EXPECT_THAT(receiver_->Begin(h), StatusIs(absl::StatusCode::kResourceExhausted,
                                            HasSubstr("token_count 2147483647 exceeds")));
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kResourceExhausted));
  ExpectNothingHeld();
  EXPECT_THAT(CheckDescriptor(layout_, h.kv_descriptor()),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("full_block_count is 6, expected 536870912")));
}

TEST_F(KvTransferTest, BadBlocksAbortWithoutLeaks) {
  const auto payloads = Payloads();
  ASSERT_EQ(payloads.size(), 8u);
  struct Case {
    std::string name;
    absl::StatusCode code;
    std::function<absl::Status(KvReceiver&, const std::string&)> run;
  };
  auto write_all_but = [&](KvReceiver& r, const std::string& id, size_t skip) {
    for (size_t i = 0; i < payloads.size(); ++i) {
      if (i != skip) EXPECT_THAT(r.WriteBlock(id, payloads[i]), IsOk());
    }
  };
  v1::KvTransferTrailer trailer;
  trailer.set_blocks(8);
  const std::vector<Case> cases = {
      {"missing block", absl::StatusCode::kDataLoss,
       [&](KvReceiver& r, const std::string& id) {
         write_all_but(r, id, 3);
         return r.Finish(id, trailer);
       }},
      {"wrong trailer", absl::StatusCode::kDataLoss,
       [&](KvReceiver& r, const std::string& id) {
         write_all_but(r, id, 99);
         v1::KvTransferTrailer t;
         t.set_blocks(7);
         return r.Finish(id, t);
       }},
      {"duplicate block", absl::StatusCode::kInvalidArgument,
       [&](KvReceiver& r, const std::string& id) {
         EXPECT_THAT(r.WriteBlock(id, payloads[1]), IsOk());
         return r.WriteBlock(id, payloads[1]);
       }},
      {"wrong size", absl::StatusCode::kInvalidArgument,
       [&](KvReceiver& r, const std::string& id) {
         v1::KvBlockPayload p = payloads[2];
         p.mutable_data()->resize(p.data().size() - 4);
         p.set_checksum(Fnv1a64(p.data()));
         return r.WriteBlock(id, p);
       }},
      {"bad checksum", absl::StatusCode::kDataLoss,
       [&](KvReceiver& r, const std::string& id) {
         v1::KvBlockPayload p = payloads[6];  // a sliding block
         (*p.mutable_data())[5] ^= 1;
         return r.WriteBlock(id, p);
       }},
      {"unannounced sliding block", absl::StatusCode::kInvalidArgument,
       [&](KvReceiver& r, const std::string& id) {
         v1::KvBlockPayload p = payloads[6];
         p.set_logical_block(1);  // sliding blocks 4..5 were announced
         return r.WriteBlock(id, p);
       }},
      {"unannounced full block", absl::StatusCode::kInvalidArgument,
       [&](KvReceiver& r, const std::string& id) {
         v1::KvBlockPayload p = payloads[0];
         p.set_logical_block(6);
         return r.WriteBlock(id, p);
       }},
  };
  int64_t failed = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string id = "req-" + c.name;
    auto got = KvWaiter::Make();
    receiver_->Expect(id, Later(), got->Callback());
    ASSERT_THAT(receiver_->Begin(Header(id)), IsOk());
    EXPECT_EQ(receiver_->pending_transfers(), 1);
    EXPECT_EQ(receiver_pool_->stats().used[F], 0);  // blocks are taken as their data arrives
    EXPECT_THAT(c.run(*receiver_, id), StatusIs(c.code));
    ASSERT_TRUE(got->Wait());
    EXPECT_THAT(got->result, StatusIs(c.code, HasSubstr(id)));
    ExpectNothingHeld();
    EXPECT_EQ(receiver_->failed_transfers(), ++failed);
    // The rest of the stream is refused.
    EXPECT_THAT(receiver_->WriteBlock(id, payloads[0]), StatusIs(absl::StatusCode::kNotFound));
  }
}

TEST_F(KvTransferTest, FailureBeforeExpectIsReported) {
  ASSERT_THAT(receiver_->Begin(Header("early")), IsOk());
  receiver_->Abort("early", absl::UnavailableError("stream cut"));
  ExpectNothingHeld();
  auto got = KvWaiter::Make();
  receiver_->Expect("early", Later(), got->Callback());
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("stream cut")));
  receiver_->Abort("unknown", absl::UnavailableError("no-op"));  // unknown id: nothing happens
}

TEST_F(KvTransferTest, DuplicateBeginKeepsTheTransferInFlight) {
  ASSERT_THAT(receiver_->Begin(Header("dup")), IsOk());
  EXPECT_THAT(receiver_->Begin(Header("dup")), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_EQ(receiver_->pending_transfers(), 1);
  EXPECT_THAT(receiver_->Begin(Header("")), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(receiver_->Begin(Header("nolease", 0)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  receiver_->Forget("dup");
  ExpectNothingHeld();
}

// A transfer larger than the whole pool can never fit: OUT_OF_RANGE (HTTP 400), not
// RESOURCE_EXHAUSTED (429, which tells a client to retry).
TEST_F(KvTransferTest, TransferLargerThanThePoolIsOutOfRange) {
  auto tiny = std::move(*BlockPool::Create(layout_, 32, 3));
  KvReceiver small(tiny.get(), 256);
  auto got = KvWaiter::Make();
  small.Expect("big", Later(), got->Callback());
  EXPECT_THAT(small.Begin(Header("big")),
              StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("in all (--kv_cache_mib)")));
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kOutOfRange));
  EXPECT_EQ(tiny->stats().used[S], 0);
  EXPECT_EQ(tiny->stats().used[F], 0);
}

// Issue 36 item 2: one header announcing a whole pool and sending no data pinned the pool for
// its lease (renewable): blocks are taken only as their data arrives now, so the header holds
// nothing and public requests are served beside it.
TEST_F(KvTransferTest, AHeaderWithoutDataHoldsNoBlocks) {
  ASSERT_THAT(receiver_->Begin(Header("pin")), IsOk());
  EXPECT_EQ(receiver_pool_->stats().used[S], 0);
  EXPECT_EQ(receiver_pool_->stats().used[F], 0);
  // Other transfers use the whole pool meanwhile (one after another, each adopted and freed).
  for (int i = 0; i < 3; ++i) {
    const std::string id = "public-" + std::to_string(i);
    auto got = KvWaiter::Make();
    receiver_->Expect(id, Later(), got->Callback());
    Deliver(id);
    ASSERT_TRUE(got->Wait());
    ASSERT_THAT(got->result, IsOk());
  }
  // A block that arrives takes exactly one block of its kind.
  const std::vector<v1::KvBlockPayload> payloads = Payloads();
  ASSERT_THAT(receiver_->WriteBlock("pin", payloads[0]), IsOk());
  const PoolStats st = receiver_pool_->stats();
  EXPECT_EQ(st.used[S] + st.used[F], 1);
  receiver_->Forget("pin");
  ExpectNothingHeld();
}

// Blocks that cannot be had when their data arrives fail the transfer with RESOURCE_EXHAUSTED
// and free what it took; a transfer larger than the whole pool is refused at its header.
TEST_F(KvTransferTest, ABlockWithoutRoomFailsTheTransferAndFreesItsBlocks) {
  const std::vector<v1::KvBlockPayload> payloads = Payloads();
  ASSERT_GE(payloads.size(), 2u);
  int full = 0, sliding = 0;
  for (const auto& p : payloads) (p.sliding() ? sliding : full)++;
  // Room for every block but one of the transfer's kinds: its last block finds none.
  auto pool = std::move(*BlockPool::Create(layout_, 32, 32));
  KvReceiver receiver(pool.get(), 256);
  const LayerKind kind = full > 0 ? LayerKind::kFull : LayerKind::kSliding;
  const int need = full > 0 ? full : sliding;
  auto hog = pool->Allocate(kind, int(pool->stats().total[KindIndex(kind)]) - (need - 1));
  ASSERT_THAT(hog, IsOk());
  auto got = KvWaiter::Make();
  receiver.Expect("tight", Later(), got->Callback());
  ASSERT_THAT(receiver.Begin(Header("tight")), IsOk());
  absl::Status last;
  for (const auto& p : payloads) {
    last = receiver.WriteBlock("tight", p);
    if (!last.ok()) break;
  }
  EXPECT_THAT(last, StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("no free")));
  // Marked as a pool full now (a sender may push again once blocks are freed).
  EXPECT_TRUE(IsKvPoolFull(last)) << last;
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kResourceExhausted));
  const PoolStats st = pool->stats();
  EXPECT_EQ(st.used[KindIndex(kind)], int64_t(hog->size())) << "the transfer freed its blocks";
  pool->Release(kind, *hog);
}

TEST_F(KvTransferTest, LeaseExpiryReclaimsBlocks) {
  // An incomplete transfer.
  auto got = KvWaiter::Make();
  receiver_->Expect("slow", absl::Now() + absl::Hours(3), got->Callback());
  ASSERT_THAT(receiver_->Begin(Header("slow", 60000)), IsOk());
  ASSERT_THAT(receiver_->WriteBlock("slow", Payloads()[0]), IsOk());
  receiver_->ReapExpired(absl::Now());  // not yet due
  EXPECT_EQ(receiver_->pending_transfers(), 1);
  receiver_->ReapExpired(Later());
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("lease")));
  ExpectNothingHeld();
  // A completed transfer nobody claims.
  Deliver("unclaimed");
  EXPECT_EQ(receiver_pool_->stats().used[F], 6);
  receiver_->ReapExpired(absl::Now());
  EXPECT_EQ(receiver_pool_->stats().used[F], 6);
  receiver_->ReapExpired(Later());
  ExpectNothingHeld();
}

TEST_F(KvTransferTest, ReaperThreadUsesTheClock) {
  ASSERT_THAT(receiver_->Begin(Header("short", 20)), IsOk());
  const absl::Time give_up = absl::Now() + kWait;
  while (receiver_->pending_transfers() > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ExpectNothingHeld();
  EXPECT_EQ(receiver_->failed_transfers(), 1);
}

TEST_F(KvTransferTest, ForgetDropsEverything) {
  // In flight: blocks freed, the Expect callback never runs, later transfers are refused.
  auto never = KvWaiter::Make();
  receiver_->Expect("gone", Later(), never->Callback());
  ASSERT_THAT(receiver_->Begin(Header("gone")), IsOk());
  ASSERT_THAT(receiver_->WriteBlock("gone", Payloads()[0]), IsOk());
  receiver_->Forget("gone");
  ExpectNothingHeld();
  EXPECT_THAT(receiver_->WriteBlock("gone", Payloads()[1]),
              StatusIs(absl::StatusCode::kCancelled));
  EXPECT_THAT(receiver_->Begin(Header("gone")), StatusIs(absl::StatusCode::kCancelled));
  receiver_->ReapExpired(absl::Now() + absl::Hours(5));
  EXPECT_EQ(never->calls.load(), 0);
  // Completed and unclaimed: freed.
  Deliver("done");
  EXPECT_EQ(receiver_pool_->stats().used[F], 6);
  receiver_->Forget("done");
  ExpectNothingHeld();
}

// A request forgotten because its deadline passed refuses its KV with DEADLINE_EXCEEDED (so the
// prefill worker records the request as the deadline's, not as cancelled); everything else
// about Forget is the same.
TEST_F(KvTransferTest, ForgetForTheDeadlineRefusesWithDeadlineExceeded) {
  ASSERT_THAT(receiver_->Begin(Header("late")), IsOk());
  ASSERT_THAT(receiver_->WriteBlock("late", Payloads()[0]), IsOk());
  receiver_->Forget("late", absl::StatusCode::kDeadlineExceeded);
  ExpectNothingHeld();
  EXPECT_THAT(receiver_->WriteBlock("late", Payloads()[1]),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("deadline passed")));
  EXPECT_THAT(receiver_->Begin(Header("late")),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("deadline passed")));
  auto got = KvWaiter::Make();
  receiver_->Expect("late", Later(), got->Callback());
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("late")));
  // The first reason stays.
  receiver_->Forget("late");
  EXPECT_THAT(receiver_->Begin(Header("late")),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_F(KvTransferTest, ExpectDeadline) {
  auto got = KvWaiter::Make();
  receiver_->Expect("late", Later(), got->Callback());
  receiver_->ReapExpired(absl::Now());
  EXPECT_EQ(got->calls.load(), 0);
  receiver_->ReapExpired(Later() + absl::Seconds(1));
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("late")));
  // Already past: at once.
  auto past = KvWaiter::Make();
  receiver_->Expect("past", absl::Now() - absl::Seconds(1), past->Callback());
  ASSERT_TRUE(past->Wait());
  EXPECT_THAT(past->result, StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST_F(KvTransferTest, ShutdownCancelsWaiters) {
  auto got = KvWaiter::Make();
  receiver_->Expect("orphan", Later(), got->Callback());
  ASSERT_THAT(receiver_->Begin(Header("half")), IsOk());
  receiver_.reset();
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result, StatusIs(absl::StatusCode::kCancelled));
  EXPECT_EQ(receiver_pool_->stats().used[F], 0);
}

}  // namespace
}  // namespace dgserve::kv

namespace dgserve::kv {
namespace {

using ::dgserve::testing::IsOk;

// A sender's lease_ms is clamped to the receiver's maximum (issue 15: a forged 1e12 ms lease
// kept blocks pinned for over an hour).
TEST(KvReceiverLeaseTest, ForgedLeaseIsClampedToTheMaximum) {
  const KvLayout layout = KvLayout::FromConfig(testing::MixedConfig(), 4, "mixed");
  auto sender_pool = std::move(*BlockPool::Create(layout, 32, 32));
  auto pool = std::move(*BlockPool::Create(layout, 32, 32));
  KvReceiver receiver(pool.get(), 256, /*max_lease_ms=*/1000);
  auto kv = std::make_shared<PagedKvCache>(sender_pool.get(), 256);
  testing::AppendPattern(*kv, layout, kTokens, 9);
  const int64_t forged = 1000000000000;  // 1e12 ms
  // Incomplete: the header only.
  ASSERT_THAT(receiver.Begin(internal::MakeHeader("open", *kv, forged)), IsOk());
  // Complete and never claimed.
  const v1::KvTransferHeader h = internal::MakeHeader("done", *kv, forged);
  ASSERT_THAT(receiver.Begin(h), IsOk());
  int blocks = 0;
  for (const auto& b : internal::BlocksToSend(h.kv_descriptor(), *kv)) {
    v1::KvBlockPayload p;
    internal::FillPayload(*kv, b, &p);
    ASSERT_THAT(receiver.WriteBlock("done", p), IsOk());
    ++blocks;
  }
  v1::KvTransferTrailer trailer;
  trailer.set_blocks(blocks);
  ASSERT_THAT(receiver.Finish("done", trailer), IsOk());
  EXPECT_EQ(receiver.clamped_leases(), 2);
  EXPECT_GT(pool->stats().used[F], 0);
  receiver.ReapExpired(absl::Now() + absl::Seconds(2));  // past the clamped lease, not 1e12 ms
  EXPECT_EQ(pool->stats().used[S], 0);
  EXPECT_EQ(pool->stats().used[F], 0);
  EXPECT_EQ(receiver.pending_transfers(), 0);
}

}  // namespace
}  // namespace dgserve::kv

namespace dgserve::kv {
namespace {

// What the gateway returned for a denoise worker's full pool (issue kvq51): the cause nested
// once per layer (receiver, stream client, sender). Only the cause is kept.
TEST(TransferFailureCauseTest, StripsEveryLayersPrefix) {
  EXPECT_EQ(TransferFailureCause(
                "KV transfer for att-1 to 127.0.0.1:9 failed: KV transfer for att-1: KV pool full: "
                "no free full block for block 19: only 0 available (21 total, 21 in use)"),
            "KV pool full: no free full block for block 19: only 0 available (21 total, 21 in "
            "use)");
  EXPECT_EQ(TransferFailureCause("KV transfer for att-1 to 127.0.0.1:9: stream closed early"),
            "stream closed early");
  EXPECT_EQ(TransferFailureCause("KV transfer for att-1 failed: CANCELLED"), "CANCELLED");
  // A message of its own that starts the same way is kept whole.
  EXPECT_EQ(TransferFailureCause("KV transfer for att-1 already in flight"),
            "KV transfer for att-1 already in flight");
  EXPECT_EQ(TransferFailureCause("KV transfer for att-1 over tcp refused: no route"),
            "KV transfer for att-1 over tcp refused: no route");
  EXPECT_EQ(TransferFailureCause("no in-process KV receiver"), "no in-process KV receiver");
}

TEST(TransferFailureCauseTest, PoolFullNeedsTheCodeAndTheMarker) {
  EXPECT_TRUE(IsKvPoolFull(absl::ResourceExhaustedError("KV transfer for a: KV pool full: x")));
  EXPECT_FALSE(IsKvPoolFull(absl::ResourceExhaustedError("token_count 9 exceeds the limit")));
  EXPECT_FALSE(IsKvPoolFull(absl::UnavailableError("KV pool full: x")));
}

}  // namespace
}  // namespace dgserve::kv
