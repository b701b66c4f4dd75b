#include "common/status_convert.h"

#include <chrono>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/excerpt.h"
#include "grpcpp/server_context.h"

namespace dgserve {

std::string BoundedMessage(std::string message) {
  if (message.size() <= kMaxErrorMessageBytes) return message;
  const size_t total = message.size();
  message.resize(Utf8PrefixWithin(message, kMaxErrorMessageBytes));
  absl::StrAppend(&message, " … (cut: ", total, " bytes in all)");
  return message;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      BoundedMessage(std::string(status.message())));
}

bool EndedByDeadline(absl::Time deadline, absl::Time now) {
  return now >= deadline - kDeadlineSlack;
}

absl::Status CancelledAtDeadline(absl::Status status, absl::Time deadline, absl::Time now) {
  if (!absl::IsCancelled(status) || !EndedByDeadline(deadline, now)) return status;
  return absl::DeadlineExceededError(
      absl::StrCat("deadline exceeded (was: ", status.message(), ")"));
}

absl::StatusCode CallerEndCode(const grpc::ServerContext& context) {
  const auto d = context.deadline();
  const bool expired = d != std::chrono::system_clock::time_point::max() &&
                       EndedByDeadline(absl::FromChrono(d), absl::Now());
  return expired ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kCancelled;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kAlreadyExists: return 409;
    case absl::StatusCode::kResourceExhausted: return 429;
    case absl::StatusCode::kCancelled: return 499;
    case absl::StatusCode::kUnimplemented: return 501;
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    default: return 500;
  }
}

std::string OpenAiErrorType(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists: return "invalid_request_error";
    case absl::StatusCode::kUnauthenticated: return "authentication_error";
    case absl::StatusCode::kPermissionDenied: return "permission_error";
    case absl::StatusCode::kNotFound: return "not_found_error";
    case absl::StatusCode::kResourceExhausted: return "rate_limit_error";
    case absl::StatusCode::kDeadlineExceeded: return "timeout_error";
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnavailable: return "service_unavailable";
    default: return "server_error";
  }
}

std::string OpenAiErrorCodeForHttp(int http_status) {
  switch (http_status) {
    case 405: return "method_not_allowed";
    case 408: return "request_timeout";
    case 413: return "request_too_large";
    case 414: return "uri_too_long";
    case 415: return "unsupported_media_type";
    case 431: return "request_header_fields_too_large";
    default: return "";
  }
}

absl::Status MissingBearerTokenError(absl::string_view authorization, absl::string_view field) {
  const absl::string_view value = absl::StripAsciiWhitespace(authorization);
  const std::string expected = absl::StrCat("send '", field, ": Bearer <key>'");
  const absl::string_view scheme = value.substr(0, value.find_first_of(" \t"));
  if (value.empty() || absl::EqualsIgnoreCase(scheme, "bearer")) {
    return absl::UnauthenticatedError(absl::StrCat("missing API key: ", expected));
  }
  // A scheme is a token before the credentials (RFC 9110 §11.4); a value without a space (a bare
  // key, say) has none, and is not echoed.
  bool named = scheme.size() < value.size() && scheme.size() <= 32;
  for (char c : scheme) named &= absl::ascii_isalnum(c) || c == '-';
  return absl::UnauthenticatedError(
      named ? absl::StrCat(field, " scheme '", scheme, "' is not supported: ", expected)
            : absl::StrCat(field, " has no 'Bearer' scheme: ", expected));
}

std::string OpenAiErrorBody(const absl::Status& status, const std::string& param,
                            const std::string& code) {
  nlohmann::json err = {
      {"message", BoundedMessage(std::string(status.message()))},
      {"type", OpenAiErrorType(status.code())},
      {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(BoundedMessage(param))},
      {"code", !code.empty() ? code
               : absl::IsInvalidArgument(status) &&
                       absl::StrContains(status.message(), "exceed the context limit")
                   ? std::string("context_length_exceeded")
                   : absl::AsciiStrToLower(absl::StatusCodeToString(status.code()))},
  };
  // Messages quote what clients sent, which need not be UTF-8 (a raw byte in a request path or
  // a header value): such bytes become U+FFFD instead of an exception (the strict dump threw
  // on the event-loop thread and ended the process).
  return nlohmann::json{{"error", err}}.dump(-1, ' ', false,
                                             nlohmann::json::error_handler_t::replace);
}

}  // namespace dgserve
