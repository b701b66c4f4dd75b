// The choice of KV transport on the real three-process cluster (issue 14, item 4): the denoise
// worker reports its node and KV transports in Stats, the prefill worker at --kv_transport=auto
// asks it (DenoiseService.Stats over the internal, token-authenticated channel) and moves the KV
// over tcp on this machine (no GPU), its transfer metrics (and failures) labelled
// transport="tcp"; a GPU transport this build or machine cannot use refuses the prefill
// worker's start.
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_cluster.h"
#include "tests/integration/test_helpers.h"

namespace dgserve::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kNode[] = "kv-transport-test-node";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every child process of the cluster inherits NODE_NAME, as the pods get it from the downward
// API.
class KvTransportClusterTest : public SharedClusterTest<KvTransportClusterTest> {
 public:
  static absl::StatusOr<ClusterOptions> Options() {
    setenv("NODE_NAME", kNode, 1);
    absl::StatusOr<std::string> dir = TestModelDir();
    if (!dir.ok()) return dir.status();
    ClusterOptions o;
    o.model_dir = *dir;
    o.prefill_flags = {"--kv_transport=auto"};
    return o;
  }
};

TEST_F(KvTransportClusterTest, DenoiseStatsReportsTheNodeAndTcpOnly) {
  absl::StatusOr<v1::StatsResponse> s = c().DenoiseStats(0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->node(), kNode);
  EXPECT_EQ(s->gpu_uuid(), "");  // --device cpu
  EXPECT_THAT(s->kv_transports(), ElementsAre("tcp"));
}

TEST_F(KvTransportClusterTest, AutoMovesKvOverTcpAndLabelsTheMetrics) {
  Result r = Generate(c(), Chat("Which transport carried this?", 5, 16));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  const std::string bytes = "dgserve_prefill_kv_transfer_bytes_total{transport=\"tcp\"}";
  const std::string count = "dgserve_prefill_kv_transfer_duration_seconds_count{transport=\"tcp\"}";
  std::string metrics;
  EXPECT_TRUE(Eventually([&] {
    metrics = *TestCluster::ScrapeMetrics(c().prefill());
    return TestCluster::MetricValue(metrics, bytes) > 0 &&
           TestCluster::MetricValue(metrics, count) >= 1;
  })) << metrics;
  // No series under the mode's name: the label is the transport that moved the bytes.
  EXPECT_THAT(metrics, Not(HasSubstr("transport=\"auto\"")));
  EXPECT_EQ(TestCluster::MetricValue(
                metrics, "dgserve_prefill_kv_transfer_failures_total{transport=\"tcp\"}"),
            0);
  // The start line names the mode and what this process can use; the prefill worker asked the
  // denoise worker (over the authenticated internal channel) what it reports.
  const std::string log = ReadFile(c().prefill().log);
  EXPECT_THAT(log, HasSubstr("--kv_transport auto; this process: node kv-transport-test-node, "
                             "no GPU, transports tcp; usable here: tcp"));
  EXPECT_THAT(log, HasSubstr(absl::StrCat("KV target 127.0.0.1:", c().denoise(0).grpc_port,
                                          " reports node kv-transport-test-node, no GPU, "
                                          "transports tcp")));
  EXPECT_THAT(log, Not(HasSubstr("sending over tcp")));  // the lookup did not fail
}

// A failed transfer counts under the transport that failed it (tcp, where the fault-injection
// hook cuts it), not under the mode's name.
TEST(KvTransportFailureTest, ACutTransferCountsAsATcpFailure) {
  ClusterOptions o;
  o.model_dir = *TestModelDir();
  o.prefill_flags = {"--kv_transport=auto", "--testing_cut_transfer_after_bytes=1000"};
  o.gateway_flags = {"--max_attempts=1"};
  auto c = TestCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  Result r = Generate(**c, Chat("cut me", 1, 16));
  ASSERT_FALSE(r.status.ok());
  const std::string failures = "dgserve_prefill_kv_transfer_failures_total{transport=\"tcp\"}";
  std::string metrics;
  EXPECT_TRUE(Eventually([&] {
    metrics = *TestCluster::ScrapeMetrics((*c)->prefill());
    return TestCluster::MetricValue(metrics, failures) >= 1;
  })) << metrics;
  EXPECT_THAT(metrics, Not(HasSubstr("transport=\"auto\"")));
}

// Runs the prefill worker with `flags` (no denoise worker behind it is needed: the flag is
// checked before anything else starts); its exit status and output.
std::pair<int, std::string> RunPrefill(const std::string& flags) {
  // `timeout`: a worker that wrongly starts serving is ended (status 124), not waited for.
  const std::string cmd = absl::StrCat(
      "timeout 60 ", BinaryPath("prefill_worker/dgserve-prefill-worker"), " --model ",
      *TestModelDir(),
      " --denoise_workers 127.0.0.1:1 --internal_insecure ", flags,
      " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(KvTransportFlagTest, GpuTransportsThisMachineCannotUseRefuseTheStart) {
  for (const char* mode : {"nccl", "cuda_ipc"}) {
    auto [status, out] = RunPrefill(absl::StrCat("--kv_transport=", mode));
    EXPECT_EQ(status, 1) << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("FAILED_PRECONDITION: --kv_transport ", mode,
                                            ": this process cannot use it with --device cpu")))
        << out;
    EXPECT_THAT(out, Not(HasSubstr("serving")));
  }
}

TEST(KvTransportFlagTest, AnUnknownTransportRefusesTheStart) {
  auto [status, out] = RunPrefill("--kv_transport=rdma");
  EXPECT_EQ(status, 1) << out;
  EXPECT_THAT(out, HasSubstr("INVALID_ARGUMENT: --kv_transport: KV transport 'rdma': must be "
                             "auto, tcp, cuda_ipc or nccl"))
      << out;
}

}  // namespace
}  // namespace dgserve::testing
