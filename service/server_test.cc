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

}  // namespace
}  // namespace dgserve
