// The one place where absl::Status meets the edges (design §2): gRPC status codes and HTTP
// status codes with the OpenAI error body's `type`.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"

namespace grpc {
class ServerContext;
}  // namespace grpc

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

// How long before a call's deadline a cancellation still counts as the deadline's. gRPC cancels
// a server call when its deadline passes, and a caller's own deadline (or the RST_STREAM its
// library sends then) reaches a server a transit time away from the server's copy of it (which
// gRPC sends as a relative timeout: the copy is later by the request's own transit, more on a
// loaded machine). A client that gives up within this time of its deadline is counted as the
// deadline.
inline constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(250);
// Whether a call cancelled at `now` ended by its deadline: now >= deadline - kDeadlineSlack.
bool EndedByDeadline(absl::Time deadline, absl::Time now);
// The status to record for a call that ended with `status`: a CANCELLED that EndedByDeadline
// becomes DEADLINE_EXCEEDED ("deadline exceeded (was: MESSAGE)"); anything else is returned as
// it is. For metrics and logs: a client whose deadline passed was told DEADLINE_EXCEEDED by its
// own library, and the server sees the same end as a cancellation.
absl::Status CancelledAtDeadline(absl::Status status, absl::Time deadline, absl::Time now);

// Why a server call's caller ended it (IsCancelled or a failed write): DEADLINE_EXCEEDED when
// the call's deadline passed (EndedByDeadline), else CANCELLED.
absl::StatusCode CallerEndCode(const grpc::ServerContext& context);
// The code a worker's Cancel RPC records (CancelRequest.deadline_exceeded): DEADLINE_EXCEEDED
// when the caller cancels because the request's deadline passed, else CANCELLED.
inline absl::StatusCode CancelCode(bool deadline_exceeded) {
  return deadline_exceeded ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kCancelled;
}

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
// limit is exceeded, else the gRPC code name in lower case. Never throws: bytes of `status`'s
// message or `param` that are not UTF-8 are written as U+FFFD.
std::string OpenAiErrorBody(const absl::Status& status, const std::string& param = "",
                            const std::string& code = "");
// The error `code` of an HTTP status that no status code maps to (HttpStatusFor): 405
// "method_not_allowed", 408 "request_timeout", 413 "request_too_large", 414 "uri_too_long", 415
// "unsupported_media_type", 431 "request_header_fields_too_large"; "" for any other status (the
// body's code then follows the status code).
std::string OpenAiErrorCodeForHttp(int http_status);

// The refusal (UNAUTHENTICATED) of an API-key check whose `authorization` value (an HTTP header
// or gRPC metadata, `field` as the protocol writes the name) carries no Bearer token: "missing
// API key" when the value is empty or a bare "Bearer", else one naming the scheme that is not
// supported ("Basic"; the value itself is never quoted: it may be a credential).
absl::Status MissingBearerTokenError(absl::string_view authorization, absl::string_view field);

}  // namespace dgserve
