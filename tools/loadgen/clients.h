// dgserve-loadgen's protocol clients: one streaming request over gRPC GenerateStream or the
// OpenAI HTTP API (SSE), timed from the client's side.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <set>

#include "tools/loadgen/loadgen.h"

namespace grpc {
class ClientContext;
}

namespace dgserve::loadgen {

using Clock = std::chrono::steady_clock;

// Cuts off the requests still running when the drain time is over: gRPC calls are cancelled
// through their contexts, HTTP streams stop at their next chunk. Thread-safe.
class Canceller {
 public:
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  // Cancels every registered call, and every call registered from now on.
  void CancelAll();
  // Registers a gRPC call for CancelAll (cancels it at once if CancelAll already ran).
  void Register(grpc::ClientContext* ctx);
  void Unregister(grpc::ClientContext* ctx);

 private:
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::set<grpc::ClientContext*> contexts_;
};

// Runs one request at a time per call; Run may be called from many threads at once.
class Client {
 public:
  virtual ~Client() = default;
  // Sends `prompt` with `max_tokens` (> 0) as a streaming request and waits for its end.
  // Times in the result are relative to the call (start_s: relative to `run_start`).
  virtual RequestResult Run(const Prompt& prompt, int64_t max_tokens,
                            Clock::time_point run_start) = 0;
};

// GenerationService.GenerateStream on o.host:o.port over `channels` HTTP/2 connections.
std::unique_ptr<Client> MakeGrpcClient(const Options& o, int channels, Canceller* canceller);

// POST /v1/chat/completions or /v1/completions with "stream": true on o.host:o.port, one
// connection per request.
std::unique_ptr<Client> MakeHttpClient(const Options& o, Canceller* canceller);

}  // namespace dgserve::loadgen
