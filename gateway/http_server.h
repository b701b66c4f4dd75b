// The gateway's OpenAI-compatible HTTP server (design §2): POST /v1/completions,
// POST /v1/chat/completions (JSON or SSE with "stream": true), GET /v1/models,
// GET /v1/models/{id}, GET /health, GET /ready. Request parsing and response formatting live in
// openai_api.h; every request is served by a GenerationCore.
//
// Event-driven, on Boost.Asio with Boost.Beast's HTTP/1.1 parser (Debian's header-only
// libboost-dev). Chosen over libevent's evhttp because Asio gives each connection an explicit
// state machine we own: a read stays posted on the socket while a request generates, so a client
// that closes is noticed at once (evhttp 2.1 does not watch a connection while its request is
// being answered), pipelined requests are buffered and answered in order, and every write is
// ours to pace (per-connection back-pressure on the generating thread) and to time out. Beast's
// parser is strict (RFC 7230), with header and body limits, and is one of the most used C++
// HTTP stacks; both are header-only, so the image gains no runtime package.
//
// Threads: `io_threads` event-loop threads own every socket (a connection costs a socket and a
// few KiB, no thread). A generation body over 64 KiB is parsed by one of `parse_threads`
// threads, never on an event-loop thread (where a 4 MiB body held all of that thread's
// connections for half a second; the memory of parsing is bounded by parse_threads bodies); a
// smaller one on the event-loop thread that read it (a few milliseconds at most), so that it
// does not wait behind big ones. A body that waited for a parse thread and is no longer wanted
// (its client went away, its deadline passed, the server stops) is answered without being
// parsed. Waiting bodies are held in memory, as they were in their connections' buffers before
// (one per connection, each at most max_body_bytes), and all the bodies held at once (read or
// being read, not yet parsed) are bounded by max_buffered_body_bytes. A request whose body parses
// then runs core->Generate on a thread of its own, started only while the core has room for it
// (core->CheckAdmission, asked before the parse and again after it), so generation threads stay
// near the core's admission limit; its events are posted to the connection's strand.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

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
  size_t max_body_bytes = 4 << 20;  // larger request bodies get 413 (and the connection closes)
  // Larger request heads get 431, a longer request line (the URI) 414; the connection closes.
  size_t max_header_bytes = 16 << 10;
  // The bytes of request bodies held at once across all connections, from the head (its
  // Content-Length; a chunked body counts max_body_bytes) until the body is parsed: a body that
  // does not fit is refused on its head, before it is read, with 503 (Retry-After: 1; the
  // head's own refusal, e.g. 401, where it has one) and the connection closes. A body always
  // fits when no other is held. 0: no bound. Bodies waiting for a parse thread count, and they
  // were what grew the gateway's memory under many concurrent large posts.
  size_t max_buffered_body_bytes = 64 << 20;
  int io_threads = 2;                  // event-loop threads
  // Threads that parse generation bodies: at most this many at once (a 4 MiB body of small
  // values takes about 0.2-0.5 s and about 80 MB while parsed); the others wait their turn.
  int parse_threads = 2;
  absl::Duration default_timeout = absl::Minutes(10);  // request deadline without a header
  // A request must arrive whole (head and body) within this time of its first byte; a slower
  // client gets 408 (code "request_timeout") and the connection closes.
  absl::Duration read_timeout = absl::Seconds(30);
  // A keep-alive connection with no request in progress is closed after this long.
  absl::Duration idle_timeout = absl::Seconds(120);
  // A write that makes no progress for this long (a client that stopped reading) closes the
  // connection and cancels its request.
  absl::Duration write_timeout = absl::Seconds(60);
  // A stream's bytes waiting to be written; beyond it the generating thread waits (back-pressure).
  size_t max_pending_stream_bytes = 256 << 10;
  absl::Duration sse_keepalive_interval = absl::Seconds(15);  // `: keep-alive` after this silence
  // Stop() waits at most this long for the answers in progress to be written (and for their
  // connections' graceful close: a client that keeps the connection open after the answer holds
  // it up to 2 s). The gateway's exit budget in deploy/k8s counts it.
  absl::Duration stop_grace = absl::Seconds(5);
};

// Serves the OpenAI API for one GenerationCore.
//
// Behaviour:
//   - Auth: every route except /health and /ready passes the Authorization header's bearer
//     token ("" when absent) to core->CheckApiKey; a failure is 401 with an OpenAI error body
//     and `WWW-Authenticate: Bearer`.
//   - Unknown path → 404, known path with the wrong method → 405 (with `Allow`), body larger
//     than max_body_bytes → 413, a body beyond max_buffered_body_bytes (all connections'
//     bodies not yet parsed) → 503 on its head, head larger than max_header_bytes → 431 (414
//     when the request line alone is), a malformed request → 400; all with OpenAI error bodies
//     (413, 414, 431 and 400 close the connection). `Expect: 100-continue` is answered.
//   - A generation body is read as JSON when it has no Content-Type (and no `Origin`: a
//     browser's untyped post must say application/json), application/json or
//     application/*+json (parameters ignored); any other type is 415 (code
//     "unsupported_media_type") before the body is parsed, two Content-Type fields are 400.
//   - HTTP/1.1 keep-alive and pipelining: requests on a connection are answered in order; the
//     next one is read once the previous answer is written. `Connection: close` (or HTTP/1.0
//     without keep-alive) closes after the answer.
//   - Timeouts: read_timeout for a whole request (a request begun and not finished in time is
//     answered 408, counted like an unreadable request, and the connection closes),
//     idle_timeout between requests and write_timeout for a stalled write (each closes the
//     connection, cancelling its request, if any).
//   - Deadline: now + default_timeout, or the `X-Request-Timeout` header (seconds, a decimal
//     number in (0, 86400]; anything else is 400), which may only shorten it: the deadline is the
//     earlier.
//   - Admission: core->CheckAdmission is asked after the head's checks (Content-Type,
//     X-Request-Timeout), before the body is parsed, and again after; RESOURCE_EXHAUSTED is
//     answered at once (429 with `Retry-After: 1`) without starting a thread.
//   - Non-streaming: core->Generate runs on its own thread; one JSON response, or the error's
//     HttpStatusFor code with an OpenAI error body (429 adds `Retry-After: 1`). A client that
//     closes its connection cancels the request at once (a read stays posted on the socket).
//   - Streaming: the same, and each event's frames are written as they come; the generating
//     thread waits while more than max_pending_stream_bytes are unwritten (back-pressure). The
//     HTTP status is chosen when the core accepts the request (GenerationCore::AcceptedCallback:
//     validated and started, possibly to wait minutes for a worker), or at the first event or
//     the final status if that comes first: an error before then is an ordinary error
//     response; otherwise `text/event-stream` (chunked) with `Cache-Control: no-cache`, sent at
//     once, one `data:` frame per chunk, `: keep-alive` comments after sse_keepalive_interval
//     of silence (also while the request waits for its first event), and `data: [DONE]` at the
//     end. An error after the head is sent as `data: {"error": {…}}`, then [DONE]. A closed
//     connection or a write failure cancels the request on the core.
//   - Every response carries `X-Request-Id` (the core's request id when it sent events, else a
//     gateway-local id).
//   - /health: 200 {"status": "ok"} while the process runs. /ready: 200 {"status": "ready"}
//     when core->Ready() and not draining, else 503 {"status": "not_ready" | "draining"}, with
//     "reason": core->NotReadyReason() when not_ready and it is not empty.
//     Draining does not refuse requests: it only fails readiness, so that load balancers
//     stop sending new ones.
//   - Metrics (when a registry is given): dgserve_gateway_http_requests_total{route,code},
//     dgserve_gateway_http_request_duration_seconds{route} (for a stream: until its end),
//     dgserve_gateway_http_open_connections and dgserve_gateway_http_open_streams.
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

  // Binds host:port (port 0 → a free port), starts the event-loop threads and returns the bound
  // port once the server accepts connections. Errors: UNAVAILABLE when the address cannot be
  // bound (port taken, bad host); FAILED_PRECONDITION when already started.
  absl::StatusOr<int> Start();

  // Stops listening, cancels in-flight requests on the core (their is_cancelled turns true),
  // waits for their generating threads, then for the answers in progress to be written (each
  // connection closes after its answer; at most options.stop_grace), stops the event loop and
  // closes every connection. A request still generating is cancelled, so call it after the
  // core has drained (the gateway's SIGTERM handling) for nothing to be cut. Idempotent.
  void Stop();

  // While draining, /ready answers 503.
  void SetDraining(bool draining);

  // The bytes of request bodies held now (HttpServerOptions::max_buffered_body_bytes).
  size_t buffered_body_bytes() const;

  // The bound port after a successful Start, else 0.
  int port() const { return port_; }

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
  bool started_ = false;
  bool stopped_ = false;
};

}  // namespace dgserve
