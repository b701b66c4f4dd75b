// Integration tests of resume on the real cluster (label `integration`): requests whose denoise
// worker is SIGKILLed after blocks reached the client continue from their next canvas on the
// surviving worker and end with exactly the output of an undisturbed run, over gRPC streams and
// OpenAI HTTP SSE, without a block sent twice and with usage counted once; past --max_resumes
// the client gets UNAVAILABLE. A worker that dies after only canvas steps (no block yet) resumes
// from canvas 0; a worker stopped (SIGSTOP) past the deadline gives a clean DEADLINE_EXCEEDED /
// 504 and no resume.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <iostream>
#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "common/testing/loopback_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/test_cluster.h"
#include "tests/integration/test_helpers.h"

namespace dgserve::testing {
namespace {

template <typename Pred>
bool EventuallyWithin60s(Pred pred) {
  return Eventually(pred, 60);
}

using ::testing::HasSubstr;

// 20 canvases of 16 tokens: the request still runs when the worker is killed.
constexpr int kMaxTokens = 320;
const char kPrompt[] = "Tell a long story about the sea.";

v1::GenerateRequest Chat(uint64_t seed, int canvas_step_interval) {
  v1::GenerateRequest r;
  v1::ChatMessage* m = r.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content(kPrompt);
  r.set_seed(seed);
  r.set_max_tokens(kMaxTokens);
  r.mutable_stream_options()->set_canvas_step_interval(canvas_step_interval);
  return r;
}

// What a gRPC stream delivered.
struct GrpcStream {
  grpc::Status status;
  std::vector<int32_t> ids;     // of the blocks, in order
  std::string text;             // of the blocks, in order
  std::vector<int> block_indices;  // of the blocks with tokens, in order
  std::vector<std::pair<int, int>> steps;  // (canvas, step) of the CanvasStep events, in order
  int finished = 0;
  v1::Finished last_finished;
  bool events_after_finished = false;
};

// Runs `req` as a gRPC stream; `blocks` counts the blocks received so far.
GrpcStream RunGrpcStream(const TestCluster& c, const v1::GenerateRequest& req,
                         std::atomic<int>* blocks) {
  GrpcStream out;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  auto reader = c.GatewayStub()->GenerateStream(&ctx, req);
  v1::GenerateEvent ev;
  while (reader->Read(&ev)) {
    if (out.finished > 0) out.events_after_finished = true;
    if (ev.has_canvas_step()) {
      out.steps.emplace_back(ev.canvas_step().canvas(), ev.canvas_step().step());
    } else if (ev.has_block()) {
      out.ids.insert(out.ids.end(), ev.block().token_ids().begin(), ev.block().token_ids().end());
      out.text += ev.block().text();
      if (ev.block().token_ids_size() > 0) out.block_indices.push_back(ev.block().index());
      ++*blocks;
    } else if (ev.has_finished()) {
      ++out.finished;
      out.last_finished = ev.finished();
    }
  }
  out.status = reader->Finish();
  return out;
}

// The body of a chunked HTTP response read so far (the head and chunk framing removed; a chunk
// not complete yet is left out).
std::string Dechunk(const std::string& raw) {
  const size_t head = raw.find("\r\n\r\n");
  if (head == std::string::npos) return "";
  std::string body;
  size_t at = head + 4;
  for (;;) {
    const size_t eol = raw.find("\r\n", at);
    if (eol == std::string::npos) break;
    int64_t size = 0;
    if (!absl::SimpleHexAtoi(raw.substr(at, eol - at), &size) || size == 0) break;
    if (eol + 2 + size_t(size) > raw.size()) break;
    body += raw.substr(eol + 2, size_t(size));
    at = eol + 2 + size_t(size) + 2;
  }
  return body;
}

// What an OpenAI /v1/completions SSE stream delivered.
struct SseStream {
  int http_status = 0;
  std::string text;
  int text_chunks = 0;
  int usage_chunks = 0;
  int finish_chunks = 0;
  std::string finish_reason;
  nlohmann::json usage;
  bool done = false;
  bool data_after_done = false;
  std::vector<std::string> errors;
};

SseStream ParseSse(const std::string& raw) {
  SseStream s;
  if (raw.rfind("HTTP/1.1 ", 0) == 0) s.http_status = std::atoi(raw.c_str() + 9);
  std::istringstream in(Dechunk(raw));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string data = line.substr(6);
    if (s.done) s.data_after_done = true;
    if (data == "[DONE]") {
      s.done = true;
      continue;
    }
    nlohmann::json chunk = nlohmann::json::parse(data, nullptr, false);
    if (!chunk.is_object()) continue;  // cut at the end of what was read so far
    if (chunk.contains("error")) {
      s.errors.push_back(data);
      continue;
    }
    if (chunk["choices"].empty()) {
      ++s.usage_chunks;
      s.usage = chunk["usage"];
      continue;
    }
    const nlohmann::json& choice = chunk["choices"][0];
    const std::string text = choice.value("text", "");
    if (!text.empty()) ++s.text_chunks;
    s.text += text;
    if (!choice["finish_reason"].is_null()) {
      ++s.finish_chunks;
      s.finish_reason = choice["finish_reason"];
    }
  }
  return s;
}

std::string CompletionBody(uint64_t seed, bool stream) {
  return absl::StrCat(R"({"prompt": ")", kPrompt, R"(", "seed": )", seed,
                      R"(, "max_tokens": )", kMaxTokens,
                      stream ? R"(, "stream": true, "stream_options": {"include_usage": true})"
                             : "",
                      "}");
}

// POSTs `body` to /v1/completions over a raw socket and reads the whole response; `blocks`
// counts the SSE chunks with text received so far.
std::string RunHttp(int port, const std::string& body, std::atomic<int>* blocks) {
  const int fd = ConnectLoopback(port, 120);
  if (fd < 0) return "";
  const std::string req = absl::StrCat(
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Connection: close\r\nContent-Length: ",
      body.size(), "\r\n\r\n", body);
  std::string raw;
  if (SendAll(fd, req)) {
    char buf[4096];
    int seen = 0;
    for (;;) {
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) break;
      raw.append(buf, size_t(n));
      const int now = ParseSse(raw).text_chunks;
      if (blocks) *blocks += now - seen;
      seen = now;
      if (raw.find("data: [DONE]") != std::string::npos) break;
    }
  }
  close(fd);
  return raw;
}

// An undisturbed run of the same request (unary).
v1::GenerateResponse Solo(const TestCluster& c, uint64_t seed) {
  v1::GenerateRequest req = Chat(seed, 0);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  v1::GenerateResponse r;
  grpc::Status s = c.GatewayStub()->Generate(&ctx, req, &r);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return r;
}

nlohmann::json SoloHttp(const TestCluster& c, uint64_t seed) {
  const std::string raw = RunHttp(c.gateway().http_port, CompletionBody(seed, false), nullptr);
  const size_t head = raw.find("\r\n\r\n");
  if (head == std::string::npos) return nlohmann::json();
  std::string body = raw.substr(head + 4);
  if (raw.find("Transfer-Encoding: chunked") != std::string::npos) body = Dechunk(raw);
  return nlohmann::json::parse(body, nullptr, false);
}

// The index of the denoise worker running the most requests now (-1: none); `active` gets
// their number.
int BusiestDenoise(const TestCluster& c, int* active = nullptr) {
  int best = -1, most = 0;
  for (int i = 0; i < c.denoise_count(); ++i) {
    auto s = c.DenoiseStats(i);
    if (s.ok() && s->active_requests() > most) {
      most = s->active_requests();
      best = i;
    }
  }
  if (active) *active = most;
  return best;
}

// Three gRPC streams (one with canvas steps) and three HTTP SSE streams run on two denoise
// workers; once every one has received a block, the busier worker is SIGKILLed (started at
// once, the requests mostly land on one worker: the gateway's load view is 250 ms old). Every request
// completes with the tokens and text of its undisturbed run, no block or canvas step arrives
// twice, and usage (one Finished / one usage chunk) counts the whole completion once.
TEST(ResumeTest, RequestsSurviveADenoiseWorkerKilledMidRequest) {
  absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens(2);
  ASSERT_TRUE(options.ok()) << options.status();
  ClusterOptions o = *options;
  auto started = TestCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& c = **started;

  constexpr int kGrpc = 3, kHttp = 3;
  std::vector<std::atomic<int>> blocks(kGrpc + kHttp);
  std::vector<GrpcStream> grpc_out(kGrpc);
  std::vector<std::string> http_raw(kHttp);
  std::vector<std::thread> threads;
  for (int i = 0; i < kGrpc; ++i) {
    threads.emplace_back([&, i] {
      grpc_out[i] = RunGrpcStream(c, Chat(700 + i, i == 0 ? 1 : 0), &blocks[i]);
    });
  }
  for (int i = 0; i < kHttp; ++i) {
    threads.emplace_back([&, i] {
      http_raw[i] = RunHttp(c.gateway().http_port, CompletionBody(800 + i, true),
                            &blocks[kGrpc + i]);
    });
  }
  // Every request has received at least one block; then the busier worker dies.
  const bool all_started = EventuallyWithin60s([&] {
    for (auto& b : blocks) {
      if (b.load() == 0) return false;
    }
    return true;
  });
  int victim_requests = 0;
  const int victim = BusiestDenoise(c, &victim_requests);
  if (all_started && victim >= 0) c.KillDenoise(victim);
  for (auto& t : threads) t.join();
  ASSERT_TRUE(all_started) << "not every request received a block";
  ASSERT_GE(victim, 0) << "no denoise worker was running the requests";

  // The gateway resumed each of the victim's requests (20 canvases each: none had finished).
  auto metrics = TestCluster::ScrapeMetrics(c.gateway());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const double resumes = TestCluster::MetricValue(*metrics, "dgserve_gateway_resumes_total");
  EXPECT_GE(victim_requests, 1);
  EXPECT_GE(resumes, victim_requests) << *metrics;
  EXPECT_LE(resumes, kGrpc + kHttp) << *metrics;
  std::cout << "killed denoise worker " << victim << " running " << victim_requests
            << " requests; resumes: " << resumes << "\n";
  // The gateway logged the death once, not once per request.
  {
    std::ifstream log_file(c.gateway().log);
    std::stringstream log;
    log << log_file.rdbuf();
    const std::string death =
        absl::StrCat("denoise worker 127.0.0.1:", c.denoise(victim).grpc_port, " is unhealthy");
    int deaths = 0;
    for (size_t at = log.str().find(death); at != std::string::npos;
         at = log.str().find(death, at + 1)) {
      ++deaths;
    }
    EXPECT_EQ(deaths, 1) << log.str();
  }

  // The undisturbed runs, on the surviving worker.
  for (int i = 0; i < kGrpc; ++i) {
    SCOPED_TRACE(absl::StrCat("gRPC request ", i));
    const GrpcStream& g = grpc_out[i];
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    const v1::GenerateResponse solo = Solo(c, 700 + i);
    EXPECT_EQ(g.ids, std::vector<int32_t>(solo.token_ids().begin(), solo.token_ids().end()));
    EXPECT_EQ(g.text, solo.text());
    // Each canvas's block exactly once, in order.
    std::vector<int> expected_indices(kMaxTokens / 16);
    for (size_t k = 0; k < expected_indices.size(); ++k) expected_indices[k] = int(k);
    EXPECT_EQ(g.block_indices, expected_indices);
    EXPECT_EQ(g.finished, 1);
    EXPECT_FALSE(g.events_after_finished);
    const v1::Usage& u = g.last_finished.usage();
    EXPECT_EQ(g.last_finished.finish_reason(), "length");
    EXPECT_EQ(u.prompt_tokens(), solo.usage().prompt_tokens());
    EXPECT_EQ(u.completion_tokens(), kMaxTokens);
    EXPECT_EQ(u.total_tokens(), solo.usage().total_tokens());
    EXPECT_EQ(u.canvases(), solo.usage().canvases());
    EXPECT_EQ(u.denoising_steps(), solo.usage().denoising_steps());
    if (i == 0) {
      // Canvas steps strictly in order: none repeated after the resume.
      ASSERT_FALSE(g.steps.empty());
      for (size_t k = 1; k < g.steps.size(); ++k) {
        EXPECT_LT(g.steps[k - 1], g.steps[k]) << "step event " << k;
      }
      EXPECT_EQ(g.steps.front(), std::make_pair(0, 0));
    }
  }
  for (int i = 0; i < kHttp; ++i) {
    SCOPED_TRACE(absl::StrCat("HTTP request ", i));
    const SseStream s = ParseSse(http_raw[i]);
    ASSERT_EQ(s.http_status, 200) << http_raw[i];
    EXPECT_TRUE(s.errors.empty()) << s.errors.front();
    EXPECT_TRUE(s.done);
    EXPECT_FALSE(s.data_after_done);
    const nlohmann::json solo = SoloHttp(c, 800 + i);
    ASSERT_TRUE(solo.is_object() && solo.contains("choices")) << solo.dump();
    EXPECT_EQ(s.text, solo["choices"][0]["text"].get<std::string>());
    EXPECT_EQ(s.finish_chunks, 1);
    EXPECT_EQ(s.finish_reason, "length");
    EXPECT_EQ(s.usage_chunks, 1);
    EXPECT_EQ(s.usage["completion_tokens"], kMaxTokens);
    EXPECT_EQ(s.usage["prompt_tokens"], solo["usage"]["prompt_tokens"]);
    EXPECT_EQ(s.usage["total_tokens"], solo["usage"]["total_tokens"]);
  }
}

// Past --max_resumes the request fails with UNAVAILABLE naming the flag, after the blocks it
// had already streamed and without a Finished: with --max_resumes=1, both denoise workers are
// killed in turn under one request.
TEST(ResumeTest, GivesUpAfterMaxResumes) {
  absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens(2);
  ASSERT_TRUE(options.ok()) << options.status();
  ClusterOptions o = *options;
  o.gateway_flags = {"--max_resumes=1"};
  auto started = TestCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& c = **started;

  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  auto reader = c.GatewayStub()->GenerateStream(&ctx, Chat(900, 0));
  v1::GenerateEvent ev;
  int blocks = 0, finished = 0;
  std::vector<int> killed;
  auto read_block = [&] {
    while (reader->Read(&ev)) {
      finished += ev.has_finished();
      if (ev.has_block()) {
        ++blocks;
        return true;
      }
    }
    return false;
  };
  // Kill the worker running the request after a block, twice: the first death resumes on the
  // other worker, the second is one too many.
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(read_block()) << "round " << round;
    int victim = -1;
    ASSERT_TRUE(EventuallyWithin60s([&] { return (victim = BusiestDenoise(c)) >= 0; }));
    c.KillDenoise(victim);
    killed.push_back(victim);
    if (round == 0) {
      ASSERT_TRUE(read_block()) << "no block after the resume";
    }
  }
  while (reader->Read(&ev)) {
    finished += ev.has_finished();
    blocks += ev.has_block();
  }
  const grpc::Status s = reader->Finish();
  EXPECT_NE(killed[0], killed[1]);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--max_resumes"));
  EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr("127.0.0.1")));
  EXPECT_EQ(finished, 0);
  EXPECT_LT(blocks, kMaxTokens / 16);
}

double MetricOf(const Service& s, const std::string& series) {
  absl::StatusOr<std::string> m = TestCluster::ScrapeMetrics(s);
  return m.ok() ? TestCluster::MetricValue(*m, series) : -1;
}

// The denoise worker dies after the client has received canvas steps of canvas 0 but no block:
// the request resumes from canvas 0 (nothing committed) on the other worker. The client gets
// every block once, canvas steps strictly in order (none repeated), one Finished, and exactly
// the tokens of an undisturbed run. Worker 0 runs the request (worker 1 is stopped until then);
// worker 0 is SIGSTOPped at the first step event the client receives and, once nothing more
// can arrive from it, checked to have sent no block (else the try is cancelled and repeated
// with another seed); then worker 1 comes back and worker 0 is SIGKILLed.
TEST(ResumeTest, ResumesFromCanvasZeroAfterOnlyStepEvents) {
  absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens(2);
  ASSERT_TRUE(options.ok()) << options.status();
  ClusterOptions o = *options;
  auto started = TestCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& c = **started;
  const std::string healthy_denoise = R"(dgserve_gateway_workers{role="denoise",state="healthy"})";
  ASSERT_TRUE(c.StopDenoiseGracefully(1));
  const pid_t victim = c.denoise(0).pid;

  constexpr int kTries = 20;
  uint64_t seed = 0;
  GrpcStream g;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::thread reader;
  int tries = 0, steps_before_kill = 0;
  std::atomic<int> steps{0}, blocks{0};  // of the current try (the reader outlives the loop)
  for (; tries < kTries; ++tries) {
    ASSERT_TRUE(EventuallyWithin60s([&] { return MetricOf(c.gateway(), healthy_denoise) == 1; }));
    seed = 1234 + tries;
    g = GrpcStream();
    steps = 0;
    blocks = 0;
    ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
    reader = std::thread([&, seed] {
      auto r = c.GatewayStub()->GenerateStream(ctx.get(), Chat(seed, 1));
      v1::GenerateEvent ev;
      while (r->Read(&ev)) {
        if (g.finished > 0) g.events_after_finished = true;
        if (ev.has_canvas_step()) {
          if (steps.fetch_add(1) == 0) kill(victim, SIGSTOP);  // at once, on the first step
          g.steps.emplace_back(ev.canvas_step().canvas(), ev.canvas_step().step());
        } else if (ev.has_block()) {
          g.ids.insert(g.ids.end(), ev.block().token_ids().begin(), ev.block().token_ids().end());
          if (ev.block().token_ids_size() > 0) g.block_indices.push_back(ev.block().index());
          ++blocks;
        } else if (ev.has_finished()) {
          ++g.finished;
          g.last_finished = ev.finished();
        }
      }
      g.status = r->Finish();
    });
    // What the stopped worker sent before it stopped reaches the client meanwhile, and the
    // gateway's polls time out on it.
    const bool stopped =
        EventuallyWithin60s([&] { return steps.load() > 0; }) &&
        EventuallyWithin60s([&] { return MetricOf(c.gateway(), healthy_denoise) == 0; });
    if (!stopped) {
      ctx->TryCancel();
      kill(victim, SIGCONT);
      reader.join();
      FAIL() << "no canvas step, or the gateway never saw the worker stop answering";
    }
    if (blocks.load() == 0) {
      steps_before_kill = steps.load();
      break;
    }
    // Canvas 0 was committed before the worker stopped: not the case under test.
    ctx->TryCancel();
    kill(victim, SIGCONT);
    reader.join();
  }
  ASSERT_LT(tries, kTries) << "canvas 0 was committed before the worker stopped in every try";
  absl::Status restarted = c.RestartDenoise(1);
  const bool back = restarted.ok() && EventuallyWithin60s([&] {
    return MetricOf(c.gateway(), healthy_denoise) == 1;
  });
  c.KillDenoise(0);
  reader.join();
  ASSERT_TRUE(restarted.ok()) << restarted;
  ASSERT_TRUE(back) << "worker 1 never became healthy again";
  std::cout << "resumed at canvas 0 in try " << tries + 1 << " after " << steps_before_kill
            << " step events\n";

  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(MetricOf(c.gateway(), "dgserve_gateway_resumes_total"), 1);
  std::ifstream log_file(c.gateway().log);
  std::stringstream log;
  log << log_file.rdbuf();
  EXPECT_THAT(log.str(), HasSubstr("resuming at canvas 0 (resume 1 of"));

  grpc::ClientContext solo_ctx;
  solo_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  v1::GenerateResponse solo;
  ASSERT_TRUE(c.GatewayStub()->Generate(&solo_ctx, Chat(seed, 0), &solo).ok());
  EXPECT_EQ(g.ids, std::vector<int32_t>(solo.token_ids().begin(), solo.token_ids().end()));
  std::vector<int> expected_indices(kMaxTokens / 16);
  for (size_t k = 0; k < expected_indices.size(); ++k) expected_indices[k] = int(k);
  EXPECT_EQ(g.block_indices, expected_indices);
  EXPECT_EQ(g.finished, 1);
  EXPECT_FALSE(g.events_after_finished);
  ASSERT_FALSE(g.steps.empty());
  EXPECT_EQ(g.steps.front(), std::make_pair(0, 0));
  for (size_t k = 1; k < g.steps.size(); ++k) {
    EXPECT_LT(g.steps[k - 1], g.steps[k]) << "step event " << k;
  }
  const v1::Usage& u = g.last_finished.usage();
  EXPECT_EQ(u.prompt_tokens(), solo.usage().prompt_tokens());
  EXPECT_EQ(u.completion_tokens(), kMaxTokens);
  EXPECT_EQ(u.canvases(), solo.usage().canvases());
  EXPECT_EQ(u.denoising_steps(), solo.usage().denoising_steps());
}

// Both denoise workers are SIGSTOPped while a gRPC stream and an HTTP request (X-Request-Timeout)
// run on them, past the requests' deadlines: the gRPC client gets DEADLINE_EXCEEDED, the HTTP
// client a 504, and the gateway does not resume (a stopped worker is not a failed one). After
// SIGCONT the workers' KV gauges return to zero.
TEST(ResumeTest, StoppedWorkerPastTheDeadlineIsACleanTimeout) {
  absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens(2);
  ASSERT_TRUE(options.ok()) << options.status();
  ClusterOptions o = *options;
  auto started = TestCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& c = **started;
  constexpr int kDeadlineSeconds = 8;
  constexpr int kLongMaxTokens = 16384;  // 1,024 canvases: neither request ends on its own

  std::atomic<int> blocks{0};
  grpc::Status grpc_status;
  std::thread grpc_client([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(kDeadlineSeconds));
    v1::GenerateRequest req = Chat(555, 0);
    req.set_max_tokens(kLongMaxTokens);
    auto r = c.GatewayStub()->GenerateStream(&ctx, req);
    v1::GenerateEvent ev;
    while (r->Read(&ev)) blocks += ev.has_block();
    grpc_status = r->Finish();
  });
  std::string http_raw;
  std::thread http_client([&] {
    const int fd = ConnectLoopback(c.gateway().http_port, 120);
    if (fd < 0) return;
    const std::string body = absl::StrCat(R"({"prompt": ")", kPrompt,
                                          R"(", "seed": 556, "max_tokens": )", kLongMaxTokens, "}");
    SendAll(fd, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             "Content-Type: application/json\r\nConnection: close\r\n"
                             "X-Request-Timeout: ", kDeadlineSeconds, "\r\nContent-Length: ",
                             body.size(), "\r\n\r\n", body));
    char buf[4096];
    for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) http_raw.append(buf, size_t(n));
    close(fd);
  });
  // Both requests run on the workers (the gRPC one has streamed a block): stop both workers.
  auto active = [&] {
    int sum = 0;
    for (int i = 0; i < c.denoise_count(); ++i) {
      auto s = c.DenoiseStats(i);
      if (s.ok()) sum += s->active_requests();
    }
    return sum;
  };
  const bool running = Eventually([&] { return blocks.load() > 0 && active() == 2; },
                                  kDeadlineSeconds);
  for (int i = 0; i < c.denoise_count(); ++i) kill(c.denoise(i).pid, SIGSTOP);
  grpc_client.join();
  http_client.join();
  for (int i = 0; i < c.denoise_count(); ++i) kill(c.denoise(i).pid, SIGCONT);
  ASSERT_TRUE(running) << "the requests were not both running on the workers";

  EXPECT_EQ(grpc_status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << grpc_status.error_message();
  ASSERT_EQ(http_raw.rfind("HTTP/1.1 504", 0), 0u) << http_raw;
  EXPECT_THAT(http_raw, HasSubstr("timeout_error"));
  EXPECT_THAT(http_raw, ::testing::Not(HasSubstr("127.0.0.1")));
  EXPECT_EQ(MetricOf(c.gateway(), "dgserve_gateway_resumes_total"), 0);
  // Both count as deadlines (the gRPC one was counted CANCELLED at times: its client's deadline
  // cancels the call at the same moment).
  EXPECT_TRUE(EventuallyWithin60s([&] {
    return MetricOf(c.gateway(), R"(dgserve_gateway_requests_total{status="DEADLINE_EXCEEDED"})") ==
           2;
  })) << MetricOf(c.gateway(), R"(dgserve_gateway_requests_total{status="DEADLINE_EXCEEDED"})");
  EXPECT_LE(MetricOf(c.gateway(), R"(dgserve_gateway_requests_total{status="CANCELLED"})"), 0);

  const std::string used_full = R"(dgserve_denoise_kv_blocks{kind="full",state="used"})";
  const std::string used_sliding = R"(dgserve_denoise_kv_blocks{kind="sliding",state="used"})";
  for (int i = 0; i < c.denoise_count(); ++i) {
    SCOPED_TRACE(absl::StrCat("denoise worker ", i));
    EXPECT_TRUE(EventuallyWithin60s([&] {
      auto s = c.DenoiseStats(i);
      return s.ok() && s->active_requests() == 0 && s->kv().full_blocks_used() == 0 &&
             s->kv().sliding_blocks_used() == 0 && MetricOf(c.denoise(i), used_full) == 0 &&
             MetricOf(c.denoise(i), used_sliding) == 0;
    })) << c.DenoiseStats(i)->DebugString();
  }
  EXPECT_TRUE(EventuallyWithin60s(
      [&] { return MetricOf(c.gateway(), "dgserve_gateway_inflight_requests") == 0; }));
}

}  // namespace
}  // namespace dgserve::testing
