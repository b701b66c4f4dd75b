#include "common/status_convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/excerpt.h"

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

// Error messages quote client bytes that need not be UTF-8 (a raw 0xFF in a request path, a
// header value): the body is still JSON, with U+FFFD for such bytes (it threw, and the gateway
// died on its event-loop thread).
TEST(StatusConvertTest, ErrorBodyWithBytesThatAreNotUtf8IsStillJson) {
  const std::string body = OpenAiErrorBody(
      absl::NotFoundError("unknown path: /v1/models/\xff\xc3"), /*param=*/"a\xe2\x82");
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << body;
  EXPECT_EQ(j["error"]["message"], "unknown path: /v1/models/\xef\xbf\xbd\xef\xbf\xbd");
  EXPECT_EQ(j["error"]["param"], "a\xef\xbf\xbd");
  EXPECT_EQ(j["error"]["code"], "not_found");
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

// A cancellation at the deadline (or within kDeadlineSlack before it: the caller's copy of the
// deadline reaches a server a transit time apart) is recorded as the deadline; one before it
// stays a cancellation, and no other status changes.
TEST(StatusConvertTest, CancelledAtTheDeadlineIsRecordedAsTheDeadline) {
  const absl::Time deadline = absl::FromUnixSeconds(1000);
  const absl::Status cancelled = absl::CancelledError("request cancelled by the client");
  for (absl::Duration at : {absl::ZeroDuration(), absl::Seconds(3), -kDeadlineSlack / 2,
                            -kDeadlineSlack}) {
    SCOPED_TRACE(absl::FormatDuration(at));
    EXPECT_TRUE(EndedByDeadline(deadline, deadline + at));
    const absl::Status s = CancelledAtDeadline(cancelled, deadline, deadline + at);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(std::string(s.message()), HasSubstr("request cancelled by the client"));
  }
  for (absl::Duration at : {-kDeadlineSlack - absl::Milliseconds(1), -absl::Seconds(5)}) {
    SCOPED_TRACE(absl::FormatDuration(at));
    EXPECT_FALSE(EndedByDeadline(deadline, deadline + at));
    EXPECT_EQ(CancelledAtDeadline(cancelled, deadline, deadline + at), cancelled);
  }
  const absl::Time late = deadline + absl::Seconds(1);
  for (const absl::Status& s : {absl::OkStatus(), absl::UnavailableError("x"),
                                absl::DeadlineExceededError("y"), absl::InternalError("z")}) {
    EXPECT_EQ(CancelledAtDeadline(s, deadline, late), s);
  }
}

// QuotedExcerpt (common/excerpt.h, built by appends since GCC 12 warned -Wrestrict in its
// operator+ form): quoted whole up to the limit, else cut at a character boundary with the size.
// A refused Authorization value without a Bearer token says why, never quoting a credential.
TEST(StatusConvertTest, MissingBearerTokenNamesTheScheme) {
  auto message = [](absl::string_view value) {
    absl::Status s = MissingBearerTokenError(value, "Authorization");
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated);
    return std::string(s.message());
  };
  EXPECT_EQ(message(""), "missing API key: send 'Authorization: Bearer <key>'");
  EXPECT_EQ(message(" bearer "), "missing API key: send 'Authorization: Bearer <key>'");
  EXPECT_EQ(message("Basic dXNlcjpwYXNz"),
            "Authorization scheme 'Basic' is not supported: send 'Authorization: Bearer <key>'");
  EXPECT_EQ(message("sk-secret"),
            "Authorization has no 'Bearer' scheme: send 'Authorization: Bearer <key>'");
  EXPECT_EQ(message("sk=secret more"),
            "Authorization has no 'Bearer' scheme: send 'Authorization: Bearer <key>'");
}

TEST(QuotedExcerptTest, QuotesWholeOrCutsAtACharacterWithTheSize) {
  EXPECT_EQ(QuotedExcerpt(""), "\"\"");
  EXPECT_EQ(QuotedExcerpt("tool"), "\"tool\"");
  EXPECT_EQ(QuotedExcerpt(std::string(64, 'x')), "\"" + std::string(64, 'x') + "\"");
  EXPECT_EQ(QuotedExcerpt(std::string(70, 'x')), "\"" + std::string(64, 'x') + "…\" (70 bytes)");
  // 'é' (2 bytes) across the limit: the cut backs off to its start.
  const std::string s = std::string(63, 'a') + "é" + "zz";
  EXPECT_EQ(QuotedExcerpt(s), "\"" + std::string(63, 'a') + "…\" (67 bytes)");
  EXPECT_EQ(QuotedExcerpt("abcdef", 3), "\"abc…\" (6 bytes)");
}

}  // namespace
}  // namespace dgserve
