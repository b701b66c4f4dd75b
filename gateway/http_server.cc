#include "gateway/http_server.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "gateway/openai_api.h"
#include "service/status_convert.h"

namespace dgserve {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

constexpr const char* kJson = "application/json";
constexpr double kMaxTimeoutSeconds = 86400;
// Bytes of pipelined requests read ahead while a request is answered (the read that notices a
// closed connection); beyond it reading pauses until the answer is written.
constexpr size_t kMaxReadAheadBytes = 64 << 10;
// After the last answer on a closing connection: read and drop what the client still sends for
// this long (at most this much), so that the answer is not lost to a TCP reset.
constexpr auto kLingerTime = std::chrono::seconds(2);
constexpr size_t kLingerBytes = 8 << 20;

std::chrono::steady_clock::duration ToSteady(absl::Duration d) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(absl::ToChronoNanoseconds(d));
}

// A gateway-local request id: used in X-Request-Id until (or unless) the core reports its own.
std::string LocalRequestId() {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrCat("gw-", absl::Hex(rng(), absl::kZeroPad16), "-", counter.fetch_add(1));
}

// The route label of a path; "" for an unknown path.
std::string RouteOf(const std::string& path) {
  static constexpr const char* kRoutes[] = {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                            "/health", "/ready"};
  for (const char* r : kRoutes) {
    if (path == r) return r;
  }
  constexpr std::string_view kModel = "/v1/models/";
  if (path.size() > kModel.size() && path.compare(0, kModel.size(), kModel) == 0) {
    return "/v1/models/{id}";
  }
  return "";
}

bool IsPostRoute(const std::string& route) {
  return route == "/v1/completions" || route == "/v1/chat/completions";
}

using Request = http::request<http::string_body>;

std::string Header(const Request& req, http::field f) {
  auto it = req.find(f);
  return it == req.end() ? std::string() : std::string(it->value());
}

std::string BearerToken(const Request& req) {
  std::string value(absl::StripAsciiWhitespace(Header(req, http::field::authorization)));
  constexpr std::string_view kBearer = "bearer ";
  if (value.size() < kBearer.size() ||
      absl::AsciiStrToLower(value.substr(0, kBearer.size())) != kBearer) {
    return "";
  }
  return std::string(absl::StripAsciiWhitespace(value.substr(kBearer.size())));
}

// One answer that is not a stream.
struct Response {
  int status = 200;
  std::string content_type = kJson;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;

  void Set(const std::string& name, const std::string& value) {
    for (auto& [n, v] : headers) {
      if (n == name) {
        v = value;
        return;
      }
    }
    headers.emplace_back(name, value);
  }
};

// An OpenAI error body whose code matches `http_status`: a status no status code maps to (405,
// 413, 431) names itself, any other follows the status code.
Response ErrorResponse(int http_status, const absl::Status& status, const std::string& param = "") {
  Response r;
  r.status = http_status;
  r.body = OpenAiErrorBody(status, param,
                           http_status == HttpStatusFor(status.code())
                               ? std::string()
                               : OpenAiErrorCodeForHttp(http_status));
  if (http_status == 429) r.Set("Retry-After", "1");
  return r;
}

Response ErrorResponse(const absl::Status& status, const std::string& param = "") {
  return ErrorResponse(HttpStatusFor(status.code()), status, param);
}

std::string StatusLine(int status) {
  return absl::StrCat("HTTP/1.1 ", status, " ",
                      std::string(http::obsolete_reason(static_cast<http::status>(status))),
                      "\r\n");
}

// The bytes of `r` on the wire (no body for HEAD).
std::string Serialize(const Response& r, bool keep_alive, bool head) {
  std::string out = StatusLine(r.status);
  absl::StrAppend(&out, "Content-Type: ", r.content_type, "\r\nContent-Length: ", r.body.size(),
                  "\r\n");
  for (const auto& [name, value] : r.headers) absl::StrAppend(&out, name, ": ", value, "\r\n");
  if (!keep_alive) out += "Connection: close\r\n";
  out += "\r\n";
  if (!head) out += r.body;
  return out;
}

// One chunk of a chunked body.
std::string Chunk(const std::string& data) {
  if (data.empty()) return "";
  return absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n");
}

}  // namespace

class OpenAiHttpServer::Impl {
 public:
  class Session;
  struct Exchange;

  Impl(GenerationCore* core, HttpServerOptions options, prometheus::Registry* registry)
      : core_(core), options_(std::move(options)), created_(absl::ToUnixSeconds(absl::Now())) {
    if (registry != nullptr) {
      requests_ = &prometheus::BuildCounter()
                       .Name("dgserve_gateway_http_requests_total")
                       .Help("HTTP requests of the OpenAI API by route and status code")
                       .Register(*registry);
      duration_ = &prometheus::BuildHistogram()
                       .Name("dgserve_gateway_http_request_duration_seconds")
                       .Help("HTTP request latency by route (streams: until the last byte)")
                       .Register(*registry);
      open_connections_ = &prometheus::BuildGauge()
                               .Name("dgserve_gateway_http_open_connections")
                               .Help("Open HTTP connections (idle keep-alive ones included)")
                               .Register(*registry)
                               .Add({});
      open_streams_ = &prometheus::BuildGauge()
                           .Name("dgserve_gateway_http_open_streams")
                           .Help("SSE streams being written")
                           .Register(*registry)
                           .Add({});
    }
  }

  absl::StatusOr<int> Start();
  void Stop();

  std::atomic<bool> stopping{false};
  std::atomic<bool> draining{false};

 private:
  void DoAccept();
  // On the session's strand: answers `req` (or starts its generation).
  void HandleRequest(const std::shared_ptr<Session>& s, Request req);
  void StartGenerate(const std::shared_ptr<Session>& s, const Request& req,
                     const std::string& route, absl::Time start, const std::string& local_id);
  // The generating thread's body.
  void RunGenerate(std::shared_ptr<Exchange> ex, v1::GenerateRequest request, absl::Time deadline,
                   ResponseContext ctx, bool stream, bool include_usage);
  Response Dispatch(const Request& req, const std::string& path, const std::string& route);
  void Record(const std::string& route, int code, absl::Duration elapsed);
  void Register(uint64_t id, std::weak_ptr<Session> s);
  void Unregister(uint64_t id);

  GenerationCore* core_;
  const HttpServerOptions options_;
  const int64_t created_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* duration_ = nullptr;
  prometheus::Gauge* open_connections_ = nullptr;
  prometheus::Gauge* open_streams_ = nullptr;

  std::mutex sessions_mu_;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> sessions_;
  uint64_t next_session_id_ = 0;

  std::mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  std::set<std::shared_ptr<Exchange>> jobs_;  // generations whose thread runs

  // Declared last: destroyed first, with the handlers (and sessions) it still holds.
  asio::io_context ioc_;
  std::optional<tcp::acceptor> acceptor_;
  std::optional<asio::steady_timer> accept_retry_;
  std::vector<std::thread> io_threads_;
};

// What a generating thread shares with its connection. The thread never touches the Session:
// it posts to the connection's strand, and waits here while too many bytes are unwritten.
struct OpenAiHttpServer::Impl::Exchange {
  std::weak_ptr<Session> session;
  asio::any_io_executor executor;  // the connection's strand
  std::string route;
  absl::Time start;

  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;  // stream bytes posted and not yet written
  std::atomic<bool> cancelled{false};

  void Cancel() {
    std::lock_guard<std::mutex> lock(mu);
    cancelled = true;
    cv.notify_all();
  }
  bool IsCancelled() const { return cancelled.load(); }
  void Written(size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    pending -= std::min(pending, n);
    cv.notify_all();
  }
  // Runs `fn` on the connection's strand if the connection still exists.
  void Post(std::function<void(Session&)> fn) {
    asio::post(executor, [weak = session, fn = std::move(fn)] {
      if (std::shared_ptr<Session> s = weak.lock()) fn(*s);
    });
  }
  // Producer side: waits while more than `limit` bytes are unwritten; false when cancelled.
  bool Send(std::string bytes, size_t limit);
};

// One connection. Everything runs on its strand.
class OpenAiHttpServer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Impl* impl, tcp::socket socket, uint64_t id)
      : impl_(impl),
        socket_(std::move(socket)),
        id_(id),
        idle_timer_(socket_.get_executor()),
        read_timer_(socket_.get_executor()),
        write_timer_(socket_.get_executor()),
        keepalive_timer_(socket_.get_executor()) {
    if (impl_->open_connections_) impl_->open_connections_->Increment();
  }
  ~Session() {
    if (exchange_) exchange_->Cancel();
    if (streaming_ && impl_->open_streams_) impl_->open_streams_->Decrement();
    if (impl_->open_connections_) impl_->open_connections_->Decrement();
    impl_->Unregister(id_);
  }

  void Start() {
    asio::dispatch(socket_.get_executor(), [self = shared_from_this()] { self->ReadNext(); });
  }
  asio::any_io_executor executor() { return socket_.get_executor(); }
  bool head() const { return head_; }

  // Closes the socket at once; cancels the request in progress. Only from the strand, or once
  // the event loop has stopped.
  void Close() {
    if (state_ == State::kClosed) return;
    state_ = State::kClosed;
    if (exchange_) exchange_->Cancel();
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    idle_timer_.cancel();
    read_timer_.cancel();
    write_timer_.cancel();
    keepalive_timer_.cancel();
  }

  // An answer that is not a stream; the connection then goes on to the next request.
  void Respond(const Response& r, const std::string& route, absl::Time start) {
    if (state_ == State::kClosed) return;
    impl_->Record(route, r.status, absl::Now() - start);  // before the client can see the answer
    Write(Serialize(r, keep_alive_ && !impl_->stopping, head_), false);
    EndExchange();
  }

  // The head of an SSE stream (chunked).
  void StartStream(const std::string& request_id) {
    if (state_ == State::kClosed) return;
    std::string head = StatusLine(200);
    absl::StrAppend(&head,
                    "Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                    "X-Accel-Buffering: no\r\nX-Request-Id: ",
                    request_id, "\r\nTransfer-Encoding: chunked\r\n");
    if (!keep_alive_) head += "Connection: close\r\n";
    head += "\r\n";
    Write(std::move(head), false);
    streaming_ = true;
    if (impl_->open_streams_) impl_->open_streams_->Increment();
    ArmKeepAlive();
  }

  // A stream's last bytes (final frames and the last chunk).
  void EndStream(std::string bytes, const std::string& route, absl::Time start) {
    if (state_ == State::kClosed) return;
    impl_->Record(route, 200, absl::Now() - start);
    Write(std::move(bytes), false);
    keepalive_timer_.cancel();
    EndExchange();
  }

  // Queues bytes; `counted` ones are a stream's and are reported to its exchange once written.
  void Write(std::string bytes, bool counted) {
    if (state_ == State::kClosed || bytes.empty()) return;
    wrote_since_tick_ = true;
    out_.push_back({std::move(bytes), counted});
    if (!writing_) DoWrite();
  }

  // Starts a generation on this connection: keeps a read posted to notice the client leaving.
  void BeginExchange(std::shared_ptr<Exchange> ex) {
    exchange_ = std::move(ex);
    if (!reading_ && buffer_.size() < kMaxReadAheadBytes) ReadSome();
  }

 private:
  enum class State {
    kIdle,      // waiting for the first byte of a request
    kReading,   // reading a request
    kBusy,      // answering a request
    kClosing,   // last answer written; dropping what still arrives, then close
    kClosed,
  };
  struct OutBuf {
    std::string data;
    bool counted;
  };

  void Arm(asio::steady_timer& timer, absl::Duration d, void (Session::*on_expiry)()) {
    timer.expires_after(ToSteady(d));
    timer.async_wait([self = shared_from_this(), on_expiry](error_code ec) {
      if (!ec) ((*self).*on_expiry)();
    });
  }

  void ReadNext() {
    if (state_ == State::kClosed) return;
    state_ = State::kIdle;
    head_ = false;
    if (impl_->stopping) {
      Close();
      return;
    }
    if (buffer_.size() > 0) {
      ReadRequest();
      return;
    }
    Arm(idle_timer_, impl_->options_.idle_timeout, &Session::Close);
    if (!reading_) ReadSome();
  }

  void ReadSome() {
    reading_ = true;
    socket_.async_read_some(buffer_.prepare(4096),
                            [self = shared_from_this()](error_code ec, size_t n) {
                              self->OnReadSome(ec, n);
                            });
  }

  void OnReadSome(error_code ec, size_t n) {
    reading_ = false;
    if (state_ == State::kClosed) return;
    const bool was_cancel = cancelling_read_;
    cancelling_read_ = false;
    if (ec && !(was_cancel && ec == asio::error::operation_aborted)) {
      // EOF or reset: the client is gone (cancels the request in progress, if any).
      Close();
      return;
    }
    buffer_.commit(n);
    switch (state_) {
      case State::kIdle:
        if (buffer_.size() > 0) {
          idle_timer_.cancel();
          ReadRequest();
        } else {
          ReadSome();
        }
        break;
      case State::kBusy:
        if (buffer_.size() < kMaxReadAheadBytes) ReadSome();
        break;
      case State::kClosing:
        lingered_ += buffer_.size();
        buffer_.consume(buffer_.size());
        if (lingered_ < kLingerBytes) {
          ReadSome();
        } else {
          Close();
        }
        break;
      case State::kReading:
      case State::kClosed:
        break;
    }
  }

  void ReadRequest() {
    state_ = State::kReading;
    parser_.emplace();
    parser_->header_limit(static_cast<std::uint32_t>(impl_->options_.max_header_bytes));
    parser_->body_limit(impl_->options_.max_body_bytes);
    Arm(read_timer_, impl_->options_.read_timeout, &Session::Close);
    reading_ = true;
    http::async_read_header(socket_, buffer_, *parser_,
                            [self = shared_from_this()](error_code ec, size_t) {
                              self->OnHeader(ec);
                            });
  }

  void OnHeader(error_code ec) {
    reading_ = false;
    if (state_ == State::kClosed) return;
    if (ec) {
      OnReadError(ec);
      return;
    }
    const Request& req = parser_->get();
    if (absl::EqualsIgnoreCase(Header(req, http::field::expect), "100-continue") &&
        !parser_->is_done()) {
      Write("HTTP/1.1 100 Continue\r\n\r\n", false);
    }
    if (parser_->is_done()) {
      OnRequest();
      return;
    }
    reading_ = true;
    http::async_read(socket_, buffer_, *parser_,
                     [self = shared_from_this()](error_code ec, size_t) {
                       self->reading_ = false;
                       if (self->state_ == State::kClosed) return;
                       if (ec) {
                         self->OnReadError(ec);
                       } else {
                         self->OnRequest();
                       }
                     });
  }

  void OnReadError(error_code ec) {
    read_timer_.cancel();
    if (ec == http::error::end_of_stream || ec == asio::error::eof ||
        ec == asio::error::operation_aborted || ec == asio::error::connection_reset) {
      Close();
      return;
    }
    // The request cannot be read further: answer and close.
    state_ = State::kBusy;
    keep_alive_ = false;
    const absl::Time now = absl::Now();
    Response r;
    if (ec == http::error::body_limit) {
      r = ErrorResponse(413, absl::InvalidArgumentError(absl::StrCat(
                                 "request body larger than ", impl_->options_.max_body_bytes,
                                 " bytes")));
    } else if (ec == http::error::header_limit) {
      r = ErrorResponse(431, absl::InvalidArgumentError(absl::StrCat(
                                 "request head larger than ", impl_->options_.max_header_bytes,
                                 " bytes")));
    } else {
      r = ErrorResponse(400, absl::InvalidArgumentError(
                                 absl::StrCat("malformed HTTP request: ", ec.message())));
    }
    r.Set("X-Request-Id", LocalRequestId());
    // A too large request to a generation route is a refused generation request.
    std::string route = "other";
    // (The request line is parsed even when a header field, e.g. Content-Length, failed.)
    if (parser_ && !parser_->get().target().empty()) {
      std::string path(parser_->get().target());
      path.resize(std::min(path.size(), path.find('?')));
      if (IsPostRoute(RouteOf(path))) {
        route = RouteOf(path);
        impl_->core_->CountRefused(absl::InvalidArgumentError(r.body));
      }
    }
    Respond(r, route, now);
  }

  void OnRequest() {
    read_timer_.cancel();
    state_ = State::kBusy;
    Request req = parser_->release();
    parser_.reset();
    keep_alive_ = req.keep_alive();
    head_ = req.method() == http::verb::head;
    impl_->HandleRequest(shared_from_this(), std::move(req));
  }

  // The answer in progress is entirely queued: once written, go on to the next request.
  void EndExchange() {
    if (exchange_) exchange_.reset();
    if (streaming_) {
      streaming_ = false;
      if (impl_->open_streams_) impl_->open_streams_->Decrement();
    }
    answer_queued_ = true;
    if (!writing_) AfterAnswer();
  }

  void AfterAnswer() {
    answer_queued_ = false;
    if (state_ == State::kClosed) return;
    if (!keep_alive_ || impl_->stopping) {
      // Graceful close: no more sends, drop what still arrives for a while.
      state_ = State::kClosing;
      error_code ignored;
      socket_.shutdown(tcp::socket::shutdown_send, ignored);
      Arm(idle_timer_, absl::FromChrono(kLingerTime), &Session::Close);
      buffer_.consume(buffer_.size());
      if (!reading_) ReadSome();
      return;
    }
    if (reading_) {
      // The read that watched the connection during the answer: cancel it so that the next
      // request is parsed from what it has read ahead (it may hold a whole pipelined request).
      state_ = State::kIdle;
      head_ = false;
      cancelling_read_ = true;
      Arm(idle_timer_, impl_->options_.idle_timeout, &Session::Close);
      error_code ignored;
      socket_.cancel(ignored);
      return;
    }
    ReadNext();
  }

  void DoWrite() {
    writing_ = true;
    Arm(write_timer_, impl_->options_.write_timeout, &Session::Close);
    asio::async_write(socket_, asio::buffer(out_.front().data),
                      [self = shared_from_this()](error_code ec, size_t) { self->OnWrite(ec); });
  }

  void OnWrite(error_code ec) {
    writing_ = false;
    write_timer_.cancel();
    if (state_ == State::kClosed) return;
    if (ec) {
      Close();
      return;
    }
    OutBuf done = std::move(out_.front());
    out_.pop_front();
    if (done.counted && exchange_) exchange_->Written(done.data.size());
    if (!out_.empty()) {
      DoWrite();
    } else if (answer_queued_) {
      AfterAnswer();
    }
  }

  void ArmKeepAlive() {
    wrote_since_tick_ = false;
    Arm(keepalive_timer_, impl_->options_.sse_keepalive_interval, &Session::OnKeepAliveTick);
  }
  void OnKeepAliveTick() {
    if (state_ != State::kBusy || !streaming_) return;
    if (!wrote_since_tick_) Write(Chunk(": keep-alive\n\n"), false);
    ArmKeepAlive();
  }

  Impl* impl_;
  tcp::socket socket_;
  const uint64_t id_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  asio::steady_timer idle_timer_, read_timer_, write_timer_, keepalive_timer_;
  std::deque<OutBuf> out_;
  std::shared_ptr<Exchange> exchange_;
  State state_ = State::kIdle;
  bool reading_ = false;           // a read is posted on the socket
  bool cancelling_read_ = false;   // ...and is being cancelled to parse the next request
  bool writing_ = false;
  bool answer_queued_ = false;     // the whole answer is in out_: go on once it is written
  bool keep_alive_ = true;
  bool head_ = false;
  bool streaming_ = false;
  bool wrote_since_tick_ = false;
  size_t lingered_ = 0;
};

bool OpenAiHttpServer::Impl::Exchange::Send(std::string bytes, size_t limit) {
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return cancelled.load() || pending < limit; });
    if (cancelled) return false;
    pending += bytes.size();
  }
  Post([bytes = std::move(bytes)](Session& s) mutable { s.Write(std::move(bytes), true); });
  return true;
}

void OpenAiHttpServer::Impl::Record(const std::string& route, int code, absl::Duration elapsed) {
  if (requests_ == nullptr) return;
  const std::string label = route.empty() ? "other" : route;
  requests_->Add({{"route", label}, {"code", std::to_string(code)}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
  duration_->Add({{"route", label}}, kBuckets).Observe(absl::ToDoubleSeconds(elapsed));
}

void OpenAiHttpServer::Impl::Register(uint64_t id, std::weak_ptr<Session> s) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  sessions_.emplace(id, std::move(s));
}

void OpenAiHttpServer::Impl::Unregister(uint64_t id) {
  std::lock_guard<std::mutex> lock(sessions_mu_);
  sessions_.erase(id);
}

void OpenAiHttpServer::Impl::DoAccept() {
  acceptor_->async_accept(asio::make_strand(ioc_), [this](error_code ec, tcp::socket socket) {
    if (!acceptor_->is_open() || stopping) return;
    if (ec) {
      // Out of file descriptors (or a transient error): try again shortly, not in a busy loop.
      DGSERVE_LOG_WARNING("HTTP accept: %s", ec.message());
      accept_retry_->expires_after(std::chrono::milliseconds(50));
      accept_retry_->async_wait([this](error_code e) {
        if (!e && !stopping) DoAccept();
      });
      return;
    }
    error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    uint64_t id;
    {
      std::lock_guard<std::mutex> lock(sessions_mu_);
      id = next_session_id_++;
    }
    auto session = std::make_shared<Session>(this, std::move(socket), id);
    Register(id, session);
    session->Start();
    DoAccept();
  });
}

void OpenAiHttpServer::Impl::HandleRequest(const std::shared_ptr<Session>& s, Request req) {
  const absl::Time start = absl::Now();
  std::string path(req.target());
  if (size_t q = path.find('?'); q != std::string::npos) path.resize(q);
  const std::string route = RouteOf(path);
  const std::string local_id = LocalRequestId();
  const std::string method(req.method_string());

  Response r;
  if (route.empty()) {
    r = ErrorResponse(404, absl::NotFoundError(absl::StrCat("unknown path: ", path)));
  } else if (IsPostRoute(route) ? method != "POST" : (method != "GET" && method != "HEAD")) {
    const char* allow = IsPostRoute(route) ? "POST" : "GET, HEAD";
    const absl::Status status = absl::InvalidArgumentError(absl::StrCat(
        "method ", method, " not allowed on ", route, " (allowed: ", allow, ")"));
    if (IsPostRoute(route)) core_->CountRefused(status);
    r = ErrorResponse(405, status);
    r.Set("Allow", allow);
  } else if (absl::Status auth = (route == "/health" || route == "/ready")
                                     ? absl::OkStatus()
                                     : core_->CheckApiKey(BearerToken(req));
             !auth.ok()) {
    if (IsPostRoute(route)) core_->CountRefused(auth);
    r = ErrorResponse(401, auth);
    r.Set("WWW-Authenticate", "Bearer");
  } else if (IsPostRoute(route)) {
    StartGenerate(s, req, route, start, local_id);
    return;
  } else {
    r = Dispatch(req, path, route);
  }
  r.Set("X-Request-Id", local_id);
  s->Respond(r, route, start);
}

Response OpenAiHttpServer::Impl::Dispatch(const Request& req, const std::string& path,
                                          const std::string& route) {
  Response r;
  if (route == "/health") {
    r.body = R"({"status":"ok"})";
  } else if (route == "/ready") {
    const bool is_draining = draining.load();
    const bool ready = !is_draining && core_->Ready();
    r.status = ready ? 200 : 503;
    r.body = nlohmann::json{{"status", ready         ? "ready"
                                       : is_draining ? "draining"
                                                     : "not_ready"}}
                 .dump();
  } else if (route == "/v1/models") {
    r.body = ModelsListJson(core_->ListModels(), created_);
  } else if (route == "/v1/models/{id}") {
    const std::string id = path.substr(std::string("/v1/models/").size());
    const v1::ListModelsResponse models = core_->ListModels();
    for (const v1::ModelInfo& m : models.models()) {
      if (m.id() == id) {
        r.body = ModelJson(m, created_);
        return r;
      }
    }
    r = ErrorResponse(404, absl::NotFoundError(absl::StrCat("model '", id, "' not found")),
                      "model");
  }
  return r;
}

void OpenAiHttpServer::Impl::StartGenerate(const std::shared_ptr<Session>& s, const Request& req,
                                           const std::string& route, absl::Time start,
                                           const std::string& local_id) {
  const bool chat = route == "/v1/chat/completions";
  // A refusal before the core runs the request (counted in the core's request metrics).
  auto refuse = [&](const absl::Status& status, Response r) {
    core_->CountRefused(status);
    r.Set("X-Request-Id", local_id);
    s->Respond(r, route, start);
  };
  absl::StatusOr<OpenAiRequest> parsed =
      chat ? ParseChatCompletionsRequest(req.body()) : ParseCompletionsRequest(req.body());
  if (!parsed.ok()) {
    return refuse(parsed.status(),
                  ErrorResponse(400, parsed.status(), ErrorParam(parsed.status())));
  }
  absl::Duration timeout = options_.default_timeout;
  if (req.count("X-Request-Timeout") > 1) {
    // Which one the client meant is unknowable (a proxy may have added one): refused.
    const absl::Status bad =
        absl::InvalidArgumentError("X-Request-Timeout: given more than once");
    return refuse(bad, ErrorResponse(400, bad));
  }
  if (auto it = req.find("X-Request-Timeout"); it != req.end()) {
    double seconds = 0;
    if (!absl::SimpleAtod(std::string(it->value()), &seconds) || !std::isfinite(seconds) ||
        seconds <= 0 || seconds > kMaxTimeoutSeconds) {
      const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
          "X-Request-Timeout: must be a number of seconds in (0, ", kMaxTimeoutSeconds, "]"));
      return refuse(bad, ErrorResponse(400, bad));
    }
    // A client may shorten its deadline, never extend it past the server's.
    timeout = std::min(timeout, absl::Seconds(seconds));
  }
  if (absl::Status admit = core_->CheckAdmission(); !admit.ok()) {
    // Already counted by the core.
    Response r = ErrorResponse(admit);
    r.Set("X-Request-Id", local_id);
    return s->Respond(r, route, start);
  }
  const absl::Time deadline = absl::Now() + timeout;
  ResponseContext ctx{local_id, parsed->model.empty() ? core_->model_id() : parsed->model,
                      absl::ToUnixSeconds(absl::Now()), chat};

  auto ex = std::make_shared<Exchange>();
  ex->session = s;
  ex->executor = s->executor();
  ex->route = route;
  ex->start = start;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    if (stopping) {
      const absl::Status st = absl::UnavailableError("the server is stopping");
      return refuse(st, ErrorResponse(st));
    }
    jobs_.insert(ex);
  }
  s->BeginExchange(ex);
  try {
    std::thread([this, ex, request = std::move(parsed->request), deadline, ctx,
                 stream = parsed->stream, include_usage = parsed->include_usage]() mutable {
      RunGenerate(ex, std::move(request), deadline, std::move(ctx), stream, include_usage);
      std::lock_guard<std::mutex> lock(jobs_mu_);
      jobs_.erase(ex);
      // This may be the last reference to the exchange, which holds the connection's strand:
      // drop it while Stop() still waits, not after the io_context (and its strand service) is
      // gone (ASan: heap-use-after-free in ~strand_impl at shutdown).
      ex.reset();
      jobs_cv_.notify_all();
    }).detach();
  } catch (const std::system_error& e) {
    {
      std::lock_guard<std::mutex> lock(jobs_mu_);
      jobs_.erase(ex);
    }
    const absl::Status st = absl::ResourceExhaustedError(
        absl::StrCat("cannot start a generation thread: ", e.what()));
    refuse(st, ErrorResponse(st));
  }
}

void OpenAiHttpServer::Impl::RunGenerate(std::shared_ptr<Exchange> ex, v1::GenerateRequest request,
                                         absl::Time deadline, ResponseContext ctx, bool stream,
                                         bool include_usage) {
  auto gone = [this, &ex] { return stopping.load() || ex->IsCancelled(); };
  const std::string route = ex->route;
  const absl::Time start = ex->start;
  const std::string local_id = ctx.request_id;
  auto run = [&](const GenerationCore::EventCallback& on_event) {
    try {
      return core_->Generate(request, deadline, gone, on_event);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("internal error: ", e.what()));
    } catch (...) {
      return absl::InternalError("internal error: unknown exception");
    }
  };

  if (!stream) {
    ResponseAccumulator acc;
    absl::Status status = run([&](const v1::GenerateEvent& event) {
      acc.OnEvent(event);
      return !gone();
    });
    Response r;
    if (!status.ok()) {
      r = ErrorResponse(status, CoreErrorParam(status, ctx.chat));
    } else if (!acc.finished()) {
      r = ErrorResponse(absl::InternalError("generation ended without a finish event"));
    } else {
      r.body = acc.Json(ctx);
    }
    r.Set("X-Request-Id", acc.request_id().empty() ? local_id : acc.request_id());
    ex->Post([r = std::move(r), route, start](Session& s) { s.Respond(r, route, start); });
    return;
  }

  StreamFormatter formatter(ctx, include_usage, request.n());
  bool started = false;
  const size_t limit = std::max<size_t>(1, options_.max_pending_stream_bytes);
  absl::Status status = run([&](const v1::GenerateEvent& event) {
    std::string frames = formatter.OnEvent(event);
    if (frames.empty()) return !gone();
    if (!started) {
      started = true;
      const std::string id =
          formatter.context().request_id.empty() ? local_id : formatter.context().request_id;
      ex->Post([id](Session& s) { s.StartStream(id); });
    }
    if (stopping) return false;
    return ex->Send(Chunk(frames), limit);
  });
  if (!started) {
    // Nothing was produced: an ordinary HTTP response.
    if (status.ok()) status = absl::InternalError("generation ended without any event");
    Response r = ErrorResponse(status, CoreErrorParam(status, ctx.chat));
    r.Set("X-Request-Id", local_id);
    ex->Post([r = std::move(r), route, start](Session& s) { s.Respond(r, route, start); });
    return;
  }
  std::string tail = Chunk(formatter.OnEnd(status)) + "0\r\n\r\n";
  ex->Post([tail = std::move(tail), route, start](Session& s) mutable {
    s.EndStream(std::move(tail), route, start);
  });
}

absl::StatusOr<int> OpenAiHttpServer::Impl::Start() {
  error_code ec;
  tcp::resolver resolver(ioc_);
  auto results = resolver.resolve(options_.host, std::to_string(options_.port),
                                  tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || results.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options_.host, ":", options_.port, ": ", ec.message()));
  }
  const tcp::endpoint endpoint = results.begin()->endpoint();
  // The acceptor and its retry timer live on a strand of their own (several loop threads).
  acceptor_.emplace(asio::make_strand(ioc_));
  accept_retry_.emplace(acceptor_->get_executor());
  // SO_REUSEADDR only (no SO_REUSEPORT): a second server cannot bind a port in use.
  if (acceptor_->open(endpoint.protocol(), ec) ||
      acceptor_->set_option(asio::socket_base::reuse_address(true), ec) ||
      acceptor_->bind(endpoint, ec) ||
      acceptor_->listen(asio::socket_base::max_listen_connections, ec)) {
    acceptor_.reset();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.host, ":",
                                               options_.port, " (", ec.message(), ")"));
  }
  const int port = acceptor_->local_endpoint().port();
  DoAccept();
  for (int i = 0; i < std::max(1, options_.io_threads); ++i) {
    io_threads_.emplace_back([this] { ioc_.run(); });
  }
  return port;
}

void OpenAiHttpServer::Impl::Stop() {
  stopping = true;
  if (acceptor_) {
    asio::post(acceptor_->get_executor(), [this] {
      error_code ignored;
      acceptor_->close(ignored);
      accept_retry_->cancel();
    });
  }
  // Cancel the generations and wait for their threads (the core sees is_cancelled).
  {
    std::unique_lock<std::mutex> lock(jobs_mu_);
    for (const std::shared_ptr<Exchange>& ex : jobs_) ex->Cancel();
    jobs_cv_.wait(lock, [&] { return jobs_.empty(); });
  }
  ioc_.stop();
  for (std::thread& t : io_threads_) t.join();
  io_threads_.clear();
  // The loop has stopped: nothing else touches the sessions now.
  std::vector<std::shared_ptr<Session>> open;
  {
    std::lock_guard<std::mutex> lock(sessions_mu_);
    for (auto& [id, weak] : sessions_) {
      if (std::shared_ptr<Session> s = weak.lock()) open.push_back(std::move(s));
    }
  }
  for (const std::shared_ptr<Session>& s : open) s->Close();
}

OpenAiHttpServer::OpenAiHttpServer(GenerationCore* core, HttpServerOptions options,
                                   prometheus::Registry* registry)
    : impl_(std::make_unique<Impl>(core, std::move(options), registry)) {}

OpenAiHttpServer::~OpenAiHttpServer() { Stop(); }

absl::StatusOr<int> OpenAiHttpServer::Start() {
  if (started_ || impl_->stopping) {
    return absl::FailedPreconditionError("the HTTP server was already started or stopped");
  }
  absl::StatusOr<int> port = impl_->Start();
  if (!port.ok()) return port.status();
  started_ = true;
  port_ = *port;
  return port_;
}

void OpenAiHttpServer::Stop() {
  if (!started_) {
    impl_->stopping = true;
    return;
  }
  if (stopped_) return;
  stopped_ = true;
  impl_->Stop();
}

void OpenAiHttpServer::SetDraining(bool draining) { impl_->draining = draining; }

}  // namespace dgserve
