#include "gateway/http_connection.h"

#include <algorithm>
#include <chrono>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_convert.h"
#include "engine/tokenizer/utf8.h"
#include "gateway/openai_api.h"

namespace dgserve::http_internal {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;

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

std::string StatusLine(int status) {
  return absl::StrCat("HTTP/1.1 ", status, " ",
                      std::string(http::obsolete_reason(static_cast<http::status>(status))),
                      "\r\n");
}

// The bytes of `r` on the wire (no body for HEAD). An HTTP/1.0 connection kept alive is told so
// (RFC 9112 §9.3: a 1.0 client closes otherwise).
std::string Serialize(const HttpResponse& r, bool keep_alive, bool head, bool http10) {
  std::string out = StatusLine(r.status);
  absl::StrAppend(&out, "Content-Type: ", r.content_type, "\r\nContent-Length: ", r.body.size(),
                  "\r\n");
  for (const auto& [name, value] : r.headers) absl::StrAppend(&out, name, ": ", value, "\r\n");
  if (!keep_alive) {
    out += "Connection: close\r\n";
  } else if (http10) {
    out += "Connection: keep-alive\r\n";
  }
  out += "\r\n";
  if (!head) out += r.body;
  return out;
}

// True when the request has one Transfer-Encoding field and it is "chunked" alone.
bool OnlyChunked(const HttpRequest& req) {
  if (req.count(http::field::transfer_encoding) != 1) return false;
  const std::string value = HeaderValue(req, http::field::transfer_encoding);
  return absl::AsciiStrToLower(absl::StripAsciiWhitespace(value)) == "chunked";
}

// RFC 9112 §3.2: an HTTP/1.1 request without a Host field, and any request with more than one
// Host field line, is a bad request (an HTTP/1.0 one may leave Host out). An empty value is
// allowed (a target without an authority).
absl::Status CheckHostField(const HttpRequest& req) {
  const size_t hosts = req.count(http::field::host);
  if (hosts > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request has ", hosts,
                     " Host header fields; at most one is allowed (RFC 9112 section 3.2)"));
  }
  if (hosts == 0 && req.version() >= 11) {
    return absl::InvalidArgumentError(
        "the request has no Host header field; an HTTP/1.1 request must have one (RFC 9112 "
        "section 3.2)");
  }
  return absl::OkStatus();
}

}  // namespace

namespace {
// The value of a hexadecimal digit, or -1.
int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
}  // namespace

std::string RequestPath(std::string_view target) {
  std::string path(target);
  // Absolute form (RFC 9112 §3.2.2): "http://host[:port]/path"; the authority is dropped.
  for (const std::string scheme : {"http://", "https://"}) {
    if (path.size() >= scheme.size() &&
        absl::EqualsIgnoreCase(path.substr(0, scheme.size()), scheme)) {
      const size_t slash = path.find_first_of("/?", scheme.size());
      if (slash == std::string::npos || path[slash] == '?') return "/";
      path.erase(0, slash);
      break;
    }
  }
  path.resize(std::min(path.size(), path.find('?')));
  // Percent-decoded (RFC 3986 §2.1), as Starlette (under vLLM) matches routes.
  std::string decoded;
  decoded.reserve(path.size());
  for (size_t i = 0; i < path.size(); ++i) {
    int hi = 0, lo = 0;
    if (path[i] == '%' && i + 2 < path.size() && (hi = HexDigit(path[i + 1])) >= 0 &&
        (lo = HexDigit(path[i + 2])) >= 0) {
      decoded.push_back(char(hi * 16 + lo));
      i += 2;
    } else {
      decoded.push_back(path[i]);
    }
  }
  // Kept as sent when the bytes it stands for are not text: such a path matches no route, and
  // the 404 quotes it as sent.
  if (!tokenizer_internal::IsValidUtf8(decoded)) return path;
  for (unsigned char ch : decoded) {
    if (ch < 0x20 || ch == 0x7f) return path;
  }
  return decoded;
}

void HttpResponse::Set(const std::string& name, const std::string& value) {
  for (auto& [n, v] : headers) {
    if (n == name) {
      v = value;
      return;
    }
  }
  headers.emplace_back(name, value);
}

HttpResponse ErrorResponse(int http_status, const absl::Status& status, const std::string& param) {
  HttpResponse r;
  r.status = http_status;
  r.body = OpenAiErrorBody(status, param,
                           http_status == HttpStatusFor(status.code())
                               ? std::string()
                               : OpenAiErrorCodeForHttp(http_status));
  if (http_status == 429) r.Set("Retry-After", "1");
  return r;
}

HttpResponse ErrorResponse(const absl::Status& status, const std::string& param) {
  return ErrorResponse(HttpStatusFor(status.code()), status, param);
}

std::string HeaderValue(const HttpRequest& req, http::field f) {
  auto it = req.find(f);
  return it == req.end() ? std::string() : std::string(it->value());
}

std::string LocalRequestId() {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrCat("gw-", absl::Hex(rng(), absl::kZeroPad16), "-", counter.fetch_add(1));
}

std::string Chunk(const std::string& data) {
  if (data.empty()) return "";
  return absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n");
}

bool BodyBudget::TryTake(size_t n) {
  size_t used = in_use_.load();
  do {
    if (limit_ != 0 && used != 0 && (used > limit_ || n > limit_ - used)) return false;
  } while (!in_use_.compare_exchange_weak(used, used + n));
  return true;
}

void HttpExchange::Cancel() {
  std::lock_guard<std::mutex> lock(mu);
  cancelled = true;
  cv.notify_all();
}

void HttpExchange::Written(size_t n) {
  std::lock_guard<std::mutex> lock(mu);
  pending -= std::min(pending, n);
  cv.notify_all();
}

void HttpExchange::Post(std::function<void(HttpConnection&)> fn) {
  asio::post(executor, [weak = connection, fn = std::move(fn)] {
    if (std::shared_ptr<HttpConnection> c = weak.lock()) fn(*c);
  });
}

bool HttpExchange::Send(std::string bytes, size_t limit) {
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return cancelled.load() || pending < limit; });
    if (cancelled) return false;
    pending += bytes.size();
  }
  Post([bytes = std::move(bytes)](HttpConnection& c) mutable {
    c.WriteStreamData(std::move(bytes), /*counted=*/true);
  });
  return true;
}

HttpConnection::HttpConnection(ConnectionHost* host, tcp::socket socket, uint64_t id)
    : host_(host),
      socket_(std::move(socket)),
      id_(id),
      idle_timer_(socket_.get_executor()),
      read_timer_(socket_.get_executor()),
      write_timer_(socket_.get_executor()),
      keepalive_timer_(socket_.get_executor()) {
  host_->CountConnections(1);
}

HttpConnection::~HttpConnection() {
  if (exchange_) exchange_->Cancel();
  if (streaming_) host_->CountStreams(-1);
  if (answering_) host_->CountAnswering(-1);
  host_->CountConnections(-1);
  host_->OnClosed(id_);
}

void HttpConnection::Start() {
  asio::dispatch(socket_.get_executor(), [self = shared_from_this()] { self->ReadNext(); });
}

void HttpConnection::Close() {
  if (state_ == State::kClosed) return;
  state_ = State::kClosed;
  body_.Reset();
  SetAnswering(false);
  if (exchange_) exchange_->Cancel();
  error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  idle_timer_.cancel();
  read_timer_.cancel();
  write_timer_.cancel();
  keepalive_timer_.cancel();
}

void HttpConnection::Respond(const HttpResponse& r, const std::string& route, absl::Time start) {
  if (state_ == State::kClosed) return;
  host_->Record(route, r.status, absl::Now() - start);  // before the client can see the answer
  Write(Serialize(r, keep_alive_ && !host_->stopping(), head_, http10_));
  EndExchange();
}

void HttpConnection::StartStream(const std::string& request_id) {
  if (state_ == State::kClosed) return;
  std::string head = StatusLine(200);
  absl::StrAppend(&head,
                  "Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                  "X-Accel-Buffering: no\r\nX-Request-Id: ",
                  request_id, "\r\n");
  if (http10_) {
    keep_alive_ = false;  // the end of the body is the end of the connection
  } else {
    head += "Transfer-Encoding: chunked\r\n";
  }
  if (!keep_alive_) head += "Connection: close\r\n";
  head += "\r\n";
  Write(std::move(head));
  streaming_ = true;
  host_->CountStreams(1);
  ArmKeepAlive();
}

void HttpConnection::EndStream(std::string last_frames, const std::string& route,
                               absl::Time start) {
  if (state_ == State::kClosed) return;
  host_->Record(route, 200, absl::Now() - start);
  WriteStreamData(std::move(last_frames), /*counted=*/false);
  if (!http10_) Write("0\r\n\r\n");  // the last chunk
  keepalive_timer_.cancel();
  EndExchange();
}

void HttpConnection::WriteStreamData(std::string data, bool counted) {
  if (data.empty()) return;
  const size_t n = data.size();
  Queue({http10_ ? std::move(data) : Chunk(data), counted ? n : 0});
}

void HttpConnection::Write(std::string bytes) { Queue({std::move(bytes), 0}); }

void HttpConnection::Queue(OutBuf buf) {
  if (state_ == State::kClosed || buf.data.empty()) return;
  wrote_since_tick_ = true;
  out_.push_back(std::move(buf));
  if (!writing_) DoWrite();
}

void HttpConnection::BeginExchange(std::shared_ptr<HttpExchange> ex) {
  exchange_ = std::move(ex);
  if (!reading_ && buffer_.size() < kMaxReadAheadBytes) ReadSome();
}

void HttpConnection::Arm(asio::steady_timer& timer, absl::Duration d,
                         void (HttpConnection::*on_expiry)()) {
  timer.expires_after(ToSteady(d));
  timer.async_wait([self = shared_from_this(), on_expiry](error_code ec) {
    if (!ec) ((*self).*on_expiry)();
  });
}

void HttpConnection::ReadNext() {
  if (state_ == State::kClosed) return;
  state_ = State::kIdle;
  SetAnswering(false);
  head_ = false;
  if (host_->stopping()) {
    Close();
    return;
  }
  if (buffer_.size() > 0) {
    ReadRequest();
    return;
  }
  Arm(idle_timer_, host_->options().idle_timeout, &HttpConnection::Close);
  if (!reading_) ReadSome();
}

void HttpConnection::ReadSome() {
  reading_ = true;
  socket_.async_read_some(buffer_.prepare(4096),
                          [self = shared_from_this()](error_code ec, size_t n) {
                            self->OnReadSome(ec, n);
                          });
}

void HttpConnection::OnReadSome(error_code ec, size_t n) {
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

void HttpConnection::ReadRequest() {
  state_ = State::kReading;
  parser_.emplace();
  parser_->header_limit(static_cast<std::uint32_t>(host_->options().max_header_bytes));
  parser_->body_limit(host_->options().max_body_bytes);
  read_timed_out_ = false;
  Arm(read_timer_, host_->options().read_timeout, &HttpConnection::OnReadTimeout);
  reading_ = true;
  http::async_read_header(socket_, buffer_, *parser_,
                          [self = shared_from_this()](error_code ec, size_t) {
                            self->OnHeader(ec);
                          });
}

void HttpConnection::OnHeader(error_code ec) {
  reading_ = false;
  if (state_ == State::kClosed) return;
  if (ec) {
    OnReadError(ec);
    return;
  }
  const HttpRequest& req = parser_->get();
  if (absl::Status host = CheckHostField(req); !host.ok()) {
    // Answered once, before the body is read: then the connection closes.
    read_timer_.cancel();
    head_ = req.method() == http::verb::head;
    http10_ = req.version() < 11;
    Refuse(400, host, absl::Now());
    return;
  }
  if (req.find(http::field::transfer_encoding) != req.end() && !OnlyChunked(req)) {
    // Any other coding leaves the body's length unknown (RFC 9112 §6.3): reading on would take
    // the body for the next request. Answered once, then the connection closes.
    read_timer_.cancel();
    Refuse(501,
           absl::UnimplementedError(absl::StrCat(
               "Transfer-Encoding: only \"chunked\" is supported, got \"",
               HeaderValue(req, http::field::transfer_encoding), "\"")),
           absl::Now());
    return;
  }
  if (RefuseOverBudget(req)) return;
  // (An HTTP/1.0 client has no interim responses: its Expect is ignored, RFC 9110 §10.1.1.)
  if (req.version() >= 11 &&
      absl::EqualsIgnoreCase(HeaderValue(req, http::field::expect), "100-continue") &&
      !parser_->is_done()) {
    // A head refused on its own gets its final answer instead of 100 Continue: the client need
    // not send a body that would only be refused. Its body is then never read, so the
    // connection closes after the answer.
    std::string route;
    if (std::optional<HttpResponse> refusal = host_->CheckHead(req, &route)) {
      read_timer_.cancel();
      state_ = State::kBusy;
      SetAnswering(true);
      keep_alive_ = false;
      head_ = req.method() == http::verb::head;
      http10_ = false;
      Respond(*refusal, route, absl::Now());
      return;
    }
    Write("HTTP/1.1 100 Continue\r\n\r\n");
  }
  if (parser_->is_done()) {
    OnRequest();
    return;
  }
  reading_ = true;
  http::async_read(socket_, buffer_, *parser_, [self = shared_from_this()](error_code ec, size_t) {
    self->reading_ = false;
    if (self->state_ == State::kClosed) return;
    if (ec) {
      self->OnReadError(ec);
    } else {
      self->OnRequest();
    }
  });
}

bool HttpConnection::RefuseOverBudget(const HttpRequest& req) {
  // The most bytes the body can hold: its Content-Length, or max_body_bytes when chunked.
  const size_t max_body = host_->options().max_body_bytes;
  size_t bytes = 0;
  if (parser_->chunked()) {
    bytes = max_body;
  } else if (boost::optional<std::uint64_t> length = parser_->content_length()) {
    bytes = size_t(std::min<std::uint64_t>(*length, max_body));
  }
  if (bytes == 0 || parser_->is_done()) return false;
  if (std::optional<BodyReservation> taken = host_->ReserveBody(bytes)) {
    body_ = std::move(*taken);
    return false;
  }
  // Not read: the head's own refusal if it has one (it would come after the body otherwise),
  // else 503. The body is never read, so the connection closes after the answer.
  read_timer_.cancel();
  state_ = State::kBusy;
  SetAnswering(true);
  keep_alive_ = false;
  head_ = req.method() == http::verb::head;
  http10_ = req.version() < 11;
  std::string route;
  if (std::optional<HttpResponse> refusal = host_->CheckHead(req, &route)) {
    Respond(*refusal, route, absl::Now());
    return true;
  }
  const absl::Status status = absl::UnavailableError(absl::StrCat(
      "the server holds its limit of request bodies being read or parsed (",
      host_->options().max_buffered_body_bytes, " bytes, --max_buffered_body_bytes); retry later"));
  HttpResponse r = ErrorResponse(503, status);
  r.Set("Retry-After", "1");
  r.Set("X-Request-Id", LocalRequestId());
  const auto target = req.target();
  Respond(r,
          host_->OnUnreadableRequest(RequestPath(std::string_view(target.data(), target.size())),
                                     status),
          absl::Now());
  return true;
}

void HttpConnection::OnReadTimeout() {
  if (state_ != State::kReading) return;
  if (writing_) {
    // A "100 Continue" not yet written: the client is not reading either.
    Close();
    return;
  }
  read_timed_out_ = true;
  if (reading_) {
    error_code ignored;
    socket_.cancel(ignored);  // the read completes with operation_aborted: OnReadError answers
    return;
  }
  OnReadError(asio::error::operation_aborted);
}

void HttpConnection::OnReadError(error_code ec) {
  read_timer_.cancel();
  body_.Reset();
  if (read_timed_out_ && ec == asio::error::operation_aborted) {
    // Some of a request came, not all of it in time: it gets an answer, not a bare close.
    Refuse(408,
           absl::DeadlineExceededError(absl::StrCat(
               "the request was not received in full within ",
               absl::FormatDuration(host_->options().read_timeout), " of its first byte")),
           absl::Now());
    return;
  }
  if (ec == http::error::end_of_stream || ec == asio::error::eof ||
      ec == asio::error::operation_aborted || ec == asio::error::connection_reset) {
    Close();
    return;
  }
  // The request cannot be read further: answer and close.
  const absl::Time now = absl::Now();
  int code = 400;
  absl::Status status;
  if (ec == http::error::body_limit) {
    code = 413;
    status = absl::InvalidArgumentError(absl::StrCat(
        "request body larger than ", host_->options().max_body_bytes, " bytes"));
  } else if (ec == http::error::header_limit && parser_ && parser_->get().target().empty()) {
    // The limit was reached before the request line ended: the URI is what is too long.
    code = 414;
    status = absl::InvalidArgumentError(absl::StrCat("request line (method and URI) longer than ",
                                                     host_->options().max_header_bytes, " bytes"));
  } else if (ec == http::error::header_limit) {
    code = 431;
    status = absl::InvalidArgumentError(absl::StrCat(
        "request head larger than ", host_->options().max_header_bytes, " bytes"));
  } else {
    status = absl::InvalidArgumentError(absl::StrCat("malformed HTTP request: ", ec.message()));
  }
  Refuse(code, status, now);
}

void HttpConnection::Refuse(int code, const absl::Status& status, absl::Time start) {
  state_ = State::kBusy;
  SetAnswering(true);
  keep_alive_ = false;
  HttpResponse r = ErrorResponse(code, status);
  r.Set("X-Request-Id", LocalRequestId());
  // (The request line is parsed even when a header field, e.g. Content-Length, failed.)
  std::string path;
  if (parser_) {
    const auto target = parser_->get().target();
    path = RequestPath(std::string_view(target.data(), target.size()));
  }
  Respond(r, host_->OnUnreadableRequest(path, status), start);
}

void HttpConnection::OnRequest() {
  read_timer_.cancel();
  state_ = State::kBusy;
  SetAnswering(true);
  HttpRequest req = parser_->release();
  parser_.reset();
  keep_alive_ = req.keep_alive();
  head_ = req.method() == http::verb::head;
  http10_ = req.version() < 11;
  host_->OnRequest(shared_from_this(), std::move(req), std::move(body_));
}

void HttpConnection::EndExchange() {
  if (exchange_) exchange_.reset();
  if (streaming_) {
    streaming_ = false;
    host_->CountStreams(-1);
  }
  answer_queued_ = true;
  if (!writing_) AfterAnswer();
}

void HttpConnection::AfterAnswer() {
  answer_queued_ = false;
  if (state_ == State::kClosed) return;
  if (!keep_alive_ || host_->stopping()) {
    // Graceful close: no more sends, drop what still arrives for a while.
    state_ = State::kClosing;
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    Arm(idle_timer_, absl::FromChrono(kLingerTime), &HttpConnection::Close);
    buffer_.consume(buffer_.size());
    if (!reading_) ReadSome();
    return;
  }
  if (reading_) {
    // The read that watched the connection during the answer: cancel it so that the next
    // request is parsed from what it has read ahead (it may hold a whole pipelined request).
    state_ = State::kIdle;
    SetAnswering(false);
    head_ = false;
    cancelling_read_ = true;
    Arm(idle_timer_, host_->options().idle_timeout, &HttpConnection::Close);
    error_code ignored;
    socket_.cancel(ignored);
    return;
  }
  ReadNext();
}

void HttpConnection::DoWrite() {
  writing_ = true;
  Arm(write_timer_, host_->options().write_timeout, &HttpConnection::Close);
  asio::async_write(socket_, asio::buffer(out_.front().data),
                    [self = shared_from_this()](error_code ec, size_t) { self->OnWrite(ec); });
}

void HttpConnection::OnWrite(error_code ec) {
  writing_ = false;
  write_timer_.cancel();
  if (state_ == State::kClosed) return;
  if (ec) {
    Close();
    return;
  }
  OutBuf done = std::move(out_.front());
  out_.pop_front();
  if (done.counted_bytes > 0 && exchange_) exchange_->Written(done.counted_bytes);
  if (!out_.empty()) {
    DoWrite();
  } else if (answer_queued_) {
    AfterAnswer();
  }
}

void HttpConnection::ArmKeepAlive() {
  wrote_since_tick_ = false;
  Arm(keepalive_timer_, host_->options().sse_keepalive_interval, &HttpConnection::OnKeepAliveTick);
}

void HttpConnection::OnKeepAliveTick() {
  if (state_ != State::kBusy || !streaming_) return;
  if (!wrote_since_tick_) WriteStreamData(": keep-alive\n\n", /*counted=*/false);
  ArmKeepAlive();
}

void HttpConnection::SetAnswering(bool answering) {
  if (answering_ == answering) return;
  answering_ = answering;
  host_->CountAnswering(answering ? 1 : -1);
}

}  // namespace dgserve::http_internal
