// ServiceRunner: binding its ports.
#include "service/server.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

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
