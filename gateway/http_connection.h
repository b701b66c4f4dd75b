// One HTTP/1.1 connection of the OpenAI HTTP server (http_server.h), and the wire helpers it
// shares with the server. Internal to the HTTP server: its interface speaks Boost.Beast types, so
// only http_server.cc and http_connection.cc include it.
//
// A connection is an explicit state machine on its own strand: it reads one request at a time
// (pipelined ones are buffered and answered in order) under the header and body limits and the
// read timeout; while a request is answered it keeps a read posted on the socket, so that a
// client that closes cancels its generation at once; it writes answers and SSE streams in order
// under the write timeout, reports a stream's written bytes to its generating thread
// (back-pressure), sends `: keep-alive` comments on a silent stream, and after its last answer
// closes gracefully (stops sending, then reads and drops what still arrives for a while, so that
// the answer is not lost to a TCP reset).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "gateway/http_server.h"

namespace dgserve::http_internal {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;

// One answer that is not a stream.
struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;

  // Sets header `name` (replacing an earlier value).
  void Set(const std::string& name, const std::string& value);
};

// An OpenAI error body whose code matches `http_status`: a status no status code maps to (405,
// 408, 413, 414, 415, 431) names itself, any other follows the status code. 429 adds Retry-After.
HttpResponse ErrorResponse(int http_status, const absl::Status& status,
                           const std::string& param = "");
// The same, with the HTTP status that `status`'s code maps to.
HttpResponse ErrorResponse(const absl::Status& status, const std::string& param = "");

// The value of header `f` in `req`; "" when absent.
std::string HeaderValue(const HttpRequest& req, boost::beast::http::field f);

// The path of a request target: the query is dropped, and so are the scheme and authority of an
// absolute-form target ("http://host/v1/models" → "/v1/models", "http://host" → "/"); then
// percent-decoded ("/v1/models/%73udoku" → "/v1/models/sudoku"), unless the decoded bytes are
// not UTF-8 or hold a control character (then as sent).
std::string RequestPath(std::string_view target);

// A gateway-local request id ("gw-<16 hex>-<counter>"): used in X-Request-Id until (or unless)
// the core reports its own.
std::string LocalRequestId();

// One chunk of a chunked body ("" for empty data: an empty chunk would end the body).
std::string Chunk(const std::string& data);

class HttpConnection;

// The bytes of request bodies held at once across all connections (being read, or read and
// waiting for or in their parse), under HttpServerOptions::max_buffered_body_bytes. Thread-safe.
class BodyBudget {
 public:
  // `limit` 0: no bound.
  explicit BodyBudget(size_t limit) : limit_(limit) {}
  // Takes `n` bytes if they fit under the limit, or if nothing is held (a body never waits on
  // itself); false otherwise.
  bool TryTake(size_t n);
  void Give(size_t n) { in_use_.fetch_sub(n); }
  size_t in_use() const { return in_use_.load(); }
  size_t limit() const { return limit_; }

 private:
  const size_t limit_;
  std::atomic<size_t> in_use_{0};
};

// Bytes taken from a BodyBudget, given back when reset or destroyed. Move-only.
class BodyReservation {
 public:
  BodyReservation() = default;
  BodyReservation(BodyBudget* budget, size_t bytes) : budget_(budget), bytes_(bytes) {}
  BodyReservation(BodyReservation&& o) noexcept
      : budget_(std::exchange(o.budget_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  BodyReservation& operator=(BodyReservation&& o) noexcept {
    if (this != &o) {
      Reset();
      budget_ = std::exchange(o.budget_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  BodyReservation(const BodyReservation&) = delete;
  BodyReservation& operator=(const BodyReservation&) = delete;
  ~BodyReservation() { Reset(); }
  void Reset() {
    if (budget_ != nullptr) budget_->Give(bytes_);
    budget_ = nullptr;
    bytes_ = 0;
  }

 private:
  BodyBudget* budget_ = nullptr;
  size_t bytes_ = 0;
};

// What a connection needs from its server. OnRequest, OnUnreadableRequest, Record and
// stopping() are called on the connection's strand; the counts and OnClosed also come from its
// constructor (the acceptor's strand) and destructor (any thread, also while the server's event
// loop is destroyed), so they must only touch what outlives the connections.
class ConnectionHost {
 public:
  virtual const HttpServerOptions& options() const = 0;
  // True once the server stops: connections close after their answer in progress.
  virtual bool stopping() const = 0;
  // A whole request was read: answer it (HttpConnection::Respond, or a stream). `body` holds its
  // body's bytes in the budget until the body is parsed (or dropped).
  virtual void OnRequest(const std::shared_ptr<HttpConnection>& connection, HttpRequest req,
                         BodyReservation body) = 0;
  // Takes `bytes` from the server's BodyBudget for a body about to be read; nullopt when they
  // do not fit.
  virtual std::optional<BodyReservation> ReserveBody(size_t bytes) = 0;
  // The head of a request whose client waits for "100 Continue" before sending its body
  // (Expect: 100-continue, RFC 9110 §10.1.1): the final answer it gets instead when the head
  // alone refuses it (counted as OnRequest would; the route to record it under in *route), or
  // nullopt to let the body come. The connection closes after such a refusal.
  virtual std::optional<HttpResponse> CheckHead(const HttpRequest& head, std::string* route) = 0;
  // A request that could not be read whole (too large, malformed) is answered with `status`;
  // `path` is its request line's path ("" if none). Returns the route label to record it under.
  virtual std::string OnUnreadableRequest(const std::string& path, const absl::Status& status) = 0;
  // An answer on `route` with HTTP status `code`, `elapsed` after the request was read.
  virtual void Record(const std::string& route, int code, absl::Duration elapsed) = 0;
  // Open connections and streams went up or down by `delta`.
  virtual void CountConnections(int delta) = 0;
  virtual void CountStreams(int delta) = 0;
  // Connections answering a request went up or down by `delta`: from the request (or the
  // refusal of an unreadable one) until the connection is idle again or closed (a connection
  // closing gracefully after its answer still counts).
  virtual void CountAnswering(int delta) = 0;
  // Connection `id` is being destroyed.
  virtual void OnClosed(uint64_t id) = 0;

 protected:
  ~ConnectionHost() = default;
};

// What a generating thread shares with its connection. The thread never touches the connection:
// it posts to the connection's strand, and waits here while too many bytes are unwritten.
struct HttpExchange {
  std::weak_ptr<HttpConnection> connection;
  boost::asio::any_io_executor executor;  // the connection's strand
  std::string route;
  absl::Time start;

  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;  // stream bytes posted and not yet written
  std::atomic<bool> cancelled{false};

  void Cancel();
  bool IsCancelled() const { return cancelled.load(); }
  // `n` stream bytes were written (from the strand).
  void Written(size_t n);
  // Runs `fn` on the connection's strand if the connection still exists.
  void Post(std::function<void(HttpConnection&)> fn);
  // Producer side: waits while more than `limit` bytes are unwritten, then posts `bytes` (SSE
  // frames, unframed: HttpConnection::WriteStreamData frames them) as stream bytes; false when
  // cancelled.
  bool Send(std::string bytes, size_t limit);
};

// One connection. Everything runs on its strand, except construction, destruction, and Close()
// once the event loop has stopped.
class HttpConnection : public std::enable_shared_from_this<HttpConnection> {
 public:
  // `host` outlives the connection; `socket` runs on a strand.
  HttpConnection(ConnectionHost* host, boost::asio::ip::tcp::socket socket, uint64_t id);
  ~HttpConnection();

  // Starts reading the first request.
  void Start();
  boost::asio::any_io_executor executor() { return socket_.get_executor(); }

  // Closes the socket at once; cancels the request in progress. Only from the strand, or once
  // the event loop has stopped.
  void Close();
  // An answer that is not a stream; the connection then goes on to the next request.
  void Respond(const HttpResponse& r, const std::string& route, absl::Time start);
  // The head of an SSE stream: chunked for an HTTP/1.1 request; for HTTP/1.0 (which has no
  // chunked coding, RFC 9112 §6.1) the body is sent as it is and ended by closing the connection.
  void StartStream(const std::string& request_id);
  // Stream bytes (SSE frames, unframed): queued as one chunk, or as they are for HTTP/1.0;
  // `counted` ones (the exchange's Send) are reported to the exchange once written.
  void WriteStreamData(std::string data, bool counted);
  // A stream's last frames (unframed), then the end of the body.
  void EndStream(std::string last_frames, const std::string& route, absl::Time start);
  // Queues bytes as they are.
  void Write(std::string bytes);
  // Starts a generation on this connection: keeps a read posted to notice the client leaving.
  void BeginExchange(std::shared_ptr<HttpExchange> ex);

 private:
  enum class State {
    kIdle,     // waiting for the first byte of a request
    kReading,  // reading a request
    kBusy,     // answering a request
    kClosing,  // last answer written; dropping what still arrives, then close
    kClosed,
  };
  struct OutBuf {
    std::string data;
    size_t counted_bytes = 0;  // reported to the exchange once written
  };
  void Queue(OutBuf buf);

  void Arm(boost::asio::steady_timer& timer, absl::Duration d,
           void (HttpConnection::*on_expiry)());
  void ReadNext();
  void ReadSome();
  void OnReadSome(boost::system::error_code ec, size_t n);
  void ReadRequest();
  void OnHeader(boost::system::error_code ec);
  void OnReadError(boost::system::error_code ec);
  // The read timeout fired while a request was being read: cancels the read, whose completion
  // then answers 408 (RFC 9110 §15.5.9) and closes.
  void OnReadTimeout();
  // Answers a request that cannot be read whole with HTTP status `code` and closes.
  void Refuse(int code, const absl::Status& status, absl::Time start);
  // The body announced by the head just read does not fit in the server's body budget: answers
  // the head's own refusal if it has one (401, 404, ...), else 503 with Retry-After, and closes
  // without reading the body. False when the body fits (its bytes are then held in body_).
  bool RefuseOverBudget(const HttpRequest& req);
  void OnRequest();
  // The answer in progress is entirely queued: once written, go on to the next request.
  void EndExchange();
  void AfterAnswer();
  void DoWrite();
  void OnWrite(boost::system::error_code ec);
  void ArmKeepAlive();
  void OnKeepAliveTick();
  // Enters or leaves the answering state (counted by the host).
  void SetAnswering(bool answering);

  ConnectionHost* const host_;
  boost::asio::ip::tcp::socket socket_;
  const uint64_t id_;
  boost::beast::flat_buffer buffer_;
  std::optional<boost::beast::http::request_parser<boost::beast::http::string_body>> parser_;
  boost::asio::steady_timer idle_timer_, read_timer_, write_timer_, keepalive_timer_;
  std::deque<OutBuf> out_;
  std::shared_ptr<HttpExchange> exchange_;
  BodyReservation body_;  // the request being read's body in the server's budget
  State state_ = State::kIdle;
  bool reading_ = false;          // a read is posted on the socket
  bool cancelling_read_ = false;  // ...and is being cancelled to parse the next request
  bool read_timed_out_ = false;   // the request being read ran past read_timeout
  bool writing_ = false;
  bool answer_queued_ = false;  // the whole answer is in out_: go on once it is written
  bool keep_alive_ = true;
  bool head_ = false;
  bool http10_ = false;  // the request being answered is HTTP/1.0
  bool streaming_ = false;
  bool wrote_since_tick_ = false;
  bool answering_ = false;
  size_t lingered_ = 0;
};

}  // namespace dgserve::http_internal
