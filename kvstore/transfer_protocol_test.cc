// The shared sending protocol (transfer_protocol.h) with a recording BlockMover: the order of
// the calls, Cancel after a failure (and not after a failed Open), the acknowledgement check,
// the lease as deadline, errors naming the request and the target, the outstanding limit.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/testing/status_matchers.h"
#include "kvstore/test_util.h"
#include "kvstore/transfer_protocol.h"

namespace dgserve::kv::internal {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Script {
  std::vector<std::string> calls;
  absl::Status open_error;
  int fail_block = -1;        // MoveBlock of this index fails
  int ack_blocks_delta = 0;   // the ack miscounts
  absl::Notification* hold = nullptr;  // MoveBlock 0 waits for it
};

class RecordingMover final : public BlockMover {
 public:
  explicit RecordingMover(Script* s) : s_(s) {}
  absl::Status Open(const v1::KvTransferHeader& header, const std::vector<OutgoingBlock>& blocks,
                    absl::Time deadline) override {
    s_->calls.push_back("open " + std::to_string(blocks.size()));
    blocks_ = &blocks;
    return s_->open_error;
  }
  absl::Status MoveBlock(const PagedKvCache& kv, size_t index) override {
    if (index == 0 && s_->hold != nullptr) s_->hold->WaitForNotification();
    s_->calls.push_back("block " + std::to_string(index));
    if (int(index) == s_->fail_block) return absl::InternalError("mover broke");
    ++ack_blocks_;
    ack_bytes_ += int64_t(kv.pool()->layout().BlockBytes((*blocks_)[index].kind));
    return absl::OkStatus();
  }
  absl::StatusOr<v1::KvAck> Close(const v1::KvTransferTrailer& trailer) override {
    s_->calls.push_back("close " + std::to_string(trailer.blocks()));
    v1::KvAck ack;
    ack.set_blocks(ack_blocks_ + s_->ack_blocks_delta);
    ack.set_bytes(ack_bytes_);
    return ack;
  }
  void Cancel(const absl::Status& why) override { s_->calls.push_back("cancel"); }

 private:
  Script* const s_;
  const std::vector<OutgoingBlock>* blocks_ = nullptr;
  int ack_blocks_ = 0;
  int64_t ack_bytes_ = 0;
};

class TransferProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = KvLayout::FromConfig(kv::testing::MixedConfig(), 4, "mixed");
    pool_ = std::move(*BlockPool::Create(layout_, 32, 32));
    auto kv = std::make_shared<PagedKvCache>(pool_.get(), 256);
    kv::testing::AppendPattern(*kv, layout_, 23, 1);  // 6 full + 2 sliding blocks
    kv_ = kv;
  }
  absl::StatusOr<TransferResult> Run(Script& s, int64_t lease_ms = 10000) {
    return RunTransferProtocol("test", "target-1", "req-1", *kv_, lease_ms,
                               [&s](const std::string&, const std::string&, absl::Time) {
                                 return absl::StatusOr<std::unique_ptr<BlockMover>>(
                                     std::make_unique<RecordingMover>(&s));
                               });
  }
  KvLayout layout_;
  std::unique_ptr<BlockPool> pool_;
  std::shared_ptr<const PagedKvCache> kv_;
};

TEST_F(TransferProtocolTest, HeaderBlocksTrailerThenAck) {
  Script s;
  absl::StatusOr<TransferResult> r = Run(s);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->blocks, 8);
  EXPECT_EQ(r->bytes, int64_t(6 * layout_.BlockBytes(LayerKind::kFull) +
                              2 * layout_.BlockBytes(LayerKind::kSliding)));
  EXPECT_THAT(s.calls, ElementsAre("open 8", "block 0", "block 1", "block 2", "block 3",
                                   "block 4", "block 5", "block 6", "block 7", "close 8"));
}

TEST_F(TransferProtocolTest, MoverErrorCancelsAndNamesRequestAndTarget) {
  Script s;
  s.fail_block = 2;
  EXPECT_THAT(Run(s), StatusIs(absl::StatusCode::kInternal,
                               HasSubstr("KV transfer for req-1 to target-1: mover broke")));
  EXPECT_THAT(s.calls, ElementsAre("open 8", "block 0", "block 1", "block 2", "cancel"));
}

TEST_F(TransferProtocolTest, FailedOpenIsNotCancelled) {
  Script s;
  s.open_error = absl::AlreadyExistsError("in flight");
  EXPECT_THAT(Run(s), StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("req-1")));
  EXPECT_THAT(s.calls, ElementsAre("open 8"));
}

TEST_F(TransferProtocolTest, WrongAcknowledgementIsDataLoss) {
  Script s;
  s.ack_blocks_delta = -1;
  EXPECT_THAT(Run(s), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("acknowledged 7 blocks")));
}

TEST_F(TransferProtocolTest, LeaseIsTheDeadline) {
  Script s;
  absl::Notification hold;
  s.hold = &hold;
  std::thread release([&] {
    absl::SleepFor(absl::Milliseconds(50));
    hold.Notify();
  });
  // Block 0 returns after the 20 ms lease: the protocol stops before block 1 and cancels.
  EXPECT_THAT(Run(s, 20), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                   HasSubstr("ran out after 1 of 8 blocks")));
  release.join();
  EXPECT_THAT(s.calls, ElementsAre("open 8", "block 0", "cancel"));
}

TEST_F(TransferProtocolTest, OutstandingLimitPerTargetAndReferenceDroppedBeforeDone) {
  ProtocolSender sender("test", 1);
  Script s;
  absl::Notification hold;
  s.hold = &hold;
  auto factory = [&s](const std::string&, const std::string&, absl::Time) {
    return absl::StatusOr<std::unique_ptr<BlockMover>>(std::make_unique<RecordingMover>(&s));
  };
  auto first = kv::testing::Waiter<TransferResult>::Make();
  std::weak_ptr<const PagedKvCache> weak = kv_;
  long uses_in_done = -1;
  auto first_cb = first->Callback();
  sender.Send("t", "a", std::move(kv_), 10000,
              [&, first_cb](absl::StatusOr<TransferResult> r) {
                uses_in_done = weak.use_count();
                first_cb(std::move(r));
              },
              factory);
  auto second = kv::testing::Waiter<TransferResult>::Make();
  sender.Send("t", "b", std::make_shared<PagedKvCache>(pool_.get(), 256), 10000,
              second->Callback(), factory);
  ASSERT_TRUE(second->Wait());
  EXPECT_THAT(second->result, StatusIs(absl::StatusCode::kResourceExhausted,
                                       HasSubstr("1 transfers to that target")));
  EXPECT_TRUE(IsKvPushLimit(second->result.status())) << second->result.status();
  EXPECT_FALSE(IsKvPoolFull(second->result.status()));
  hold.Notify();
  ASSERT_TRUE(first->Wait());
  EXPECT_THAT(first->result, IsOk());
  EXPECT_EQ(uses_in_done, 0);  // the sender's KV reference was released before done
}

}  // namespace
}  // namespace dgserve::kv::internal
