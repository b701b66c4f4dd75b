#include "prefill_worker/prefill_service.h"

#include "absl/synchronization/notification.h"
#include "common/status_convert.h"

namespace dgserve {

grpc::Status PrefillServiceImpl::Prefill(grpc::ServerContext* context,
                                         const v1::PrefillRequest* request,
                                         v1::PrefillResponse* response) {
  struct Result {
    absl::Notification done;
    absl::StatusOr<v1::PrefillResponse> value;
  };
  auto result = std::make_shared<Result>();
  absl::Status s = engine_->Submit(*request, [result](absl::StatusOr<v1::PrefillResponse> r) {
    result->value = std::move(r);
    result->done.Notify();
  });
  if (!s.ok()) return ToGrpcStatus(s);
  bool cancel_sent = false;
  while (!result->done.WaitForNotificationWithTimeout(absl::Milliseconds(50))) {
    if (!cancel_sent && context->IsCancelled()) {
      engine_->Cancel(request->request_id(), CallerEndCode(*context));
      cancel_sent = true;
    }
  }
  if (!result->value.ok()) return ToGrpcStatus(result->value.status());
  *response = *result->value;
  return grpc::Status::OK;
}

grpc::Status PrefillServiceImpl::Cancel(grpc::ServerContext*, const v1::CancelRequest* request,
                                        v1::CancelResponse* response) {
  response->set_found(
      engine_->Cancel(request->request_id(), CancelCode(request->deadline_exceeded())));
  return grpc::Status::OK;
}

grpc::Status PrefillServiceImpl::Stats(grpc::ServerContext*, const v1::StatsRequest*,
                                       v1::StatsResponse* response) {
  const PrefillEngineStats s = engine_->stats();
  response->set_role("prefill");
  response->set_model_id(model_id_);
  response->set_active_requests(s.active + s.transferring);
  response->set_queued_requests(s.queued);
  response->set_draining(engine_->draining());
  FillPoolStats(*pool_, response);
  return grpc::Status::OK;
}

}  // namespace dgserve
