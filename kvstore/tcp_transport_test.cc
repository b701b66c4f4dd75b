// The TCP transport against a real gRPC server on 127.0.0.1 hosting KvTransferServiceImpl.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/synchronization/notification.h"
#include "common/testing/loopback_socket.h"
#include "common/testing/status_matchers.h"
#include "grpcpp/grpcpp.h"
#include "kvstore/test_util.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_internal.h"
#include "kvstore/transfer_service.h"

namespace dgserve::kv {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int S = 0, F = 1;
constexpr int kTokens = 23;  // full blocks 0..5, sliding blocks 4..5
constexpr absl::Duration kWait = absl::Seconds(10);

using KvWaiter = testing::KvWaiter;
using SendWaiter = testing::Waiter<TransferResult>;

bool Eventually(const std::function<bool()>& done) { return testing::Eventually(done, kWait); }

class KvTcpTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout_ = KvLayout::FromConfig(testing::MixedConfig(), 4, "mixed");
    sender_pool_ = std::move(*BlockPool::Create(layout_, 32, 32));
    StartServer(layout_);
    auto kv = std::make_shared<PagedKvCache>(sender_pool_.get(), 256);
    testing::AppendPattern(*kv, layout_, kTokens, 4);
    src_ = kv;
  }
  void TearDown() override {
    server_->Shutdown();
    server_.reset();
    service_.reset();
    receiver_.reset();
    EXPECT_EQ(receiver_pool_->stats().used[S], 0);
    EXPECT_EQ(receiver_pool_->stats().used[F], 0);
  }

  void StartServer(const KvLayout& layout) {
    receiver_pool_ = std::move(*BlockPool::Create(layout, 32, 32));
    receiver_ = std::make_unique<KvReceiver>(receiver_pool_.get(), 256);
    service_ = std::make_unique<KvTransferServiceImpl>(receiver_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    builder.SetMaxReceiveMessageSize(64 << 20);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    target_ = "127.0.0.1:" + std::to_string(port);
  }
  bool ReceiverHoldsNothing() {
    const PoolStats st = receiver_pool_->stats();
    return st.used[S] == 0 && st.used[F] == 0 && receiver_->pending_transfers() == 0;
  }
  absl::Time Later() const { return absl::Now() + absl::Hours(1); }

  KvLayout layout_;
  std::unique_ptr<BlockPool> sender_pool_, receiver_pool_;
  std::unique_ptr<KvReceiver> receiver_;
  std::unique_ptr<KvTransferServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string target_;
  std::shared_ptr<const PagedKvCache> src_;
};

TEST_F(KvTcpTransportTest, TransfersEveryRow) {
  auto transport = CreateTcpTransport();
  EXPECT_EQ(transport->name(), "tcp");
  auto got = KvWaiter::Make();
  receiver_->Expect("tcp-1", Later(), got->Callback());
  auto sent = SendWaiter::Make();
  transport->Send(target_, "tcp-1", src_, 10000, sent->Callback());
  ASSERT_TRUE(sent->Wait());
  ASSERT_THAT(sent->result, IsOk());
  EXPECT_EQ(sent->result->blocks, 8);
  EXPECT_EQ(sent->result->bytes, int64_t(6 * layout_.BlockBytes(LayerKind::kFull) +
                                        2 * layout_.BlockBytes(LayerKind::kSliding)));
  EXPECT_GE(sent->result->seconds, 0.0);
  ASSERT_TRUE(got->Wait());
  ASSERT_THAT(got->result, IsOk());
  EXPECT_EQ((*got->result)->num_tokens(), kTokens);
  testing::ExpectPattern(**got->result, layout_, 4);
  got->result = absl::CancelledError("dropped");
  EXPECT_TRUE(ReceiverHoldsNothing());

  // A second transfer over the cached channel, arriving before Expect.
  auto again = SendWaiter::Make();
  transport->Send(target_, "tcp-2", src_, 10000, again->Callback());
  ASSERT_TRUE(again->Wait());
  ASSERT_THAT(again->result, IsOk());
  auto got2 = KvWaiter::Make();
  receiver_->Expect("tcp-2", Later(), got2->Callback());
  ASSERT_TRUE(got2->Wait());
  ASSERT_THAT(got2->result, IsOk());
  testing::ExpectPattern(**got2->result, layout_, 4);
  // Both transfers' bytes came inline, over the stream.
  const std::map<v1::KvDataPath, int64_t> by_path = receiver_->received_bytes_by_path();
  ASSERT_EQ(by_path.size(), 1u);
  EXPECT_EQ(by_path.begin()->first, v1::KV_DATA_INLINE);
  EXPECT_EQ(by_path.begin()->second, 2 * sent->result->bytes);
}

TEST_F(KvTcpTransportTest, CutStreamFailsBothSidesWithoutLeaks) {
  TcpTransportOptions options;
  options.cut_after_bytes = 2 * int64_t(layout_.BlockBytes(LayerKind::kFull)) + 100;
  auto transport = CreateTcpTransport(options);
  auto got = KvWaiter::Make();
  // Depending on where the cancellation overtakes the data, the receiver rejects the truncated
  // block, sees the stream end without a trailer, or (the header itself lost) never hears of
  // the transfer, and then the Expect deadline fails the request. Always an error, never a leak.
  receiver_->Expect("cut-1", absl::Now() + absl::Seconds(1), got->Callback());
  auto sent = SendWaiter::Make();
  transport->Send(target_, "cut-1", src_, 10000, sent->Callback());
  ASSERT_TRUE(sent->Wait());
  EXPECT_THAT(sent->result,
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("fault injection")));
  ASSERT_TRUE(got->Wait());
  EXPECT_FALSE(got->result.ok());
  EXPECT_THAT(got->result.status().message(), HasSubstr("cut-1"));
  EXPECT_TRUE(Eventually([&] { return ReceiverHoldsNothing(); }));
  EXPECT_LE(receiver_->failed_transfers(), 1);
  // The sender's own blocks are untouched (the test still holds the sequence).
  EXPECT_EQ(sender_pool_->stats().used[F], 6);
}

TEST_F(KvTcpTransportTest, StreamWithoutTrailerIsAborted) {
  auto channel = grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
  auto stub = v1::KvTransferService::NewStub(channel);
  auto got = KvWaiter::Make();
  receiver_->Expect("short", Later(), got->Callback());
  grpc::ClientContext context;
  v1::KvAck ack;
  auto writer = stub->PushBlocks(&context, &ack);
  v1::KvChunk chunk;
  *chunk.mutable_header() = internal::MakeHeader("short", *src_, 10000);
  const auto blocks = internal::BlocksToSend(chunk.header().kv_descriptor(), *src_);
  ASSERT_TRUE(writer->Write(chunk));
  for (int i = 0; i < 2; ++i) {
    internal::FillPayload(*src_, blocks[i], chunk.mutable_block());
    ASSERT_TRUE(writer->Write(chunk));
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("ended after 2 of 8 blocks"));
  ASSERT_TRUE(got->Wait());
  EXPECT_THAT(got->result,
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("ended after 2 of 8 blocks")));
  EXPECT_TRUE(ReceiverHoldsNothing());
}

TEST_F(KvTcpTransportTest, ReceiverErrorsReachTheSender) {
  // A receiver serving another model refuses the descriptor.
  KvLayout other = layout_;
  other.model_id = "other-model";
  server_->Shutdown();
  server_.reset();
  service_.reset();
  receiver_.reset();
  StartServer(other);
  auto sent = SendWaiter::Make();
  CreateTcpTransport()->Send(target_, "mismatch", src_, 10000, sent->Callback());
  ASSERT_TRUE(sent->Wait());
  EXPECT_THAT(sent->result, StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("model_id")));
  EXPECT_THAT(sent->result.status().message(), HasSubstr(target_));
  EXPECT_TRUE(ReceiverHoldsNothing());
}

TEST_F(KvTcpTransportTest, UnreachableTargetIsUnavailable) {
  // Reserve a port, then close it: nothing listens there.
  std::string dead;
  {
    KvTransferServiceImpl unused(receiver_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&unused);
    auto server = builder.BuildAndStart();
    ASSERT_NE(server, nullptr);
    dead = "127.0.0.1:" + std::to_string(port);
    server->Shutdown();
  }
  auto sent = SendWaiter::Make();
  CreateTcpTransport()->Send(dead, "nowhere", src_, 5000, sent->Callback());
  ASSERT_TRUE(sent->Wait());
  EXPECT_FALSE(sent->result.ok());
  EXPECT_THAT(sent->result.status().message(), HasSubstr(dead));
}

// A service without a GpuReceiveEndpoint refuses the GPU transports' set-up clearly.
TEST_F(KvTcpTransportTest, GpuSetUpRefusedWithoutGpu) {
  auto stub = v1::KvTransferService::NewStub(
      grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    v1::NcclBootstrapRequest request;
    v1::NcclBootstrapResponse response;
    const grpc::Status s = stub->NcclBootstrap(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("GPU KV transports are off"));
  }
  {
    grpc::ClientContext context;
    v1::CudaIpcOpenRequest request;
    v1::CudaIpcOpenResponse response;
    EXPECT_EQ(stub->CudaIpcOpen(&context, request, &response).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
}

}  // namespace
}  // namespace dgserve::kv

namespace dgserve::kv {
namespace {

// One sender can hold at most max_transfers_per_peer streams open, each at most
// max_stream_time: a header left open is cancelled and its blocks freed.
TEST(KvTransferServiceLimitsTest, StreamsPerPeerAndStreamTimeAreBounded) {
  const KvLayout layout = KvLayout::FromConfig(testing::MixedConfig(), 4, "mixed");
  auto sender_pool = std::move(*BlockPool::Create(layout, 32, 32));
  auto pool = std::move(*BlockPool::Create(layout, 32, 32));
  // The lease is long: only the stream bound ends the open transfers.
  KvReceiver receiver(pool.get(), 256, /*max_lease_ms=*/3600000);
  KvTransferServiceOptions options;
  options.max_transfers_per_peer = 2;
  options.max_stream_time = absl::Seconds(1);
  KvTransferServiceImpl service(&receiver, options);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  auto stub = v1::KvTransferService::NewStub(channel);
  auto kv = std::make_shared<PagedKvCache>(sender_pool.get(), 256);
  testing::AppendPattern(*kv, layout, kTokens, 4);

  struct Open {
    grpc::ClientContext ctx;
    v1::KvAck ack;
    std::unique_ptr<grpc::ClientWriter<v1::KvChunk>> writer;
  };
  std::vector<std::unique_ptr<Open>> open;
  for (int i = 0; i < 2; ++i) {
    auto o = std::make_unique<Open>();
    o->writer = stub->PushBlocks(&o->ctx, &o->ack);
    v1::KvChunk chunk;
    *chunk.mutable_header() = internal::MakeHeader("held" + std::to_string(i), *kv, 3600000);
    ASSERT_TRUE(o->writer->Write(chunk));
    open.push_back(std::move(o));
  }
  ASSERT_TRUE(Eventually([&] { return receiver.pending_transfers() == 2; }));
  EXPECT_EQ(service.open_streams("ipv4:127.0.0.1"), 2);
  {
    grpc::ClientContext ctx;
    v1::KvAck ack;
    auto w = stub->PushBlocks(&ctx, &ack);
    v1::KvChunk chunk;
    *chunk.mutable_header() = internal::MakeHeader("third", *kv, 1000);
    w->Write(chunk);
    const grpc::Status s = w->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  }
  EXPECT_EQ(service.refused_streams(), 1);
  // The two held streams end at max_stream_time; their blocks are freed.
  for (auto& o : open) EXPECT_FALSE(o->writer->Finish().ok());
  EXPECT_TRUE(Eventually([&] {
    return receiver.pending_transfers() == 0 && pool->stats().used[F] == 0 &&
           pool->stats().used[S] == 0;
  }));
  EXPECT_EQ(service.cancelled_streams(), 2);
  // A cancelled stream's client has its status at once; the handler counts the stream closed
  // when its Read returns, which may be a moment later.
  EXPECT_TRUE(Eventually([&] { return service.open_streams("ipv4:127.0.0.1") == 0; }))
      << service.open_streams("ipv4:127.0.0.1");
  server->Shutdown();
}

TEST(KvTransferServiceLimitsTest, PeerAddressDropsThePort) {
  EXPECT_EQ(PeerAddress("ipv4:127.0.0.1:5555"), "ipv4:127.0.0.1");
  EXPECT_EQ(PeerAddress("ipv6:[::1]:5555"), "ipv6:[::1]");
  EXPECT_EQ(PeerAddress("unix:"), "unix:");
}

// An unresponsive target holds at most max_outstanding_per_target pushes; more fail at once.
TEST(KvTcpTransportLimitsTest, OutstandingPushesPerTargetAreBounded) {
  const KvLayout layout = KvLayout::FromConfig(testing::MixedConfig(), 4, "mixed");
  auto sender_pool = std::move(*BlockPool::Create(layout, 32, 32));
  auto kv = std::make_shared<PagedKvCache>(sender_pool.get(), 256);
  testing::AppendPattern(*kv, layout, kTokens, 4);
  // A listener that accepts TCP and never answers HTTP/2.
  int port = 0;
  const int fd = dgserve::testing::ListenLoopback(&port);
  ASSERT_GE(fd, 0);
  const std::string target = "127.0.0.1:" + std::to_string(port);
  TcpTransportOptions options;
  options.max_outstanding_per_target = 2;
  auto transport = CreateTcpTransport(options);
  std::vector<std::shared_ptr<SendWaiter>> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.push_back(SendWaiter::Make());
    transport->Send(target, "r" + std::to_string(i), kv, /*lease_ms=*/1500,
                    waiters.back()->Callback());
  }
  ASSERT_TRUE(waiters[2]->Wait());  // at once: the third is refused
  EXPECT_THAT(waiters[2]->result, StatusIs(absl::StatusCode::kResourceExhausted));
  // The two others end at their lease deadline.
  ASSERT_TRUE(waiters[0]->Wait());
  ASSERT_TRUE(waiters[1]->Wait());
  EXPECT_FALSE(waiters[0]->result.ok());
  close(fd);
}

}  // namespace
}  // namespace dgserve::kv
