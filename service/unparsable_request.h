// Server interceptor for requests whose message cannot be parsed.
//
// gRPC answers a request message that it cannot parse with INTERNAL before any handler runs: a
// proto3 `string` field holding bytes that are not UTF-8, a truncated or garbled message (empty
// status message), no message at all or a gRPC frame cut short ("Couldn't initialize byte
// buffer reader"). That is the client's fault, so such a call ends INVALID_ARGUMENT instead,
// with a message naming the method and the likely cause, and `on_unparsable` is told (for the
// request metrics: no handler sees the call).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/server_interceptor.h"

namespace dgserve {

// Called once per call whose request message could not be parsed, with the method's full path
// ("/dgserve.v1.GenerationService/Generate") and the status sent. Any thread.
using UnparsableRequestCallback =
    std::function<void(const std::string& method, const absl::Status& status)>;

// The factory for ServerBuilder::experimental().SetInterceptorCreators. `on_unparsable` may be
// empty.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeUnparsableRequestInterceptorFactory(UnparsableRequestCallback on_unparsable);

// The status such a call ends with (exposed for tests).
absl::Status UnparsableRequestStatus(const std::string& method);

// Stops protobuf from logging one line per such request ("String field ... contains invalid
// UTF-8 data when parsing"): an unauthenticated client could fill the log with them. The call's
// status says it instead. Other protobuf log lines (also the same report when serializing, which
// would be our fault) still go to stderr. Once per process.
void QuietProtobufParseErrors();

}  // namespace dgserve
