#include "service/status_convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/str_cat.h"

namespace dgserve {
namespace {

using ::testing::EndsWith;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Messages quote what clients sent; what reaches a client is bounded (a 4 MB model name in a
// gRPC trailer stalled a grpc-js channel until its deadline), cut at a character boundary.
TEST(StatusConvertTest, MessagesSentToClientsAreBounded) {
  EXPECT_EQ(BoundedMessage("model 'x' not found"), "model 'x' not found");
  const std::string exact(kMaxErrorMessageBytes, 'a');
  EXPECT_EQ(BoundedMessage(exact), exact);
  // 'é' is two bytes: a cut inside it backs off to the character's start.
  std::string huge = "model '" + std::string(kMaxErrorMessageBytes - 8, 'm');
  for (int i = 0; i < 2000000; ++i) huge += "\xc3\xa9";
  const std::string cut = BoundedMessage(huge);
  EXPECT_LE(cut.size(), kMaxErrorMessageBytes + 64);
  EXPECT_THAT(cut, StartsWith(huge.substr(0, kMaxErrorMessageBytes - 1)));
  EXPECT_EQ(cut.substr(kMaxErrorMessageBytes - 1, 6), " … (");  // 'é' not cut in half
  EXPECT_THAT(cut, EndsWith(absl::StrCat("(cut: ", huge.size(), " bytes in all)")));

  const grpc::Status g = ToGrpcStatus(absl::NotFoundError(huge));
  EXPECT_EQ(g.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(g.error_message(), cut);

  const nlohmann::json body = nlohmann::json::parse(
      OpenAiErrorBody(absl::InvalidArgumentError(huge), /*param=*/huge));
  EXPECT_EQ(body["error"]["message"], cut);
  EXPECT_EQ(body["error"]["param"], cut);
  EXPECT_EQ(body["error"]["code"], "invalid_argument");
}

// The context-limit code is read from the whole message, not the bounded one.
TEST(StatusConvertTest, ContextLimitCodeSurvivesALongMessage) {
  const std::string message =
      std::string(2000, 'x') + " exceed the context limit of 4096 positions";
  const nlohmann::json body =
      nlohmann::json::parse(OpenAiErrorBody(absl::InvalidArgumentError(message)));
  EXPECT_EQ(body["error"]["code"], "context_length_exceeded");
  EXPECT_THAT(body["error"]["message"].get<std::string>(), HasSubstr("(cut: "));
}

}  // namespace
}  // namespace dgserve
