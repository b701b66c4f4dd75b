// Test helpers for authentication checks: a unary call of raw bytes (not a valid message if
// the test wants) to any method, with chosen request headers.
#pragma once

#include <future>
#include <string>
#include <utility>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace dgserve::testing {

// Sends `body` as the request of `method` ("/pkg.Service/Method") on `channel` and returns the
// call's status (waits at most 30 s).
inline grpc::Status RawUnaryCall(const std::shared_ptr<grpc::Channel>& channel,
                                 const std::string& method, const std::string& body,
                                 const std::vector<std::pair<std::string, std::string>>& headers =
                                     {}) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  for (const auto& [k, v] : headers) ctx.AddMetadata(k, v);
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

// Bytes that are not a protobuf message (a field tag with wire type 7) repeated to `size`.
inline std::string GarbageMessage(size_t size) { return std::string(size, '\xff'); }

}  // namespace dgserve::testing
