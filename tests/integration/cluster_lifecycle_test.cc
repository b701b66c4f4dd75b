// Integration tests of the cluster's life cycle (label `integration`): the single-process
// server, API keys, a denoise worker killed or restarted under load, a gateway drained by
// SIGTERM, a KV transfer cut mid-block, and the admission limit over gRPC and HTTP. Each test
// starts its own cluster (cluster_test.cc has the tests that share one).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/http_client.h"
#include "common/testing/loopback_socket.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/test_cluster.h"
#include "tests/integration/test_helpers.h"

namespace dgserve::testing {
namespace {

using ::testing::HasSubstr;

// As cluster_test.cc's: chunks of 32 prompt tokens (twice the KV block).
const std::vector<std::string> kPrefillFlags = {"--chunk_tokens=32", "--step_token_budget=256"};

std::vector<int32_t> Ids(const v1::GenerateResponse& r) {
  return {r.token_ids().begin(), r.token_ids().end()};
}

// The single-process mode (dgserve-server: all roles, in-process KV transport) gives the same
// tokens as `dgserve generate` and as the multi-process cluster.
TEST(SingleProcessTest, ServesTheSameTokensAsGenerate) {
  const std::string dir = *TestModelDir();
  const std::string ports = dir + "/../single.ports";
  std::remove(ports.c_str());
  const std::string cmd = absl::StrCat(BinaryPath("tools/dgserve-server"), " --model ", dir,
                                       " --ports_file ", ports, " > ", dir,
                                       "/../single.log 2>&1 & echo $!");
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  int pid = 0;
  ASSERT_EQ(fscanf(p, "%d", &pid), 1);
  pclose(p);
  struct Stop {  // ends the server we started, however the test ends
    int pid;
    ~Stop() {
      kill(pid, SIGTERM);
      for (int i = 0; i < 100 && kill(pid, 0) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      kill(pid, SIGKILL);
    }
  } stop{pid};
  int grpc_port = 0;
  for (int i = 0; i < 600 && grpc_port == 0; ++i) {
    std::ifstream in(ports);
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_object()) grpc_port = j.value("grpc", 0);
    if (grpc_port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GT(grpc_port, 0);
  auto stub = v1::GenerationService::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", grpc_port), grpc::InsecureChannelCredentials()));
  v1::GenerateResponse resp;
  grpc::Status st;
  for (int i = 0; i < 100; ++i) {  // until the gateway has polled its in-process workers
    grpc::ClientContext ctx;
    resp.Clear();
    st = stub->Generate(&ctx, Chat("Name three rivers.", 11, 40), &resp);
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(st.ok()) << st.error_message();
  const std::string gen = absl::StrCat(
      BinaryPath("tools/dgserve"), " generate --json --model ", dir,
      " --chat --prompt 'Name three rivers.' --seed 11 --max-tokens 40 2>/dev/null");
  FILE* g = popen(gen.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, g)) out.append(buf, n);
  ASSERT_EQ(pclose(g), 0);
  nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(Ids(resp), j["token_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(resp.text(), j["text"].get<std::string>());
}

// With --api_keys, requests without a valid key are refused over HTTP (401) and gRPC
// (UNAUTHENTICATED); /health stays open; a valid key is served.
TEST(ClusterAuthTest, ApiKeysAreEnforced) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  o.gateway_flags = {"--api_keys=key-one,key-two"};
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  HttpClient http("127.0.0.1", (*c)->gateway().http_port);
  const std::string body = R"({"prompt": "hi", "max_tokens": 4, "seed": 1})";
  auto none = http.Post("/v1/completions", body);
  ASSERT_TRUE(none);
  EXPECT_EQ(none.status, 401) << none.body;
  auto wrong = http.Post("/v1/completions", body, {{"Authorization", "Bearer nope"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong.status, 401);
  auto good = http.Post("/v1/completions", body, {{"Authorization", "Bearer key-two"}});
  ASSERT_TRUE(good);
  EXPECT_EQ(good.status, 200) << good.body;
  auto health = http.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health.status, 200);
  grpc::ClientContext ctx;
  v1::GenerateResponse resp;
  EXPECT_EQ((*c)->GatewayStub()->Generate(&ctx, Chat("hi", 1, 4), &resp).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  grpc::ClientContext ctx2;
  ctx2.AddMetadata("authorization", "Bearer key-one");
  EXPECT_TRUE((*c)->GatewayStub()->Generate(&ctx2, Chat("hi", 1, 4), &resp).ok());
  // Every refusal is in the request counter (two over HTTP, one over gRPC), like the successes.
  const std::string metrics = *TestCluster::ScrapeMetrics((*c)->gateway());
  EXPECT_EQ(TestCluster::MetricValue(metrics,
                                     "dgserve_gateway_requests_total{status=\"UNAUTHENTICATED\"}"),
            3);
  EXPECT_EQ(TestCluster::MetricValue(metrics, "dgserve_gateway_requests_total{status=\"OK\"}"), 2);
}

// What a client read from a stream during which a denoise worker was stopped.
struct StreamedWhileStopping {
  std::vector<int32_t> ids;  // every block's tokens, in order
  bool finished = false;     // a Finished event came
  bool stopped = false;      // a denoise worker ran the request and `stop` was called on it
  grpc::Status status;
};

// Streams `req` through the gateway of a 2-denoise-worker cluster; once a denoise worker runs it,
// calls stop(that worker's index), then reads the stream to its end.
StreamedWhileStopping StreamWhileStopping(TestCluster& c, const v1::GenerateRequest& req,
                                          const std::function<void(int)>& stop) {
  StreamedWhileStopping out;
  grpc::ClientContext ctx;
  auto reader = c.GatewayStub()->GenerateStream(&ctx, req);
  v1::GenerateEvent ev;
  bool first = true;
  while (reader->Read(&ev)) {
    if (ev.has_block()) {
      out.ids.insert(out.ids.end(), ev.block().token_ids().begin(), ev.block().token_ids().end());
    }
    if (ev.has_finished()) out.finished = true;
    if (!first) continue;
    first = false;
    int victim = -1;
    if (!Eventually([&] {
          for (int i = 0; i < 2; ++i) {
            auto s = c.DenoiseStats(i);
            if (s.ok() && s->active_requests() > 0) victim = i;
          }
          return victim >= 0;
        })) {
      continue;
    }
    stop(victim);
    out.stopped = true;
  }
  out.status = reader->Finish();
  return out;
}

// A denoise worker killed mid-stream: the gateway resumes the request on the other worker
// (--max_resumes) and the client gets the complete answer, equal to the same request run
// again, never a truncated success (tests/integration/resume_test.cc has the details).
TEST(ClusterFailureTest, DenoiseWorkerKilledMidStream) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  o.denoise_workers = 2;
  o.prefill_flags = kPrefillFlags;
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::GenerateRequest req = Chat("Tell a long story.", 9, 320);  // 20 canvases
  StreamedWhileStopping r = StreamWhileStopping(**c, req, [&](int i) { (*c)->KillDenoise(i); });
  ASSERT_TRUE(r.stopped) << "no denoise worker reported the request as active";
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_TRUE(r.finished);
  Result again = Generate(**c, req);
  ASSERT_TRUE(again.status.ok());
  EXPECT_EQ(r.ids, Ids(again.response));
  // The surviving worker serves the next request.
  Result next = Generate(**c, Chat("hello", 1, 16));
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
}

// A worker that ends a call itself (here a denoise worker stopped with no drain grace: its gRPC
// server cancels the streams it still runs) has failed, not the request: the client never sees
// the worker's CANCELLED, the gateway resumes the request on the other worker and the client gets
// the tokens the request gets alone. (A KV transfer the target cancels reaches the gateway through
// the prefill worker the same way.)
TEST(ClusterDrainTest, DenoiseWorkerStoppedWithoutGraceResumesItsRequest) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  o.denoise_workers = 2;
  o.prefill_flags = kPrefillFlags;
  o.denoise_flags = {"--drain_grace_seconds=0"};
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::GenerateRequest req = Chat("Tell a long story.", 9, 320);  // 20 canvases
  StreamedWhileStopping r = StreamWhileStopping(**c, req, [&](int i) {
    EXPECT_TRUE((*c)->StopDenoiseGracefully(i)) << "the worker did not exit cleanly on SIGTERM";
  });
  ASSERT_TRUE(r.stopped) << "no denoise worker reported the request as active";
  ASSERT_TRUE(r.status.ok()) << r.status.error_code() << ": " << r.status.error_message();
  ASSERT_TRUE(r.finished);
  Result again = Generate(**c, req);
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(r.ids, Ids(again.response));
}

// Graceful drain: a denoise worker restarted (SIGTERM, then started again) while requests run
// loses none of them and truncates none: every request completes with exactly the tokens it
// gets alone, and the restarted worker serves again.
TEST(ClusterDrainTest, RestartingADenoiseWorkerUnderLoadLosesNothing) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  o.denoise_workers = 2;
  o.prefill_flags = kPrefillFlags;
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  constexpr int kRequests = 16;
  std::vector<Result> results(kRequests);
  std::vector<std::thread> threads;
  // 10 requests of 10 canvases at once (both workers busy), 6 more while worker 0 restarts.
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      if (i >= 10) std::this_thread::sleep_for(std::chrono::milliseconds(100 * (i - 9)));
      results[i] = Generate(**c, Chat("Tell me a story.", 500 + i, 160));
    });
  }
  // Stop worker 0 while it runs at least two requests that have already streamed blocks.
  ASSERT_TRUE(Eventually([&] {
    auto s = (*c)->DenoiseStats(0);
    return s.ok() && s->active_requests() >= 2;
  }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE((*c)->StopDenoiseGracefully(0)) << "the worker did not exit cleanly on SIGTERM";
  ASSERT_TRUE((*c)->RestartDenoise(0).ok());
  for (auto& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(results[i].status.ok())
        << "request " << i << ": " << results[i].status.error_message();
    Result alone = Generate(**c, Chat("Tell me a story.", 500 + i, 160));
    ASSERT_TRUE(alone.status.ok());
    EXPECT_EQ(Ids(results[i].response), Ids(alone.response)) << "request " << i;
    EXPECT_EQ(results[i].response.finish_reason(), alone.response.finish_reason());
  }
  // The restarted worker is back in rotation.
  EXPECT_TRUE(Eventually([&] {
    Generate(**c, Chat("ping", 1, 8));
    auto s = TestCluster::ScrapeMetrics((*c)->denoise(0));
    return s.ok() &&
           TestCluster::MetricValue(*s, "dgserve_denoise_requests_total{status=\"OK\"}") >= 1;
  }));
}

// The gateway drains on SIGTERM: a stream in flight runs to its Finished event, and the process
// then exits cleanly.
TEST(ClusterDrainTest, GatewayFinishesInFlightStreamsOnSigterm) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  grpc::ClientContext ctx;
  auto reader = (*c)->GatewayStub()->GenerateStream(&ctx, Chat("Tell me a story.", 3, 320));
  v1::GenerateEvent ev;
  ASSERT_TRUE(reader->Read(&ev));  // the first block is out
  std::thread stopper([&] { EXPECT_TRUE((*c)->StopGatewayGracefully()); });
  int blocks = 1, finished = 0;
  while (reader->Read(&ev)) {
    blocks += ev.has_block();
    finished += ev.has_finished();
  }
  stopper.join();
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(finished, 1);
  EXPECT_GE(blocks, 2);
}

// A KV transfer cut in the middle of a block fails the request clearly and leaks no blocks.
TEST(ClusterFailureTest, TransferCutMidBlockFailsCleanly) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  o.prefill_flags = {"--testing_cut_transfer_after_bytes=1000"};
  o.gateway_flags = {"--max_attempts=1"};
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Result r = Generate(**c, Chat("hello there", 1, 16));
  ASSERT_FALSE(r.status.ok());
  EXPECT_THAT(r.status.error_message(), HasSubstr("transfer"));
  // Worker addresses go to the gateway's log, not to clients.
  EXPECT_THAT(r.status.error_message(), ::testing::Not(HasSubstr("127.0.0.1")));
  EXPECT_TRUE(Eventually([&] {
    auto s = (*c)->DenoiseStats(0);
    return s.ok() && s->kv().full_blocks_used() == 0 && s->kv().sliding_blocks_used() == 0 &&
           s->pending_transfers() == 0;
  })) << (*c)->DenoiseStats(0)->DebugString();
  auto p = (*c)->PrefillStats();
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->kv().full_blocks_used(), 0);
  EXPECT_EQ(p->kv().sliding_blocks_used(), 0);
}


// A raw HTTP client socket on 127.0.0.1 that sent `body` to `path` (-1 on failure).
int SendHttpPost(int port, const std::string& path, const std::string& body) {
  const int fd = ConnectLoopback(port, 60);
  if (fd < 0) return -1;
  const std::string req = absl::StrCat("POST ", path,
                                       " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                       "application/json\r\nContent-Length: ",
                                       body.size(), "\r\n\r\n", body);
  if (!SendAll(fd, req)) {
    close(fd);
    return -1;
  }
  return fd;
}

// Reads from `fd` until `needle` is seen (or EOF / the 60 s receive timeout).
std::string ReadUntil(int fd, const std::string& needle) {
  std::string out;
  char buf[4096];
  while (out.find(needle) == std::string::npos) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// The gateway drains HTTP requests on SIGTERM as it does gRPC streams: an SSE stream in flight
// runs to its last chunk and "data: [DONE]", and a non-streaming request in flight gets its
// whole 200 answer, before the connections close and the process exits cleanly. (The client reads
// at once, so this guards the drain; the HTTP server's own test, StopWritesTheAnswersInProgress-
// First, covers answers still queued for a slow client.)
TEST(ClusterDrainTest, GatewayFinishesInFlightHttpRequestsOnSigterm) {
  absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens();
  ASSERT_TRUE(options.ok()) << options.status();
  auto c = TestCluster::Start(*options);
  ASSERT_TRUE(c.ok()) << c.status();
  const int http_port = (*c)->gateway().http_port;
  const int sse = SendHttpPost(http_port, "/v1/completions",
                               R"({"prompt": "Tell me a story.", "max_tokens": 640,
                                   "stream": true, "seed": 3})");
  ASSERT_GE(sse, 0);
  std::string sse_out = ReadUntil(sse, "data: ");  // the first chunk is out
  ASSERT_THAT(sse_out, HasSubstr("HTTP/1.1 200"));
  const int unary = SendHttpPost(http_port, "/v1/completions",
                                 R"({"prompt": "Tell me more.", "max_tokens": 640, "seed": 4})");
  ASSERT_GE(unary, 0);
  ASSERT_TRUE(Eventually([&] {
    auto s = (*c)->DenoiseStats(0);
    return s.ok() && s->active_requests() + s->queued_requests() == 2;
  })) << "both requests should be running before the gateway is stopped";

  std::thread stopper([&] { EXPECT_TRUE((*c)->StopGatewayGracefully()); });
  sse_out += ReadUntil(sse, "no such text: read to the end");
  const std::string unary_out = ReadUntil(unary, "no such text: read to the end");
  close(sse);
  close(unary);
  stopper.join();
  EXPECT_THAT(sse_out, HasSubstr("data: [DONE]"));
  EXPECT_THAT(sse_out, HasSubstr(R"("finish_reason":"length")"));
  EXPECT_THAT(unary_out, HasSubstr("HTTP/1.1 200"));
  const size_t body = unary_out.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos) << unary_out;
  const nlohmann::json answer = nlohmann::json::parse(unary_out.substr(body + 4), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(answer.is_discarded()) << "the answer was cut: " << unary_out;
  EXPECT_EQ(answer["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(answer["usage"]["completion_tokens"], 640);
}

// --max_concurrent_requests counts gRPC and HTTP requests together: with 2 running (one of
// each) and 2 queued, the next ones get 429 + Retry-After (HTTP) and RESOURCE_EXHAUSTED (gRPC)
// at once; /health and /ready still answer; closing an HTTP connection cancels its request at
// once (streaming or not) and frees its KV, which lets the queued requests in. A queued stream is
// visibly alive while it waits: the HTTP client gets 200, the SSE headers and keep-alive comments,
// the gRPC client initial metadata (both got nothing until a slot was free); a bad request that
// would queue is answered at once (it waited for a slot, then got its 400).
TEST(ClusterAdmissionTest, LimitAppliesToGrpcAndHttpAlike) {
  absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens();
  ASSERT_TRUE(options.ok()) << options.status();
  ClusterOptions o = *options;
  o.gateway_flags = {"--max_concurrent_requests=2", "--max_queued_requests=2",
                     "--sse_keepalive_seconds=1"};
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const TestCluster& cl = **c;
  const int http_port = cl.gateway().http_port;
  auto denoise_idle = [&] {
    auto s = cl.DenoiseStats(0);
    return s.ok() && s->active_requests() == 0 && s->queued_requests() == 0 &&
           s->kv().full_blocks_used() == 0 && s->kv().sliding_blocks_used() == 0;
  };
  auto queued_requests = [&] {
    return TestCluster::MetricValue(*TestCluster::ScrapeMetrics(cl.gateway()),
                                    "dgserve_gateway_queued_requests");
  };

  // Two long requests hold the two slots: one gRPC stream, one HTTP SSE stream.
  grpc::ClientContext held_ctx;
  auto held = cl.GatewayStub()->GenerateStream(&held_ctx, Chat("Count to a million.", 1, 16000));
  v1::GenerateEvent ev;
  ASSERT_TRUE(held->Read(&ev));
  int sse = SendHttpPost(http_port, "/v1/completions",
                         R"({"prompt": "Count on.", "max_tokens": 16000, "stream": true})");
  ASSERT_GE(sse, 0);
  ASSERT_THAT(ReadUntil(sse, "data: "), HasSubstr("HTTP/1.1 200"));

  // A third, an SSE stream, waits in the queue with its head and keep-alives already sent.
  const int queued_sse = SendHttpPost(http_port, "/v1/completions",
                                      R"({"prompt": "hi", "max_tokens": 4, "stream": true})");
  ASSERT_GE(queued_sse, 0);
  std::string queued_head = ReadUntil(queued_sse, ": keep-alive\n\n");
  queued_head += ReadUntil(queued_sse, ": keep-alive\n\n");  // a second one, a second later
  EXPECT_THAT(queued_head, HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(queued_head, HasSubstr("text/event-stream"));
  EXPECT_THAT(queued_head, Not(HasSubstr("data: "))) << "it was admitted, not queued";
  EXPECT_EQ(queued_requests(), 1);

  // A request the gateway refuses (a stop sequence over 1024 bytes) is answered while the slots
  // stay taken: it does not wait in the queue for one.
  HttpClient http("127.0.0.1", http_port);
  http.set_idle_timeout(absl::Seconds(60));
  const auto bad =
      http.Post("/v1/completions",
                absl::StrCat(R"({"prompt": "hi", "max_tokens": 4, "stream": true, "stop": [")",
                             std::string(1025, 'a'), R"("]})"));
  ASSERT_TRUE(bad) << bad.error;
  EXPECT_EQ(bad.status, 400) << bad.body;
  EXPECT_THAT(bad.body, HasSubstr("at most 1024"));
  EXPECT_EQ(queued_requests(), 1);

  // A fourth, a gRPC stream, queues too, and gets its initial metadata while it waits.
  grpc::ClientContext queued_ctx;
  queued_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto queued_grpc = cl.GatewayStub()->GenerateStream(&queued_ctx, Chat("hi", 2, 4));
  queued_grpc->WaitForInitialMetadata();
  const absl::Time queued_at = absl::Now();
  EXPECT_NE(queued_ctx.GetServerInitialMetadata().find("x-request-id"),
            queued_ctx.GetServerInitialMetadata().end());
  EXPECT_EQ(queued_requests(), 2) << "the gRPC stream was not queued";

  // Beyond: refused at once on both protocols.
  for (int i = 0; i < 3; ++i) {
    auto res = http.Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 4})");
    ASSERT_TRUE(res);
    EXPECT_EQ(res.status, 429) << res.body;
    EXPECT_EQ(res.Header("Retry-After"), "1");
    EXPECT_THAT(res.body, HasSubstr("rate_limit_error"));
    Result refused = Generate(cl, Chat("hi", 3, 4));
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << refused.status.error_message();
    EXPECT_EQ(http.Get("/health").status, 200);
    EXPECT_EQ(http.Get("/ready").status, 200);
  }
  EXPECT_EQ(TestCluster::MetricValue(*TestCluster::ScrapeMetrics(cl.gateway()),
                                     "dgserve_gateway_inflight_requests"),
            2);

  // Closing the SSE connection cancels that request: the queued ones get the slot in turn (after
  // a second more in the queue, for the usage check below).
  absl::SleepFor(absl::Seconds(1));
  const absl::Time released = absl::Now();
  close(sse);
  const std::string queued_out = ReadUntil(queued_sse, "data: [DONE]");
  EXPECT_THAT(queued_out, HasSubstr("\"finish_reason\":\"length\"")) << queued_out;
  close(queued_sse);
  int events = 0;
  double queue_seconds = -1;
  while (queued_grpc->Read(&ev)) {
    ++events;
    if (ev.has_finished()) queue_seconds = ev.finished().usage().timings().queue_seconds();
  }
  EXPECT_GT(events, 0);
  // Its usage counts the wait in the admission queue (it said only the prefill worker's queue,
  // about a millisecond): it cannot have started before the slot was released.
  EXPECT_GE(queue_seconds, absl::ToDoubleSeconds(released - queued_at) - 0.01);
  EXPECT_TRUE(queued_grpc->Finish().ok());
  held_ctx.TryCancel();
  while (held->Read(&ev)) {
  }
  EXPECT_EQ(held->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually(denoise_idle)) << cl.DenoiseStats(0)->DebugString();

  // A non-streaming HTTP request whose client leaves is cancelled too, and its KV freed.
  int unary = SendHttpPost(http_port, "/v1/completions",
                           R"({"prompt": "Count on.", "max_tokens": 16000})");
  ASSERT_GE(unary, 0);
  ASSERT_TRUE(Eventually([&] {
    auto s = cl.DenoiseStats(0);
    return s.ok() && s->active_requests() == 1 && s->kv().full_blocks_used() > 0;
  }));
  close(unary);
  EXPECT_TRUE(Eventually(denoise_idle)) << cl.DenoiseStats(0)->DebugString();

  const std::string metrics = *TestCluster::ScrapeMetrics(cl.gateway());
  EXPECT_GE(TestCluster::MetricValue(metrics,
                                     "dgserve_gateway_requests_total{status=\"RESOURCE_EXHAUSTED\"}"),
            6);
  EXPECT_GE(TestCluster::MetricValue(metrics, "dgserve_gateway_queue_duration_seconds_count"), 1);
  EXPECT_EQ(TestCluster::MetricValue(metrics, "dgserve_gateway_queued_requests"), 0);
}

}  // namespace
}  // namespace dgserve::testing
