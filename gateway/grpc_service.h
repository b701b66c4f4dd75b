// GenerationService (generation.proto): the public gRPC API over the GenerationCore.
#pragma once

#include "dgserve/v1/generation.grpc.pb.h"
#include "gateway/generation_core.h"

namespace dgserve {

class GenerationServiceImpl final : public v1::GenerationService::Service {
 public:
  // `default_timeout` applies when the client sets no deadline.
  GenerationServiceImpl(GenerationCore* core, absl::Duration default_timeout)
      : core_(core), default_timeout_(default_timeout) {}

  // Runs the request and returns the whole completion (text, token ids, usage).
  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        v1::GenerateResponse* response) override;
  // Streams CanvasStep (if asked), BlockCommitted and a final Finished event.
  grpc::Status GenerateStream(grpc::ServerContext* context, const v1::GenerateRequest* request,
                              grpc::ServerWriter<v1::GenerateEvent>* writer) override;
  grpc::Status ListModels(grpc::ServerContext* context, const v1::ListModelsRequest* request,
                          v1::ListModelsResponse* response) override;

 private:
  absl::Status Authenticate(grpc::ServerContext* context) const;
  // Authenticate, counting a refusal in the core's request metrics.
  absl::Status AuthenticateGeneration(grpc::ServerContext* context) const;
  absl::Time Deadline(grpc::ServerContext* context) const;

  GenerationCore* core_;
  absl::Duration default_timeout_;
};

}  // namespace dgserve
