// Integration tests of the gateway's limits on the real cluster (label `integration`): a gRPC
// message over --max_body_bytes is refused before it is parsed; admission comes before
// tokenization, so a request beyond --max_concurrent_requests costs no tokenizer work;
// tokenizing stops at the context limit; a worker's death is logged once with its cause and a
// failed request's log line lists every attempt's cause.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/http_client.h"
#include "common/testing/loopback_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/test_cluster.h"
#include "tests/integration/test_helpers.h"

namespace dgserve::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// The test model's context limit (tiny-v512: max_position_embeddings).
constexpr int64_t kContextLimit = 262144;
// Its canvas length: a prompt may have at most kContextLimit − kCanvasLength tokens.
constexpr int64_t kCanvasLength = 16;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The lines of `text` containing `needle`.
std::vector<std::string> LinesWith(const std::string& text, const std::string& needle) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StrContains(line, needle)) out.emplace_back(line);
  }
  return out;
}

// Peak resident memory of a process (VmHWM), in KiB; -1 when unknown.
int64_t PeakRssKiB(pid_t pid) {
  for (const std::string& line :
       LinesWith(ReadFile(absl::StrCat("/proc/", pid, "/status")), "VmHWM:")) {
    return std::strtoll(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

// A chat request of `count` user messages "hello world".
v1::GenerateRequest ManyMessages(int count) {
  v1::GenerateRequest r;
  for (int i = 0; i < count; ++i) {
    v1::ChatMessage* m = r.mutable_chat()->add_messages();
    m->set_role("user");
    m->set_content("hello world");
  }
  r.set_seed(1);
  r.set_max_tokens(16);
  return r;
}

// The same as an OpenAI /v1/chat/completions body.
std::string ManyMessagesJson(int count) {
  std::string body = R"({"seed": 1, "max_tokens": 16, "messages": [)";
  for (int i = 0; i < count; ++i) {
    absl::StrAppend(&body, i > 0 ? "," : "", R"({"role": "user", "content": "hello world"})");
  }
  return body + "]}";
}

struct HttpResult {
  int status = 0;
  nlohmann::json body;
};

// POSTs `body` to `path` over a raw socket (Connection: close) and parses the JSON response.
HttpResult Post(int port, const std::string& path, const std::string& body) {
  HttpResult r;
  const int fd = ConnectLoopback(port, 120);
  if (fd < 0) return r;
  const std::string req = absl::StrCat(
      "POST ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
      "Connection: close\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
  std::string raw;
  if (SendAll(fd, req)) {
    char buf[65536];
    for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) raw.append(buf, size_t(n));
  }
  close(fd);
  if (raw.rfind("HTTP/1.1 ", 0) == 0) r.status = std::atoi(raw.c_str() + 9);
  const size_t head = raw.find("\r\n\r\n");
  if (head != std::string::npos) {
    r.body = nlohmann::json::parse(raw.substr(head + 4), nullptr, false);
  }
  return r;
}

double GatewayMetric(const TestCluster& c, const std::string& series) {
  absl::StatusOr<std::string> m = TestCluster::ScrapeMetrics(c.gateway());
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? TestCluster::MetricValue(*m, series) : -1;
}

double Tokenized(const TestCluster& c) {
  return GatewayMetric(c, "dgserve_gateway_tokenized_tokens_total");
}

// One gateway admitting one request at a time, with the default --max_body_bytes (4 MiB), and
// prompts bounded by the model's context limit alone (--max_prompt_tokens=0: these tests are
// about that limit; gateway/prepare_test.cc covers the gateway's own).
class LimitsTest : public SharedClusterTest<LimitsTest> {
 public:
  static absl::StatusOr<ClusterOptions> Options() {
    absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens();
    if (!options.ok()) return options.status();
    ClusterOptions o = *options;
    o.gateway_flags = {"--max_concurrent_requests=1", "--max_body_bytes=4194304",
                       "--max_prompt_tokens=0"};
    return o;
  }
};

// A 32 MB GenerateRequest (over --max_body_bytes, under gRPC's old 64 MiB limit) is refused with
// RESOURCE_EXHAUSTED by gRPC's receive limit, before the gateway parses (or tokenizes) it: its
// peak memory grows by about the message's size once (the receive buffer), not by the parsed
// copies a read message costs.
TEST_F(LimitsTest, GrpcMessageOverMaxBodyBytesIsRefusedUnread) {
  const double tokenized_before = Tokenized(c());
  const int64_t peak_before = PeakRssKiB(c().gateway().pid);
  ASSERT_GT(peak_before, 0);
  v1::GenerateRequest req;
  req.set_text(std::string(32 << 20, 'x'));
  req.set_max_tokens(16);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::GenerateResponse resp;
  const grpc::Status s = c().GatewayStub()->Generate(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  const int64_t peak_after = PeakRssKiB(c().gateway().pid);
  // gRPC (1.51) assembles the message before its size check: the gateway holds that one buffer
  // for a moment, never a parsed copy of it (nor the tokenizer's work on it).
  EXPECT_LT(peak_after - peak_before, 48 << 10)
      << "peak RSS " << peak_before << " KiB → " << peak_after << " KiB";
  EXPECT_EQ(Tokenized(c()), tokenized_before);

  // Just under the limit, the message is read (and refused for its length by the gateway).
  req.set_text(std::string(3 << 20, 'x'));
  grpc::ClientContext ctx2;
  ctx2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  const grpc::Status s2 = c().GatewayStub()->Generate(&ctx2, req, &resp);
  EXPECT_NE(s2.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s2.error_message();
}

// A string field holding bytes that are not UTF-8 cannot be parsed as proto3: gRPC answered
// INTERNAL with an empty message, counted nowhere, and protobuf logged a line per call. Now:
// INVALID_ARGUMENT naming the method and the cause, counted, on both generation methods; so is
// a call that sends no message at all.
TEST_F(LimitsTest, GrpcRequestWithAStringThatIsNotUtf8IsInvalidArgument) {
  const std::string series = "dgserve_gateway_requests_total{status=\"INVALID_ARGUMENT\"}";
  const double before = std::max(0.0, GatewayMetric(c(), series));
  v1::GenerateRequest req;
  req.set_text("caf\xc3 \xff");  // a truncated é, then a byte UTF-8 never uses
  req.set_max_tokens(16);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::GenerateResponse resp;
  const grpc::Status s = c().GatewayStub()->Generate(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("/dgserve.v1.GenerationService/Generate"));
  EXPECT_THAT(s.error_message(), HasSubstr("not UTF-8"));

  grpc::ClientContext ctx2;
  ctx2.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = c().GatewayStub()->GenerateStream(&ctx2, req);
  v1::GenerateEvent ev;
  EXPECT_FALSE(reader->Read(&ev));
  const grpc::Status s2 = reader->Finish();
  EXPECT_EQ(s2.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s2.error_message();
  EXPECT_THAT(s2.error_message(), HasSubstr("GenerateStream"));

  // No message at all (the call half-closed before sending one): gRPC's own INTERNAL
  // ("Couldn't initialize byte buffer reader") became INVALID_ARGUMENT as well.
  {
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", c().gateway().grpc_port),
                                       grpc::InsecureChannelCredentials());
    grpc::GenericStub stub(channel);
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx3;
    ctx3.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto call = stub.PrepareCall(&ctx3, "/dgserve.v1.GenerationService/Generate", &cq);
    auto step = [&cq](auto&& op, intptr_t tag) {  // runs one op and waits for its completion
      op(reinterpret_cast<void*>(tag));
      void* got = nullptr;
      bool ok = false;
      EXPECT_TRUE(cq.Next(&got, &ok));
      EXPECT_EQ(got, reinterpret_cast<void*>(tag));
    };
    step([&](void* t) { call->StartCall(t); }, 1);
    step([&](void* t) { call->WritesDone(t); }, 2);
    grpc::ByteBuffer response;
    step([&](void* t) { call->Read(&response, t); }, 3);
    grpc::Status s3;
    step([&](void* t) { call->Finish(&s3, t); }, 4);
    EXPECT_EQ(s3.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s3.error_message();
    EXPECT_THAT(s3.error_message(), HasSubstr("missing"));
    cq.Shutdown();
    void* ignored_tag = nullptr;
    bool ignored_ok = false;
    while (cq.Next(&ignored_tag, &ignored_ok)) {
    }
  }

  EXPECT_EQ(GatewayMetric(c(), series), before + 3);
  // The client's status says it; the gateway's log does not repeat it per call.
  EXPECT_THAT(ReadFile(c().gateway().log), Not(HasSubstr("invalid UTF-8")));
  // The gateway still serves a valid request.
  req.set_text("caf\xc3\xa9");
  grpc::ClientContext ctx4;
  ctx4.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  EXPECT_TRUE(c().GatewayStub()->Generate(&ctx4, req, &resp).ok());
}

// 150,000 chat messages (about 1 M tokens rendered) over gRPC and 80,000 over HTTP: the
// request is refused as over the context limit (HTTP 400 with code context_length_exceeded
// and param "messages"), and the tokenizer stopped just past the limit instead of rendering
// every message.
TEST_F(LimitsTest, TokenizingStopsAtTheContextLimit) {
  double before = Tokenized(c());
  const Result r = Generate(c(), ManyMessages(150000));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("exceed the context limit"));
  // A chat's message names the messages, as its HTTP param does (it said "prompt:").
  EXPECT_THAT(r.status.error_message(), StartsWith("messages: "));
  double tokenized = Tokenized(c()) - before;
  EXPECT_GE(tokenized, kContextLimit - kCanvasLength);
  EXPECT_LE(tokenized, kContextLimit - kCanvasLength + 14);  // < the old budget, limit − 1

  before = Tokenized(c());
  const HttpResult h =
      Post(c().gateway().http_port, "/v1/chat/completions", ManyMessagesJson(80000));
  ASSERT_EQ(h.status, 400) << h.body.dump();
  EXPECT_EQ(h.body["error"]["code"], "context_length_exceeded") << h.body.dump();
  EXPECT_EQ(h.body["error"]["param"], "messages") << h.body.dump();
  EXPECT_THAT(h.body["error"]["message"].get<std::string>(), StartsWith("messages: "));
  tokenized = Tokenized(c()) - before;
  EXPECT_GE(tokenized, kContextLimit - kCanvasLength);
  EXPECT_LE(tokenized, kContextLimit - kCanvasLength + 14);  // < the old budget, limit − 1

  // A text prompt of 2 M words: the same, through the tokenizer's budget.
  before = Tokenized(c());
  v1::GenerateRequest text;
  std::string words;
  for (int i = 0; i < 1000000; ++i) words += "a b ";
  text.set_text(words);
  text.set_max_tokens(16);
  const Result t = Generate(c(), text);
  EXPECT_EQ(t.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(t.status.error_message(), HasSubstr("exceed the context limit"));
  tokenized = Tokenized(c()) - before;
  EXPECT_GE(tokenized, kContextLimit - kCanvasLength);
  EXPECT_LE(tokenized, kContextLimit - kCanvasLength + 14);  // < the old budget, limit − 1
}

// A prompt that leaves less than one canvas before the context limit is the prompt's fault, not
// max_tokens' (no max_tokens could fix it; it was blamed on max_tokens); a prompt that leaves one
// canvas but not the canvases max_tokens needs is max_tokens'.
TEST_F(LimitsTest, ContextLimitErrorNamesTheFieldThatCanFixIt) {
  v1::GenerateRequest req;
  for (int64_t i = 0; i < kContextLimit - 4; ++i) req.mutable_token_ids()->add_ids(2);
  req.set_max_tokens(1);
  Result r = Generate(c(), req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(),
              HasSubstr(absl::StrCat("prompt: 262140 tokens and one canvas of ", kCanvasLength,
                                     " tokens exceed the context limit of 262144 positions (a "
                                     "prompt may have at most 262128 tokens)")));

  req.mutable_token_ids()->clear_ids();
  for (int64_t i = 0; i < kContextLimit - 20; ++i) req.mutable_token_ids()->add_ids(2);
  req.set_max_tokens(17);
  r = Generate(c(), req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(),
              HasSubstr("max_tokens: the prompt (262124 tokens) plus 2 canvases of 16 tokens"));
}

// A stop sequence longer than 1024 bytes is refused naming the field (a 1 MB one was accepted:
// the reviewer's finding), over gRPC and HTTP; 1024 bytes are accepted.
TEST_F(LimitsTest, StopSequencesAreBounded) {
  v1::GenerateRequest req = Chat("Stop here.", 1, 16);
  req.add_stop(std::string(1025, 'a'));
  const Result r = Generate(c(), req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("stop: a sequence of 1025 bytes; at most 1024"));
  req.set_stop(0, std::string(1024, 'a'));
  EXPECT_TRUE(Generate(c(), req).status.ok());
  const HttpResponse res = HttpClient("127.0.0.1", c().gateway().http_port).Post(
      "/v1/completions", absl::StrCat(R"({"prompt": "x", "max_tokens": 4, "stop": [")",
                                      std::string(1000000, 'b'), R"("]})"));
  EXPECT_EQ(res.status, 400) << res.body;
  EXPECT_THAT(res.body, HasSubstr("at most 1024"));
}

// With the one slot taken by a running request, a huge chat request is refused at once
// (RESOURCE_EXHAUSTED over gRPC, 429 over HTTP) before the gateway tokenizes any of it.
TEST_F(LimitsTest, AdmissionComesBeforeTokenization) {
  // 1,024 canvases: it runs until cancelled below.
  v1::GenerateRequest running = Chat("Tell a long story about the sea.", 7, 16384);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = c().GatewayStub()->GenerateStream(&ctx, running);
  v1::GenerateEvent ev;
  bool got_block = false;
  while (!got_block && reader->Read(&ev)) got_block = ev.has_block();
  ASSERT_TRUE(got_block);
  EXPECT_EQ(GatewayMetric(c(), "dgserve_gateway_inflight_requests"), 1);

  const double before = Tokenized(c());
  const Result r = Generate(c(), ManyMessages(100000));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << r.status.error_message();
  const HttpResult h =
      Post(c().gateway().http_port, "/v1/chat/completions", ManyMessagesJson(80000));
  EXPECT_EQ(h.status, 429) << h.body.dump();
  EXPECT_EQ(Tokenized(c()), before);

  ctx.TryCancel();
  while (reader->Read(&ev)) {
  }
  reader->Finish();
  EXPECT_TRUE(Eventually([&] { return GatewayMetric(c(), "dgserve_gateway_inflight_requests") == 0; }));
}

// Three streams run on the only denoise worker when it is SIGKILLed: the gateway logs the
// worker's death once (naming it and the cause), not once per request or poll; each request
// fails after its attempts (the first broken, the resumes finding no worker) with one log line
// listing every attempt's cause, and the client's error lists the earlier attempts without
// worker addresses.
TEST(WorkerDeathTest, LoggedOnceAndEveryAttemptsCauseKept) {
  absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens();
  ASSERT_TRUE(options.ok()) << options.status();
  ClusterOptions o = *options;
  o.gateway_flags = {"--max_resumes=2"};
  auto started = TestCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& c = **started;
  const std::string denoise = absl::StrCat("127.0.0.1:", c.denoise(0).grpc_port);

  constexpr int kStreams = 3;
  std::vector<std::atomic<int>> blocks(kStreams);
  std::vector<grpc::Status> status(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      auto reader = c.GatewayStub()->GenerateStream(&ctx, Chat("Tell a long story.", 40 + i, 320));
      v1::GenerateEvent ev;
      while (reader->Read(&ev)) blocks[i] += ev.has_block();
      status[i] = reader->Finish();
    });
  }
  const bool all_started = Eventually([&] {
    for (auto& b : blocks) {
      if (b.load() == 0) return false;
    }
    return true;
  }, 60);
  c.KillDenoise(0);
  for (auto& t : threads) t.join();
  ASSERT_TRUE(all_started);
  // Let the polls see the dead worker too (they must not log it again).
  std::this_thread::sleep_for(std::chrono::seconds(2));

  const std::string log = ReadFile(c.gateway().log);
  const std::vector<std::string> deaths =
      LinesWith(log, absl::StrCat("denoise worker ", denoise, " is unhealthy"));
  ASSERT_EQ(deaths.size(), 1u) << log;
  EXPECT_THAT(deaths[0], HasSubstr("(")) << "no cause: " << deaths[0];

  const std::vector<std::string> failed = LinesWith(log, "failed after 3 attempts");
  EXPECT_EQ(failed.size(), size_t(kStreams)) << log;
  for (const std::string& line : failed) {
    EXPECT_THAT(line, HasSubstr(absl::StrCat("attempt 1: denoise on ", denoise, ": ")));
    EXPECT_THAT(line, HasSubstr("attempt 2: no healthy denoise worker"));
    EXPECT_THAT(line, HasSubstr("attempt 3: no healthy denoise worker"));
  }
  for (int i = 0; i < kStreams; ++i) {
    SCOPED_TRACE(absl::StrCat("stream ", i));
    EXPECT_EQ(status[i].error_code(), grpc::StatusCode::UNAVAILABLE) << status[i].error_message();
    EXPECT_THAT(status[i].error_message(), HasSubstr("earlier attempts: 1: denoise: "));
    EXPECT_THAT(status[i].error_message(), HasSubstr("2: no healthy denoise worker"));
    EXPECT_THAT(status[i].error_message(), Not(HasSubstr("127.0.0.1")));
  }
}

}  // namespace
}  // namespace dgserve::testing
