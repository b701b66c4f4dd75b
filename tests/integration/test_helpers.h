// Small helpers shared by the integration tests: a chat request, a unary Generate with its
// status, and a bounded poll.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/test_cluster.h"

namespace dgserve::testing {

// One user turn `text`, with a seed, max_tokens and n (0 = one sample).
inline v1::GenerateRequest Chat(const std::string& text, uint64_t seed, int max_tokens,
                                int n = 0) {
  v1::GenerateRequest r;
  v1::ChatMessage* m = r.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content(text);
  r.set_seed(seed);
  r.set_max_tokens(max_tokens);
  r.set_n(n);
  return r;
}

struct Result {
  grpc::Status status;
  v1::GenerateResponse response;
};

// The gateway's unary Generate with a 120 s deadline.
inline Result Generate(const TestCluster& c, const v1::GenerateRequest& req) {
  Result r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  r.status = c.GatewayStub()->Generate(&ctx, req, &r.response);
  return r;
}

// Polls `pred` every 50 ms for at most `seconds`; returns its last value.
template <typename Pred>
bool Eventually(Pred pred, int seconds = 20) {
  for (int i = 0; i < seconds * 20; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

// Whether every thread of process `pid` is stopped (state T or t in /proc/<pid>/task/*/stat; a
// thread that exited, Z or X, counts as stopped); false when none can be read (no such process)
// or the directory cannot be listed.
inline bool AllThreadsStopped(pid_t pid) {
  std::error_code ec;
  int threads = 0;
  for (std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/task", ec), end;
       !ec && it != end; it.increment(ec)) {
    std::ifstream in(it->path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');  // the state follows the command name: "pid (comm) S"
    if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
    const char state = stat[paren + 2];
    if (state != 'T' && state != 't' && state != 'Z' && state != 'X') return false;
    ++threads;
  }
  return !ec && threads > 0;
}

// Sends SIGSTOP to `pid` and waits (bounded: 10 s) until every thread of it has stopped. kill()
// returns before the stop takes effect: the process stops when the thread the signal woke next
// runs, and until then its other threads go on (on a loaded machine, long enough for a worker to
// serve a whole KV push). False if kill() failed or the process did not stop in time.
inline bool StopProcess(pid_t pid) {
  if (kill(pid, SIGSTOP) != 0) return false;
  return Eventually([pid] { return AllThreadsStopped(pid); }, 10);
}

// A fixture whose test suite shares one cluster, started once from Derived::Options()
// (a static function returning absl::StatusOr<ClusterOptions>) and stopped after the suite.
template <typename Derived>
class SharedClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<ClusterOptions> options = Derived::Options();
    ASSERT_TRUE(options.ok()) << options.status();
    auto c = TestCluster::Start(*options);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = c->release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static const TestCluster& c() { return *cluster_; }
  static inline TestCluster* cluster_ = nullptr;
};

}  // namespace dgserve::testing
