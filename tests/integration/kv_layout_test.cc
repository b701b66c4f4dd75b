// KV layout agreement on the real three-process cluster: a denoise worker started with
// --kv_block_size 7 behind a prefill worker at the default 16 made the gateway answer /ready 200
// while every request failed with 503 "KV descriptor mismatch: block_size is 16, expected 7".
// Now the workers report their KV layout in Stats (kv_layout) and the gateway is not ready, with
// the reason naming both workers and both values; a request is refused with that reason before
// any transfer. Matching layouts (both at 7) are ready and serve.
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/http_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/test_cluster.h"
#include "tests/integration/test_helpers.h"

namespace dgserve::testing {
namespace {

using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(KvLayoutTest, MismatchedBlockSizesAreNotReadyAndSayWhy) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  o.denoise_flags = {"--kv_block_size=7"};  // the prefill worker keeps the default 16
  o.wait_until_ready = false;
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string prefill = absl::StrCat("127.0.0.1:", (*c)->prefill().grpc_port);
  const std::string denoise = absl::StrCat("127.0.0.1:", (*c)->denoise(0).grpc_port);
  const std::string reason =
      absl::StrCat("KV layout mismatch: prefill worker ", prefill,
                   " has block_size 16, denoise worker ", denoise, " has block_size 7");

  // Both workers report their layout.
  absl::StatusOr<v1::StatsResponse> ps = (*c)->PrefillStats();
  absl::StatusOr<v1::StatsResponse> ds = (*c)->DenoiseStats(0);
  ASSERT_TRUE(ps.ok()) << ps.status();
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ps->kv_layout().block_size(), 16);
  EXPECT_EQ(ds->kv_layout().block_size(), 7);
  EXPECT_EQ(ps->kv_layout().layers_size(), ds->kv_layout().layers_size());
  EXPECT_GT(ps->kv_layout().layers_size(), 0);

  // /ready: 503 with the reason once the gateway has polled both workers (bounded wait); never
  // 200 on the way.
  HttpClient http("127.0.0.1", (*c)->gateway().http_port);
  http.set_timeout(absl::Seconds(5));
  HttpResponse ready;
  bool was_ready = false;
  EXPECT_TRUE(Eventually([&] {
    ready = http.Get("/ready");
    if (ready && ready.status == 200) was_ready = true;
    return ready && ready.status == 503 && ready.body.find("reason") != std::string::npos;
  })) << ready.status
      << " " << ready.body;
  EXPECT_FALSE(was_ready);
  ASSERT_TRUE(ready);
  const nlohmann::json body = nlohmann::json::parse(ready.body);
  EXPECT_EQ(body["status"], "not_ready");
  EXPECT_EQ(body["reason"], reason);

  // A request is refused with the same reason (gRPC FAILED_PRECONDITION → HTTP 503), not tried.
  Result r = Generate(**c, Chat("mismatched", 1, 8));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(r.status.error_message(), reason);
  auto http_r = http.Post("/v1/completions", R"({"prompt": "hi", "max_tokens": 4, "seed": 1})");
  ASSERT_TRUE(http_r);
  EXPECT_EQ(http_r.status, 503) << http_r.body;
  EXPECT_THAT(http_r.body, HasSubstr(reason));
  EXPECT_THAT(ReadFile((*c)->denoise(0).log), ::testing::Not(HasSubstr("KV descriptor mismatch")));

  // The gateway logged it.
  EXPECT_THAT(ReadFile((*c)->gateway().log), HasSubstr(absl::StrCat("not ready: ", reason)));
}

TEST(KvLayoutTest, MatchingBlockSizesAreReadyAndServe) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  o.prefill_flags = {"--kv_block_size=7"};
  o.denoise_flags = {"--kv_block_size=7"};
  auto c = TestCluster::Start(o);  // waits (bounded) for /ready 200
  ASSERT_TRUE(c.ok()) << c.status();
  Result r = Generate(**c, Chat("matched", 1, 8));
  EXPECT_TRUE(r.status.ok()) << r.status.error_message();
}

}  // namespace
}  // namespace dgserve::testing
