// The NCCL and CUDA IPC KV transports over the host emulation of the CUDA runtime and NCCL
// (engine/cuda/emu; label gpu-emu): a real gRPC KvTransferService on 127.0.0.1 in this process,
// a real KvReceiver and BlockPool. The emulation runs both NCCL ranks and both "processes" of
// CUDA IPC in this process and moves bytes with memcpy, so these tests check the transports'
// logic (bootstrap, staging rounds, control messages, waits, aborts, re-creation), not a GPU.
#include <gtest/gtest.h>

#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "common/testing/status_matchers.h"
#include "grpcpp/grpcpp.h"
#include "kvstore/gpu_transport.h"
#include "kvstore/test_util.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_service.h"
#include "kvstore/transport_selection.h"

namespace dgserve::kv {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::HasSubstr;
using KvWaiter = testing::KvWaiter;
using SendWaiter = testing::Waiter<TransferResult>;
namespace emu = ::dgserve::cuda::emu;

constexpr int S = 0, F = 1;
constexpr int kTokens = 23;  // block size 4: full blocks 0..5, sliding blocks 4..5
// Two 1 KiB full blocks or one 1.5 KiB sliding block (offsets 256-aligned) per round, so a
// transfer of 8 blocks takes several rounds.
constexpr int64_t kStaging = 3000;
constexpr absl::Duration kWait = absl::Seconds(20);

bool Eventually(const std::function<bool()>& done) { return testing::Eventually(done, kWait); }

class GpuTransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    layout_ = KvLayout::FromConfig(testing::MixedConfig(), 4, "mixed");
    sender_pool_ = std::move(*BlockPool::Create(layout_, 64, 64));
    options_.cuda_device = 0;
    options_.staging_bytes = kStaging;
    options_.nccl_init_timeout = absl::Seconds(10);
    StartServer(layout_, /*gpu=*/true);
    src_ = Sequence(kTokens, 4);
  }
  void TearDown() override {
    emu::SetNcclFault(emu::NcclFault::kNone, 0);
    transport_.reset();
    StopServer();
  }

  std::shared_ptr<const PagedKvCache> Sequence(int tokens, int seed) {
    auto kv = std::make_shared<PagedKvCache>(sender_pool_.get(), 256);
    testing::AppendPattern(*kv, layout_, tokens, seed);
    return kv;
  }
  void StartServer(const KvLayout& layout, bool gpu) {
    receiver_pool_ = std::move(*BlockPool::Create(layout, 32, 32));
    receiver_ = std::make_unique<KvReceiver>(receiver_pool_.get(), 256);
    KvTransferServiceOptions options;
    if (gpu) {
      auto endpoint = CreateGpuReceiveEndpoint(options_);
      ASSERT_THAT(endpoint, IsOk());
      options.gpu = *endpoint;
    }
    service_ = std::make_unique<KvTransferServiceImpl>(receiver_.get(), options);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = "127.0.0.1:" + std::to_string(port);
  }
  void StopServer() {
    server_->Shutdown();
    server_.reset();
    service_.reset();
    receiver_.reset();
    EXPECT_EQ(receiver_pool_->stats().used[S], 0);
    EXPECT_EQ(receiver_pool_->stats().used[F], 0);
  }
  KvTransport& Transport() {
    if (transport_ == nullptr) {
      auto t = GetParam() == "nccl" ? CreateNcclTransport(options_)
                                    : CreateCudaIpcTransport(options_);
      EXPECT_THAT(t, IsOk());
      transport_ = *std::move(t);
    }
    return *transport_;
  }
  bool ReceiverHoldsNothing() {
    const PoolStats st = receiver_pool_->stats();
    return st.used[S] == 0 && st.used[F] == 0 && receiver_->pending_transfers() == 0;
  }
  absl::Time Later() const { return absl::Now() + absl::Hours(1); }

  // Sends `kv` as `id` and returns the sender's result and the receiver's KV.
  struct Outcome {
    absl::StatusOr<TransferResult> sent;
    absl::StatusOr<std::unique_ptr<PagedKvCache>> got;
  };
  Outcome Transfer(const std::string& id, std::shared_ptr<const PagedKvCache> kv,
                   int64_t lease_ms = 10000, bool expect = true) {
    auto got = KvWaiter::Make();
    if (expect) receiver_->Expect(id, Later(), got->Callback());
    auto sent = SendWaiter::Make();
    Transport().Send(target_, id, std::move(kv), lease_ms, sent->Callback());
    EXPECT_TRUE(sent->Wait(kWait));
    if (expect) EXPECT_TRUE(got->Wait(kWait));
    Outcome o{sent->result, std::move(got->result)};
    return o;
  }

  // Every announced block of `got` equals the source's block, byte for byte.
  void ExpectSameBlocks(const PagedKvCache& got, const PagedKvCache& want) {
    const BlockTable& g = got.table();
    const BlockTable& w = want.table();
    const v1::KvDescriptor d = DescribeSequence(layout_, want);
    ASSERT_EQ(int(g.full.size()), d.full_block_count());
    for (int i = 0; i < d.full_block_count(); ++i) {
      EXPECT_EQ(std::memcmp(receiver_pool_->BlockData(LayerKind::kFull, g.full[i]),
                            sender_pool_->BlockData(LayerKind::kFull, w.full[i]),
                            layout_.BlockBytes(LayerKind::kFull)),
                0)
          << "full block " << i;
    }
    ASSERT_EQ(int(g.sliding.size()), d.sliding_block_count());
    for (int i = 0; i < d.sliding_block_count(); ++i) {
      const int logical = d.first_sliding_block() + i;
      EXPECT_EQ(std::memcmp(
                    receiver_pool_->BlockData(LayerKind::kSliding,
                                              g.sliding[logical - g.first_sliding_block]),
                    sender_pool_->BlockData(LayerKind::kSliding,
                                            w.sliding[logical - w.first_sliding_block]),
                    layout_.BlockBytes(LayerKind::kSliding)),
                0)
          << "sliding block " << logical;
    }
  }

  KvLayout layout_;
  GpuTransportOptions options_;
  std::unique_ptr<BlockPool> sender_pool_, receiver_pool_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<KvTransferServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::shared_ptr<const PagedKvCache> src_;
  std::unique_ptr<KvTransport> transport_;
};

TEST_P(GpuTransportTest, DeliversBitIdenticalKvThroughSeveralStagingRounds) {
  EXPECT_EQ(Transport().name(), GetParam());
  // More blocks (6 full + 2 sliding, 9 KiB) than the 3000 bytes of staging hold at once.
  ASSERT_GT(6 * layout_.BlockBytes(LayerKind::kFull), size_t(kStaging));
  Outcome o = Transfer("gpu-1", src_);
  ASSERT_THAT(o.sent, IsOk());
  EXPECT_EQ(o.sent->blocks, 8);
  EXPECT_EQ(o.sent->bytes, int64_t(6 * layout_.BlockBytes(LayerKind::kFull) +
                                   2 * layout_.BlockBytes(LayerKind::kSliding)));
  ASSERT_THAT(o.got, IsOk());
  EXPECT_EQ((*o.got)->num_tokens(), kTokens);
  ExpectSameBlocks(**o.got, *src_);
  testing::ExpectPattern(**o.got, layout_, 4);
  o.got = absl::CancelledError("dropped");
  EXPECT_TRUE(ReceiverHoldsNothing());
  // The receiver counts the bytes under the path they took (the denoise worker's
  // kv_transfer_bytes_total{transport} label; it said "tcp" for every path).
  const std::map<v1::KvDataPath, int64_t> by_path = receiver_->received_bytes_by_path();
  const v1::KvDataPath path = GetParam() == "nccl" ? v1::KV_DATA_NCCL : v1::KV_DATA_CUDA_IPC;
  ASSERT_EQ(by_path.size(), 1u);
  EXPECT_EQ(by_path.begin()->first, path);
  EXPECT_EQ(by_path.begin()->second, o.sent->bytes);
  EXPECT_EQ(receiver_->received_bytes(), o.sent->bytes);

  // Further transfers over the cached session: a longer sequence (its sliding blocks start
  // later) and a one-block one.
  const int64_t comms = emu::NcclCommunicatorsCreated();
  auto longer = Sequence(61, 9);
  Outcome o2 = Transfer("gpu-2", longer);
  ASSERT_THAT(o2.sent, IsOk());
  ASSERT_THAT(o2.got, IsOk());
  ExpectSameBlocks(**o2.got, *longer);
  testing::ExpectPattern(**o2.got, layout_, 9);
  o2.got = absl::CancelledError("dropped");
  auto tiny = Sequence(3, 5);
  Outcome o3 = Transfer("gpu-3", tiny);
  ASSERT_THAT(o3.sent, IsOk());
  ASSERT_THAT(o3.got, IsOk());
  ExpectSameBlocks(**o3.got, *tiny);
  o3.got = absl::CancelledError("dropped");
  EXPECT_EQ(emu::NcclCommunicatorsCreated(), comms);  // no new communicator
  EXPECT_TRUE(ReceiverHoldsNothing());
}

TEST_P(GpuTransportTest, DescriptorMismatchFailsWithFailedPrecondition) {
  StopServer();
  StartServer(KvLayout::FromConfig(testing::MixedConfig(), 4, "other-model"), true);
  Outcome o = Transfer("gpu-mismatch", src_);
  EXPECT_THAT(o.sent, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("model_id")));
  EXPECT_THAT(o.got, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("model_id")));
  EXPECT_TRUE(Eventually([&] { return ReceiverHoldsNothing(); }));
}

TEST_P(GpuTransportTest, ReceiverWithGpuTransportsOffRefusesClearly) {
  StopServer();
  StartServer(layout_, /*gpu=*/false);
  // Refused at the session set-up (NcclBootstrap / CudaIpcOpen), before any transfer began.
  Outcome o = Transfer("gpu-off", src_, 10000, /*expect=*/false);
  EXPECT_THAT(o.sent, StatusIs(absl::StatusCode::kFailedPrecondition,
                               HasSubstr("GPU KV transports are off")));
  EXPECT_TRUE(ReceiverHoldsNothing());
}

INSTANTIATE_TEST_SUITE_P(Transports, GpuTransportTest, ::testing::Values("nccl", "cuda_ipc"),
                         [](const auto& info) { return info.param; });

// A fault mid-transfer (the emulated NCCL fails or swallows a send once 2 KiB were sent, in
// the second staging round): the transfer fails by its deadline, the receiver holds nothing,
// the request waiting for the KV gets the error, and the next transfer to the same target
// succeeds over a new communicator.
class NcclTransportTest : public GpuTransportTest {};

TEST_P(NcclTransportTest, FaultsFailTheTransferAndTheNextOneRecreatesTheCommunicator) {
  ASSERT_THAT(Transfer("warm-up", src_).sent, IsOk());  // the communicator exists
  for (emu::NcclFault fault : {emu::NcclFault::kFail, emu::NcclFault::kHang}) {
    SCOPED_TRACE(fault == emu::NcclFault::kFail ? "fail" : "hang");
    const int64_t comms = emu::NcclCommunicatorsCreated();
    emu::SetNcclFault(fault, 2 * int64_t(layout_.BlockBytes(LayerKind::kFull)));
    const std::string id = fault == emu::NcclFault::kFail ? "fault-fail" : "fault-hang";
    // A short lease: the hang ends at its deadline.
    Outcome o = Transfer(id, src_, /*lease_ms=*/1500);
    EXPECT_FALSE(o.sent.ok());
    EXPECT_THAT(o.sent.status().message(), HasSubstr(id));
    EXPECT_THAT(o.sent.status().message(), HasSubstr(target_));
    EXPECT_FALSE(o.got.ok());
    EXPECT_TRUE(Eventually([&] { return ReceiverHoldsNothing(); }));
    EXPECT_GE(receiver_->failed_transfers(), 1);

    Outcome next = Transfer(id + "-next", src_);
    ASSERT_THAT(next.sent, IsOk());
    ASSERT_THAT(next.got, IsOk());
    ExpectSameBlocks(**next.got, *src_);
    next.got = absl::CancelledError("dropped");
    EXPECT_EQ(emu::NcclCommunicatorsCreated(), comms + 2);  // both ranks joined a new one
    EXPECT_TRUE(ReceiverHoldsNothing());
  }
}

// --kv_transport auto over a failing NCCL path (a firewall that blocks NCCL's own sockets, say):
// the failed transfer makes the target's next ones go over TCP for gpu_failure_backoff, with the
// same KV; once the backoff has passed NCCL is tried again (the reviewer's finding: auto chose
// NCCL again for every transfer, each failing at its deadline).
TEST_P(NcclTransportTest, AutoSendsOverTcpAfterAFailedNcclTransfer) {
  const KvPeerInfo info{"node-a", "GPU-x", {"tcp", "nccl"}};
  for (const absl::Duration backoff : {absl::Minutes(5), absl::ZeroDuration()}) {
    SCOPED_TRACE(absl::FormatDuration(backoff));
    RoutingKvTransportOptions ropts;
    ropts.mode = KvTransportMode::kAuto;
    ropts.local = info;
    ropts.lookup = [&](const std::string&) -> absl::StatusOr<KvPeerInfo> { return info; };
    ropts.gpu_failure_backoff = backoff;
    auto nccl = CreateNcclTransport(options_);
    ASSERT_THAT(nccl, IsOk());
    RoutingKvTransport routing(ropts, CreateTcpTransport(), nullptr, *std::move(nccl));
    const auto send = [&](const std::string& id) {
      auto got = KvWaiter::Make();
      receiver_->Expect(id, Later(), got->Callback());
      auto sent = SendWaiter::Make();
      routing.Send(target_, id, src_, 1500, sent->Callback());
      EXPECT_TRUE(sent->Wait(kWait));
      EXPECT_TRUE(got->Wait(kWait));
      Outcome o{sent->result, std::move(got->result)};
      return o;
    };
    const std::string tag = backoff > absl::ZeroDuration() ? "backoff" : "none";
    emu::SetNcclFault(emu::NcclFault::kFail, 0);
    Outcome failed = send("auto-fail-" + tag);
    EXPECT_FALSE(failed.sent.ok());
    EXPECT_EQ(FailedKvTransport(failed.sent.status(), "?"), "nccl");
    emu::SetNcclFault(emu::NcclFault::kNone, 0);
    EXPECT_TRUE(Eventually([&] { return ReceiverHoldsNothing(); }));

    Outcome next = send("auto-next-" + tag);
    ASSERT_THAT(next.sent, IsOk());
    EXPECT_EQ(next.sent->transport, backoff > absl::ZeroDuration() ? "tcp" : "nccl");
    ASSERT_THAT(next.got, IsOk());
    ExpectSameBlocks(**next.got, *src_);
    next.got = absl::CancelledError("dropped");
    EXPECT_TRUE(ReceiverHoldsNothing());
  }
}

INSTANTIATE_TEST_SUITE_P(Nccl, NcclTransportTest, ::testing::Values("nccl"),
                         [](const auto& info) { return info.param; });

TEST(LocalKvPeerInfoTest, ReportsNodeDeviceAndTransports) {
  setenv("NODE_NAME", "node-a", 1);
  const KvPeerInfo gpu = LocalKvPeerInfo(0);
  EXPECT_EQ(gpu.node, "node-a");
  // The emulated device's UUID bytes are e0 e1 … ef.
  EXPECT_EQ(gpu.gpu_uuid, "GPU-e0e1e2e3-e4e5-e6e7-e8e9-eaebecedeeef");
  EXPECT_EQ(gpu.transports, (std::vector<std::string>{"tcp", "cuda_ipc", "nccl"}));
  const KvPeerInfo none = LocalKvPeerInfo(-1);
  EXPECT_EQ(none.gpu_uuid, "");
  EXPECT_EQ(none.transports, (std::vector<std::string>{"tcp"}));
  unsetenv("NODE_NAME");
  EXPECT_FALSE(LocalKvPeerInfo(-1).node.empty());  // the host name
}

}  // namespace
}  // namespace dgserve::kv
