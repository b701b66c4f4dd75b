// The one place where absl::Status meets the edges (design §2): gRPC status codes and HTTP
// status codes with the OpenAI error body's `type`.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace dgserve {

// The most bytes of an error message (or param) sent to a client: messages quote what the
// client sent (a model name, a role, a template piece, a JSON key), and a 4 MB echo in a gRPC
// trailer stalled a grpc-js channel until its deadline.
inline constexpr size_t kMaxErrorMessageBytes = 1024;
// `message` when it has at most kMaxErrorMessageBytes bytes; else its start, cut at a UTF-8
// character boundary, and " … (cut: N bytes in all)".
std::string BoundedMessage(std::string message);

// Same code; the message bounded (BoundedMessage).
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// HTTP status for a status code: INVALID_ARGUMENT/OUT_OF_RANGE/FAILED_PRECONDITION(no) → 400,
// UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404, RESOURCE_EXHAUSTED 429,
// CANCELLED 499, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, FAILED_PRECONDITION 503 (model not
// loaded), UNIMPLEMENTED 501, anything else 500.
int HttpStatusFor(absl::StatusCode code);
// The OpenAI error `type` for a code: "invalid_request_error", "authentication_error",
// "permission_error", "not_found_error", "rate_limit_error", "server_error", "timeout_error",
// "service_unavailable".
std::string OpenAiErrorType(absl::StatusCode code);
// {"error": {"message", "type", "param" (or null), "code"}}: `code` is `code` when given, else
// OpenAI's "context_length_exceeded" for an INVALID_ARGUMENT whose message says the context
// limit is exceeded, else the gRPC code name in lower case.
std::string OpenAiErrorBody(const absl::Status& status, const std::string& param = "",
                            const std::string& code = "");
// The error `code` of an HTTP status that no status code maps to (HttpStatusFor): 405
// "method_not_allowed", 413 "request_too_large", 415 "unsupported_media_type",
// 431 "request_header_fields_too_large"; ""
// for any other status (the body's code then follows the status code).
std::string OpenAiErrorCodeForHttp(int http_status);

}  // namespace dgserve
