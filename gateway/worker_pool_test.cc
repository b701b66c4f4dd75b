// WorkerPool against fake workers on loopback (issue 36 items 1 and 4): a burst of requests
// spreads over equal workers because each pick counts at once; a slow Stats answer is not a dead
// worker, a refused connection is.
#include "gateway/worker_pool.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "dgserve/v1/worker.grpc.pb.h"

namespace dgserve {
namespace {

// A two-layer (sliding, full) KV layout as the workers report it in Stats.kv_layout; 0: none
// reported (a worker that predates the field).
v1::KvDescriptor Layout(int block_size) {
  v1::KvDescriptor d;
  if (block_size == 0) return d;
  d.set_model_id("m");
  for (bool sliding : {true, false}) {
    v1::KvLayerShape* l = d.add_layers();
    l->set_sliding(sliding);
    l->set_kv_heads(1);
    l->set_head_dim(256);
  }
  d.set_dtype("f32");
  d.set_block_size(block_size);
  d.set_sliding_window(512);
  return d;
}

class FakePrefill final : public v1::PrefillService::Service {
 public:
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*,
                     v1::StatsResponse* out) override {
    out->set_role("prefill");
    out->set_model_id("m");
    *out->mutable_kv_layout() = Layout(block_size);
    return grpc::Status::OK;
  }
  std::atomic<int> block_size{16};
};

// Idle, 8 batch slots; answers Stats after `delay` (a busy worker).
class FakeDenoise final : public v1::DenoiseService::Service {
 public:
  grpc::Status Stats(grpc::ServerContext*, const v1::StatsRequest*,
                     v1::StatsResponse* out) override {
    if (slow) absl::SleepFor(absl::Milliseconds(1500));
    out->set_role("denoise");
    out->set_model_id("m");
    out->set_max_batch_canvases(8);
    *out->mutable_kv_layout() = Layout(block_size);
    return grpc::Status::OK;
  }
  std::atomic<bool> slow{false};
  std::atomic<int> block_size{16};
};

struct FakeWorker {
  FakeWorker() {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&prefill);
    b.RegisterService(&denoise);
    server = b.BuildAndStart();
  }
  ~FakeWorker() { Stop(); }
  void Stop() {
    if (server) server->Shutdown(absl::ToChronoTime(absl::Now()));
    server.reset();
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
  FakePrefill prefill;
  FakeDenoise denoise;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

// Picks `n` times without releasing (a burst arriving between two Stats polls) and returns
// the picks per address.
std::map<std::string, int> Burst(WorkerPool& pool, int n, uint64_t key, bool vary_key = false) {
  std::map<std::string, int> count;
  for (int i = 0; i < n; ++i) {
    const std::optional<std::string> a = pool.Pick(vary_key ? key + 2 * i : key, {});
    EXPECT_TRUE(a.has_value());
    if (a) ++count[*a];
  }
  return count;
}

// All 64 streams of a burst went to the first denoise worker: the pick was counted only after
// prefill, and ties went to the first worker.
TEST(WorkerPoolTest, ABurstSpreadsOverEqualDenoiseWorkers) {
  FakeWorker a, b;
  WorkerPool pool("denoise", {a.address(), b.address()}, "m");
  pool.PollNow();
  ASSERT_EQ(pool.healthy_count(), 2);
  std::map<std::string, int> count = Burst(pool, 32, 0);
  EXPECT_GE(count[a.address()], 13) << "of 32 (40 %)";
  EXPECT_GE(count[b.address()], 13) << "of 32 (40 %)";
  EXPECT_EQ(pool.inflight(a.address()), count[a.address()]);
  for (int i = 0; i < count[a.address()]; ++i) pool.Release(a.address());
  for (int i = 0; i < count[b.address()]; ++i) pool.Release(b.address());
  EXPECT_EQ(pool.inflight(a.address()), 0);
  EXPECT_EQ(pool.inflight(b.address()), 0);
}

// Prefill keeps its prefix-cache affinity, but a burst of one prompt spills over once the
// preferred worker is 4 requests ahead; a burst of different prompts spreads by the hash.
TEST(WorkerPoolTest, ABurstSpreadsOverPrefillWorkers) {
  FakeWorker a, b;
  WorkerPool pool("prefill", {a.address(), b.address()}, "m");
  pool.PollNow();
  ASSERT_EQ(pool.healthy_count(), 2);
  std::map<std::string, int> same = Burst(pool, 32, 12345);
  EXPECT_GE(same[a.address()], 13);
  EXPECT_GE(same[b.address()], 13);
  EXPECT_LE(std::abs(same[a.address()] - same[b.address()]), 5);
}

TEST(WorkerPoolTest, WorkerHoldReleasesOnce) {
  FakeWorker a;
  WorkerPool pool("denoise", {a.address()}, "m");
  pool.PollNow();
  std::optional<std::string> addr = pool.Pick(0, {});
  ASSERT_TRUE(addr.has_value());
  {
    WorkerHold hold(&pool, *addr);
    EXPECT_EQ(pool.inflight(*addr), 1);
    WorkerHold moved = std::move(hold);
    hold.Release();  // moved from: no effect
    EXPECT_EQ(pool.inflight(*addr), 1);
    moved.Release();
    EXPECT_EQ(pool.inflight(*addr), 0);
    ASSERT_TRUE(pool.Pick(0, {}).has_value());
    WorkerHold last(&pool, *addr);
  }
  EXPECT_EQ(pool.inflight(*addr), 0);
}

// A busy worker answering Stats late stays healthy for kMaxMissedPolls − 1 late answers in a
// row (one late answer made it unhealthy: 503 "no healthy denoise worker" while it served).
TEST(WorkerPoolTest, LateStatsAnswersAreNotADeadWorker) {
  FakeWorker a;
  WorkerPool pool("denoise", {a.address()}, "m");
  pool.PollNow();
  ASSERT_EQ(pool.healthy_count(), 1);
  a.denoise.slow = true;
  for (int miss = 1; miss < kMaxMissedPolls; ++miss) {
    pool.PollNow();
    EXPECT_EQ(pool.healthy_count(), 1) << "after " << miss << " late answers";
  }
  pool.PollNow();
  EXPECT_EQ(pool.healthy_count(), 0) << "after " << kMaxMissedPolls << " late answers";
  a.denoise.slow = false;
  pool.PollNow();
  EXPECT_EQ(pool.healthy_count(), 1);
}

// A worker that is gone (connection refused) is out at the next poll.
TEST(WorkerPoolTest, ADeadWorkerIsOutAtTheNextPoll) {
  FakeWorker a, b;
  WorkerPool pool("denoise", {a.address(), b.address()}, "m");
  pool.PollNow();
  ASSERT_EQ(pool.healthy_count(), 2);
  const std::string dead = a.address();
  a.Stop();
  pool.PollNow();
  EXPECT_EQ(pool.healthy_count(), 1);
  for (int i = 0; i < 4; ++i) {
    const std::optional<std::string> p = pool.Pick(0, {});
    ASSERT_TRUE(p.has_value());
    EXPECT_NE(*p, dead);
  }
}

// A dns:/// address whose name does not resolve gives no endpoint to poll: it is named in one
// warning (the gateway logged nothing), and the pool has no worker. A worker that never
// answers is named in one warning by its first poll (a poll logged only a change of health,
// and an endpoint starts unhealthy).
TEST(WorkerPoolTest, AnAddressThatNeverWorksIsLoggedOnce) {
  const std::string unresolved = "dns:///nosuch.invalid:50051";
  WorkerPool dns("prefill", {unresolved}, "m");
  ::testing::internal::CaptureStderr();
  dns.PollNow();
  dns.PollNow();
  const std::string dns_log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(dns.total_count(), 0);
  EXPECT_EQ(dns.healthy_count(), 0);
  EXPECT_THAT(dns_log,
              ::testing::StartsWith(absl::StrCat("[W] prefill worker address ", unresolved,
                                                 ": 'nosuch.invalid' does not resolve (")));
  EXPECT_THAT(dns_log, ::testing::HasSubstr("); no prefill worker there until it resolves"));
  EXPECT_EQ(std::count(dns_log.begin(), dns_log.end(), '\n'), 1) << dns_log;

  FakeWorker gone;
  const std::string refused = gone.address();
  gone.Stop();
  WorkerPool pool("denoise", {refused}, "m");
  ::testing::internal::CaptureStderr();
  pool.PollNow();
  pool.PollNow();
  const std::string poll_log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(pool.total_count(), 1);
  EXPECT_EQ(pool.healthy_count(), 0);
  EXPECT_THAT(poll_log, ::testing::StartsWith(absl::StrCat("[W] denoise worker ", refused,
                                                           " fails its first Stats poll (")));
  EXPECT_THAT(poll_log, ::testing::HasSubstr("); no requests go to it until a poll passes"));
  EXPECT_EQ(std::count(poll_log.begin(), poll_log.end(), '\n'), 1) << poll_log;
}

// A prefill and a denoise worker reporting different KV layouts are a mismatch naming both
// workers and both values; equal layouts, or a worker that reports none, are not.
TEST(WorkerPoolTest, KvLayoutMismatchNamesBothWorkersAndValues) {
  FakeWorker p, d;
  d.denoise.block_size = 7;
  WorkerPool prefill("prefill", {p.address()}, "m");
  WorkerPool denoise("denoise", {d.address()}, "m");
  prefill.PollNow();
  denoise.PollNow();
  ASSERT_EQ(prefill.healthy_count(), 1);
  ASSERT_EQ(denoise.healthy_count(), 1);
  const std::string want =
      absl::StrCat("KV layout mismatch: prefill worker ", p.address(),
                   " has block_size 16, denoise worker ", d.address(), " has block_size 7");
  EXPECT_EQ(KvLayoutMismatch(prefill, denoise), want);
  EXPECT_EQ(KvLayoutMismatch(p.address(), prefill.KvLayoutOf(p.address()), d.address(),
                             denoise.KvLayoutOf(d.address())),
            want);
  d.denoise.block_size = 16;
  denoise.PollNow();
  EXPECT_EQ(KvLayoutMismatch(prefill, denoise), "");
  d.denoise.block_size = 0;  // reports no layout: nothing to compare
  denoise.PollNow();
  EXPECT_EQ(KvLayoutMismatch(prefill, denoise), "");
}

// Every field the transfer's descriptor check compares is compared.
TEST(WorkerPoolTest, KvLayoutMismatchComparesEveryDescriptorField) {
  const v1::KvDescriptor base = Layout(16);
  auto differ = [&](const std::function<void(v1::KvDescriptor&)>& change) {
    v1::KvDescriptor d = base;
    change(d);
    return KvLayoutMismatch("p:1", base, "d:2", d);
  };
  EXPECT_EQ(KvLayoutMismatch("p:1", base, "d:2", base), "");
  EXPECT_EQ(differ([](v1::KvDescriptor& d) { d.set_model_id("other"); }),
            "KV layout mismatch: prefill worker p:1 has model_id 'm', denoise worker d:2 has "
            "model_id 'other'");
  EXPECT_EQ(differ([](v1::KvDescriptor& d) { d.mutable_layers()->RemoveLast(); }),
            "KV layout mismatch: prefill worker p:1 has layers 2, denoise worker d:2 has layers 1");
  EXPECT_EQ(differ([](v1::KvDescriptor& d) { d.mutable_layers(1)->set_sliding(true); }),
            "KV layout mismatch: prefill worker p:1 has layers[1] full, denoise worker d:2 has "
            "layers[1] sliding");
  EXPECT_EQ(differ([](v1::KvDescriptor& d) { d.mutable_layers(0)->set_kv_heads(2); }),
            "KV layout mismatch: prefill worker p:1 has layers[0].kv_heads 1, denoise worker d:2 "
            "has layers[0].kv_heads 2");
  EXPECT_EQ(differ([](v1::KvDescriptor& d) { d.mutable_layers(1)->set_head_dim(128); }),
            "KV layout mismatch: prefill worker p:1 has layers[1].head_dim 256, denoise worker "
            "d:2 has layers[1].head_dim 128");
  EXPECT_EQ(differ([](v1::KvDescriptor& d) { d.set_dtype("bf16"); }),
            "KV layout mismatch: prefill worker p:1 has dtype 'f32', denoise worker d:2 has "
            "dtype 'bf16'");
  EXPECT_EQ(differ([](v1::KvDescriptor& d) { d.set_sliding_window(1024); }),
            "KV layout mismatch: prefill worker p:1 has sliding_window 512, denoise worker d:2 "
            "has sliding_window 1024");
}

}  // namespace
}  // namespace dgserve
