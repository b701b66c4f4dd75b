// dgserve-loadgen against a closed loopback port (the target is dead): the connection failures
// are errors, the attempts follow ConnectBackoff's schedule instead of spinning, the run ends at
// its duration or request count, and the report and exit status say the target was never
// reachable. Runs the real binary (DGSERVE_LOADGEN_BIN) and counts its attempts ("sent").
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/testing/loopback_socket.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tools/loadgen/loadgen.h"
#include "tools/loadgen/run_loadgen_testing.h"

namespace dgserve::loadgen {
namespace {

using ::dgserve::loadgen::testing::LoadgenRun;
using ::dgserve::loadgen::testing::RunLoadgen;
using ::dgserve::testing::ClosedLoopbackPort;
using ::testing::HasSubstr;

// The most attempts a closed loop of `workers` can make in `duration_s` against a dead target:
// one each at the start, then one probe per step of ConnectBackoff's schedule (50 ms doubling
// to 1 s) that fits in the duration. A bound from the schedule, not a timing: real attempts
// only take longer.
int64_t AttemptBound(int workers, double duration_s) {
  int64_t probes = 0;
  double t = 0, delay = ConnectBackoff::kInitialS;
  while (t + delay < duration_s) {
    t += delay;
    ++probes;
    delay = std::min(2 * delay, ConnectBackoff::kMaxS);
  }
  return workers + probes;
}

void ExpectBoundedRefusedRun(const std::string& flag, const std::string& error_code) {
  const int port = ClosedLoopbackPort();
  const LoadgenRun r = RunLoadgen(absl::StrCat(
      flag, "=127.0.0.1:", port, " --mode=closed --concurrency=4 --duration_s=1 --json"));
  EXPECT_EQ(r.exit_status, 3) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  const int64_t sent = j["sent"].get<int64_t>();
  EXPECT_EQ(AttemptBound(4, 1.0), 8);  // 4, then probes at 0.05, 0.15, 0.35, 0.75 s
  EXPECT_GE(sent, 1);
  EXPECT_LE(sent, AttemptBound(4, 1.0)) << r.out;  // it was thousands before the backoff
  EXPECT_EQ(j["errors"], sent);
  EXPECT_EQ(j["connect_errors"], sent);
  EXPECT_EQ(j["errors_by_code"][error_code], sent) << r.out;
  EXPECT_EQ(j["completed"], 0);
  EXPECT_EQ(j["reachable"], false);
}

TEST(LoadgenUnreachableTest, HttpAttemptsAreBoundedByTheBackoff) {
  ExpectBoundedRefusedRun("--http", "http:connect");
}

TEST(LoadgenUnreachableTest, GrpcAttemptsAreBoundedByTheBackoff) {
  ExpectBoundedRefusedRun("--target", "UNAVAILABLE");
}

// A run bounded by its request count still ends there (each request one attempt), and the text
// report says the target was never reachable.
TEST(LoadgenUnreachableTest, EndsAtTheRequestCountAndSaysSo) {
  const int port = ClosedLoopbackPort();
  const LoadgenRun r = RunLoadgen(absl::StrCat("--http=127.0.0.1:", port, " --requests=3"));
  EXPECT_EQ(r.exit_status, 3) << r.out;
  EXPECT_THAT(r.out, HasSubstr("requests     sent 3  completed 0  errors 3"));
  EXPECT_THAT(r.out, HasSubstr(absl::StrCat(
                         "UNREACHABLE  the target was never reachable: all 3 attempts failed to "
                         "connect (is the gateway running at 127.0.0.1:",
                         port, "?)")));
  EXPECT_THAT(r.out, HasSubstr("http:connect=3"));
}

// An open loop at a high rate sends only the backoff's probes; the other arrivals are held back
// (counted), and the run lasts its duration. The attempts admitted before the first failure came
// back were all in flight together, so --max_inflight bounds them.
TEST(LoadgenUnreachableTest, OpenLoopHoldsBackArrivals) {
  const int port = ClosedLoopbackPort();
  const LoadgenRun r = RunLoadgen(absl::StrCat("--http=127.0.0.1:", port,
                                               " --mode=open --rate=2000 --max_inflight=16 "
                                               "--duration_s=1 --json"));
  EXPECT_EQ(r.exit_status, 3) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  const int64_t sent = j["sent"].get<int64_t>(), held = j["held_back"].get<int64_t>();
  EXPECT_LE(sent, AttemptBound(16, 1.0)) << r.out;
  EXPECT_GT(held, 0);
  EXPECT_EQ(j["connect_errors"], sent);
  EXPECT_EQ(j["reachable"], false);
}

}  // namespace
}  // namespace dgserve::loadgen
