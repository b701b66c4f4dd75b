// The choice of KV transport (ChooseKvTransport) over the cases that matter, and the routing
// transport with the real TCP transport to a real KvTransferService on 127.0.0.1 whose
// DenoiseService.Stats (same port, as on the denoise worker) reports what that end can do.
#include "kvstore/transport_selection.h"

#include <gtest/gtest.h>

#include <atomic>

#include "common/testing/status_matchers.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvstore/test_util.h"
#include "kvstore/transfer_service.h"

namespace dgserve::kv {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

KvPeerInfo Peer(std::string node, std::string gpu, std::vector<std::string> transports) {
  return KvPeerInfo{std::move(node), std::move(gpu), std::move(transports)};
}

const std::vector<std::string> kAll = {"tcp", "cuda_ipc", "nccl"};

struct Case {
  const char* what;
  KvPeerInfo local, peer;
  const char* auto_choice;
};

TEST(ChooseKvTransportTest, AutoPicksCudaIpcThenNcclThenTcp) {
  const KvPeerInfo gpu0 = Peer("node-a", "GPU-0000", kAll);
  const Case cases[] = {
      {"same node, same GPU", gpu0, Peer("node-a", "GPU-0000", kAll), "cuda_ipc"},
      {"same node, different GPU", gpu0, Peer("node-a", "GPU-1111", kAll), "nccl"},
      {"different node, same UUID string", gpu0, Peer("node-b", "GPU-0000", kAll), "nccl"},
      {"different node, different GPU", gpu0, Peer("node-b", "GPU-1111", kAll), "nccl"},
      {"peer without a GPU", gpu0, Peer("node-a", "", {"tcp"}), "tcp"},
      {"peer reporting nothing (older worker)", gpu0, Peer("", "", {}), "tcp"},
      {"this end without a GPU", Peer("node-a", "", {"tcp"}), Peer("node-a", "GPU-0000", kAll),
       "tcp"},
      {"same node, no UUID on either end", Peer("node-a", "", kAll), Peer("node-a", "", kAll),
       "nccl"},
      {"same GPU, peer without CUDA IPC", gpu0, Peer("node-a", "GPU-0000", {"tcp", "nccl"}),
       "nccl"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<std::string> a = ChooseKvTransport(KvTransportMode::kAuto, c.local, c.peer);
    ASSERT_THAT(a, IsOk());
    EXPECT_EQ(*a, c.auto_choice);
    absl::StatusOr<std::string> t = ChooseKvTransport(KvTransportMode::kTcp, c.local, c.peer);
    ASSERT_THAT(t, IsOk());
    EXPECT_EQ(*t, "tcp");
  }
}

TEST(ChooseKvTransportTest, ExplicitModesThePairCanUse) {
  const KvPeerInfo gpu0 = Peer("node-a", "GPU-0000", kAll);
  absl::StatusOr<std::string> ipc =
      ChooseKvTransport(KvTransportMode::kCudaIpc, gpu0, Peer("node-a", "GPU-0000", kAll));
  ASSERT_THAT(ipc, IsOk());
  EXPECT_EQ(*ipc, "cuda_ipc");
  absl::StatusOr<std::string> nccl =
      ChooseKvTransport(KvTransportMode::kNccl, gpu0, Peer("node-a", "GPU-0000", kAll));
  ASSERT_THAT(nccl, IsOk());
  EXPECT_EQ(*nccl, "nccl");  // explicit nccl even where CUDA IPC would do
}

TEST(ChooseKvTransportTest, ExplicitModesThePairCannotUseAreRefused) {
  const KvPeerInfo gpu0 = Peer("node-a", "GPU-0000", kAll);
  EXPECT_THAT(
      ChooseKvTransport(KvTransportMode::kCudaIpc, gpu0, Peer("node-a", "GPU-1111", kAll),
                        "10.0.0.7:50051"),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("kv_transport cuda_ipc"), HasSubstr("10.0.0.7:50051"),
                     HasSubstr("same node and GPU"), HasSubstr("GPU GPU-1111"),
                     HasSubstr("this end reports node node-a, GPU GPU-0000"))));
  EXPECT_THAT(
      ChooseKvTransport(KvTransportMode::kCudaIpc, gpu0, Peer("node-b", "GPU-0000", kAll), "t"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("node node-b")));
  EXPECT_THAT(
      ChooseKvTransport(KvTransportMode::kNccl, gpu0, Peer("node-b", "", {"tcp"}), "peer:1"),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("kv_transport nccl to peer:1"),
                     HasSubstr("the peer cannot use NCCL"),
                     HasSubstr("peer:1 reports node node-b, no GPU, transports tcp"))));
  EXPECT_THAT(ChooseKvTransport(KvTransportMode::kNccl, Peer("node-a", "", {"tcp"}), gpu0, "p"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("this end cannot use NCCL")));
  EXPECT_THAT(
      ChooseKvTransport(KvTransportMode::kCudaIpc, Peer("node-a", "", {"tcp"}), gpu0, "p"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("this end cannot use CUDA IPC")));
  EXPECT_THAT(ChooseKvTransport(KvTransportMode::kNccl, gpu0, Peer("", "", {}), "p"),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("transports (none reported: tcp)")));
}

TEST(ChooseKvTransportTest, ParsesTheFlagValues) {
  for (const char* name : {"auto", "tcp", "cuda_ipc", "nccl"}) {
    absl::StatusOr<KvTransportMode> m = ParseKvTransportMode(name);
    ASSERT_THAT(m, IsOk());
    EXPECT_EQ(KvTransportModeName(*m), name);
  }
  EXPECT_THAT(ParseKvTransportMode("rdma"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'rdma'"), HasSubstr("auto, tcp, cuda_ipc or nccl"))));
  EXPECT_THAT(ParseKvTransportMode(""), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ChooseKvTransportTest, StatsCarriesThePeerInfo) {
  v1::StatsResponse stats;
  FillKvPeerInfo(Peer("node-a", "GPU-0000", {"tcp", "nccl"}), &stats);
  EXPECT_EQ(stats.node(), "node-a");
  EXPECT_EQ(stats.gpu_uuid(), "GPU-0000");
  ASSERT_EQ(stats.kv_transports_size(), 2);
  const KvPeerInfo back = KvPeerInfoFromStats(stats);
  EXPECT_EQ(back.node, "node-a");
  EXPECT_EQ(back.gpu_uuid, "GPU-0000");
  EXPECT_EQ(back.transports, (std::vector<std::string>{"tcp", "nccl"}));
}

TEST(ChooseKvTransportTest, ThisBuildReportsItsNodeAndTcpOnly) {
  setenv("NODE_NAME", "node-from-env", 1);
  const KvPeerInfo info = LocalKvPeerInfo(-1);
  unsetenv("NODE_NAME");
  EXPECT_EQ(info.node, "node-from-env");
  EXPECT_EQ(info.gpu_uuid, "");
  EXPECT_EQ(info.transports, (std::vector<std::string>{"tcp"}));
  EXPECT_FALSE(LocalKvPeerInfo(-1).node.empty());  // the host name
}

// DenoiseService with only Stats: what the denoise worker reports about its KV transports.
class StatsOnlyDenoiseService final : public v1::DenoiseService::Service {
 public:
  explicit StatsOnlyDenoiseService(KvPeerInfo info) : info_(std::move(info)) {}
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*,
                     v1::StatsResponse* response) override {
    ++calls;
    response->set_role("denoise");
    FillKvPeerInfo(info_, response);
    return grpc::Status::OK;
  }
  std::atomic<int> calls{0};

 private:
  KvPeerInfo info_;
};

using SendWaiter = testing::Waiter<TransferResult>;
using KvWaiter = testing::KvWaiter;
constexpr int kTokens = 23;

class RoutingKvTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = KvLayout::FromConfig(testing::MixedConfig(), 4, "mixed");
    sender_pool_ = std::move(*BlockPool::Create(layout_, 32, 32));
    receiver_pool_ = std::move(*BlockPool::Create(layout_, 32, 32));
    receiver_ = std::make_unique<KvReceiver>(receiver_pool_.get(), 256);
    transfer_ = std::make_unique<KvTransferServiceImpl>(receiver_.get());
    stats_ = std::make_unique<StatsOnlyDenoiseService>(LocalKvPeerInfo(-1));
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(transfer_.get());
    builder.RegisterService(stats_.get());
    builder.SetMaxReceiveMessageSize(64 << 20);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    target_ = "127.0.0.1:" + std::to_string(port);
    auto kv = std::make_shared<PagedKvCache>(sender_pool_.get(), 256);
    testing::AppendPattern(*kv, layout_, kTokens, 7);
    src_ = kv;
  }
  void TearDown() override {
    server_->Shutdown();
    server_.reset();
  }

  // Sends src_ as `id` and, if the transfer succeeded, checks the receiver got every row.
  absl::StatusOr<TransferResult> SendAndCheck(KvTransport& t, const std::string& target,
                                              const std::string& id) {
    auto sent = SendWaiter::Make();
    t.Send(target, id, src_, 10000, sent->Callback());
    EXPECT_TRUE(sent->Wait());
    if (sent->result.ok()) {
      auto got = KvWaiter::Make();
      receiver_->Expect(id, absl::Now() + absl::Seconds(10), got->Callback());
      EXPECT_TRUE(got->Wait());
      EXPECT_THAT(got->result, IsOk());
      if (got->result.ok()) testing::ExpectPattern(**got->result, layout_, 7);
    }
    return sent->result;
  }

  KvLayout layout_;
  std::unique_ptr<BlockPool> sender_pool_, receiver_pool_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<KvTransferServiceImpl> transfer_;
  std::unique_ptr<StatsOnlyDenoiseService> stats_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::shared_ptr<const PagedKvCache> src_;
};

TEST_F(RoutingKvTransportTest, AutoAsksTheTargetsStatsAndSendsOverTcp) {
  RoutingKvTransportOptions o;
  o.mode = KvTransportMode::kAuto;
  o.local = LocalKvPeerInfo(-1);
  o.lookup = StatsKvPeerLookup(nullptr);
  RoutingKvTransport router(o, CreateTcpTransport(), nullptr, nullptr);
  EXPECT_EQ(router.name(), "auto");
  EXPECT_EQ(router.available(), (std::vector<std::string>{"tcp"}));
  absl::StatusOr<TransferResult> r = SendAndCheck(router, target_, "auto-1");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->transport, "tcp");
  EXPECT_EQ(r->blocks, 8);
  EXPECT_EQ(stats_->calls.load(), 1);
  // The second transfer uses the cached answer.
  absl::StatusOr<TransferResult> again = SendAndCheck(router, target_, "auto-2");
  ASSERT_THAT(again, IsOk());
  EXPECT_EQ(again->transport, "tcp");
  EXPECT_EQ(stats_->calls.load(), 1);
  EXPECT_EQ(router.lookups(), 1);
}

TEST_F(RoutingKvTransportTest, AutoSkipsAGpuTransportThisProcessHasNoObjectFor) {
  // Both ends report NCCL, but this process could not make the NCCL transport (null): TCP.
  RoutingKvTransportOptions o;
  o.mode = KvTransportMode::kAuto;
  o.local = Peer("node-a", "GPU-0000", kAll);
  o.lookup = [](const std::string&) -> absl::StatusOr<KvPeerInfo> {
    return Peer("node-b", "GPU-1111", kAll);
  };
  RoutingKvTransport router(o, CreateTcpTransport(), nullptr, nullptr);
  EXPECT_EQ(router.available(), (std::vector<std::string>{"tcp"}));
  absl::StatusOr<TransferResult> r = SendAndCheck(router, target_, "skip-1");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->transport, "tcp");
}

TEST_F(RoutingKvTransportTest, ExplicitGpuModeWithoutThatTransportFailsTheTransfer) {
  RoutingKvTransportOptions o;
  o.mode = KvTransportMode::kNccl;
  o.local = LocalKvPeerInfo(-1);
  o.lookup = StatsKvPeerLookup(nullptr);
  RoutingKvTransport router(o, CreateTcpTransport(), nullptr, nullptr);
  absl::StatusOr<TransferResult> r = SendAndCheck(router, target_, "nccl-1");
  EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                          AllOf(HasSubstr("kv_transport nccl to " + target_),
                                HasSubstr("this end cannot use NCCL"))));
  EXPECT_EQ(FailedKvTransport(r.status(), "?"), "nccl");
  EXPECT_EQ(receiver_->pending_transfers(), 0);
}

// A sequence whose newest rows are still on a device backend's memory is refused before any
// lookup or transport (FAILED_PRECONDITION, no transport named as the failure).
TEST_F(RoutingKvTransportTest, StaleHostRowsAreRefusedBeforeRouting) {
  RoutingKvTransportOptions o;
  o.mode = KvTransportMode::kAuto;
  o.local = LocalKvPeerInfo(-1);
  o.lookup = [](const std::string&) -> absl::StatusOr<KvPeerInfo> {
    ADD_FAILURE() << "looked up for a refused sequence";
    return absl::InternalError("no");
  };
  RoutingKvTransport router(o, CreateTcpTransport(), nullptr, nullptr);
  auto kv = std::make_shared<PagedKvCache>(sender_pool_.get(), 256);
  testing::AppendPattern(*kv, layout_, kTokens, 7);
  kv->set_host_rows_stale(true);
  auto sent = SendWaiter::Make();
  router.Send(target_, "stale-1", kv, 10000, sent->Callback());
  ASSERT_TRUE(sent->Wait());
  EXPECT_THAT(sent->result,
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("SyncKvToHost")));
  EXPECT_EQ(FailedKvTransport(sent->result.status(), "?"), "?");
  EXPECT_EQ(router.lookups(), 0);
  EXPECT_EQ(receiver_->pending_transfers(), 0);
}

TEST_F(RoutingKvTransportTest, ExplicitTcpNeverAsks) {
  RoutingKvTransportOptions o;
  o.mode = KvTransportMode::kTcp;
  o.local = LocalKvPeerInfo(-1);
  o.lookup = [](const std::string&) -> absl::StatusOr<KvPeerInfo> {
    ADD_FAILURE() << "looked up in mode tcp";
    return absl::InternalError("no");
  };
  RoutingKvTransport router(o, CreateTcpTransport(), nullptr, nullptr);
  absl::StatusOr<TransferResult> r = SendAndCheck(router, target_, "tcp-1");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->transport, "tcp");
  EXPECT_EQ(router.lookups(), 0);
}

TEST_F(RoutingKvTransportTest, AFailedTransferOrAnExpiredAnswerIsLookedUpAgain) {
  std::atomic<int> asked{0};
  RoutingKvTransportOptions o;
  o.mode = KvTransportMode::kAuto;
  o.local = LocalKvPeerInfo(-1);
  o.lookup = [&asked](const std::string&) -> absl::StatusOr<KvPeerInfo> {
    ++asked;
    return Peer("node-b", "", {"tcp"});
  };
  TcpTransportOptions cut;
  cut.cut_after_bytes = 100;  // every transfer fails, over tcp
  {
    RoutingKvTransport router(o, CreateTcpTransport(cut), nullptr, nullptr);
    absl::StatusOr<TransferResult> r = SendAndCheck(router, target_, "fail-1");
    EXPECT_THAT(r, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("fault injection")));
    EXPECT_EQ(FailedKvTransport(r.status(), "?"), "tcp");
    EXPECT_EQ(asked.load(), 1);
    r = SendAndCheck(router, target_, "fail-2");
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(asked.load(), 2);  // the failure dropped the cached answer
  }
  asked = 0;
  o.peer_info_ttl = absl::ZeroDuration();  // every answer is stale at once
  RoutingKvTransport router(o, CreateTcpTransport(), nullptr, nullptr);
  ASSERT_THAT(SendAndCheck(router, target_, "ttl-1"), IsOk());
  ASSERT_THAT(SendAndCheck(router, target_, "ttl-2"), IsOk());
  EXPECT_EQ(asked.load(), 2);
  EXPECT_EQ(router.lookups(), 2);
}

TEST_F(RoutingKvTransportTest, SendsThatArriveDuringALookupWaitForItsAnswer) {
  absl::Notification answer;
  std::atomic<int> asked{0};
  RoutingKvTransportOptions o;
  o.mode = KvTransportMode::kAuto;
  o.local = LocalKvPeerInfo(-1);
  o.lookup = [&](const std::string&) -> absl::StatusOr<KvPeerInfo> {
    ++asked;
    answer.WaitForNotification();
    return Peer("node-b", "", {"tcp"});
  };
  RoutingKvTransport router(o, CreateTcpTransport(), nullptr, nullptr);
  std::vector<std::shared_ptr<SendWaiter>> sent;
  for (int i = 0; i < 3; ++i) {
    sent.push_back(SendWaiter::Make());
    router.Send(target_, "wait-" + std::to_string(i), src_, 10000, sent.back()->Callback());
  }
  EXPECT_FALSE(sent[2]->done.HasBeenNotified());  // nothing is sent before the answer
  answer.Notify();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(sent[i]->Wait());
    ASSERT_THAT(sent[i]->result, IsOk());
    EXPECT_EQ(sent[i]->result->transport, "tcp");
    auto got = KvWaiter::Make();
    receiver_->Expect("wait-" + std::to_string(i), absl::Now() + absl::Seconds(10),
                      got->Callback());
    ASSERT_TRUE(got->Wait());
    ASSERT_THAT(got->result, IsOk());
    testing::ExpectPattern(**got->result, layout_, 7);
  }
  EXPECT_EQ(asked.load(), 1);
  EXPECT_EQ(router.lookups(), 1);
}

TEST_F(RoutingKvTransportTest, AutoFallsBackToTcpWhenTheTargetCannotBeAsked) {
  RoutingKvTransportOptions o;
  o.mode = KvTransportMode::kAuto;
  o.local = LocalKvPeerInfo(-1);
  o.lookup = [](const std::string&) -> absl::StatusOr<KvPeerInfo> {
    return absl::UnimplementedError("no DenoiseService here");
  };
  RoutingKvTransport router(o, CreateTcpTransport(), nullptr, nullptr);
  absl::StatusOr<TransferResult> r = SendAndCheck(router, target_, "fallback-1");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->transport, "tcp");
}

}  // namespace
}  // namespace dgserve::kv
