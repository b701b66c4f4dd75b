// A small blocking HTTP/1.1 client on libcurl, for the tests and for dgserve-loadgen: plain
// requests (method, path, headers, body, timeouts) and streamed responses (a callback per received
// chunk, e.g. SSE frames, that may stop the transfer). One HttpClient holds one curl easy handle,
// so the requests it sends reuse one keep-alive connection while the server keeps it open.
//
//   HttpClient c("127.0.0.1", port);
//   HttpResponse r = c.Post("/v1/chat/completions", body_json, {{"Authorization", "Bearer k"}});
//   if (!r) { /* r.error: transport failure */ }
//   r.status; r.Header("Content-Type"); r.body;
//
// An HttpClient is not thread-safe: use one per thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace dgserve {

// Header fields in the order sent or received; names compare case-insensitively in lookups.
using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// What one request got back.
struct HttpResponse {
  // The status code of the last response head received; 0 when none arrived.
  int status = 0;
  // The response's header fields (of the final response, after any 100 Continue).
  HttpHeaders headers;
  // The body (left empty by HttpClient::Stream, which hands it to its callback instead).
  std::string body;
  // Empty when the exchange completed; otherwise what failed: curl's message (connect refused,
  // timeout, broken connection, or "aborted by the callback").
  std::string error;
  // With `error`: a short stable name of the failure for counting: "connect", "timeout", "send",
  // "recv", "aborted" (the stream callback returned false) or "other".
  std::string error_kind;
  // New connections opened for this request: 0 when it reused the client's open connection.
  int new_connections = 0;

  // True when the exchange completed (any status code); false on a transport failure.
  explicit operator bool() const { return error.empty(); }
  // The first value of header `name` (case-insensitive), or "" when absent.
  std::string Header(std::string_view name) const;
  // How many times header `name` (case-insensitive) appears.
  size_t HeaderCount(std::string_view name) const;
};

// One request. `path` is the request target ("/v1/models?x=1"), sent to the client's host:port.
struct HttpRequest {
  std::string method = "GET";  // GET, HEAD, POST, PUT, DELETE, ...
  std::string path = "/";
  HttpHeaders headers;  // sent as given; curl adds Host, Accept and Content-Length
  std::string body;     // sent when non-empty, or always for POST and PUT
  // Send the body with "Transfer-Encoding: chunked" (no Content-Length).
  bool chunked_body = false;
  // Limit on the whole exchange (connect to last byte); absl::ZeroDuration() = the client's.
  absl::Duration timeout = absl::ZeroDuration();
  // Polled with each received chunk and about once a second while nothing arrives; true stops
  // the transfer (error_kind "aborted"). Unset: never.
  std::function<bool()> is_cancelled;
};

// Blocking HTTP/1.1 client to one host:port over plain TCP.
class HttpClient {
 public:
  // Called with each piece of the body as it arrives (`response` has the status and headers);
  // returning false stops the transfer (the response then has error_kind "aborted").
  using ChunkCallback = std::function<bool(const HttpResponse& response, std::string_view chunk)>;

  // Connects lazily, at the first request. `host` is a name or an address ("127.0.0.1", "::1").
  HttpClient(std::string host, int port);
  ~HttpClient();
  HttpClient(HttpClient&&) noexcept;
  HttpClient& operator=(HttpClient&&) noexcept;
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Default limit on a whole exchange (default 300 s; absl::InfiniteDuration() = none).
  void set_timeout(absl::Duration timeout) { timeout_ = timeout; }
  // Limit on connecting (default 10 s).
  void set_connect_timeout(absl::Duration timeout) { connect_timeout_ = timeout; }
  // Limit on a pause without any byte received or sent, checked about once a second (default
  // none; absl::InfiniteDuration() = none). A timed-out request has error_kind "timeout".
  void set_idle_timeout(absl::Duration timeout) { idle_timeout_ = timeout; }

  // Sends `request` and returns the response with its whole body.
  HttpResponse Send(const HttpRequest& request);
  // Sends `request` and hands the body to `on_chunk` as it arrives instead of keeping it.
  HttpResponse Stream(const HttpRequest& request, const ChunkCallback& on_chunk);

  // GET `path`.
  HttpResponse Get(const std::string& path, const HttpHeaders& headers = {});
  // POST `body` to `path` with the given Content-Type.
  HttpResponse Post(const std::string& path, const std::string& body,
                    const HttpHeaders& headers = {},
                    const std::string& content_type = "application/json");
  // DELETE `path`.
  HttpResponse Delete(const std::string& path, const HttpHeaders& headers = {});

  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  HttpResponse Perform(const HttpRequest& request, const ChunkCallback* on_chunk);

  std::string host_;
  int port_;
  absl::Duration timeout_ = absl::Seconds(300);
  absl::Duration connect_timeout_ = absl::Seconds(10);
  absl::Duration idle_timeout_ = absl::InfiniteDuration();
  void* curl_ = nullptr;  // CURL*, kept between requests for connection reuse
};

}  // namespace dgserve
