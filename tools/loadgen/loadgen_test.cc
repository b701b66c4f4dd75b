// Unit tests of dgserve-loadgen's pure parts (no network, no wall clock).
#include "tools/loadgen/loadgen.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dgserve::loadgen {
namespace {

using ::testing::HasSubstr;

// --- percentiles -----------------------------------------------------------------------------

TEST(PercentileTest, InterpolatesBetweenClosestRanks) {
  const std::vector<double> v = {5, 1, 4, 2, 3};  // unsorted on purpose
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(v, 25), 2);
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 3);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 5);
  EXPECT_DOUBLE_EQ(Percentile({1, 2, 3, 4}, 50), 2.5);
  std::vector<double> hundred;
  for (int i = 1; i <= 100; ++i) hundred.push_back(i);
  EXPECT_NEAR(Percentile(hundred, 90), 90.1, 1e-9);
  EXPECT_NEAR(Percentile(hundred, 99), 99.01, 1e-9);
}

TEST(PercentileTest, EdgeCases) {
  EXPECT_DOUBLE_EQ(Percentile({}, 50), 0);
  EXPECT_DOUBLE_EQ(Percentile({7}, 0), 7);
  EXPECT_DOUBLE_EQ(Percentile({7}, 99), 7);
  EXPECT_DOUBLE_EQ(Percentile({1, 2}, 150), 2);  // clamped
  EXPECT_DOUBLE_EQ(Percentile({1, 2}, -5), 1);
}

TEST(SummarizeTest, CountMeanMax) {
  const Summary s = Summarize({0.5, 1.5, 1.0});
  EXPECT_EQ(s.count, 3u);
  EXPECT_DOUBLE_EQ(s.mean, 1.0);
  EXPECT_DOUBLE_EQ(s.p50, 1.0);
  EXPECT_DOUBLE_EQ(s.max, 1.5);
  EXPECT_EQ(Summarize({}).count, 0u);
}

// --- Poisson schedule --------------------------------------------------------------------------

TEST(PoissonScheduleTest, InterArrivalStatisticsMatchTheRate) {
  constexpr double kRate = 4.0;
  constexpr int kN = 200000;
  PoissonSchedule s(kRate, /*seed=*/42);
  double sum = 0, sum_sq = 0;
  for (int i = 0; i < kN; ++i) {
    const double g = s.NextGap();
    ASSERT_GT(g, 0);
    sum += g;
    sum_sq += g * g;
  }
  const double mean = sum / kN;
  const double stddev = std::sqrt(sum_sq / kN - mean * mean);
  // Exponential gaps: mean = std = 1/rate. With 200k samples the standard error is ~0.2%.
  EXPECT_NEAR(mean, 1 / kRate, 0.01 / kRate);
  EXPECT_NEAR(stddev, 1 / kRate, 0.02 / kRate);
}

TEST(PoissonScheduleTest, ArrivalCountsInAWindow) {
  PoissonSchedule s(/*rate=*/2.5, /*seed=*/7);
  int n = 0;
  double prev = 0;
  for (double t = s.NextArrival(); t < 4000; t = s.NextArrival()) {
    ASSERT_GT(t, prev);
    prev = t;
    ++n;
  }
  EXPECT_NEAR(n, 10000, 300);  // Poisson(10000): sd 100
}

TEST(PoissonScheduleTest, DeterministicGivenTheSeed) {
  PoissonSchedule a(3, 9), b(3, 9), c(3, 10);
  bool differs = false;
  for (int i = 0; i < 100; ++i) {
    const double x = a.NextArrival();
    EXPECT_EQ(x, b.NextArrival());
    if (x != c.NextArrival()) differs = true;
  }
  EXPECT_TRUE(differs);
}

// --- JSONL prompts -----------------------------------------------------------------------------

TEST(PromptsJsonlTest, ParsesPromptsAndMessages) {
  auto p = ParsePromptsJsonl(
      "{\"prompt\": \"hello\"}\n"
      "\n"
      "  {\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"},"
      " {\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 12}\r\n"
      "{\"prompt\": \"last\", \"max_tokens\": null}");
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 3u);
  EXPECT_FALSE((*p)[0].is_chat);
  EXPECT_EQ((*p)[0].text, "hello");
  EXPECT_EQ((*p)[0].max_tokens, 0);
  EXPECT_TRUE((*p)[1].is_chat);
  ASSERT_EQ((*p)[1].messages.size(), 2u);
  EXPECT_EQ((*p)[1].messages[1].role, "user");
  EXPECT_EQ((*p)[1].messages[1].content, "hi");
  EXPECT_EQ((*p)[1].max_tokens, 12);
  EXPECT_EQ((*p)[2].text, "last");
}

// Every role the gateway takes (developer as system, model as assistant: gateway/BEHAVIOUR.md)
// is taken here too and sent as written; they were refused as not "system, user or assistant".
TEST(PromptsJsonlTest, TakesTheGatewaysRoles) {
  auto p = ParsePromptsJsonl(
      R"({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", )"
      R"("content": "hi"}, {"role": "model", "content": "hello"}, {"role": "user", )"
      R"("content": "again"}]})");
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 1u);
  ASSERT_EQ((*p)[0].messages.size(), 4u);
  EXPECT_EQ((*p)[0].messages[0].role, "developer");
  EXPECT_EQ((*p)[0].messages[2].role, "model");
}

TEST(PromptsJsonlTest, ErrorsNameTheLineAndTheProblem) {
  struct Case {
    const char* input;
    const char* want;
  };
  const Case cases[] = {
      {"{\"prompt\": \"a\"}\n{not json", "line 2: not valid JSON"},
      {"[1, 2]", "line 1: expected a JSON object"},
      {"{}", "exactly one of \"prompt\" and \"messages\""},
      {"{\"prompt\": \"a\", \"messages\": []}", "exactly one of"},
      {"{\"prompt\": 5}", "\"prompt\" must be a string"},
      {"{\"prompt\": \"\"}", "\"prompt\" is empty"},
      {"{\"messages\": \"hi\"}", "\"messages\" must be a non-empty array"},
      {"{\"messages\": []}", "\"messages\" must be a non-empty array"},
      {"{\"messages\": [{\"role\": \"user\"}]}", "messages[0] must be"},
      {"{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", "messages[0].role"},
      {"{\"prompt\": \"a\", \"max_tokens\": 0}", "\"max_tokens\" must be a positive integer"},
      {"{\"prompt\": \"a\", \"max_tokens\": -3}", "positive integer"},
      {"{\"prompt\": \"a\", \"max_tokens\": 2.5}", "positive integer"},
      {"{\"prompt\": \"a\", \"max_tokens\": \"8\"}", "positive integer"},
      {"{\"prompt\": \"a\", \"max_tokens\": 1000001}", "\"max_tokens\" must be at most 1000000"},
      {"{\"prompt\": \"a\", \"temperature\": 1}", "unknown key \"temperature\""},
      {"\n\n  \n", "no prompts"},
      {"", "no prompts"},
  };
  for (const Case& c : cases) {
    auto p = ParsePromptsJsonl(c.input);
    ASSERT_FALSE(p.ok()) << c.input;
    EXPECT_THAT(std::string(p.status().message()), HasSubstr(c.want)) << c.input;
  }
  auto third = ParsePromptsJsonl("{\"prompt\": \"a\"}\n\n{\"prompt\": 1}\n");
  ASSERT_FALSE(third.ok());
  EXPECT_THAT(std::string(third.status().message()), HasSubstr("line 3:"));
}

TEST(PromptsJsonlTest, LoadFileNamesTheFile) {
  auto missing = LoadPromptsFile("/nonexistent/prompts.jsonl");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr("/nonexistent/prompts.jsonl: cannot open: No such file or directory"));
  // A directory is named as one (it read as a file of blank lines: "no prompts").
  auto dir = LoadPromptsFile(::testing::TempDir());
  ASSERT_FALSE(dir.ok());
  EXPECT_THAT(std::string(dir.status().message()), HasSubstr(": is a directory"));
  const std::string path = ::testing::TempDir() + "/loadgen_prompts.jsonl";
  std::ofstream(path) << "{\"prompt\": \"x\"}\n{\"bad\": 1}\n";
  auto bad = LoadPromptsFile(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(path + ": line 2:"));
}

// --- synthetic prompts -------------------------------------------------------------------------

int WordCount(const std::string& s) {
  if (s.empty()) return 0;
  int n = 1;
  for (char c : s) n += c == ' ';
  return n;
}

TEST(PromptSourceTest, SyntheticLengthsFollowTheDistributionAndStayPositive) {
  SyntheticOptions o;
  o.prompt_words_mean = 32;
  o.prompt_words_std = 8;
  o.max_tokens_mean = 5;
  o.max_tokens_std = 20;  // many draws below 1: clamped
  o.seed = 3;
  PromptSource src({}, o);
  constexpr int kN = 4000;
  double words_sum = 0, tokens_sum = 0;
  for (int i = 0; i < kN; ++i) {
    const Prompt p = src.Get(i);
    EXPECT_FALSE(p.is_chat);
    const int w = WordCount(p.text);
    ASSERT_GE(w, 1);
    ASSERT_GE(p.max_tokens, 1);
    words_sum += w;
    tokens_sum += p.max_tokens;
  }
  EXPECT_NEAR(words_sum / kN, 32, 0.6);
  EXPECT_GT(tokens_sum / kN, 5);  // clamping at 1 lifts the mean
}

TEST(PromptSourceTest, ZeroStdGivesTheMeanExactly) {
  SyntheticOptions o;
  o.prompt_words_mean = 10;
  o.prompt_words_std = 0;
  o.max_tokens_mean = 16.4;
  o.max_tokens_std = 0;
  PromptSource src({}, o);
  for (int i = 0; i < 50; ++i) {
    const Prompt p = src.Get(i);
    EXPECT_EQ(WordCount(p.text), 10);
    EXPECT_EQ(p.max_tokens, 16);
  }
}

TEST(PromptSourceTest, DrawPositiveClampsToOne) {
  std::mt19937_64 rng(1);
  EXPECT_EQ(PromptSource::DrawPositive(rng, 0.2, 0), 1);
  EXPECT_EQ(PromptSource::DrawPositive(rng, -50, 0), 1);
  for (int i = 0; i < 1000; ++i) EXPECT_GE(PromptSource::DrawPositive(rng, 1, 100), 1);
}

TEST(PromptSourceTest, DeterministicPerIndexAndSeed) {
  SyntheticOptions o;
  o.seed = 11;
  PromptSource a({}, o), b({}, o);
  o.seed = 12;
  PromptSource c({}, o);
  // The same index gives the same prompt whatever the call order (threads may interleave).
  const Prompt late = a.Get(99);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.Get(i).text, b.Get(i).text);
  EXPECT_EQ(late.text, b.Get(99).text);
  int differ = 0;
  for (int i = 0; i < 100; ++i) differ += a.Get(i).text != c.Get(i).text;
  EXPECT_GT(differ, 90);
  EXPECT_NE(a.Get(0).text, a.Get(1).text);
}

TEST(PromptSourceTest, FilePromptsInTurnKeepTheirMaxTokens) {
  Prompt x;
  x.text = "x";
  x.max_tokens = 7;
  Prompt y;
  y.is_chat = true;
  y.messages = {{"user", "y"}};
  SyntheticOptions o;
  o.max_tokens_mean = 20;
  PromptSource src({x, y}, o);
  EXPECT_EQ(src.Get(0).text, "x");
  EXPECT_EQ(src.Get(0).max_tokens, 7);
  EXPECT_TRUE(src.Get(1).is_chat);
  EXPECT_EQ(src.Get(1).max_tokens, 20);
  EXPECT_EQ(src.Get(4).text, "x");
}

// --- options -----------------------------------------------------------------------------------

Options GoodOptions() {
  Options o;
  o.host = "127.0.0.1";
  o.port = 8080;
  o.concurrency = 1;
  o.requests = 10;
  return o;
}

TEST(OptionsTest, ParseHostPort) {
  auto a = ParseHostPort("127.0.0.1:50051");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->first, "127.0.0.1");
  EXPECT_EQ(a->second, 50051);
  auto b = ParseHostPort("http://localhost:8080/");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->first, "localhost");
  auto c = ParseHostPort("[::1]:80");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->first, "::1");
  // The OpenAI base URL, as the README gives it and OpenAI clients take it.
  for (const char* base : {"http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"}) {
    auto u = ParseHostPort(base);
    ASSERT_TRUE(u.ok()) << base << ": " << u.status();
    EXPECT_EQ(u->first, "127.0.0.1");
    EXPECT_EQ(u->second, 8000);
  }
  // Each refusal names what is wrong (they read "port must be 1..65535" or "write an IPv6 host
  // in brackets").
  const std::vector<std::pair<std::string, std::string>> named = {
      {"https://127.0.0.1:8000", "only http:// is supported (https://"},
      {"127.0.0.1:8000/v1/completions", "the path '/v1/completions' is not taken"},
      {"http://127.0.0.1:8000/metrics", "the path '/metrics' is not taken"},
      {" 127.0.0.1:8000", "holds white space"},
  };
  for (const auto& [address, want] : named) {
    auto r = ParseHostPort(address);
    ASSERT_FALSE(r.ok()) << address;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(want)) << address;
  }
  for (const char* bad : {"localhost", ":80", "host:", "host:0", "host:65536", "host:8x", "::1:80"}) {
    EXPECT_FALSE(ParseHostPort(bad).ok()) << bad;
  }
}

// The report's target, as ParseHostPort reads it back: an IPv6 host in brackets (the report
// said "is the gateway running at ::1:8000?").
TEST(OptionsTest, JoinHostPortBracketsIpv6) {
  EXPECT_EQ(JoinHostPort("127.0.0.1", 8000), "127.0.0.1:8000");
  EXPECT_EQ(JoinHostPort("::1", 8000), "[::1]:8000");
  auto back = ParseHostPort(JoinHostPort("::1", 8000));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->first, "::1");
}

TEST(OptionsTest, ValidateNamesTheFlag) {
  EXPECT_TRUE(ValidateOptions(GoodOptions()).ok());
  struct Case {
    std::function<void(Options&)> edit;
    const char* want;
  };
  const std::vector<Case> cases = {
      {[](Options& o) { o.host = ""; }, "--target"},
      {[](Options& o) {
         o.mode = Mode::kOpen;
         o.concurrency = 0;
       },
       "--rate must be > 0"},
      {[](Options& o) {
         o.mode = Mode::kOpen;
         o.rate = 2;
       },
       "--concurrency applies"},
      {[](Options& o) { o.rate = 2; }, "--rate applies to --mode open"},
      {[](Options& o) { o.concurrency = 0; }, "--concurrency must be >= 1"},
      {[](Options& o) { o.requests = 0; }, "--duration_s"},
      {[](Options& o) { o.requests = -1; }, "--requests"},
      {[](Options& o) { o.duration_s = NAN; }, "--duration_s"},
      {[](Options& o) { o.max_inflight = 0; }, "--max_inflight"},
      {[](Options& o) { o.timeout_s = 0; }, "--timeout_s"},
      {[](Options& o) { o.drain_s = -1; }, "--drain_s"},
      {[](Options& o) { o.prompt_tokens_mean = 0; }, "--prompt_tokens_mean"},
      {[](Options& o) { o.prompt_tokens_std = -1; }, "--prompt_tokens_std"},
      {[](Options& o) { o.max_tokens_mean = 0.5; }, "--max_tokens_mean"},
      {[](Options& o) { o.max_tokens_mean = 1e6 + 1; }, "--max_tokens_mean must be <= 1000000"},
      {[](Options& o) { o.max_tokens_std = -2; }, "--max_tokens_std"},
      {[](Options& o) { o.max_denoising_steps = 2000; }, "--max_denoising_steps"},
      {[](Options& o) { o.canvas_step_interval = -1; }, "--canvas_step_interval"},
  };
  for (const Case& c : cases) {
    Options o = GoodOptions();
    c.edit(o);
    absl::Status s = ValidateOptions(o);
    ASSERT_FALSE(s.ok()) << c.want;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.want));
  }
}

// --- SSE and OpenAI chunks ---------------------------------------------------------------------

TEST(SseParserTest, EventsAcrossArbitraryPieces) {
  const std::string stream =
      ": comment\n"
      "data: {\"a\":1}\n\n"
      "data: line1\r\n"
      "data: line2\r\n\r\n"
      "event: x\n"
      "data:[DONE]\n\n";
  for (size_t piece : {size_t{1}, size_t{3}, size_t{7}, stream.size()}) {
    SseParser p;
    std::vector<std::string> got;
    for (size_t i = 0; i < stream.size(); i += piece) {
      p.Feed(std::string_view(stream).substr(i, piece),
             [&](std::string_view d) { got.emplace_back(d); });
    }
    ASSERT_EQ(got.size(), 3u) << piece;
    EXPECT_EQ(got[0], "{\"a\":1}");
    EXPECT_EQ(got[1], "line1\nline2");
    EXPECT_EQ(got[2], "[DONE]");
  }
}

TEST(ClassifyChunkTest, Kinds) {
  EXPECT_EQ(ClassifyChunk("[DONE]").kind, StreamChunk::kDone);
  EXPECT_EQ(ClassifyChunk(R"({"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"}}]})")
                .kind,
            StreamChunk::kContent);
  EXPECT_EQ(ClassifyChunk(R"({"choices":[{"index":0,"text":"Hi"}]})").kind, StreamChunk::kContent);
  EXPECT_EQ(ClassifyChunk(R"({"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]})").kind,
            StreamChunk::kOther);
  EXPECT_EQ(ClassifyChunk(R"({"choices":[{"index":0,"text":""}],"dgserve":{"canvas_step":{}}})")
                .kind,
            StreamChunk::kCanvasStep);
  const StreamChunk u = ClassifyChunk(
      R"({"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9,"total_tokens":14,)"
      R"("dgserve":{"canvases":2,"denoising_steps":6,"timings":{"first_step_seconds":0.25}}}})");
  EXPECT_EQ(u.kind, StreamChunk::kUsage);
  EXPECT_EQ(u.prompt_tokens, 5);
  EXPECT_EQ(u.completion_tokens, 9);
  EXPECT_EQ(u.canvases, 2);
  EXPECT_EQ(u.denoising_steps, 6);
  EXPECT_DOUBLE_EQ(u.server_first_step_s, 0.25);
  const StreamChunk e =
      ClassifyChunk(R"({"error":{"message":"no worker","type":"x","code":"unavailable"}})");
  EXPECT_EQ(e.kind, StreamChunk::kError);
  EXPECT_EQ(e.error_code, "unavailable");
  EXPECT_EQ(e.error_message, "no worker");
  EXPECT_EQ(ClassifyChunk("{oops").kind, StreamChunk::kInvalid);
}

TEST(HttpRequestBodyTest, ChatAndCompletions) {
  Options o = GoodOptions();
  o.max_denoising_steps = 4;
  Prompt p;
  p.text = "hello";
  auto chat = HttpRequestBody(p, 8, /*chat=*/true, o);
  ASSERT_TRUE(chat.ok());
  const nlohmann::json j = nlohmann::json::parse(*chat);
  EXPECT_EQ(j["messages"][0]["role"], "user");
  EXPECT_EQ(j["messages"][0]["content"], "hello");
  EXPECT_EQ(j["max_tokens"], 8);
  EXPECT_EQ(j["stream"], true);
  EXPECT_EQ(j["stream_options"]["include_usage"], true);
  EXPECT_EQ(j["max_denoising_steps"], 4);
  EXPECT_FALSE(j.contains("model"));
  EXPECT_FALSE(j.contains("canvas_step_interval"));
  auto completion = HttpRequestBody(p, 8, /*chat=*/false, o);
  ASSERT_TRUE(completion.ok());
  EXPECT_EQ(nlohmann::json::parse(*completion)["prompt"], "hello");
  Prompt m;
  m.is_chat = true;
  m.messages = {{"user", "x"}};
  EXPECT_FALSE(HttpRequestBody(m, 8, /*chat=*/false, o).ok());
}

// --- report ------------------------------------------------------------------------------------

TEST(ReportTest, AggregatesResults) {
  std::vector<RequestResult> results;
  for (int i = 0; i < 4; ++i) {
    RequestResult r;
    r.ok = true;
    r.start_s = i;
    r.ttft_s = 0.1 * (i + 1);
    r.e2e_s = 1.0;
    r.completion_tokens = 10;
    r.prompt_tokens = 3;
    r.canvases = 2;
    r.denoising_steps = 5;
    results.push_back(r);
  }
  RequestResult err;
  err.error = "UNAVAILABLE";
  err.e2e_s = 0.01;
  results.push_back(err);
  results.push_back(err);
  RequestResult http;
  http.error = "HTTP 429";
  results.push_back(http);
  RunInfo info;
  info.protocol = "grpc";
  info.mode = "closed";
  info.concurrency = 2;
  info.sent = 8;  // one still in flight
  info.dropped = 3;
  info.wall_s = 5;
  const Report r = BuildReport(results, info);
  EXPECT_EQ(r.completed, 4);
  EXPECT_EQ(r.errors, 3);
  EXPECT_EQ(r.unfinished, 1);
  EXPECT_EQ(r.errors_by_code.at("UNAVAILABLE"), 2);
  EXPECT_EQ(r.errors_by_code.at("HTTP 429"), 1);
  EXPECT_DOUBLE_EQ(r.elapsed_s, 5);  // unfinished requests: the wall time
  EXPECT_DOUBLE_EQ(r.requests_per_s, 4 / 5.0);
  EXPECT_DOUBLE_EQ(r.output_tokens_per_s, 40 / 5.0);
  EXPECT_DOUBLE_EQ(r.mean_steps_per_canvas, 2.5);
  EXPECT_EQ(r.ttft.count, 4u);
  EXPECT_NEAR(r.ttft.p50, 0.25, 1e-12);
  EXPECT_EQ(r.first_step.count, 0u);

  const nlohmann::ordered_json j = ReportJson(r);
  EXPECT_EQ(j["completed"], 4);
  EXPECT_EQ(j["dropped"], 3);
  EXPECT_EQ(j["errors_by_code"]["UNAVAILABLE"], 2);
  EXPECT_TRUE(j["first_canvas_step_s"].is_null());
  EXPECT_TRUE(j["rate"].is_null());
  EXPECT_DOUBLE_EQ(j["ttft_s"]["p50"].get<double>(), r.ttft.p50);
  const std::string text = FormatReport(r);
  EXPECT_THAT(text, HasSubstr("completed 4  errors 3  dropped 3  unfinished 1"));
  EXPECT_THAT(text, HasSubstr("HTTP 429=1 UNAVAILABLE=2"));
  EXPECT_THAT(text, HasSubstr("2.50 steps per canvas"));
}

TEST(ReportTest, ElapsedEndsAtTheLastCompletionWhenAllFinished) {
  RequestResult a;
  a.ok = true;
  a.start_s = 1;
  a.e2e_s = 2;
  RequestResult cancelled;
  cancelled.cancelled = true;
  RunInfo info;
  info.sent = 1;
  info.wall_s = 10;
  Report r = BuildReport({a}, info);
  EXPECT_DOUBLE_EQ(r.elapsed_s, 3);
  EXPECT_EQ(r.unfinished, 0);
  info.issue_s = 4;  // an open loop issues until its duration is over
  r = BuildReport({a}, info);
  EXPECT_DOUBLE_EQ(r.elapsed_s, 4);
  info.sent = 2;
  r = BuildReport({a, cancelled}, info);
  EXPECT_EQ(r.unfinished, 1);
  EXPECT_EQ(r.errors, 0);
  EXPECT_DOUBLE_EQ(r.elapsed_s, 10);
}

// --- backoff while the target refuses connections ----------------------------------------------

// Each attempt fails to connect at once (a closed port): the attempts start 50 ms after the
// first failure, then 100, 200, 400, 800 ms after the previous one, then every 1 s.
TEST(ConnectBackoffTest, ProbesFollowTheDoublingScheduleUpToTheCap) {
  ConnectBackoff b;  // 50 ms doubling to 1 s
  std::vector<double> starts;
  double t = 0;
  while (starts.size() < 9) {
    const ConnectBackoff::Admission a = b.TryStart(t);
    if (!a.admitted) {
      ASSERT_GT(a.retry_at, t);
      t = a.retry_at;
      continue;
    }
    EXPECT_EQ(a.probe, !starts.empty());  // the first attempt is an ordinary one
    starts.push_back(t);
    b.Finish(t, a.probe, /*connect_failed=*/true);
  }
  const std::vector<double> want_gaps = {0.05, 0.1, 0.2, 0.4, 0.8, 1, 1, 1};
  for (size_t i = 1; i < starts.size(); ++i) {
    EXPECT_NEAR(starts[i] - starts[i - 1], want_gaps[i - 1], 1e-12) << "attempt " << i;
  }
  EXPECT_DOUBLE_EQ(b.delay(), 1.0);
}

// A simulated closed loop of 4 workers against a dead target over 1 s of fake time, asking as
// often as they can: the 4 first attempts, then one probe at a time on the schedule (0.05,
// 0.15, 0.35, 0.75 s; the next would be at 1.55 s). Without a backoff this loop never ends.
TEST(ConnectBackoffTest, BoundsTheAttemptsOfAClosedLoopAgainstADeadTarget) {
  ConnectBackoff b;
  constexpr int kWorkers = 4;
  constexpr double kDuration = 1.0, kTick = 0.001;
  int attempts = 0, probes_in_flight_max = 0;
  for (int step = 0; step * kTick < kDuration; ++step) {
    const double now = step * kTick;
    std::vector<bool> probes;
    for (int w = 0; w < kWorkers; ++w) {
      const ConnectBackoff::Admission a = b.TryStart(now);
      if (a.admitted) probes.push_back(a.probe);
    }
    attempts += static_cast<int>(probes.size());
    int p = 0;
    for (bool probe : probes) p += probe;
    probes_in_flight_max = std::max(probes_in_flight_max, p);
    // The attempts fail 0.5 ms later (all started in this tick end before the next one).
    for (bool probe : probes) b.Finish(now + kTick / 2, probe, /*connect_failed=*/true);
  }
  EXPECT_EQ(attempts, kWorkers + 4);
  EXPECT_EQ(probes_in_flight_max, 1);
}

TEST(ConnectBackoffTest, OneProbeAtATimeAndAnyAnswerEndsTheBackoff) {
  ConnectBackoff b(0.05, 1.0);
  ASSERT_TRUE(b.TryStart(0).admitted);
  ASSERT_TRUE(b.TryStart(0).admitted);  // two attempts in flight before the first failure
  b.Finish(0.01, /*probe=*/false, /*connect_failed=*/true);
  EXPECT_DOUBLE_EQ(b.delay(), 0.05);
  // The other attempt that started before the backoff fails too: the delay stays, the next
  // probe moves to 50 ms after it.
  b.Finish(0.02, false, true);
  EXPECT_DOUBLE_EQ(b.delay(), 0.05);
  EXPECT_FALSE(b.TryStart(0.06).admitted);
  EXPECT_NEAR(b.TryStart(0.06).retry_at, 0.07, 1e-12);
  const ConnectBackoff::Admission probe = b.TryStart(0.075);
  ASSERT_TRUE(probe.admitted);
  EXPECT_TRUE(probe.probe);
  EXPECT_FALSE(b.TryStart(5).admitted);  // the probe is still in flight
  b.CancelProbe();                       // (not sent: the open loop's pool was full)
  ASSERT_TRUE(b.TryStart(0.08).admitted);
  // The server answers (even with an error): no more backoff, every attempt is admitted.
  b.Finish(0.09, /*probe=*/true, /*connect_failed=*/false);
  EXPECT_DOUBLE_EQ(b.delay(), 0);
  const ConnectBackoff::Admission free = b.TryStart(0.09);
  EXPECT_TRUE(free.admitted);
  EXPECT_FALSE(free.probe);
  // A later failure starts again from the initial delay.
  b.Finish(0.2, false, true);
  EXPECT_DOUBLE_EQ(b.delay(), 0.05);
}

TEST(ReportTest, SaysWhenTheTargetWasNeverReachable) {
  RequestResult refused;
  refused.error = "http:connect";
  refused.connect_failed = true;
  refused.e2e_s = 0.001;
  RunInfo info;
  info.protocol = "http";
  info.target = "127.0.0.1:9";
  info.mode = "open";
  info.rate = 100;
  info.sent = 3;
  info.held_back = 40;
  info.wall_s = 1;
  Report r = BuildReport({refused, refused, refused}, info);
  EXPECT_EQ(r.errors, 3);
  EXPECT_EQ(r.connect_errors, 3);
  EXPECT_TRUE(r.never_reachable);
  std::string text = FormatReport(r);
  EXPECT_THAT(text, HasSubstr("UNREACHABLE  the target was never reachable: all 3 attempts "
                              "failed to connect (is the gateway running at 127.0.0.1:9?)"));
  EXPECT_THAT(text, HasSubstr("3 failed to connect; retried with a backoff of 50 ms doubling "
                              "to 1 s (40 arrivals held back)"));
  nlohmann::ordered_json j = ReportJson(r);
  EXPECT_EQ(j["reachable"], false);
  EXPECT_EQ(j["connect_errors"], 3);
  EXPECT_EQ(j["held_back"], 40);

  // One answer from the server (here an error of its own) means it was reachable.
  RequestResult answered;
  answered.error = "HTTP 503";
  r = BuildReport({refused, answered, refused}, info);
  EXPECT_EQ(r.connect_errors, 2);
  EXPECT_FALSE(r.never_reachable);
  text = FormatReport(r);
  EXPECT_THAT(text, ::testing::Not(HasSubstr("UNREACHABLE")));
  EXPECT_EQ(ReportJson(r)["reachable"], true);
}

// --- backoff after a refusal for load (closed loop) ---------------------------------------------

TEST(RetryAfterTest, ParsesDeltaSecondsAndReadsADateAsOneSecond) {
  EXPECT_EQ(ParseRetryAfter(""), std::nullopt);  // absent (HttpResponse::Header gives "")
  EXPECT_EQ(ParseRetryAfter("1"), 1.0);
  EXPECT_EQ(ParseRetryAfter(" 2 "), 2.0);
  EXPECT_EQ(ParseRetryAfter("0"), 0.0);
  EXPECT_EQ(ParseRetryAfter("120"), 120.0);
  EXPECT_EQ(ParseRetryAfter("99999999999999999999"), 1e9);  // no overflow
  // Garbage: no hint.
  for (const char* bad : {"soon", "-1", "1.5", "1s", "0x10", "Mon", "Wed, 21 Oct"}) {
    EXPECT_EQ(ParseRetryAfter(bad), std::nullopt) << bad;
  }
  // HTTP-dates (IMF-fixdate and the two obsolete forms) read as kRetryAfterDateS.
  EXPECT_EQ(ParseRetryAfter("Wed, 21 Oct 2015 07:28:00 GMT"), kRetryAfterDateS);
  EXPECT_EQ(ParseRetryAfter("Sunday, 06-Nov-94 08:49:37 GMT"), kRetryAfterDateS);
  EXPECT_EQ(ParseRetryAfter("Sun Nov  6 08:49:37 1994"), kRetryAfterDateS);
  EXPECT_DOUBLE_EQ(kRetryAfterDateS, 1.0);
}

TEST(RetryAfterTest, TheWaitIsTheHintCappedByMaxBackoff) {
  OverloadBackoff b(/*max_s=*/1.0, /*seed=*/1, /*worker=*/0);
  EXPECT_DOUBLE_EQ(b.OnRefused(ParseRetryAfter("1")), 1.0);    // the gateway's Retry-After: 1
  EXPECT_DOUBLE_EQ(b.OnRefused(ParseRetryAfter("0")), 0.0);    // the server asks for no wait
  EXPECT_DOUBLE_EQ(b.OnRefused(ParseRetryAfter("120")), 1.0);  // capped
  EXPECT_DOUBLE_EQ(b.OnRefused(ParseRetryAfter("Wed, 21 Oct 2015 07:28:00 GMT")), 1.0);
  OverloadBackoff longer(/*max_s=*/5.0, 1, 0);
  EXPECT_DOUBLE_EQ(longer.OnRefused(ParseRetryAfter("2")), 2.0);
  EXPECT_DOUBLE_EQ(longer.OnRefused(ParseRetryAfter("120")), 5.0);
  // Absent or garbage: the exponential backoff's first step, [25 ms, 50 ms).
  for (const char* none : {"", "soon"}) {
    OverloadBackoff fresh(1.0, 1, 0);
    const double w = fresh.OnRefused(ParseRetryAfter(none));
    EXPECT_GE(w, OverloadBackoff::kInitialS / 2) << none;
    EXPECT_LT(w, OverloadBackoff::kInitialS) << none;
  }
  // --max_backoff_s 0: never a wait, hint or not.
  OverloadBackoff off(0, 1, 0);
  EXPECT_EQ(off.OnRefused(1.0), 0);
  EXPECT_EQ(off.OnRefused(std::nullopt), 0);
}

TEST(RetryAfterTest, LoadRefusalsAre429AndA503WithRetryAfter) {
  EXPECT_TRUE(IsHttpLoadRefusal(429, true));
  EXPECT_TRUE(IsHttpLoadRefusal(429, false));
  EXPECT_TRUE(IsHttpLoadRefusal(503, true));    // the gateway's full body budget
  EXPECT_FALSE(IsHttpLoadRefusal(503, false));  // draining / stopping: not load
  EXPECT_FALSE(IsHttpLoadRefusal(500, true));
  EXPECT_FALSE(IsHttpLoadRefusal(400, false));
}

// Without a hint (gRPC RESOURCE_EXHAUSTED): after the n-th refusal in a row the wait lies in
// [d/2, d), d = 50 ms * 2^(n-1) up to the cap; the jitter depends only on the seed and the
// worker; an accepted request starts the schedule again.
TEST(OverloadBackoffTest, DoublesWithJitterUpToTheCap) {
  OverloadBackoff b(/*max_s=*/1.0, /*seed=*/7, /*worker=*/3);
  const std::vector<double> d = {0.05, 0.1, 0.2, 0.4, 0.8, 1, 1, 1};
  std::vector<double> waits;
  for (size_t n = 0; n < d.size(); ++n) {
    const double w = b.OnRefused(std::nullopt);
    EXPECT_GE(w, d[n] / 2) << "refusal " << n + 1;
    EXPECT_LE(w, d[n]) << "refusal " << n + 1;
    waits.push_back(w);
  }
  EXPECT_NE(waits[5], waits[6]);  // jitter
  OverloadBackoff same(1.0, 7, 3);
  for (size_t n = 0; n < waits.size(); ++n) EXPECT_EQ(same.OnRefused(std::nullopt), waits[n]);
  bool differs_worker = false, differs_seed = false;
  OverloadBackoff w4(1.0, 7, 4), s8(1.0, 8, 3);
  for (size_t n = 0; n < waits.size(); ++n) {
    differs_worker |= w4.OnRefused(std::nullopt) != waits[n];
    differs_seed |= s8.OnRefused(std::nullopt) != waits[n];
  }
  EXPECT_TRUE(differs_worker);
  EXPECT_TRUE(differs_seed);
  // A hint does not advance the schedule; a served request restarts it.
  EXPECT_EQ(b.OnRefused(0.3), 0.3);
  b.OnServed();
  const double first = b.OnRefused(std::nullopt);
  EXPECT_GE(first, 0.025);
  EXPECT_LT(first, 0.05);
  // Many refusals in a row stay at the cap (no overflow): from the 6th on, [0.5 s, 1 s].
  for (int n = 2; n < 200; ++n) {
    const double w = b.OnRefused(std::nullopt);
    ASSERT_LE(w, 1.0) << "refusal " << n;
    if (n >= 6) ASSERT_GE(w, 0.5) << "refusal " << n;
  }
}

TEST(ReportTest, SaysHowManyRefusalsWereBackedOff) {
  RequestResult refused;
  refused.error = "HTTP 429";
  refused.load_refusal = true;
  refused.retry_after_s = 1;
  refused.e2e_s = 0.001;
  RunInfo info;
  info.protocol = "http";
  info.mode = "closed";
  info.concurrency = 2;
  info.sent = 3;
  info.wall_s = 2;
  info.backed_off = 3;
  info.backoff_wait_s = 2.5;
  info.max_backoff_s = 1;
  const Report r = BuildReport({refused, refused, refused}, info);
  EXPECT_EQ(r.errors, 3);  // refusals stay errors, by their code
  EXPECT_EQ(r.completed, 0);
  EXPECT_EQ(r.errors_by_code.at("HTTP 429"), 3);
  EXPECT_THAT(FormatReport(r), HasSubstr("backoff      3 refusals for load waited after, 2.50 s "
                                         "in all (Retry-After, else 50 ms doubling; at most 1 s "
                                         "each)"));
  const nlohmann::ordered_json j = ReportJson(r);
  EXPECT_EQ(j["backed_off"], 3);
  EXPECT_DOUBLE_EQ(j["backoff_wait_s"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(j["max_backoff_s"].get<double>(), 1);
  EXPECT_EQ(j["errors"], 3);
  // Nothing backed off: no line; an open loop has no --max_backoff_s.
  info.backed_off = 0;
  info.backoff_wait_s = 0;
  info.mode = "open";
  info.rate = 5;
  const Report open = BuildReport({refused}, info);
  EXPECT_THAT(FormatReport(open), ::testing::Not(HasSubstr("backoff ")));
  EXPECT_EQ(ReportJson(open)["backed_off"], 0);
  EXPECT_TRUE(ReportJson(open)["max_backoff_s"].is_null());
}

TEST(OptionsTest, MaxBackoffMustBeFiniteAndNotNegative) {
  Options o;
  o.host = "127.0.0.1";
  o.port = 1;
  o.concurrency = 1;
  o.requests = 1;
  EXPECT_TRUE(ValidateOptions(o).ok());
  o.max_backoff_s = 0;
  EXPECT_TRUE(ValidateOptions(o).ok());
  for (double bad : {-1.0, std::nan(""), double(INFINITY)}) {
    o.max_backoff_s = bad;
    const absl::Status s = ValidateOptions(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("--max_backoff_s must be a finite number >= 0"));
  }
}

}  // namespace
}  // namespace dgserve::loadgen
