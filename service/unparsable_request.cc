#include "service/unparsable_request.h"

#include <cstdio>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/support/interceptor.h"

namespace dgserve {
namespace {

using grpc::experimental::InterceptionHookPoints;

class UnparsableRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  UnparsableRequestInterceptor(std::string method, const UnparsableRequestCallback* callback)
      : method_(std::move(method)), callback_(callback) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // The server reports every received message here; a message it could not parse is null.
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsable_ = true;
    }
    if (unparsable_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      // No handler ran (it needs the message): an INTERNAL here is gRPC's own answer, with an
      // empty message for a protobuf parse failure, "Couldn't initialize byte buffer reader"
      // for a missing or cut-off message.
      if (methods->GetSendStatus().error_code() == grpc::StatusCode::INTERNAL) {
        const absl::Status status = UnparsableRequestStatus(method_);
        methods->ModifySendStatus(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(status.message())));
        if (*callback_) (*callback_)(method_, status);
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  const UnparsableRequestCallback* callback_;
  bool unparsable_ = false;
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(UnparsableRequestCallback callback) : callback_(std::move(callback)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // Requests of streaming RPCs arrive through Read(), which reports a bad one itself.
    using Type = grpc::experimental::ServerRpcInfo::Type;
    if (info->type() != Type::UNARY && info->type() != Type::SERVER_STREAMING) return nullptr;
    return new UnparsableRequestInterceptor(info->method(), &callback_);
  }

 private:
  const UnparsableRequestCallback callback_;
};

void LogHandler(google::protobuf::LogLevel level, const char* filename, int line,
                const std::string& message) {
  // protobuf's wire-format parser reports a received string field that is not UTF-8 this way
  // (the same report when serializing, a fault of ours, is still printed).
  if (absl::StrContains(message, "invalid UTF-8 data when parsing")) return;
  static const char* const kNames[] = {"INFO", "WARNING", "ERROR", "FATAL"};
  std::fprintf(stderr, "[libprotobuf %s %s:%d] %s\n",
               kNames[level >= 0 && level <= 3 ? level : 2], filename, line, message.c_str());
}

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeUnparsableRequestInterceptorFactory(UnparsableRequestCallback on_unparsable) {
  return std::make_unique<Factory>(std::move(on_unparsable));
}

absl::Status UnparsableRequestStatus(const std::string& method) {
  return absl::InvalidArgumentError(absl::StrCat(
      "the request message of ", method,
      " could not be parsed: a string field holds bytes that are not UTF-8, or the message is "
      "missing, truncated or not of the method's request type"));
}

void QuietProtobufParseErrors() { google::protobuf::SetLogHandler(&LogHandler); }

}  // namespace dgserve
