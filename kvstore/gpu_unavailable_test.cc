// The GPU KV transports in a build without CUDA/NCCL answer UNAVAILABLE and report TCP only.
#include <gtest/gtest.h>

#include "common/testing/status_matchers.h"
#include "kvstore/gpu_transport.h"
#include "kvstore/transfer_service.h"

namespace dgserve::kv {
namespace {

using ::dgserve::testing::StatusIs;
using ::testing::HasSubstr;

TEST(GpuTransportUnavailableTest, CreateAnswersUnavailable) {
  GpuTransportOptions options;
  EXPECT_THAT(CreateNcclTransport(options),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("built without CUDA/NCCL")));
  EXPECT_THAT(CreateCudaIpcTransport(options),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("built without CUDA/NCCL")));
  EXPECT_THAT(CreateGpuReceiveEndpoint(options),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("built without CUDA/NCCL")));
  const KvPeerInfo info = LocalKvPeerInfo(0);
  EXPECT_EQ(info.gpu_uuid, "");
  EXPECT_EQ(info.transports, std::vector<std::string>{"tcp"});
  EXPECT_FALSE(info.node.empty());
}

}  // namespace
}  // namespace dgserve::kv
