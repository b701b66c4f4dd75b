// Integration tests of the cluster: real gateway, prefill and denoise processes on loopback
// ports chosen at run time, driven over gRPC and HTTP (label `integration`).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>


#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "common/http_client.h"
#include "common/testing/loopback_socket.h"
#include "tests/integration/test_cluster.h"
#include "tests/integration/test_helpers.h"

namespace dgserve::testing {
namespace {

using ::testing::HasSubstr;

// Chunks of 32 prompt tokens (twice the KV block): prefix hits fall on and off the chunk grid.
const std::vector<std::string> kPrefillFlags = {"--chunk_tokens=32", "--step_token_budget=256"};

std::vector<int32_t> Ids(const v1::GenerateResponse& r) {
  return {r.token_ids().begin(), r.token_ids().end()};
}

// `requests` unary requests at once from as many threads; request i has seed 100 + i.
std::vector<Result> GenerateConcurrently(const TestCluster& c, int requests) {
  std::vector<Result> results(requests);
  std::vector<std::thread> threads;
  for (int i = 0; i < requests; ++i) {
    threads.emplace_back(
        [&, i] { results[i] = Generate(c, Chat("Write a short poem.", 100 + i, 48)); });
  }
  for (auto& t : threads) t.join();
  return results;
}

class ClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::string> model = TestModelDir();
    ASSERT_TRUE(model.ok()) << model.status();
    ClusterOptions o;
    o.model_dir = *model;
    o.prefill_flags = kPrefillFlags;
    auto c = TestCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  const TestCluster& c() { return *cluster_; }
  static TestCluster* cluster_;
};
TestCluster* ClusterTest::cluster_ = nullptr;

TEST_F(ClusterTest, StreamedChatOverGrpc) {
  v1::GenerateRequest req = Chat("Tell me about the sea.", 3, 40);
  req.mutable_stream_options()->set_canvas_step_interval(1);
  req.mutable_stream_options()->set_canvas_text(true);
  grpc::ClientContext ctx;
  auto reader = c().GatewayStub()->GenerateStream(&ctx, req);
  v1::GenerateEvent ev;
  int steps = 0, blocks = 0, finished = 0;
  std::string text;
  v1::Usage usage;
  while (reader->Read(&ev)) {
    if (ev.has_canvas_step()) {
      ++steps;
      EXPECT_EQ(ev.canvas_step().token_ids_size(), 16);
    }
    if (ev.has_block()) {
      ++blocks;
      text += ev.block().text();
    }
    if (ev.has_finished()) {
      ++finished;
      usage = ev.finished().usage();
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_GE(steps, 3);  // 40 tokens = 3 canvases of 16, ≥ 1 step each
  EXPECT_EQ(blocks, 3);
  EXPECT_EQ(finished, 1);
  EXPECT_EQ(usage.canvases(), 3);
  EXPECT_GT(usage.completion_tokens(), 0);
  EXPECT_LE(usage.completion_tokens(), 40);
  // The unary call returns the same text for the same seed.
  Result unary = Generate(c(), Chat("Tell me about the sea.", 3, 40));
  ASSERT_TRUE(unary.status.ok()) << unary.status.error_message();
  EXPECT_EQ(unary.response.text(), text);
}

TEST_F(ClusterTest, StreamedChatOverHttp) {
  HttpClient http("127.0.0.1", c().gateway().http_port);
  http.set_idle_timeout(absl::Seconds(120));
  const std::string body = R"({"model": "it-model", "messages": [{"role": "user",
      "content": "Tell me about the sea."}], "stream": true, "seed": 3, "max_tokens": 40})";
  std::string sse;
  auto res = http.Post("/v1/chat/completions", body);
  ASSERT_TRUE(res);
  ASSERT_EQ(res.status, 200) << res.body;
  EXPECT_THAT(res.Header("Content-Type"), HasSubstr("text/event-stream"));
  std::string text, finish;
  int chunks = 0;
  bool done = false;
  std::istringstream in(res.body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string data = line.substr(6);
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    nlohmann::json j = nlohmann::json::parse(data);
    ASSERT_FALSE(j.contains("error")) << data;
    ++chunks;
    const auto& choice = j["choices"][0];
    if (choice["delta"].contains("content")) text += choice["delta"]["content"].get<std::string>();
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
  }
  EXPECT_TRUE(done);
  EXPECT_GE(chunks, 2);
  EXPECT_THAT(finish, ::testing::AnyOf("stop", "length"));
  Result unary = Generate(c(), Chat("Tell me about the sea.", 3, 40));
  ASSERT_TRUE(unary.status.ok());
  EXPECT_EQ(text, unary.response.text());
}

TEST_F(ClusterTest, EqualsSingleProcessGenerate) {
  const std::string cmd = absl::StrCat(
      BinaryPath("tools/dgserve"), " generate --json --model ", *TestModelDir(),
      " --chat --prompt 'Name three rivers.' --seed 11 --max-tokens 40 2>/dev/null");
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  ASSERT_EQ(pclose(p), 0) << out;
  nlohmann::json j = nlohmann::json::parse(out);
  Result r = Generate(c(), Chat("Name three rivers.", 11, 40));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(Ids(r.response), j["token_ids"].get<std::vector<int32_t>>());
  EXPECT_EQ(r.response.text(), j["text"].get<std::string>());
  EXPECT_EQ(r.response.finish_reason(), j["finish_reason"].get<std::string>());
}

// `dgserve generate --json <args>` on the test model: its JSON answer (text, token_ids, ...).
absl::StatusOr<nlohmann::json> GenerateJson(const std::string& args) {
  const std::string cmd = absl::StrCat(BinaryPath("tools/dgserve"), " generate --json --model ",
                                       *TestModelDir(), " ", args, " 2>/dev/null");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return absl::InternalError("popen failed");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  if (pclose(p) != 0) return absl::InternalError(absl::StrCat("dgserve generate failed: ", out));
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  if (!j.is_object()) return absl::InternalError(absl::StrCat("not JSON: ", out));
  return j;
}

// A streamed HTTP chat completion with a canvas step after every denoising step: the completion
// token ids (the last step of each canvas is its committed argmax canvas; cut at the test model's
// first stop token, {1, 106, 50}, and at max_tokens) and the streamed text.
struct HttpCompletion {
  int status = 0;
  std::string body;  // the raw body (an error's JSON when status != 200)
  std::vector<int32_t> ids;
  std::string text;
};
HttpCompletion HttpChatWithCanvasIds(const TestCluster& c, nlohmann::json body, int max_tokens) {
  body["stream"] = true;
  body["canvas_step_interval"] = 1;
  body["max_tokens"] = max_tokens;
  HttpClient http("127.0.0.1", c.gateway().http_port);
  http.set_idle_timeout(absl::Seconds(120));
  HttpCompletion out;
  auto res = http.Post("/v1/chat/completions", body.dump());
  if (!res) return out;
  out.status = res.status;
  out.body = res.body;
  if (res.status != 200) return out;
  std::map<int, std::vector<int32_t>> canvases;  // canvas → its latest step's argmax canvas
  std::istringstream in(res.body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0 || line == "data: [DONE]") continue;
    nlohmann::json j = nlohmann::json::parse(line.substr(6));
    if (j.contains("dgserve") && j["dgserve"].contains("canvas_step")) {
      const nlohmann::json& st = j["dgserve"]["canvas_step"];
      canvases[st["canvas"].get<int>()] = st["token_ids"].get<std::vector<int32_t>>();
    } else if (!j["choices"].empty() && j["choices"][0]["delta"].contains("content")) {
      out.text += j["choices"][0]["delta"]["content"].get<std::string>();
    }
  }
  for (const auto& [index, ids] : canvases) {
    for (int32_t id : ids) {
      if (id == 1 || id == 106 || id == 50 || int(out.ids.size()) == max_tokens) return out;
      out.ids.push_back(id);
    }
  }
  return out;
}

// The self-conditioning ablation end to end: `self_conditioning: false` over HTTP and gRPC gives
// the tokens of `dgserve generate --no-self-conditioning`, which differ from the default run's;
// an explicit true is the default; a non-boolean gets 400 naming the field.
TEST_F(ClusterTest, SelfConditioningOffEqualsGenerateAndDiffersFromDefault) {
  const std::string prompt = "Name three rivers.";
  const std::string args = absl::StrCat("--chat --prompt '", prompt, "' --seed 11 --max-tokens 40");
  absl::StatusOr<nlohmann::json> gen_off = GenerateJson(args + " --no-self-conditioning");
  absl::StatusOr<nlohmann::json> gen_on = GenerateJson(args);
  ASSERT_TRUE(gen_off.ok()) << gen_off.status();
  ASSERT_TRUE(gen_on.ok()) << gen_on.status();
  const auto off_ids = (*gen_off)["token_ids"].get<std::vector<int32_t>>();
  const auto on_ids = (*gen_on)["token_ids"].get<std::vector<int32_t>>();
  ASSERT_FALSE(off_ids.empty());
  ASSERT_NE(off_ids, on_ids) << "self-conditioning changed nothing on this prompt and seed";

  // gRPC (GenerationService.Generate).
  v1::GenerateRequest req = Chat(prompt, 11, 40);
  req.mutable_diffusion()->set_self_conditioning(false);
  Result grpc_off = Generate(c(), req);
  ASSERT_TRUE(grpc_off.status.ok()) << grpc_off.status.error_message();
  EXPECT_EQ(Ids(grpc_off.response), off_ids);
  EXPECT_EQ(grpc_off.response.text(), (*gen_off)["text"].get<std::string>());
  req.mutable_diffusion()->set_self_conditioning(true);
  Result grpc_on = Generate(c(), req);
  ASSERT_TRUE(grpc_on.status.ok()) << grpc_on.status.error_message();
  EXPECT_EQ(Ids(grpc_on.response), on_ids);

  // HTTP (/v1/chat/completions, streamed with canvas steps to see the ids).
  const nlohmann::json base = {{"messages", {{{"role", "user"}, {"content", prompt}}}},
                               {"seed", 11}};
  nlohmann::json body = base;
  body["self_conditioning"] = false;
  HttpCompletion http_off = HttpChatWithCanvasIds(c(), body, 40);
  ASSERT_EQ(http_off.status, 200) << http_off.body;
  EXPECT_EQ(http_off.ids, off_ids);
  EXPECT_EQ(http_off.text, (*gen_off)["text"].get<std::string>());
  HttpCompletion http_on = HttpChatWithCanvasIds(c(), base, 40);
  ASSERT_EQ(http_on.status, 200) << http_on.body;
  EXPECT_EQ(http_on.ids, on_ids);
  EXPECT_NE(http_off.ids, http_on.ids);

  // A non-boolean value: 400 with the OpenAI error body naming the field.
  body["self_conditioning"] = "no";
  HttpCompletion bad = HttpChatWithCanvasIds(c(), body, 40);
  EXPECT_EQ(bad.status, 400) << bad.body;
  nlohmann::json err = nlohmann::json::parse(bad.body, nullptr, false);
  ASSERT_TRUE(err.is_object() && err.contains("error")) << bad.body;
  EXPECT_EQ(err["error"]["param"], "self_conditioning") << bad.body;
  EXPECT_THAT(err["error"]["message"].get<std::string>(), HasSubstr("self_conditioning"));
}

// The design's promise: a seed gives the same tokens whatever the request is batched with (every
// GEMM row of the CPU backend is its own fma chain, engine/cpu/gemm.h).
TEST_F(ClusterTest, ConcurrentRequestsEqualTheirResultsAlone) {
  constexpr int kRequests = 8;
  const std::vector<Result> together = GenerateConcurrently(c(), kRequests);
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(together[i].status.ok()) << together[i].status.error_message();
    Result alone = Generate(c(), Chat("Write a short poem.", 100 + i, 48));
    ASSERT_TRUE(alone.status.ok());
    EXPECT_EQ(Ids(together[i].response), Ids(alone.response)) << "seed " << 100 + i;
  }
  // Different seeds give different completions.
  EXPECT_NE(Ids(together[0].response), Ids(together[1].response));
}

// Concurrent requests all complete, each with its own seed's output.
TEST_F(ClusterTest, ConcurrentRequestsAllComplete) {
  constexpr int kRequests = 8;
  const std::vector<Result> together = GenerateConcurrently(c(), kRequests);
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(together[i].status.ok()) << together[i].status.error_message();
    EXPECT_GE(together[i].response.usage().canvases(), 1);
    EXPECT_LE(together[i].response.usage().canvases(), 3);  // 48 tokens = 3 canvases of 16
    const v1::GenerateResponse& r = together[i].response;
    // A random model may emit a stop token early; otherwise it ran to max_tokens.
    if (r.finish_reason() == "length") {
      EXPECT_EQ(r.usage().completion_tokens(), 48);
    } else {
      EXPECT_EQ(r.finish_reason(), "stop");
      EXPECT_LT(r.usage().completion_tokens(), 48);
    }
    EXPECT_EQ(r.token_ids_size(), r.usage().completion_tokens());
  }
  EXPECT_NE(Ids(together[0].response), Ids(together[1].response));
}

// A stop sequence cuts the text where it begins, across canvas boundaries, and the usage counts
// only the tokens up to it.
TEST_F(ClusterTest, StopSequenceCutsTextAndUsage) {
  Result full = Generate(c(), Chat("List some animals.", 77, 48));
  ASSERT_TRUE(full.status.ok());
  const std::string& text = full.response.text();
  // A two-letter ASCII stop sequence from the second half of the text.
  std::string stop;
  for (size_t k = text.size() / 2; k + 1 < text.size() && stop.empty(); ++k) {
    if (std::isalpha(static_cast<unsigned char>(text[k])) &&
        std::isalpha(static_cast<unsigned char>(text[k + 1]))) {
      stop = text.substr(k, 2);
    }
  }
  if (stop.empty()) GTEST_SKIP() << "no ASCII pair in: " << text;
  v1::GenerateRequest req = Chat("List some animals.", 77, 48);
  req.add_stop(stop);
  Result cut = Generate(c(), req);
  ASSERT_TRUE(cut.status.ok());
  EXPECT_EQ(cut.response.text(), text.substr(0, text.find(stop)));
  EXPECT_EQ(cut.response.finish_reason(), "stop");
  EXPECT_LT(cut.response.usage().completion_tokens(), full.response.usage().completion_tokens());
  EXPECT_EQ(cut.response.token_ids_size(), cut.response.usage().completion_tokens());
  // The kept ids are a prefix of the full completion's.
  std::vector<int32_t> full_ids = Ids(full.response), cut_ids = Ids(cut.response);
  ASSERT_LE(cut_ids.size(), full_ids.size());
  EXPECT_TRUE(std::equal(cut_ids.begin(), cut_ids.end(), full_ids.begin()));
}

// Whole UTF-8 characters of `s` from character index `from` (negative: from the end), `count`
// characters long.
std::string Chars(const std::string& s, int from, int count) {
  std::vector<size_t> starts;
  for (size_t i = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) starts.push_back(i);
  }
  starts.push_back(s.size());
  const int n = int(starts.size()) - 1;
  const int a = std::max(0, from < 0 ? n + from : from), b = std::min(n, a + count);
  return a < b ? s.substr(starts[a], starts[b] - starts[a]) : std::string();
}

// A stop sequence that crosses a canvas boundary ends the completion where it begins, exactly
// as the part of it inside the first canvas does: same text, same token count.
TEST_F(ClusterTest, StopSequenceAcrossCanvasesCountsLikeWithinOne) {
  v1::GenerateRequest req = Chat("Describe the weather.", 31, 32);  // 2 canvases of 16
  grpc::ClientContext ctx;
  auto reader = c().GatewayStub()->GenerateStream(&ctx, req);
  std::vector<std::string> blocks;
  v1::GenerateEvent ev;
  while (reader->Read(&ev)) {
    if (ev.has_block()) blocks.push_back(ev.block().text());
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_GE(blocks.size(), 2u);
  // Starts 12 characters before the boundary (in an earlier token than the canvas's last).
  const std::string head = Chars(blocks[0], -12, 3);
  const std::string crossing = Chars(blocks[0], -12, 12) + Chars(blocks[1], 0, 3);
  if (head.empty() || Chars(blocks[1], 0, 3).empty()) GTEST_SKIP() << "canvas text too short";
  v1::GenerateRequest a = req, b = req;
  a.add_stop(crossing);
  b.add_stop(head);
  Result ra = Generate(c(), a), rb = Generate(c(), b);
  ASSERT_TRUE(ra.status.ok() && rb.status.ok());
  if (rb.response.usage().completion_tokens() >= 16) GTEST_SKIP() << "stop in the last token";
  EXPECT_EQ(ra.response.finish_reason(), "stop");
  EXPECT_EQ(ra.response.text(), rb.response.text());
  EXPECT_EQ(ra.response.usage().completion_tokens(), rb.response.usage().completion_tokens());
  EXPECT_EQ(ra.response.token_ids_size(), ra.response.usage().completion_tokens());
  EXPECT_EQ(Ids(ra.response), Ids(rb.response));
}

// grpc.health.v1 Check on `port` for `service` (the client stub is not generated: the
// standard method is called by name).
grpc::Status HealthCheck(int port, const std::string& service,
                         grpc::health::v1::HealthCheckResponse* resp) {
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  return grpc::internal::BlockingUnaryCall(
      channel.get(),
      grpc::internal::RpcMethod("/grpc.health.v1.Health/Check",
                                grpc::internal::RpcMethod::NORMAL_RPC),
      &ctx, req, resp);
}

// Health answers for the whole server ("") and for each service a process serves by name;
// another name is NOT_FOUND.
TEST_F(ClusterTest, HealthAnswersForEachServedService) {
  using grpc::health::v1::HealthCheckResponse;
  const std::vector<std::pair<int, std::vector<std::string>>> cases = {
      {c().gateway().grpc_port, {"", "dgserve.v1.GenerationService"}},
      {c().prefill().grpc_port, {"", "dgserve.v1.PrefillService"}},
      {c().denoise(0).grpc_port, {"", "dgserve.v1.DenoiseService", "dgserve.v1.KvTransferService"}},
  };
  for (const auto& [port, names] : cases) {
    for (const std::string& name : names) {
      HealthCheckResponse resp;
      grpc::Status st = HealthCheck(port, name, &resp);
      ASSERT_TRUE(st.ok()) << port << " '" << name << "': " << st.error_message();
      EXPECT_EQ(resp.status(), HealthCheckResponse::SERVING) << port << " '" << name << "'";
    }
    HealthCheckResponse resp;
    EXPECT_EQ(HealthCheck(port, "dgserve.v1.NoSuchService", &resp).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

// The worker's denoise and commit timings reach the usage when the last canvas is cut by
// max_tokens (they were 0: the gateway stopped reading before the worker's Finished).
TEST_F(ClusterTest, UsageTimingsWhenTheLastCanvasIsCut) {
  for (uint64_t seed : {1, 2, 3}) {
    v1::GenerateRequest req;
    req.set_text("Hi");
    req.set_max_tokens(33);  // 3 canvases of 16, the last one cut after 1 token
    req.set_seed(seed);
    req.mutable_diffusion()->set_max_denoising_steps(4);
    Result r = Generate(c(), req);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    const v1::Usage& u = r.response.usage();
    EXPECT_GT(u.timings().denoise_seconds(), 0) << u.DebugString();
    if (u.canvases() > 1) EXPECT_GT(u.timings().commit_seconds(), 0) << u.DebugString();
    if (r.response.finish_reason() == "length") EXPECT_EQ(u.completion_tokens(), 33);
  }
  // The worker counted them as finished, not cancelled.
  EXPECT_TRUE(Eventually([&] {
    auto s = c().DenoiseStats(0);
    return s.ok() && s->active_requests() == 0;
  }));
}

// A control-token string in a prompt is text: "<eos>" is encoded as its characters (more than
// <bos> plus one token), so a prompt cannot end itself or forge turns.
TEST_F(ClusterTest, ControlTokenStringsInAPromptAreText) {
  v1::GenerateRequest req;
  req.set_text("<eos>");
  req.set_max_tokens(4);
  req.set_seed(1);
  Result r = Generate(c(), req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_GT(r.response.usage().prompt_tokens(), 2);
  // Raw control tokens can still be sent as token ids.
  v1::GenerateRequest ids;
  ids.mutable_token_ids()->add_ids(2);
  ids.mutable_token_ids()->add_ids(1);
  ids.set_max_tokens(4);
  Result raw = Generate(c(), ids);
  ASSERT_TRUE(raw.status.ok()) << raw.status.error_message();
  EXPECT_EQ(raw.response.usage().prompt_tokens(), 2);
}

TEST_F(ClusterTest, CancelMidStreamFreesKvBlocks) {
  // Up to 240 canvases: the request must still run when the client polls after its first event
  // (with 30 it failed once in CI, likely a client thread starved for ~0.1 s that found it done).
  v1::GenerateRequest req = Chat("Count to a thousand.", 5, 480 * 8);
  grpc::ClientContext ctx;
  auto reader = c().GatewayStub()->GenerateStream(&ctx, req);
  v1::GenerateEvent ev;
  ASSERT_TRUE(reader->Read(&ev));
  ASSERT_TRUE(Eventually([&] {
    auto s = c().DenoiseStats(0);
    return s.ok() && s->kv().full_blocks_used() > 0;
  }));
  ctx.TryCancel();
  while (reader->Read(&ev)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] {
    auto s = c().DenoiseStats(0);
    return s.ok() && s->kv().full_blocks_used() == 0 && s->kv().sliding_blocks_used() == 0 &&
           s->active_requests() == 0 && s->queued_requests() == 0;
  })) << c().DenoiseStats(0)->DebugString();
}

// A request whose deadline ends during prefill or the KV transfer leaves no KV on the denoise
// worker once the request has ended (KV pushed in full just as the deadline passes waits for
// its lease: noted below).
TEST_F(ClusterTest, DeadlineDuringPrefillLeavesNoKv) {
  const std::string failures = "dgserve_prefill_kv_transfer_failures_total{transport=\"tcp\"}";
  const double failures_before =
      TestCluster::MetricValue(*TestCluster::ScrapeMetrics(c().prefill()), failures);
  // Requests by status on each service (0 for a series not yet exported).
  auto counted = [](const Service& p, const std::string& service, const std::string& status) {
    return std::max(0.0, TestCluster::MetricValue(
                             *TestCluster::ScrapeMetrics(p),
                             absl::StrCat("dgserve_", service, "_requests_total{status=\"",
                                          status, "\"}")));
  };
  const double gateway_cancelled = counted(c().gateway(), "gateway", "CANCELLED");
  const double gateway_expired = counted(c().gateway(), "gateway", "DEADLINE_EXCEEDED");
  const double prefill_cancelled = counted(c().prefill(), "prefill", "CANCELLED");
  const double denoise_cancelled = counted(c().denoise(0), "denoise", "CANCELLED");
  // A fast engine may finish a request within the longer deadlines (a stop token can end it at
  // the first canvas): each request ends either way, and the short ones end by their deadline.
  // Deadlines 1..60 ms step through the prefill: some pass while it runs, some just as its
  // KV push completes (before the gateway's denoise call), some during the denoise call.
  int deadlines = 0;
  for (int ms = 1; ms <= 60; ++ms) {
    const std::string prompt = absl::StrCat("a short prompt ", ms);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
    v1::GenerateResponse resp;
    grpc::Status st = c().GatewayStub()->Generate(&ctx, Chat(prompt, 1, 1024), &resp);
    EXPECT_TRUE(st.ok() || st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
        << ms << " ms: " << st.error_code() << " " << st.error_message();
    deadlines += st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
  }
  EXPECT_GE(deadlines, 1);
  // Freed well before the KV lease (30 s) ends: the gateway tells the denoise worker to drop an
  // attempt whose prefill or denoise call ended by the deadline (before, KV pushed as the
  // deadline passed was held for the whole lease: a clean-clone CI run saw 4 + 2 blocks left).
  EXPECT_TRUE(Eventually(
      [&] {
        auto s = c().DenoiseStats(0);
        return s.ok() && s->kv().full_blocks_used() == 0 && s->pending_transfers() == 0 &&
               s->active_requests() == 0;
      },
      25))
      << c().DenoiseStats(0)->DebugString();
  // Deadlines are the client's, not transfer failures.
  EXPECT_EQ(TestCluster::MetricValue(*TestCluster::ScrapeMetrics(c().prefill()), failures),
            failures_before);
  // And they are counted as deadlines, on every service: the gateway's call was cancelled by
  // gRPC at the client's deadline, and so were the workers' calls (before, the gateway counted
  // some of them CANCELLED and the workers all of them).
  // (A call whose deadline passes before it reaches the gateway is not counted there, and one
  // the gateway finished just as the client's deadline passed is counted OK.)
  EXPECT_TRUE(Eventually([&] {
    return counted(c().gateway(), "gateway", "DEADLINE_EXCEEDED") - gateway_expired >=
           deadlines / 2;
  })) << counted(c().gateway(), "gateway", "DEADLINE_EXCEEDED") - gateway_expired << " of "
      << deadlines;
  EXPECT_EQ(counted(c().gateway(), "gateway", "CANCELLED"), gateway_cancelled);
  EXPECT_EQ(counted(c().prefill(), "prefill", "CANCELLED"), prefill_cancelled);
  EXPECT_EQ(counted(c().denoise(0), "denoise", "CANCELLED"), denoise_cancelled);
}

// The denoise worker counts the KV bytes it receives (its kv_transfer_bytes_total never moved),
// at least as many as the prefill worker completed.
TEST_F(ClusterTest, KvTransferBytesCountedOnBothSides) {
  Result r = Generate(c(), Chat("Bytes on the wire, please.", 4, 16));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  const std::string series = "dgserve_prefill_kv_transfer_bytes_total{transport=\"tcp\"}";
  const std::string received = "dgserve_denoise_kv_transfer_bytes_total{transport=\"tcp\"}";
  EXPECT_TRUE(Eventually([&] {
    const double sent = TestCluster::MetricValue(*TestCluster::ScrapeMetrics(c().prefill()), series);
    const double got = TestCluster::MetricValue(*TestCluster::ScrapeMetrics(c().denoise(0)), received);
    return sent > 0 && got >= sent;  // aborted transfers count on the receiving side only
  })) << TestCluster::MetricValue(*TestCluster::ScrapeMetrics(c().denoise(0)), received);
}

TEST_F(ClusterTest, RepeatedPromptHitsThePrefixCache) {
  std::string prompt;
  for (int i = 0; i < 12; ++i) absl::StrAppend(&prompt, "The river runs to the sea, ", i, ". ");
  Result first = Generate(c(), Chat(prompt, 21, 32));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  const double before = TestCluster::MetricValue(*TestCluster::ScrapeMetrics(c().prefill()),
                                                 "dgserve_prefill_prefix_cache_hit_tokens_total");
  Result second = Generate(c(), Chat(prompt, 21, 32));
  ASSERT_TRUE(second.status.ok());
  EXPECT_GE(second.response.usage().cached_prompt_tokens(), 64);
  EXPECT_EQ(second.response.usage().cached_prompt_tokens() % 16, 0);  // whole KV blocks
  EXPECT_EQ(Ids(second.response), Ids(first.response));
  EXPECT_TRUE(Eventually([&] {
    const double after = TestCluster::MetricValue(
        *TestCluster::ScrapeMetrics(c().prefill()), "dgserve_prefill_prefix_cache_hit_tokens_total");
    return after >= before + 64;
  }));

  // Only the prefill worker has a prefix cache: the denoise worker exports no prefix-cache
  // series and no "cached" block state (they were there and never moved).
  const std::string denoise = *TestCluster::ScrapeMetrics(c().denoise(0));
  EXPECT_THAT(denoise, ::testing::Not(HasSubstr("dgserve_denoise_prefix_cache")));
  EXPECT_THAT(denoise, ::testing::Not(HasSubstr("state=\"cached\"")));
  EXPECT_THAT(denoise, HasSubstr("dgserve_denoise_kv_blocks{kind=\"full\",state=\"free\"}"));
  const std::string prefill = *TestCluster::ScrapeMetrics(c().prefill());
  EXPECT_THAT(prefill, HasSubstr("dgserve_prefill_prefix_cache_queries_total"));
  EXPECT_THAT(prefill, HasSubstr("dgserve_prefill_kv_blocks{kind=\"full\",state=\"cached\"}"));
}

// Prefix-cache hits are used at every 16-token KV block, and a hit gives the cold run's tokens
// exactly: the encoder computes a prompt's KV bit for bit however it is split (row-invariant
// GEMMs, attention over keys in a fixed order). Prompts of 16k + r token ids, run cold and then
// again: the second run reuses k blocks and computes the r-token remainder in chunks that start
// off the 32-token chunk grid (r = 1: cached blocks + one token; r = 0: the whole prompt cached).
TEST_F(ClusterTest, PrefixHitsAtAnyBlockBoundaryGiveTheColdTokens) {
  int trial = 0;
  for (const int length : {49, 17, 41, 80, 113}) {
    v1::GenerateRequest req;
    for (int i = 0; i < length; ++i) {
      req.mutable_token_ids()->add_ids(3 + (97 * trial + 31 * i + i * i) % 480);  // test vocab: 512
    }
    req.set_seed(300 + trial);
    req.set_max_tokens(24);
    ++trial;
    Result cold = Generate(c(), req);
    ASSERT_TRUE(cold.status.ok()) << length << ": " << cold.status.error_message();
    EXPECT_EQ(cold.response.usage().cached_prompt_tokens(), 0) << length;
    Result warm = Generate(c(), req);
    ASSERT_TRUE(warm.status.ok()) << length << ": " << warm.status.error_message();
    EXPECT_EQ(warm.response.usage().cached_prompt_tokens(), length / 16 * 16) << length;
    EXPECT_EQ(Ids(warm.response), Ids(cold.response)) << length;
    EXPECT_EQ(warm.response.text(), cold.response.text()) << length;
  }
}

TEST_F(ClusterTest, BadInputGetsA4xxAndTheServiceKeepsServing) {
  HttpClient http("127.0.0.1", c().gateway().http_port);
  http.set_idle_timeout(absl::Seconds(60));
  std::string huge_prompt = "[";
  for (int i = 0; i < 262145; ++i) absl::StrAppend(&huge_prompt, i ? "," : "", 5);
  huge_prompt += "]";
  struct Case {
    std::string name, path, body;
    int status;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"empty prompt", "/v1/completions", R"({"prompt": ""})", 400, "prompt"},
      {"prompt over the context limit", "/v1/completions",
       absl::StrCat(R"({"prompt": )", huge_prompt, "}"), 400, "context limit"},
      {"negative max_tokens", "/v1/completions", R"({"prompt": "hi", "max_tokens": -3})", 400,
       "max_tokens"},
      {"huge max_tokens", "/v1/completions", R"({"prompt": "hi", "max_tokens": 900000})", 400,
       "max_tokens"},
      {"unknown model", "/v1/completions", R"({"prompt": "hi", "model": "gpt-9"})", 404,
       "gpt-9"},
      {"malformed JSON", "/v1/chat/completions", R"({"messages": [)", 400, "JSON"},
      {"wrong type", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"})", 400,
       "max_tokens"},
      {"unsupported field", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true})", 400,
       "logprobs"},
      {"bad diffusion control", "/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi"}], "t_min": 0.9})", 400, "t_min"},
      {"too-large body", "/v1/completions",
       absl::StrCat(R"({"prompt": ")", std::string(5 << 20, 'a'), "\"}"), 413, ""},
  };
  for (const Case& k : cases) {
    auto r = http.Post(k.path, k.body);
    ASSERT_TRUE(r) << k.name;
    EXPECT_EQ(r.status, k.status) << k.name << ": " << r.body;
    nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << k.name << ": " << r.body;
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(k.message)) << k.name;
  }
  // The same rules over gRPC, and on the workers' own APIs.
  {
    v1::GenerateRequest req = Chat("hi", 1, 8);
    req.mutable_stream_options()->set_canvas_text(true);  // without canvas_step_interval
    grpc::ClientContext ctx;
    v1::GenerateResponse resp;
    grpc::Status st = c().GatewayStub()->Generate(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("canvas_text"));
  }
  {
    auto stub = v1::PrefillService::NewStub(c().InternalChannel(c().prefill().grpc_port));
    v1::PrefillRequest req;
    req.set_request_id("bad-lease");
    req.add_tokens(2);
    req.set_kv_target(absl::StrCat("127.0.0.1:", c().denoise(0).grpc_port));
    req.set_lease_ms(-5);
    grpc::ClientContext ctx;
    v1::PrefillResponse resp;
    grpc::Status st = stub->Prefill(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("lease_ms"));
  }
  auto ok = http.Post("/v1/completions", R"({"prompt": "hello", "max_tokens": 8, "seed": 1})");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok.status, 200) << ok.body;
}

}  // namespace
}  // namespace dgserve::testing
