#include "gateway/grpc_service.h"

#include <vector>

#include "absl/strings/match.h"
#include "common/status_convert.h"

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
  // choices[i] collects sample i; the top-level fields are sample 0's.
  std::vector<v1::Usage> usages;
  absl::Status s = core_->Generate(
      *request, Deadline(context), [context] { return context->IsCancelled(); },
      [response, &usages](const v1::GenerateEvent& ev) {
        response->set_request_id(ev.request_id());
        while (response->choices_size() <= ev.index()) {
          response->add_choices()->set_index(response->choices_size() - 1);
        }
        v1::Choice* choice = response->mutable_choices(ev.index());
        if (ev.has_block()) {
          choice->mutable_text()->append(ev.block().text());
          choice->mutable_token_ids()->MergeFrom(ev.block().token_ids());
        } else if (ev.has_finished()) {
          choice->set_finish_reason(ev.finished().finish_reason());
          if (usages.size() <= size_t(ev.index())) usages.resize(ev.index() + 1);
          usages[ev.index()] = ev.finished().usage();
        }
        return true;
      });
  if (s.ok()) {
    for (int i = 0; i < response->choices_size(); ++i) {
      // Ids streamed before a stop sequence was found may run past it; the usage count is
      // exact.
      v1::Choice* choice = response->mutable_choices(i);
      const int keep = size_t(i) < usages.size() ? usages[i].completion_tokens() : 0;
      if (choice->token_ids_size() > keep) choice->mutable_token_ids()->Truncate(keep);
      if (i == 0) {
        *response->mutable_usage() = usages.empty() ? v1::Usage() : usages[0];
      } else if (size_t(i) < usages.size()) {
        AddSampleUsage(usages[i], response->mutable_usage());
      }
    }
    if (response->choices_size() > 0) {
      const v1::Choice& first = response->choices(0);
      response->set_text(first.text());
      *response->mutable_token_ids() = first.token_ids();
      response->set_finish_reason(first.finish_reason());
    }
  }
  return ToGrpcStatus(s);
}

grpc::Status GenerationServiceImpl::GenerateStream(grpc::ServerContext* context,
                                                   const v1::GenerateRequest* request,
                                                   grpc::ServerWriter<v1::GenerateEvent>* writer) {
  if (absl::Status s = AuthenticateGeneration(context); !s.ok()) return ToGrpcStatus(s);
  // Initial metadata (with the request id) as soon as the request is accepted: a client
  // waiting behind other requests' canvases sees the call is alive before its first event.
  absl::Status s = core_->Generate(
      *request, Deadline(context), [context] { return context->IsCancelled(); },
      [writer](const v1::GenerateEvent& ev) { return writer->Write(ev); },
      [context, writer](const std::string& request_id) {
        context->AddInitialMetadata("x-request-id", request_id);
        writer->SendInitialMetadata();
      });
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
