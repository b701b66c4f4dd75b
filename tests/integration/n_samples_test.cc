// Integration tests of `n` (parallel samples sharing one prefill) on the real three-process
// cluster: sample i of a request with seed s equals the request with seed s + i and n = 1, the
// denoise worker holds the prompt's KV blocks once for all samples, the limits are enforced,
// and the OpenAI HTTP API returns one choice per sample (label `integration`).
#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <thread>


#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/http_client.h"
#include "common/limits.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/test_cluster.h"
#include "tests/integration/test_helpers.h"

namespace dgserve::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kMaxN = 4;

std::vector<int32_t> Ids(const google::protobuf::RepeatedField<int32_t>& ids) {
  return {ids.begin(), ids.end()};
}

// One denoise worker with a batch of a single canvas, so that a request with n > 1 is
// scheduled in parts and its samples wait (holding their KV) behind a running request; the
// test model without stop tokens, so that max_tokens alone ends a completion.
class NSamplesTest : public SharedClusterTest<NSamplesTest> {
 public:
  static absl::StatusOr<ClusterOptions> Options() {
    absl::StatusOr<ClusterOptions> options = OptionsWithoutStopTokens();
    if (!options.ok()) return options.status();
    ClusterOptions o = *options;
    o.denoise_flags = {"--max_batch_canvases=1"};
    o.gateway_flags = {absl::StrCat("--max_n=", kMaxN)};
    return o;
  }

 protected:
  bool DenoiseIdle() {
    auto s = c().DenoiseStats(0);
    return s.ok() && s->kv().full_blocks_used() == 0 && s->kv().sliding_blocks_used() == 0 &&
           s->kv().full_blocks_shared() == 0 && s->active_requests() == 0 &&
           s->queued_requests() == 0;
  }
};

TEST_F(NSamplesTest, EachSampleEqualsTheSoloRequestWithSeedPlusIndex) {
  constexpr uint64_t kSeed = 40;
  constexpr int kN = 3;
  Result r = Generate(c(), Chat("Write a short poem.", kSeed, 40, kN));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.response.choices_size(), kN);
  int completion = 0;
  for (int i = 0; i < kN; ++i) {
    const v1::Choice& choice = r.response.choices(i);
    EXPECT_EQ(choice.index(), i);
    Result solo = Generate(c(), Chat("Write a short poem.", kSeed + i, 40));
    ASSERT_TRUE(solo.status.ok()) << solo.status.error_message();
    EXPECT_EQ(Ids(choice.token_ids()), Ids(solo.response.token_ids())) << "sample " << i;
    EXPECT_EQ(choice.text(), solo.response.text()) << "sample " << i;
    EXPECT_EQ(choice.finish_reason(), solo.response.finish_reason()) << "sample " << i;
    ASSERT_EQ(solo.response.choices_size(), 1);  // choices is filled for n = 1 too
    EXPECT_EQ(solo.response.choices(0).text(), solo.response.text());
    completion += solo.response.usage().completion_tokens();
  }
  // The top level is sample 0; usage counts the prompt once and every sample's completion.
  EXPECT_EQ(r.response.text(), r.response.choices(0).text());
  EXPECT_EQ(Ids(r.response.token_ids()), Ids(r.response.choices(0).token_ids()));
  EXPECT_EQ(r.response.usage().completion_tokens(), completion);
  EXPECT_EQ(r.response.usage().total_tokens(), r.response.usage().prompt_tokens() + completion);
  EXPECT_EQ(r.response.usage().canvases(), kN * 3);  // 40 tokens = 3 canvases of 16 each
  EXPECT_NE(Ids(r.response.choices(0).token_ids()), Ids(r.response.choices(1).token_ids()));

  // The stream carries every sample's events by index, each sample ending with one Finished,
  // its last event.
  grpc::ClientContext ctx;
  auto reader =
      c().GatewayStub()->GenerateStream(&ctx, Chat("Write a short poem.", kSeed, 40, kN));
  std::map<int, std::string> text;
  std::map<int, int> finished;
  v1::GenerateEvent ev;
  while (reader->Read(&ev)) {
    EXPECT_EQ(finished[ev.index()], 0) << "an event of sample " << ev.index() << " after its end";
    if (ev.has_block()) text[ev.index()] += ev.block().text();
    if (ev.has_finished()) ++finished[ev.index()];
  }
  ASSERT_TRUE(reader->Finish().ok());
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(text[i], r.response.choices(i).text()) << "sample " << i;
    EXPECT_EQ(finished[i], 1) << "sample " << i;
  }
  EXPECT_EQ(text.size(), size_t(kN));

  const std::string metrics = *TestCluster::ScrapeMetrics(c().gateway());
  EXPECT_GE(TestCluster::MetricValue(metrics, "dgserve_gateway_samples_total"), 2 * kN + kN);
  const std::string dmetrics = *TestCluster::ScrapeMetrics(c().denoise(0));
  EXPECT_GE(TestCluster::MetricValue(dmetrics, "dgserve_denoise_samples_total"), 2 * kN + kN);
}

// Sample seeds are seed + i modulo 2^64: after the largest seed comes 0 (documented; a
// uint64 wraps the same way in every client language that has one).
TEST_F(NSamplesTest, SampleSeedsWrapAroundAfterTheLargestSeed) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  Result r = Generate(c(), Chat("Name a colour.", kMax, 16, 2));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.response.choices_size(), 2);
  const uint64_t seeds[] = {kMax, 0};
  for (int i = 0; i < 2; ++i) {
    Result solo = Generate(c(), Chat("Name a colour.", seeds[i], 16));
    ASSERT_TRUE(solo.status.ok()) << solo.status.error_message();
    EXPECT_EQ(Ids(r.response.choices(i).token_ids()), Ids(solo.response.token_ids()))
        << "sample " << i << " (seed " << seeds[i] << ")";
  }
  // The seeds give different samples here, so the check above tells them apart.
  EXPECT_NE(Ids(r.response.choices(0).token_ids()), Ids(r.response.choices(1).token_ids()));
}

// The samples of one request share the prompt's KV blocks by reference: while they wait behind
// a running request, every whole prompt block is referenced more than once (a copy per sample
// would leave none shared), and the results still equal the solo requests.
TEST_F(NSamplesTest, PromptBlocksAreHeldOnceForAllSamples) {
  auto stats = c().DenoiseStats(0);
  ASSERT_TRUE(stats.ok()) << stats.status();
  const int block = stats->kv().block_size();
  ASSERT_GT(block, 0);
  const int prompt_blocks = 10;
  v1::GenerateRequest shared;
  for (int i = 0; i < prompt_blocks * block; ++i) shared.mutable_token_ids()->add_ids(3 + i % 97);
  shared.set_seed(70);
  shared.set_max_tokens(16);  // one canvas: no commit pass appends to the KV
  shared.set_n(3);

  // A long request takes the single batch slot.
  grpc::ClientContext held_ctx;
  auto held = c().GatewayStub()->GenerateStream(&held_ctx, Chat("Count on.", 5, 16000));
  v1::GenerateEvent ev;
  ASSERT_TRUE(held->Read(&ev));

  Result r;
  std::thread t([&] { r = Generate(c(), shared); });
  // The three samples wait for the slot, each with its table over the same prompt blocks.
  const bool saw_shared = Eventually([&] {
    auto s = c().DenoiseStats(0);
    return s.ok() && s->kv().full_blocks_shared() == prompt_blocks;
  });
  auto during = c().DenoiseStats(0);
  held_ctx.TryCancel();
  while (held->Read(&ev)) {
  }
  t.join();
  ASSERT_TRUE(saw_shared) << during->DebugString();
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.response.choices_size(), 3);
  for (int i = 0; i < 3; ++i) {
    v1::GenerateRequest solo = shared;
    solo.set_n(1);
    solo.set_seed(70 + i);
    Result s = Generate(c(), solo);
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_EQ(Ids(r.response.choices(i).token_ids()), Ids(s.response.token_ids())) << i;
  }
  EXPECT_TRUE(Eventually([&] { return DenoiseIdle(); })) << c().DenoiseStats(0)->DebugString();
}

TEST_F(NSamplesTest, CancellingARequestEndsAllItsSamplesAndFreesTheirKv) {
  grpc::ClientContext ctx;
  auto reader = c().GatewayStub()->GenerateStream(&ctx, Chat("Count on.", 9, 16000, 2));
  v1::GenerateEvent ev;
  ASSERT_TRUE(reader->Read(&ev));
  ctx.TryCancel();
  while (reader->Read(&ev)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(Eventually([&] { return DenoiseIdle(); })) << c().DenoiseStats(0)->DebugString();
}

TEST_F(NSamplesTest, NAboveMaxNOrNegativeIsInvalidArgument) {
  for (int n : {kMaxN + 1, -1}) {
    Result r = Generate(c(), Chat("Hi.", 1, 16, n));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << n;
    EXPECT_THAT(r.status.error_message(), HasSubstr("n: ")) << n;
  }
  HttpClient http("127.0.0.1", c().gateway().http_port);
  http.set_idle_timeout(absl::Seconds(120));
  for (int n : {kMaxN + 1, -1}) {
    const std::string body = absl::StrCat(
        R"({"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 16, "n": )", n, "}");
    auto res = http.Post("/v1/chat/completions", body);
    ASSERT_TRUE(res);
    EXPECT_EQ(res.status, 400) << res.body;
    nlohmann::json err = nlohmann::json::parse(res.body, nullptr, false);
    ASSERT_TRUE(err.is_object() && err.contains("error")) << res.body;
    EXPECT_EQ(err["error"]["param"], "n") << res.body;
  }
  // n = max_n is served.
  Result ok = Generate(c(), Chat("Hi.", 1, 16, kMaxN));
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.response.choices_size(), kMaxN);
}

TEST_F(NSamplesTest, OpenAiChoicesPerSampleUnaryAndStreamed) {
  HttpClient http("127.0.0.1", c().gateway().http_port);
  http.set_idle_timeout(absl::Seconds(120));
  const std::string body =
      R"({"prompt": "Tell me about the sea.", "seed": 3, "max_tokens": 24, "n": 2)";
  auto res = http.Post("/v1/completions", body + "}");
  ASSERT_TRUE(res);
  ASSERT_EQ(res.status, 200) << res.body;
  nlohmann::json j = nlohmann::json::parse(res.body);
  ASSERT_EQ(j["choices"].size(), 2u) << res.body;
  int completion = 0;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["finish_reason"], "length");
    auto solo = http.Post("/v1/completions",
                          absl::StrCat(R"({"prompt": "Tell me about the sea.", "seed": )", 3 + i,
                                       R"(, "max_tokens": 24})"));
    ASSERT_TRUE(solo);
    ASSERT_EQ(solo.status, 200) << solo.body;
    nlohmann::json s = nlohmann::json::parse(solo.body);
    EXPECT_EQ(j["choices"][i]["text"], s["choices"][0]["text"]) << i;
    completion += s["usage"]["completion_tokens"].get<int>();
  }
  EXPECT_EQ(j["usage"]["completion_tokens"], completion);

  // Streamed: chunks of both choices, each choice ending with its finish_reason, one usage
  // chunk, then [DONE].
  auto stream = http.Post("/v1/completions",
                          body + R"(, "stream": true, "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(stream);
  ASSERT_EQ(stream.status, 200) << stream.body;
  std::map<int, std::string> text, finish;
  int usage_chunks = 0;
  bool done = false;
  std::istringstream in(stream.body);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    const std::string data = line.substr(6);
    ASSERT_FALSE(done) << "data after [DONE]: " << data;
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    nlohmann::json chunk = nlohmann::json::parse(data);
    ASSERT_FALSE(chunk.contains("error")) << data;
    if (chunk["choices"].empty()) {
      ++usage_chunks;
      EXPECT_EQ(chunk["usage"]["completion_tokens"], completion) << data;
      continue;
    }
    const nlohmann::json& choice = chunk["choices"][0];
    const int index = choice["index"].get<int>();
    ASSERT_TRUE(index == 0 || index == 1) << data;
    EXPECT_EQ(finish.count(index), 0u) << "chunk after the finish of choice " << index;
    text[index] += choice["text"].get<std::string>();
    if (!choice["finish_reason"].is_null()) finish[index] = choice["finish_reason"];
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(usage_chunks, 1);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(text[i], j["choices"][i]["text"]) << i;
    EXPECT_EQ(finish[i], "length") << i;
  }
}

// A sample that ends before the others is reported when it ends: with a batch of one canvas
// the worker runs the samples one after another, and sample 0's Finished (with its usage)
// comes before sample 1's first block, over gRPC and as the SSE finish chunk of choice 0 (it
// used to come only when the last sample had ended).
TEST_F(NSamplesTest, ASampleThatEndsFirstIsFinishedFirst) {
  v1::GenerateRequest req = Chat("Count to ten.", 3, 40, 2);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto reader = c().GatewayStub()->GenerateStream(&ctx, req);
  std::vector<std::string> order;  // "block 0", "finished 1", ... in stream order
  v1::GenerateEvent ev;
  while (reader->Read(&ev)) {
    if (ev.has_block()) order.push_back(absl::StrCat("block ", ev.index()));
    if (ev.has_finished()) {
      order.push_back(absl::StrCat("finished ", ev.index()));
      EXPECT_EQ(ev.finished().usage().completion_tokens(), 40) << ev.index();
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  const auto at = [&](const std::string& e) {
    return std::find(order.begin(), order.end(), e) - order.begin();
  };
  ASSERT_LT(at("finished 0"), int64_t(order.size())) << absl::StrJoin(order, ", ");
  ASSERT_LT(at("block 1"), int64_t(order.size())) << absl::StrJoin(order, ", ");
  EXPECT_LT(at("finished 0"), at("block 1")) << absl::StrJoin(order, ", ");
  EXPECT_EQ(order.back(), "finished 1");

  const HttpResponse res = HttpClient("127.0.0.1", c().gateway().http_port).Post(
      "/v1/completions",
      R"({"prompt": "Count to ten.", "max_tokens": 40, "n": 2, "seed": 3, "stream": true})");
  ASSERT_EQ(res.status, 200) << res.body;
  const size_t finish0 = res.body.find(R"("finish_reason":"length","index":0)");
  const size_t first1 = res.body.find(R"("index":1)");
  ASSERT_NE(finish0, std::string::npos) << res.body;
  ASSERT_NE(first1, std::string::npos) << res.body;
  EXPECT_LT(finish0, first1) << res.body;
  EXPECT_TRUE(Eventually([&] { return DenoiseIdle(); }));
}

// With room in the batch the samples run in the same decoder passes: their events interleave
// in the stream, and each still equals its solo request.
class NSamplesBatchedTest : public SharedClusterTest<NSamplesBatchedTest> {
 public:
  static absl::StatusOr<ClusterOptions> Options() {
    return OptionsWithoutStopTokens();
  }
};

TEST_F(NSamplesBatchedTest, SamplesInterleaveAndEqualTheirSoloRequests) {
  constexpr int kN = 3;
  v1::GenerateRequest req = Chat("Name three rivers.", 11, 40, kN);
  req.mutable_stream_options()->set_canvas_step_interval(1);
  grpc::ClientContext ctx;
  auto reader = c().GatewayStub()->GenerateStream(&ctx, req);
  std::vector<int> order;  // the sample of every event, in stream order
  std::map<int, std::vector<int32_t>> ids;
  v1::GenerateEvent ev;
  while (reader->Read(&ev)) {
    order.push_back(ev.index());
    if (ev.has_block()) {
      ids[ev.index()].insert(ids[ev.index()].end(), ev.block().token_ids().begin(),
                             ev.block().token_ids().end());
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  // Sample 1's first canvas step comes in the first batched pass, before sample 0's third
  // (last) canvas is done.
  const auto first_of_1 = std::find(order.begin(), order.end(), 1);
  const auto last_of_0 = std::find(order.rbegin() + kN, order.rend(), 0);  // before Finished
  ASSERT_NE(first_of_1, order.end());
  EXPECT_LT(first_of_1 - order.begin(), order.rend() - last_of_0 - 1);
  for (int i = 0; i < kN; ++i) {
    Result solo = Generate(c(), Chat("Name three rivers.", 11 + i, 40));
    ASSERT_TRUE(solo.status.ok()) << solo.status.error_message();
    EXPECT_EQ(ids[i], Ids(solo.response.token_ids())) << "sample " << i;
  }
  auto s = c().DenoiseStats(0);
  ASSERT_TRUE(s.ok());
  EXPECT_GE(s->max_batch_canvases(), kN);
}

// The denoise worker enforces the per-request limit itself (common/limits.h), whatever a gateway
// sends: num_samples above it, or negative, is INVALID_ARGUMENT naming the field, and nothing
// is queued.
TEST_F(NSamplesTest, DenoiseWorkerRefusesMoreSamplesThanThePerRequestLimit) {
  auto stub = v1::DenoiseService::NewStub(c().InternalChannel(c().denoise(0).grpc_port));
  for (int n : {kMaxSamplesPerRequest + 1, 1000, -1}) {
    v1::DenoiseRequest req;
    req.set_request_id(absl::StrCat("too-many-samples-", n));
    req.set_prompt_tokens(4);
    req.set_max_new_tokens(4);
    req.set_num_samples(n);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = stub->Denoise(&ctx, req);
    v1::DenoiseEvent ev;
    EXPECT_FALSE(reader->Read(&ev)) << n;
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << n << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(absl::StrCat("num_samples: must be in [0, ",
                                                  kMaxSamplesPerRequest, "], got ", n)),
              std::string::npos)
        << s.error_message();
  }
  auto stats = c().DenoiseStats(0);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->queued_requests(), 0);
}

}  // namespace
}  // namespace dgserve::testing
