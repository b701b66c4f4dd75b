// A full denoise KV pool on the real three-process cluster (issue kvq51): with the denoise
// worker at --kv_cache_mib=1, the reproduction's request (a prompt of 120 "1"s, max_tokens 91)
// fits its pool alone but not two at once (42 full blocks with this test model). Alone it is
// served; three at once got 429 twice ("no free full block", the cause nested three times;
// with --kv_push_wait_ms=0 two still get 429, the cause said once) because the prefill worker's
// push failed the request when the pool was full now. The push now waits for room
// (--kv_push_wait_ms), so all three are served with the tokens of the one alone (same seed), and
// the prefill worker counts the prompts that waited.
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/http_client.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/test_cluster.h"

namespace dgserve::testing {
namespace {

std::string Body() {
  std::string prompt;
  for (int i = 0; i < 120; ++i) absl::StrAppend(&prompt, i > 0 ? " " : "", "1");
  nlohmann::json j = {{"prompt", prompt}, {"max_tokens", 91}, {"seed", 7}};
  return j.dump();
}

struct Outcome {
  int status = 0;
  std::string body;
};

Outcome Complete(int port) {
  HttpClient http("127.0.0.1", port);
  auto r = http.Post("/v1/completions", Body());
  Outcome o;
  if (r) {
    o.status = r.status;
    o.body = r.body;
  }
  return o;
}

std::string Text(const Outcome& o) {
  const nlohmann::json j = nlohmann::json::parse(o.body, nullptr, false);
  if (j.is_discarded() || !j.contains("choices")) return "";
  return j["choices"][0]["text"].get<std::string>();
}

TEST(KvPoolFullTest, ConcurrentRequestsWaitForTheDenoiseWorkersKvRoom) {
  absl::StatusOr<std::string> model = TestModelDir();
  ASSERT_TRUE(model.ok()) << model.status();
  ClusterOptions o;
  o.model_dir = *model;
  o.denoise_flags = {"--kv_cache_mib=1"};
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const int port = (*c)->gateway().http_port;

  const Outcome alone = Complete(port);
  ASSERT_EQ(alone.status, 200) << alone.body;
  const std::string text = Text(alone);
  ASSERT_FALSE(text.empty()) << alone.body;

  std::vector<Outcome> outcomes(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] { outcomes[i] = Complete(port); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(outcomes[i].status, 200) << i << ": " << outcomes[i].body;
    EXPECT_EQ(Text(outcomes[i]), text) << i;
  }
  // The three collided: the later pushes found the pool full and waited.
  auto metrics = TestCluster::ScrapeMetrics((*c)->prefill());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  const double waits = TestCluster::MetricValue(*metrics, "dgserve_prefill_kv_push_waits_total");
  EXPECT_GE(waits, 1) << *metrics;
}

}  // namespace
}  // namespace dgserve::testing
