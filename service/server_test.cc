// ServiceRunner: binding its ports, the metrics endpoint.
#include "service/server.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "common/testing/loopback_socket.h"

namespace dgserve {
namespace {

// A second server on a gRPC port in use fails to start (UNAVAILABLE naming the address): with
// gRPC's default SO_REUSEPORT it started and shared the port with the first.
TEST(ServiceRunnerTest, APortInUseIsRefusedNotShared) {
  ServerOptions a;
  a.metrics_address = "";
  ServiceRunner first(a);
  ASSERT_TRUE(first.Start({}).ok());
  ASSERT_GT(first.grpc_port(), 0);

  ServerOptions b;
  b.metrics_address = "";
  b.grpc_address = absl::StrCat("127.0.0.1:", first.grpc_port());
  ServiceRunner second(b);
  const absl::Status st = second.Start({});
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find(b.grpc_address), std::string::npos) << st;
}

// `request` sent to 127.0.0.1:port; everything the server answers until it closes.
std::string Exchange(int port, const std::string& request) {
  const int fd = testing::ConnectLoopback(port, 10);
  if (fd < 0) return "";
  std::string out;
  if (testing::SendAll(fd, request)) {
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

// The line of `response`'s head that starts with `name` (e.g. "Content-Type:"), or "".
std::string HeaderLine(const std::string& response, const std::string& name) {
  const size_t at = response.find("\r\n" + name);
  if (at == std::string::npos) return "";
  return response.substr(at + 2, response.find("\r\n", at + 2) - at - 2);
}

// HEAD /metrics answers as GET does, without the content (prometheus-cpp registers GET only:
// HEAD was civetweb's 404). Other paths are still civetweb's.
TEST(ServiceRunnerTest, MetricsAnswerHead) {
  ServerOptions o;
  ServiceRunner runner(o);
  ASSERT_TRUE(runner.Start({}).ok());
  ASSERT_GT(runner.metrics_port(), 0);
  const std::string get = Exchange(runner.metrics_port(),
                                   "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  ASSERT_THAT(get, ::testing::StartsWith("HTTP/1.1 200 OK\r\n")) << get;
  const std::string content_type = HeaderLine(get, "Content-Type:");
  ASSERT_THAT(content_type, ::testing::StartsWith("Content-Type: text/plain")) << get;

  const std::string head = Exchange(
      runner.metrics_port(), "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(head, ::testing::StartsWith("HTTP/1.1 200 OK\r\n")) << head;
  EXPECT_EQ(HeaderLine(head, "Content-Type:"), content_type) << head;
  EXPECT_THAT(head, ::testing::EndsWith("\r\n\r\n")) << "content after the head: " << head;

  const std::string other = Exchange(
      runner.metrics_port(), "HEAD /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(other, ::testing::StartsWith("HTTP/1.1 404 ")) << other;
}

// An address gRPC would misread is refused before anything listens, naming the flag: gRPC took
// port 99999 as 34463 (99999 - 65536), an address without a port as port 443, and ":8000" or a
// bad host as "cannot listen (port in use?)".
TEST(ServiceRunnerTest, AMisreadListenAddressIsRefusedNamingTheFlag) {
  struct Case {
    const char* grpc;
    const char* health;
    const char* metrics;
    const char* want;
  };
  const Case cases[] = {
      {"127.0.0.1:99999", "", "",
       "--grpc_address: address '127.0.0.1:99999': expected host:port "
       "with a port in 0..65535"},
      {"127.0.0.1", "", "", "--grpc_address: address '127.0.0.1': expected host:port"},
      {"127.0.0.1:-5", "", "", "--grpc_address: address '127.0.0.1:-5': expected host:port"},
      {":0", "", "", "--grpc_address: address ':0': no host"},
      {"127.0.0.1:0", "127.0.0.1:70000", "",
       "--health_address: address '127.0.0.1:70000': expected host:port"},
      {"127.0.0.1:0", "", "127.0.0.1", "--metrics_address: address '127.0.0.1': expected"},
  };
  for (const Case& c : cases) {
    ServerOptions o;
    o.grpc_address = c.grpc;
    o.health_address = c.health;
    o.metrics_address = c.metrics;
    ServiceRunner runner(o);
    const absl::Status st = runner.Start({});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.grpc << " " << st;
    EXPECT_EQ(std::string(st.message().substr(0, std::string_view(c.want).size())), c.want) << st;
    EXPECT_EQ(runner.grpc_port(), 0) << c.grpc;
  }
}

}  // namespace
}  // namespace dgserve
