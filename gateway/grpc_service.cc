#include "gateway/grpc_service.h"

#include "absl/strings/match.h"
#include "service/status_convert.h"

namespace dgserve {

absl::Status GenerationServiceImpl::Authenticate(grpc::ServerContext* context) const {
  std::string bearer;
  auto it = context->client_metadata().find("authorization");
  if (it != context->client_metadata().end()) {
    std::string value(it->second.data(), it->second.size());
    if (absl::StartsWithIgnoreCase(value, "bearer ")) bearer = value.substr(7);
  }
  return core_->CheckApiKey(bearer);
}

absl::Status GenerationServiceImpl::AuthenticateGeneration(grpc::ServerContext* context) const {
  absl::Status s = Authenticate(context);
  if (!s.ok()) core_->CountRefused(s);
  return s;
}

absl::Time GenerationServiceImpl::Deadline(grpc::ServerContext* context) const {
  const absl::Time fallback = absl::Now() + default_timeout_;
  const auto d = context->deadline();
  if (d == std::chrono::system_clock::time_point::max()) return fallback;
  return std::min(fallback, absl::FromChrono(d));
}

grpc::Status GenerationServiceImpl::Generate(grpc::ServerContext* context,
                                             const v1::GenerateRequest* request,
                                             v1::GenerateResponse* response) {
  if (absl::Status s = AuthenticateGeneration(context); !s.ok()) return ToGrpcStatus(s);
  absl::Status s = core_->Generate(
      *request, Deadline(context), [context] { return context->IsCancelled(); },
      [response](const v1::GenerateEvent& ev) {
        response->set_request_id(ev.request_id());
        if (ev.has_block()) {
          response->mutable_text()->append(ev.block().text());
          response->mutable_token_ids()->MergeFrom(ev.block().token_ids());
        } else if (ev.has_finished()) {
          response->set_finish_reason(ev.finished().finish_reason());
          *response->mutable_usage() = ev.finished().usage();
        }
        return true;
      });
  // Ids streamed before a stop sequence was found may run past it; the usage count is exact.
  if (s.ok() && response->token_ids_size() > response->usage().completion_tokens()) {
    response->mutable_token_ids()->Truncate(response->usage().completion_tokens());
  }
  return ToGrpcStatus(s);
}

grpc::Status GenerationServiceImpl::GenerateStream(grpc::ServerContext* context,
                                                   const v1::GenerateRequest* request,
                                                   grpc::ServerWriter<v1::GenerateEvent>* writer) {
  if (absl::Status s = AuthenticateGeneration(context); !s.ok()) return ToGrpcStatus(s);
  absl::Status s = core_->Generate(
      *request, Deadline(context), [context] { return context->IsCancelled(); },
      [writer](const v1::GenerateEvent& ev) { return writer->Write(ev); });
  return ToGrpcStatus(s);
}

grpc::Status GenerationServiceImpl::ListModels(grpc::ServerContext* context,
                                               const v1::ListModelsRequest*,
                                               v1::ListModelsResponse* response) {
  if (absl::Status s = Authenticate(context); !s.ok()) return ToGrpcStatus(s);
  *response = core_->ListModels();
  return grpc::Status::OK;
}

}  // namespace dgserve
