#include "denoise_worker/denoise_service.h"

#include "common/status_convert.h"
#include "kvstore/transport_selection.h"

namespace dgserve {

grpc::Status DenoiseServiceImpl::Denoise(grpc::ServerContext* context,
                                         const v1::DenoiseRequest* request,
                                         grpc::ServerWriter<v1::DenoiseEvent>* writer) {
  auto job = std::make_shared<DenoiseJob>(*request);
  if (absl::Status s = engine_->Submit(job); !s.ok()) return ToGrpcStatus(s);
  for (;;) {
    v1::DenoiseEvent event;
    std::optional<absl::Status> final;
    if (job->Pop(&event, &final, absl::Milliseconds(50))) {
      if (!writer->Write(event)) {
        engine_->Cancel(job->id(), CallerEndCode(*context));
        return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
      }
      continue;
    }
    if (final) return ToGrpcStatus(*final);
    if (context->IsCancelled()) {
      engine_->Cancel(job->id(), CallerEndCode(*context));
      return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled");
    }
  }
}

grpc::Status DenoiseServiceImpl::Cancel(grpc::ServerContext*, const v1::CancelRequest* request,
                                        v1::CancelResponse* response) {
  const absl::StatusCode why = CancelCode(request->deadline_exceeded());
  response->set_found(engine_->Cancel(request->request_id(), why));
  // Prompt KV that arrived (or is arriving) for a request that will never be denoised — e.g.
  // the gateway's prefill call failed or timed out after the transfer — is freed now rather
  // than at the end of its lease.
  receiver_->Forget(request->request_id(), why);
  return grpc::Status::OK;
}

grpc::Status DenoiseServiceImpl::Stats(grpc::ServerContext*, const v1::StatsRequest*,
                                       v1::StatsResponse* response) {
  const DenoiseEngineStats s = engine_->stats();
  response->set_role("denoise");
  response->set_model_id(model_id_);
  response->set_active_requests(s.active_requests);
  response->set_queued_requests(s.queued);
  response->set_active_canvases(s.active_canvases);
  response->set_pending_transfers(receiver_->pending_transfers());
  response->set_draining(engine_->draining());
  response->set_max_batch_canvases(max_batch_canvases_);
  FillPoolStats(*pool_, response);
  kv::FillKvPeerInfo(peer_info_, response);
  return grpc::Status::OK;
}

}  // namespace dgserve
