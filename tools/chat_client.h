// `dgserve chat`: a streaming client of a running cluster's gateway (gRPC GenerateStream).
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dgserve/v1/generation.pb.h"

namespace dgserve {

struct ChatClientOptions {
  std::string gateway = "127.0.0.1:50051";  // gRPC address
  std::string api_key;
  bool show_steps = false;  // print canvas steps as they stream
  double timeout_seconds = 600;
};

// The gateway's ListModels, or the gRPC status as the error (message "gateway HOST:PORT: ...").
absl::StatusOr<v1::ListModelsResponse> ListServedModels(const ChatClientOptions& options);

// Sends `request` to the gateway's GenerateStream and calls `on_event` for every event as it
// arrives. Returns the Finished event (a default one when the stream ended without it), or the
// gRPC status as the error (UNAVAILABLE when the gateway cannot be reached), with a message
// that starts "gateway HOST:PORT: ". Shared by `dgserve chat` and `dgserve sudoku`.
absl::StatusOr<v1::Finished> StreamGeneration(
    const v1::GenerateRequest& request, const ChatClientOptions& options,
    const std::function<void(const v1::GenerateEvent&)>& on_event);

// Sends `request` and prints the streamed text to stdout as blocks commit (canvas steps to
// stderr with show_steps), then a usage line to stderr. The gRPC status (UNAVAILABLE when the
// gateway cannot be reached) comes back as the error.
absl::Status RunChatClient(const v1::GenerateRequest& request, const ChatClientOptions& options);

}  // namespace dgserve
