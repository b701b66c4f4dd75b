// PrefillService (worker.proto): the gRPC face of the PrefillEngine.
#pragma once

#include "dgserve/v1/worker.grpc.pb.h"
#include "kvstore/block_pool.h"
#include "prefill_worker/prefill_engine.h"
#include "worker/worker_model.h"

namespace dgserve {

class PrefillServiceImpl final : public v1::PrefillService::Service {
 public:
  PrefillServiceImpl(PrefillEngine* engine, kv::BlockPool* pool, std::string model_id)
      : engine_(engine), pool_(pool), model_id_(std::move(model_id)) {}

  // Runs the prompt's prefill and KV transfer; returns when the denoise worker acknowledged
  // the KV. A cancelled call cancels the prefill.
  grpc::Status Prefill(grpc::ServerContext* context, const v1::PrefillRequest* request,
                       v1::PrefillResponse* response) override;
  grpc::Status Cancel(grpc::ServerContext* context, const v1::CancelRequest* request,
                      v1::CancelResponse* response) override;
  grpc::Status Stats(grpc::ServerContext* context, const v1::StatsRequest* request,
                     v1::StatsResponse* response) override;

 private:
  PrefillEngine* engine_;
  kv::BlockPool* pool_;
  std::string model_id_;
};

}  // namespace dgserve
