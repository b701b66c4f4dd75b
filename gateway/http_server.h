// The gateway's OpenAI-compatible HTTP server (design §2): POST /v1/completions,
// POST /v1/chat/completions (JSON or SSE with "stream": true), GET /v1/models,
// GET /v1/models/{id}, GET /health, GET /ready, on cpp-httplib. Request parsing and response
// formatting live in openai_api.h; every request is served by a GenerationCore.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gateway/generation_core.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace dgserve {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                     // 0 = any free port (Start returns it)
  size_t max_body_bytes = 4 << 20;  // larger request bodies get 413
  int threads = 16;                 // HTTP worker threads (one per open connection)
  absl::Duration default_timeout = absl::Minutes(10);  // request deadline without a header
};

// Serves the OpenAI API for one GenerationCore.
//
// Behaviour:
//   - Auth: every route except /health and /ready passes the Authorization header's bearer
//     token ("" when absent) to core->CheckApiKey; a failure is 401 with an OpenAI error body
//     and `WWW-Authenticate: Bearer`.
//   - Unknown path → 404, known path with the wrong method → 405 (with `Allow`), body larger
//     than max_body_bytes → 413; all with OpenAI error bodies. The Content-Type is not checked:
//     a body that parses as JSON is accepted.
//   - Deadline: now + default_timeout, or the `X-Request-Timeout` header (seconds, a number in
//     (0, 86400]; anything else is 400).
//   - Non-streaming: core->Generate runs on the HTTP worker thread; one JSON response, or the
//     error's HttpStatusFor code with an OpenAI error body (429 adds `Retry-After: 1`). A client
//     that disconnects is not noticed until the request ends (its deadline bounds it).
//   - Streaming: Generate runs on its own thread feeding a bounded queue (a slow client
//     back-pressures the core's event callback). The HTTP status is chosen when the first
//     event or the final status arrives: an error before any event is an ordinary error
//     response; otherwise `text/event-stream` with `Cache-Control: no-cache`, one `data:` frame
//     per chunk, `: keep-alive` comments every 15 s of silence, and `data: [DONE]` at the end.
//     An error after the first event is sent as `data: {"error": {…}}` with no [DONE]. A write
//     failure (client gone) cancels the request on the core. The generating thread is always
//     joined before the HTTP response is destroyed.
//   - Every response carries `X-Request-Id` (the core's request id when it sent events, else a
//     gateway-local id).
//   - /health: 200 {"status": "ok"} while the process runs. /ready: 200 {"status": "ready"}
//     when core->Ready() and not draining, else 503 {"status": "not_ready" | "draining"}.
//     Draining does not refuse requests: it only fails readiness, so that load balancers
//     stop sending new ones.
//   - Metrics (when a registry is given): dgserve_gateway_http_requests_total{route,code}
//     and dgserve_gateway_http_request_duration_seconds{route} (for a stream: until its end).
//
// Thread-safe: SetDraining may be called from any thread; Start and Stop from one owner.
class OpenAiHttpServer {
 public:
  // `core` must outlive the server. `registry` may be null (no metrics).
  OpenAiHttpServer(GenerationCore* core, HttpServerOptions options, prometheus::Registry* registry);
  // Stops the server if it runs.
  ~OpenAiHttpServer();

  OpenAiHttpServer(const OpenAiHttpServer&) = delete;
  OpenAiHttpServer& operator=(const OpenAiHttpServer&) = delete;

  // Binds host:port (port 0 → a free port), starts the listening thread and returns the bound
  // port once the server accepts connections. Errors: UNAVAILABLE when the address cannot be
  // bound (port taken, bad host); FAILED_PRECONDITION when already started.
  absl::StatusOr<int> Start();

  // Stops listening, cancels in-flight requests on the core (their is_cancelled turns true),
  // waits for the HTTP worker threads and the streaming threads to finish. Idempotent.
  void Stop();

  // While draining, /ready answers 503.
  void SetDraining(bool draining);

  // The bound port after a successful Start, else 0.
  int port() const { return port_; }

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
  std::thread listen_thread_;
  int port_ = 0;
  bool started_ = false;
};

}  // namespace dgserve
