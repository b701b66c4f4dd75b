// The OpenAI HTTP server: accepting connections, routing each request, and running generations
// on threads of their own. One connection's HTTP/1.1 state machine is in http_connection.cc.
#include "gateway/http_server.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <boost/asio.hpp>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_convert.h"
#include "gateway/http_connection.h"
#include "gateway/openai_api.h"

namespace dgserve {
namespace {

namespace asio = boost::asio;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using boost::system::error_code;
using http_internal::ErrorResponse;
using http_internal::HeaderValue;
using http_internal::LocalRequestId;
using HttpConnection = http_internal::HttpConnection;
using HttpExchange = http_internal::HttpExchange;
using HttpRequest = http_internal::HttpRequest;
using HttpResponse = http_internal::HttpResponse;

constexpr double kMaxTimeoutSeconds = 86400;

// Generation bodies up to this size are parsed on the event-loop thread that read them (a few
// milliseconds at most); larger ones on the parse pool.
constexpr size_t kInlineParseBytes = 64 << 10;

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

std::string BearerToken(const HttpRequest& req) {
  std::string value(absl::StripAsciiWhitespace(HeaderValue(req, http::field::authorization)));
  constexpr std::string_view kBearer = "bearer ";
  if (value.size() < kBearer.size() ||
      absl::AsciiStrToLower(value.substr(0, kBearer.size())) != kBearer) {
    return "";
  }
  return std::string(absl::StripAsciiWhitespace(value.substr(kBearer.size())));
}

// A generation request's body must be JSON, as FastAPI (vLLM) reads it: no Content-Type, or
// application/json or application/*+json, parameters (charset) ignored. Anything else is 415, so
// that a browser cannot send a cross-site form or text post (text/plain,
// application/x-www-form-urlencoded and multipart/form-data need no CORS preflight) that the
// server runs as a request. A browser can also post an untyped body (fetch of a Blob, sendBeacon)
// without a preflight; browsers send `Origin` with every POST and API clients (curl, the OpenAI
// SDKs) do not, so a request with an Origin must say application/json. Two Content-Type fields
// are 400 (returns INVALID_ARGUMENT; `*http_status` is set to 415 or 400).
absl::Status CheckJsonContentType(const HttpRequest& req, int* http_status) {
  *http_status = 400;
  if (req.count(http::field::content_type) > 1) {
    return absl::InvalidArgumentError("Content-Type: given more than once");
  }
  *http_status = 415;
  const std::string value = HeaderValue(req, http::field::content_type);
  if (absl::StripAsciiWhitespace(value).empty()) {
    if (req.find(http::field::origin) == req.end()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "Content-Type: missing on a request with an Origin (from a browser); send the body as "
        "application/json");
  }
  const std::string media = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(absl::string_view(value).substr(0, value.find(';'))));
  const std::string application = "application/";
  const std::string json_suffix = "+json";
  if (media.compare(0, application.size(), application) == 0) {
    const std::string subtype = media.substr(application.size());
    // A subtype is a token (RFC 9110 §5.6.2): no '/', no whitespace.
    if (subtype.find_first_of("/ \t") == std::string::npos &&
        (subtype == "json" ||
         (subtype.size() >= json_suffix.size() &&
          subtype.compare(subtype.size() - json_suffix.size(), json_suffix.size(), json_suffix) ==
              0))) {
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Content-Type: \"", absl::CHexEscape(value),
                   "\" is not JSON; send the body as application/json (curl: -H "
                   "'Content-Type: application/json')"));
}

// X-Request-Timeout: a decimal number of seconds in (0, kMaxTimeoutSeconds] (strtod alone would
// also read hexadecimal, "inf" and "nan"). A client may shorten its deadline, never extend it
// past the server's: *timeout becomes the smaller of the two. False if the value is not one.
bool ParseTimeoutHeader(const std::string& value, absl::Duration* timeout) {
  double seconds = 0;
  const bool decimal =
      !value.empty() && value.find_first_not_of("0123456789.eE+-") == std::string::npos &&
      absl::c_any_of(value, [](char ch) { return ch >= '0' && ch <= '9'; });
  if (!decimal || !absl::SimpleAtod(value, &seconds) || !std::isfinite(seconds) ||
      seconds <= 0 || seconds > kMaxTimeoutSeconds) {
    return false;
  }
  *timeout = std::min(*timeout, absl::Seconds(seconds));
  return true;
}

// The head checks of a generation request (POST, authorised): its Content-Type (415, or 400)
// and X-Request-Timeout (400; *timeout shortened to it). INVALID_ARGUMENT with the HTTP status
// in *http_status, or OK.
absl::Status GenerationHeadRefusal(const HttpRequest& req, absl::Duration* timeout,
                                   int* http_status) {
  if (absl::Status type = CheckJsonContentType(req, http_status); !type.ok()) return type;
  *http_status = 400;
  if (req.count("X-Request-Timeout") > 1) {
    // Which one the client meant is unknowable (a proxy may have added one): refused.
    return absl::InvalidArgumentError("X-Request-Timeout: given more than once");
  }
  if (auto it = req.find("X-Request-Timeout");
      it != req.end() && !ParseTimeoutHeader(std::string(it->value()), timeout)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "X-Request-Timeout: must be a number of seconds in (0, ", kMaxTimeoutSeconds, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

class OpenAiHttpServer::Impl final : public http_internal::ConnectionHost {
 public:
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

  std::atomic<bool> stopping_flag{false};
  std::atomic<bool> draining{false};

  // ConnectionHost.
  const HttpServerOptions& options() const override { return options_; }
  bool stopping() const override { return stopping_flag.load(); }
  // On the connection's strand: answers `req` (or starts its generation).
  void OnRequest(const std::shared_ptr<HttpConnection>& c, HttpRequest req,
                 http_internal::BodyReservation body) override;
  std::optional<http_internal::BodyReservation> ReserveBody(size_t bytes) override {
    if (!body_budget_.TryTake(bytes)) return std::nullopt;
    return http_internal::BodyReservation(&body_budget_, bytes);
  }
  size_t buffered_body_bytes() const { return body_budget_.in_use(); }
  std::optional<HttpResponse> CheckHead(const HttpRequest& head, std::string* route) override;
  std::string OnUnreadableRequest(const std::string& path, const absl::Status& status) override;
  void Record(const std::string& route, int code, absl::Duration elapsed) override;
  void CountConnections(int delta) override { Add(open_connections_, delta); }
  void CountStreams(int delta) override { Add(open_streams_, delta); }
  void CountAnswering(int delta) override { answering_ += delta; }
  void OnClosed(uint64_t id) override;

 private:
  // Decrement() for a negative delta: not every prometheus-cpp release takes a negative
  // Increment().
  static void Add(prometheus::Gauge* gauge, int delta) {
    if (gauge == nullptr) return;
    if (delta >= 0) {
      gauge->Increment(delta);
    } else {
      gauge->Decrement(-delta);
    }
  }
  void DoAccept();
  // What the head alone decides (404, 405, 401; for a generation route also 415, a bad
  // X-Request-Timeout 400, and admission 429/503): the refusal, counted, with X-Request-Id
  // `local_id`; or nullopt with the request's timeout in *timeout (generation routes).
  std::optional<HttpResponse> HeadRefusal(const HttpRequest& req, const std::string& path,
                                          const std::string& route, const std::string& local_id,
                                          absl::Duration* timeout);
  void StartGenerate(const std::shared_ptr<HttpConnection>& c, HttpRequest req,
                     http_internal::BodyReservation reservation, const std::string& route,
                     absl::Time start, const std::string& local_id, absl::Duration timeout);
  // On the parse pool: parses a generation body, then answers its error or starts the
  // generation's thread.
  // `reservation` holds the body's bytes in the budget until it is parsed.
  void ParseAndStart(std::shared_ptr<HttpExchange> ex, std::string body,
                     http_internal::BodyReservation reservation, bool chat, absl::Time deadline,
                     const std::string& local_id);
  // Removes a finished job (Stop() waits until none is left) and drops `ex`.
  void EndJob(std::shared_ptr<HttpExchange>& ex);
  // The generating thread's body.
  void RunGenerate(std::shared_ptr<HttpExchange> ex, v1::GenerateRequest request,
                   absl::Time deadline, ResponseContext ctx, bool stream, bool include_usage);
  HttpResponse Dispatch(const std::string& path, const std::string& route);

  GenerationCore* core_;
  const HttpServerOptions options_;
  const int64_t created_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* duration_ = nullptr;
  prometheus::Gauge* open_connections_ = nullptr;
  prometheus::Gauge* open_streams_ = nullptr;
  std::atomic<int> answering_{0};  // connections answering a request (CountAnswering)
  http_internal::BodyBudget body_budget_{options_.max_buffered_body_bytes};

  std::mutex connections_mu_;
  std::unordered_map<uint64_t, std::weak_ptr<HttpConnection>> connections_;
  uint64_t next_connection_id_ = 0;

  std::mutex jobs_mu_;
  std::condition_variable jobs_cv_;
  // Generations from the head's checks on: waiting for or in a parse, or on their thread.
  std::set<std::shared_ptr<HttpExchange>> jobs_;

  // Destroyed after parse_pool_ (declared below it) and before everything above, with the
  // handlers (and connections) it still holds.
  asio::io_context ioc_;
  std::optional<tcp::acceptor> acceptor_;
  std::optional<asio::steady_timer> accept_retry_;
  std::vector<std::thread> io_threads_;
  // Parses generation bodies (declared after ioc_: destroyed before it, with any handler still
  // holding an exchange). Stop() joins it once no job is left.
  asio::thread_pool parse_pool_{size_t(std::max(1, options_.parse_threads))};
};

void OpenAiHttpServer::Impl::Record(const std::string& route, int code, absl::Duration elapsed) {
  if (requests_ == nullptr) return;
  const std::string label = route.empty() ? "other" : route;
  requests_->Add({{"route", label}, {"code", std::to_string(code)}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
  duration_->Add({{"route", label}}, kBuckets).Observe(absl::ToDoubleSeconds(elapsed));
}

void OpenAiHttpServer::Impl::OnClosed(uint64_t id) {
  std::lock_guard<std::mutex> lock(connections_mu_);
  connections_.erase(id);
}

std::string OpenAiHttpServer::Impl::OnUnreadableRequest(const std::string& path,
                                                        const absl::Status& status) {
  // A request to a generation route that cannot be read is a refused generation request.
  const std::string route = RouteOf(path);
  if (!IsPostRoute(route)) return "other";
  core_->CountRefused(status);
  return route;
}

void OpenAiHttpServer::Impl::DoAccept() {
  acceptor_->async_accept(asio::make_strand(ioc_), [this](error_code ec, tcp::socket socket) {
    if (!acceptor_->is_open() || stopping_flag) return;
    if (ec) {
      // Out of file descriptors (or a transient error): try again shortly, not in a busy loop.
      DGSERVE_LOG_WARNING("HTTP accept: %s", ec.message());
      accept_retry_->expires_after(std::chrono::milliseconds(50));
      accept_retry_->async_wait([this](error_code e) {
        if (!e && !stopping_flag) DoAccept();
      });
      return;
    }
    error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    std::shared_ptr<HttpConnection> connection;
    {
      // Registered so that Stop() can close it.
      std::lock_guard<std::mutex> lock(connections_mu_);
      const uint64_t id = next_connection_id_++;
      connection = std::make_shared<HttpConnection>(this, std::move(socket), id);
      connections_.emplace(id, connection);
    }
    connection->Start();
    DoAccept();
  });
}

void OpenAiHttpServer::Impl::OnRequest(const std::shared_ptr<HttpConnection>& c, HttpRequest req,
                                       http_internal::BodyReservation body) {
  const absl::Time start = absl::Now();
  const std::string path =
      http_internal::RequestPath(std::string_view(req.target().data(), req.target().size()));
  const std::string route = RouteOf(path);
  const std::string local_id = LocalRequestId();
  absl::Duration timeout = options_.default_timeout;
  if (std::optional<HttpResponse> refusal = HeadRefusal(req, path, route, local_id, &timeout)) {
    return c->Respond(*refusal, route, start);
  }
  if (IsPostRoute(route)) {
    return StartGenerate(c, std::move(req), std::move(body), route, start, local_id, timeout);
  }
  HttpResponse r = Dispatch(path, route);
  r.Set("X-Request-Id", local_id);
  c->Respond(r, route, start);
}

std::optional<HttpResponse> OpenAiHttpServer::Impl::CheckHead(const HttpRequest& head,
                                                              std::string* route) {
  const std::string path =
      http_internal::RequestPath(std::string_view(head.target().data(), head.target().size()));
  *route = RouteOf(path);
  absl::Duration timeout = options_.default_timeout;  // (not needed before the body comes)
  return HeadRefusal(head, path, *route, LocalRequestId(), &timeout);
}

std::optional<HttpResponse> OpenAiHttpServer::Impl::HeadRefusal(const HttpRequest& req,
                                                                const std::string& path,
                                                                const std::string& route,
                                                                const std::string& local_id,
                                                                absl::Duration* timeout) {
  const std::string method(req.method_string());
  const bool post = IsPostRoute(route);
  HttpResponse r;
  int code = 400;
  // A refusal of a generation request is counted in the core's request metrics.
  auto refuse = [&](int http_status, const absl::Status& status) {
    if (post) core_->CountRefused(status);
    r = ErrorResponse(http_status, status);
  };
  if (route.empty()) {
    r = ErrorResponse(404, absl::NotFoundError(absl::StrCat("unknown path: ", path)));
  } else if (post ? method != "POST" : (method != "GET" && method != "HEAD")) {
    const char* allow = post ? "POST" : "GET, HEAD";
    refuse(405, absl::InvalidArgumentError(absl::StrCat("method ", method, " not allowed on ",
                                                        route, " (allowed: ", allow, ")")));
    r.Set("Allow", allow);
  } else if (absl::Status auth = (route == "/health" || route == "/ready")
                                     ? absl::OkStatus()
                                     : core_->CheckApiKey(BearerToken(req));
             !auth.ok()) {
    // An Authorization header without a Bearer token (a Basic one): the refusal says so.
    const std::string authorization = HeaderValue(req, http::field::authorization);
    const bool other_scheme =
        BearerToken(req).empty() && !absl::StripAsciiWhitespace(authorization).empty();
    refuse(401, other_scheme ? MissingBearerTokenError(authorization, "Authorization") : auth);
    r.Set("WWW-Authenticate", "Bearer");
  } else if (!post) {
    return std::nullopt;
  } else if (absl::Status refusal = GenerationHeadRefusal(req, timeout, &code); !refusal.ok()) {
    refuse(code, refusal);
  } else if (absl::Status admit = core_->CheckAdmission(); !admit.ok()) {
    // Before a thread is started (and the body parsed): generation threads stay bounded by the
    // core's admission limit. Already counted by the core.
    r = ErrorResponse(admit);
  } else {
    return std::nullopt;
  }
  r.Set("X-Request-Id", local_id);
  return r;
}

HttpResponse OpenAiHttpServer::Impl::Dispatch(const std::string& path, const std::string& route) {
  HttpResponse r;
  if (route == "/health") {
    r.body = R"({"status":"ok"})";
  } else if (route == "/ready") {
    const bool is_draining = draining.load();
    const bool ready = !is_draining && core_->Ready();
    r.status = ready ? 200 : 503;
    nlohmann::json body{{"status", ready ? "ready" : is_draining ? "draining" : "not_ready"}};
    if (!ready && !is_draining) {
      if (std::string reason = core_->NotReadyReason(); !reason.empty()) body["reason"] = reason;
    }
    r.body = body.dump();
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

void OpenAiHttpServer::Impl::StartGenerate(const std::shared_ptr<HttpConnection>& c,
                                           HttpRequest req,
                                           http_internal::BodyReservation reservation,
                                           const std::string& route, absl::Time start,
                                           const std::string& local_id, absl::Duration timeout) {
  const bool chat = route == "/v1/chat/completions";
  // A refusal before the core runs the request (counted in the core's request metrics).
  auto refuse = [&](const absl::Status& status, HttpResponse r) {
    core_->CountRefused(status);
    r.Set("X-Request-Id", local_id);
    c->Respond(r, route, start);
  };
  // On the event loop only the head was checked (HeadRefusal). The body is parsed on the
  // request's own thread (below): a 4 MiB body takes about half a second to parse, which held
  // every connection of this loop thread (their reads, writes, /health) for as long.
  const absl::Time deadline = absl::Now() + timeout;

  auto ex = std::make_shared<HttpExchange>();
  ex->connection = c;
  ex->executor = c->executor();
  ex->route = route;
  ex->start = start;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    if (stopping_flag) {
      const absl::Status st = absl::UnavailableError("the server is stopping");
      return refuse(st, ErrorResponse(st));
    }
    jobs_.insert(ex);
  }
  c->BeginExchange(ex);
  std::string body = std::move(req.body());
  // A small body is parsed here, at once (at most kInlineParseBytes: a few milliseconds), so
  // that it does not wait behind big ones; a bigger one on the parse pool
  // (HttpServerOptions::parse_threads at once), never on this thread.
  if (body.size() <= kInlineParseBytes) {
    return ParseAndStart(std::move(ex), std::move(body), std::move(reservation), chat, deadline,
                         local_id);
  }
  asio::post(parse_pool_, [this, ex, body = std::move(body), reservation = std::move(reservation),
                           chat, deadline, local_id]() mutable {
    ParseAndStart(std::move(ex), std::move(body), std::move(reservation), chat, deadline, local_id);
  });
}

void OpenAiHttpServer::Impl::ParseAndStart(std::shared_ptr<HttpExchange> ex, std::string body,
                                           http_internal::BodyReservation reservation, bool chat,
                                           absl::Time deadline, const std::string& local_id) {
  absl::StatusOr<OpenAiRequest> parsed = absl::UnknownError("not parsed");
  // Answers without a generation thread, and ends the job.
  auto answer = [&](HttpResponse r) {
    r.Set("X-Request-Id", local_id);
    ex->Post([r = std::move(r), route = ex->route, start = ex->start](HttpConnection& s) {
      s.Respond(r, route, start);
    });
    parsed = absl::UnknownError("answered");  // the request's memory goes on this thread
    std::string().swap(body);
    reservation.Reset();
    EndJob(ex);
  };
  // A refusal the core has not counted.
  auto refuse = [&](const absl::Status& status) {
    core_->CountRefused(status);
    answer(ErrorResponse(status));
  };
  // A body that waited for a parse thread may no longer be wanted: not parsed then.
  if (stopping_flag) return refuse(absl::UnavailableError("the server is stopping"));
  if (ex->IsCancelled()) {
    return refuse(absl::CancelledError("the client went away before its request was read"));
  }
  if (absl::Now() >= deadline) {
    return refuse(absl::DeadlineExceededError("deadline exceeded before the request was read"));
  }
  parsed = chat ? ParseChatCompletionsRequest(body) : ParseCompletionsRequest(body);
  std::string().swap(body);
  reservation.Reset();  // parsed: the body's bytes are gone
  if (!parsed.ok()) {
    core_->CountRefused(parsed.status());
    return answer(ErrorResponse(400, parsed.status(), ErrorParam(parsed.status())));
  }
  if (stopping_flag) return refuse(absl::UnavailableError("the server is stopping"));
  // The core may have filled up while the body waited or was parsed: a generation thread starts
  // only while it has room (already counted by the core when it has none).
  if (absl::Status admit = core_->CheckAdmission(); !admit.ok()) {
    return answer(ErrorResponse(admit));
  }
  try {
    std::thread([this, ex, request = std::move(*parsed), deadline, local_id, chat]() mutable {
      ResponseContext ctx{local_id, request.model.empty() ? core_->model_id() : request.model,
                          absl::ToUnixSeconds(absl::Now()), chat};
      RunGenerate(ex, std::move(request.request), deadline, std::move(ctx), request.stream,
                  request.include_usage);
      EndJob(ex);
    }).detach();
    ex.reset();  // the job (jobs_) and the generation thread hold it on
  } catch (const std::system_error& e) {
    refuse(absl::ResourceExhaustedError(
        absl::StrCat("cannot start a generation thread: ", e.what())));
  }
}

void OpenAiHttpServer::Impl::EndJob(std::shared_ptr<HttpExchange>& ex) {
  std::lock_guard<std::mutex> lock(jobs_mu_);
  jobs_.erase(ex);
  // This may be the last reference to the exchange, which holds the connection's strand: drop
  // it while Stop() still waits, not after the io_context (and its strand service) is gone
  // (ASan: heap-use-after-free in ~strand_impl at shutdown).
  ex.reset();
  jobs_cv_.notify_all();
}

void OpenAiHttpServer::Impl::RunGenerate(std::shared_ptr<HttpExchange> ex,
                                         v1::GenerateRequest request, absl::Time deadline,
                                         ResponseContext ctx, bool stream, bool include_usage) {
  auto gone = [this, &ex] { return stopping_flag.load() || ex->IsCancelled(); };
  const std::string route = ex->route;
  const absl::Time start = ex->start;
  const std::string local_id = ctx.request_id;
  auto run = [&](const GenerationCore::EventCallback& on_event,
                 const GenerationCore::AcceptedCallback& on_accepted) {
    try {
      return core_->Generate(request, deadline, gone, on_event, on_accepted);
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("internal error: ", e.what()));
    } catch (...) {
      return absl::InternalError("internal error: unknown exception");
    }
  };

  if (!stream) {
    ResponseAccumulator acc;
    absl::Status status = run(
        [&](const v1::GenerateEvent& event) {
          acc.OnEvent(event);
          return !gone();
        },
        {});
    HttpResponse r;
    if (!status.ok()) {
      r = ErrorResponse(status, CoreErrorParam(status, ctx.chat));
    } else if (!acc.finished()) {
      r = ErrorResponse(absl::InternalError("generation ended without a finish event"));
    } else {
      r.body = acc.Json(ctx);
    }
    r.Set("X-Request-Id", acc.request_id().empty() ? local_id : acc.request_id());
    ex->Post([r = std::move(r), route, start](HttpConnection& s) { s.Respond(r, route, start); });
    return;
  }

  StreamFormatter formatter(ctx, include_usage, request.n(),
                            request.stream_options().continuous_usage());
  // The response head goes out when the core accepts the request (or, failing that, with the
  // first frames): from then on the connection carries SSE keep-alive comments while the
  // request waits for a worker, and an error comes in-stream.
  bool started = false;
  auto start_stream = [&](const std::string& id) {
    if (started) return;
    started = true;
    ex->Post([id](HttpConnection& s) { s.StartStream(id); });
  };
  const size_t limit = std::max<size_t>(1, options_.max_pending_stream_bytes);
  absl::Status status = run(
      [&](const v1::GenerateEvent& event) {
        std::string frames = formatter.OnEvent(event);
        if (frames.empty()) return !gone();
        start_stream(formatter.context().request_id.empty() ? local_id
                                                            : formatter.context().request_id);
        if (stopping_flag) return false;
        return ex->Send(std::move(frames), limit);
      },
      [&](const std::string& request_id) {
        start_stream(request_id.empty() ? local_id : request_id);
      });
  if (!started) {
    // Nothing was produced: an ordinary HTTP response.
    if (status.ok()) status = absl::InternalError("generation ended without any event");
    HttpResponse r = ErrorResponse(status, CoreErrorParam(status, ctx.chat));
    r.Set("X-Request-Id", local_id);
    ex->Post([r = std::move(r), route, start](HttpConnection& s) { s.Respond(r, route, start); });
    return;
  }
  ex->Post([tail = formatter.OnEnd(status), route, start](HttpConnection& s) mutable {
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
  stopping_flag = true;
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
    for (const std::shared_ptr<HttpExchange>& ex : jobs_) ex->Cancel();
    jobs_cv_.wait(lock, [&] { return jobs_.empty(); });
  }
  parse_pool_.join();  // idle: every parse ended its job or started a generation
  // The answers in progress are written before the loop stops: a generation's last frames (they
  // are posted to the connection as its thread ends) and what a slow client has not read yet.
  // Each connection closes after its answer (stopping()): when the client closes too, after
  // its graceful-close linger (2 s), or at its write timeout.
  const absl::Time until = absl::Now() + options_.stop_grace;
  while (answering_.load() > 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  ioc_.stop();
  for (std::thread& t : io_threads_) t.join();
  io_threads_.clear();
  // The loop has stopped: nothing else touches the connections now.
  std::vector<std::shared_ptr<HttpConnection>> open;
  {
    std::lock_guard<std::mutex> lock(connections_mu_);
    for (auto& [id, weak] : connections_) {
      if (std::shared_ptr<HttpConnection> c = weak.lock()) open.push_back(std::move(c));
    }
  }
  for (const std::shared_ptr<HttpConnection>& c : open) c->Close();
}

OpenAiHttpServer::OpenAiHttpServer(GenerationCore* core, HttpServerOptions options,
                                   prometheus::Registry* registry)
    : impl_(std::make_unique<Impl>(core, std::move(options), registry)) {}

OpenAiHttpServer::~OpenAiHttpServer() { Stop(); }

absl::StatusOr<int> OpenAiHttpServer::Start() {
  if (started_ || impl_->stopping_flag) {
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
    impl_->stopping_flag = true;
    return;
  }
  if (stopped_) return;
  stopped_ = true;
  impl_->Stop();
}

void OpenAiHttpServer::SetDraining(bool draining) { impl_->draining = draining; }

size_t OpenAiHttpServer::buffered_body_bytes() const { return impl_->buffered_body_bytes(); }

}  // namespace dgserve
