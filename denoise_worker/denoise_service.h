// DenoiseService (worker.proto): the gRPC face of the DenoiseEngine.
#pragma once

#include "denoise_worker/denoise_engine.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "kvstore/block_pool.h"
#include "kvstore/gpu_transport.h"
#include "kvstore/transfer.h"
#include "worker/worker_model.h"

namespace dgserve {

class DenoiseServiceImpl final : public v1::DenoiseService::Service {
 public:
  // All pointers must outlive the service. `peer_info` is what Stats reports for the prefill
  // workers' choice of KV transport (node, gpu_uuid, kv_transports).
  DenoiseServiceImpl(DenoiseEngine* engine, kv::BlockPool* pool, kv::KvReceiver* receiver,
                     std::string model_id, int max_batch_canvases,
                     kv::KvPeerInfo peer_info = {})
      : engine_(engine),
        pool_(pool),
        receiver_(receiver),
        model_id_(std::move(model_id)),
        max_batch_canvases_(max_batch_canvases),
        peer_info_(std::move(peer_info)) {}

  // Queues the request, then streams its events until Finished or an error. A client that goes
  // away (or cancels) cancels the request: its KV blocks are freed before the next step.
  grpc::Status Denoise(grpc::ServerContext* context, const v1::DenoiseRequest* request,
                       grpc::ServerWriter<v1::DenoiseEvent>* writer) override;
  grpc::Status Cancel(grpc::ServerContext* context, const v1::CancelRequest* request,
                      v1::CancelResponse* response) override;
  grpc::Status Stats(grpc::ServerContext* context, const v1::StatsRequest* request,
                     v1::StatsResponse* response) override;

 private:
  DenoiseEngine* engine_;
  kv::BlockPool* pool_;
  kv::KvReceiver* receiver_;
  std::string model_id_;
  int max_batch_canvases_;
  kv::KvPeerInfo peer_info_;
};

}  // namespace dgserve
