// dgserve-loadgen against loopback servers that refuse every request for load, as a full gateway
// does (HTTP 429 or 503 with Retry-After, gRPC RESOURCE_EXHAUSTED without a hint): a closed
// loop's workers wait before their next request (the Retry-After, else OverloadBackoff's
// schedule), so the server sees a handful of requests where it saw thousands with the wait off
// (--max_backoff_s=0); the refusals stay errors by their code; an open loop does not wait. Runs
// the real binary (DGSERVE_LOADGEN_BIN) and counts the requests the server saw.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/testing/loopback_socket.h"
#include "dgserve/v1/generation.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tools/loadgen/loadgen.h"
#include "tools/loadgen/run_loadgen_testing.h"

namespace dgserve::loadgen {
namespace {

using ::dgserve::loadgen::testing::LoadgenRun;
using ::dgserve::loadgen::testing::RunLoadgen;

// An HTTP/1.1 server on 127.0.0.1 that answers every request with `status_line` (and
// `Retry-After: retry_after` unless empty) and an OpenAI error body, one connection per
// request, on one thread; counts the requests it answered.
class RefusingHttpServer {
 public:
  RefusingHttpServer(std::string status_line, std::string retry_after)
      : status_line_(std::move(status_line)), retry_after_(std::move(retry_after)) {
    fd_ = dgserve::testing::ListenLoopback(&port_);
    if (fd_ >= 0) thread_ = std::thread([this] { Serve(); });
  }
  ~RefusingHttpServer() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) close(fd_);
  }
  int port() const { return fd_ >= 0 ? port_ : -1; }
  int64_t requests() const { return requests_.load(); }

 private:
  void Serve() {
    const std::string body =
        R"({"error":{"message":"the gateway is at its limit of 1 concurrent requests and 0 )"
        R"(queued; retry later","type":"server_error","code":"rate_limit_exceeded"}})";
    std::string head = absl::StrCat("HTTP/1.1 ", status_line_, "\r\n");
    if (!retry_after_.empty()) absl::StrAppend(&head, "Retry-After: ", retry_after_, "\r\n");
    const std::string response =
        absl::StrCat(head, "Content-Type: application/json\r\nContent-Length: ", body.size(),
                     "\r\nConnection: close\r\n\r\n", body);
    while (!stop_.load()) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const int c = accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      timeval tv{2, 0};
      setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      if (ReadRequest(c)) {
        requests_.fetch_add(1);
        dgserve::testing::SendAll(c, response);
      }
      shutdown(c, SHUT_WR);
      close(c);
    }
  }

  // Reads one request's head and its Content-Length body; false when the client went away.
  static bool ReadRequest(int c) {
    std::string in;
    char buf[4096];
    size_t need = std::string::npos;
    for (int reads = 0; reads < 1000; ++reads) {
      if (need == std::string::npos) {
        if (const size_t end = in.find("\r\n\r\n"); end != std::string::npos) {
          size_t length = 0;
          std::string lower = in.substr(0, end);
          std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
          if (const size_t at = lower.find("content-length:"); at != std::string::npos) {
            length = std::stoul(lower.substr(at + 15));
          }
          need = end + 4 + length;
        }
      }
      if (need != std::string::npos && in.size() >= need) return true;
      const ssize_t n = read(c, buf, sizeof(buf));
      if (n <= 0) return false;
      in.append(buf, static_cast<size_t>(n));
    }
    return false;
  }

  const std::string status_line_, retry_after_;
  int fd_ = -1, port_ = 0;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> requests_{0};
};

// GenerationService on 127.0.0.1 whose GenerateStream refuses every call as the gateway does
// when its admission queue is full: RESOURCE_EXHAUSTED, no retry hint.
class RefusingGrpcServer final : public v1::GenerationService::Service {
 public:
  RefusingGrpcServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~RefusingGrpcServer() override {
    if (server_) server_->Shutdown();
  }
  int port() const { return server_ ? port_ : -1; }
  int64_t requests() const { return requests_.load(); }

  grpc::Status GenerateStream(grpc::ServerContext*, const v1::GenerateRequest*,
                              grpc::ServerWriter<v1::GenerateEvent>*) override {
    requests_.fetch_add(1);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "the gateway is at its limit of 1 concurrent requests and 0 queued; "
                        "retry later");
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<int64_t> requests_{0};
};

nlohmann::json ParseReport(const LoadgenRun& r) {
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_TRUE(j.is_object()) << r.out;
  return j.is_object() ? j : nlohmann::json::object();
}

// The most requests a closed loop of `workers` can send in `duration_s` when every answer is a
// refusal with Retry-After `retry_after_s`: one at the start and one after each full wait that
// fits, plus one for the request in flight when the duration ends. A bound from the waits, not
// a timing: real requests only take longer.
int64_t RetryAfterBound(int workers, double duration_s, double retry_after_s) {
  return workers * (static_cast<int64_t>(duration_s / retry_after_s) + 2);
}

// The same without a hint: each worker's n-th wait in a row is at least OverloadBackoff's
// d/2 (d = 50 ms doubling to --max_backoff_s).
int64_t BackoffBound(int workers, double duration_s, double max_s) {
  int64_t per_worker = 2;
  double t = 0, d = OverloadBackoff::kInitialS;
  while (t + std::min(d, max_s) / 2 < duration_s) {
    t += std::min(d, max_s) / 2;
    ++per_worker;
    d *= 2;
  }
  return workers * per_worker;
}

// Checks a backed-off closed-loop run: the server saw at most `bound` requests, each an error by
// its code, and the report counts the waits.
void ExpectBackedOff(const LoadgenRun& r, int64_t server_saw, int64_t bound,
                     const std::string& code) {
  EXPECT_EQ(r.exit_status, 0) << r.out;
  const nlohmann::json j = ParseReport(r);
  EXPECT_GE(server_saw, 1);
  EXPECT_LE(server_saw, bound) << r.out;
  EXPECT_EQ(j.value("sent", int64_t{-1}), server_saw) << r.out;
  EXPECT_EQ(j.value("errors", int64_t{-1}), server_saw);  // refusals stay errors, not successes
  EXPECT_EQ(j.value("completed", int64_t{-1}), 0);
  EXPECT_EQ(j["errors_by_code"].value(code, int64_t{-1}), server_saw) << r.out;
  EXPECT_GE(j.value("backed_off", int64_t{-1}), 1) << r.out;
  EXPECT_GT(j.value("backoff_wait_s", 0.0), 0) << r.out;
}

// The gateway's full admission queue over HTTP: 429 with Retry-After: 1. With the wait, 8
// workers over 2 s send at most 8 * (2 / 1 + 2); without it (--max_backoff_s=0) they send as
// fast as the server refuses (thousands; the bound is 32).
TEST(LoadgenOverloadTest, HttpClosedLoopWaitsTheRetryAfter) {
  RefusingHttpServer server("429 Too Many Requests", "1");
  ASSERT_GT(server.port(), 0);
  const std::string target =
      absl::StrCat("--http=127.0.0.1:", server.port(), " --mode=closed --concurrency=8 --json");
  const int64_t bound = RetryAfterBound(8, 2.0, 1.0);
  ASSERT_EQ(bound, 32);

  const LoadgenRun waited = RunLoadgen(absl::StrCat(target, " --duration_s=2"));
  const int64_t waited_saw = server.requests();
  ExpectBackedOff(waited, waited_saw, bound, "HTTP 429");
  const nlohmann::json j = ParseReport(waited);
  EXPECT_EQ(j["max_backoff_s"], 1.0);

  const LoadgenRun spun = RunLoadgen(absl::StrCat(target, " --duration_s=2 --max_backoff_s=0"));
  const int64_t spun_saw = server.requests() - waited_saw;
  EXPECT_EQ(spun.exit_status, 0) << spun.out;
  EXPECT_GT(spun_saw, bound) << spun.out;
  EXPECT_EQ(ParseReport(spun).value("backed_off", int64_t{-1}), 0) << spun.out;
}

// The gateway's full budget of request bodies: 503 with Retry-After: 1, waited like a 429.
TEST(LoadgenOverloadTest, HttpA503WithRetryAfterIsWaitedToo) {
  RefusingHttpServer server("503 Service Unavailable", "1");
  ASSERT_GT(server.port(), 0);
  const LoadgenRun r = RunLoadgen(
      absl::StrCat("--http=127.0.0.1:", server.port(), " --concurrency=4 --duration_s=1 --json"));
  ExpectBackedOff(r, server.requests(), RetryAfterBound(4, 1.0, 1.0), "HTTP 503");
}

// A Retry-After beyond --max_backoff_s is capped (120 s would leave the run idle): the workers
// still send after each capped wait, within the bound of that wait.
TEST(LoadgenOverloadTest, HttpRetryAfterIsCappedByMaxBackoff) {
  RefusingHttpServer server("429 Too Many Requests", "120");
  ASSERT_GT(server.port(), 0);
  const LoadgenRun r =
      RunLoadgen(absl::StrCat("--http=127.0.0.1:", server.port(),
                              " --concurrency=2 --duration_s=1 --max_backoff_s=0.25 --json"));
  ExpectBackedOff(r, server.requests(), RetryAfterBound(2, 1.0, 0.25), "HTTP 429");
  EXPECT_EQ(ParseReport(r)["max_backoff_s"], 0.25);
}

// The gateway's full queue over gRPC: RESOURCE_EXHAUSTED without a hint, so the exponential
// backoff (50 ms doubling to 1 s, jittered within [d/2, d]).
TEST(LoadgenOverloadTest, GrpcResourceExhaustedBacksOffExponentially) {
  RefusingGrpcServer server;
  ASSERT_GT(server.port(), 0);
  const std::string target = absl::StrCat("--target=127.0.0.1:", server.port(),
                                          " --mode=closed --concurrency=4 --duration_s=2 --json");
  const int64_t bound = BackoffBound(4, 2.0, 1.0);
  ASSERT_EQ(bound, 4 * 9);  // waits of at least 25, 50, 100, 200, 400, then 500 ms

  const LoadgenRun waited = RunLoadgen(target);
  const int64_t waited_saw = server.requests();
  ExpectBackedOff(waited, waited_saw, bound, "RESOURCE_EXHAUSTED");

  const LoadgenRun spun = RunLoadgen(absl::StrCat(target, " --max_backoff_s=0"));
  EXPECT_EQ(spun.exit_status, 0) << spun.out;
  EXPECT_GT(server.requests() - waited_saw, bound) << spun.out;
}

// A run bounded by its request count sends all of them, the waits between included: a worker
// that finds every index taken must not cut off another's wait (it stopped issuing, and a run
// of 7 sent 5).
TEST(LoadgenOverloadTest, ARequestCountIsSentInFullDespiteTheWaits) {
  RefusingHttpServer server("429 Too Many Requests", "1");
  ASSERT_GT(server.port(), 0);
  const LoadgenRun r =
      RunLoadgen(absl::StrCat("--http=127.0.0.1:", server.port(),
                              " --concurrency=3 --requests=7 --max_backoff_s=0.1 --json"));
  EXPECT_EQ(r.exit_status, 0) << r.out;
  const nlohmann::json j = ParseReport(r);
  EXPECT_EQ(server.requests(), 7);
  EXPECT_EQ(j.value("sent", int64_t{-1}), 7) << r.out;
  EXPECT_EQ(j["errors_by_code"].value("HTTP 429", int64_t{-1}), 7) << r.out;
  EXPECT_EQ(j.value("unfinished", int64_t{-1}), 0) << r.out;
  EXPECT_GE(j.value("backed_off", int64_t{-1}), 4) << r.out;  // requests 3..6 each came after one
}

// An open loop's arrivals are its schedule: each is sent whatever the server answered before
// (Poisson at 100/s over 1 s with the default seed), and nothing is backed off.
TEST(LoadgenOverloadTest, OpenLoopDoesNotWait) {
  RefusingHttpServer server("429 Too Many Requests", "1");
  ASSERT_GT(server.port(), 0);
  PoissonSchedule schedule(100, /*seed=*/1);
  int64_t arrivals = 0;
  while (schedule.NextArrival() < 1.0) ++arrivals;
  const LoadgenRun r = RunLoadgen(absl::StrCat("--http=127.0.0.1:", server.port(),
                                               " --mode=open --rate=100 --duration_s=1 --json"));
  EXPECT_EQ(r.exit_status, 0) << r.out;
  const nlohmann::json j = ParseReport(r);
  EXPECT_EQ(j.value("sent", int64_t{-1}) + j.value("dropped", int64_t{-1}), arrivals) << r.out;
  EXPECT_EQ(server.requests(), j.value("sent", int64_t{-1}));
  EXPECT_GT(arrivals, RetryAfterBound(1, 1.0, 1.0) * 10);
  EXPECT_EQ(j.value("backed_off", int64_t{-1}), 0) << r.out;
  EXPECT_TRUE(j.contains("max_backoff_s") && j["max_backoff_s"].is_null()) << r.out;
}

}  // namespace
}  // namespace dgserve::loadgen
