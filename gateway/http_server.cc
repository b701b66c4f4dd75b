#include "gateway/http_server.h"

#include <httplib.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gateway/openai_api.h"
#include "service/status_convert.h"

namespace dgserve {
namespace {

constexpr const char* kJson = "application/json";
constexpr size_t kStreamQueueFrames = 64;  // frames buffered per stream at most
constexpr auto kKeepAliveInterval = std::chrono::seconds(15);
constexpr auto kWaitSlice = std::chrono::milliseconds(200);
constexpr double kMaxTimeoutSeconds = 86400;

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

std::string BearerToken(const httplib::Request& req) {
  std::string value(absl::StripAsciiWhitespace(req.get_header_value("Authorization")));
  constexpr std::string_view kBearer = "bearer ";
  if (value.size() < kBearer.size() ||
      absl::AsciiStrToLower(value.substr(0, kBearer.size())) != kBearer) {
    return "";
  }
  return std::string(absl::StripAsciiWhitespace(value.substr(kBearer.size())));
}

void SetError(httplib::Response& res, int http_status, const absl::Status& status,
              const std::string& param = "") {
  res.status = http_status;
  res.set_content(OpenAiErrorBody(status, param), kJson);
  if (http_status == 429) res.set_header("Retry-After", "1");
}

void SetError(httplib::Response& res, const absl::Status& status, const std::string& param = "") {
  SetError(res, HttpStatusFor(status.code()), status, param);
}

// Shared between a streaming request's generating thread (producer) and its HTTP writer.
struct StreamShared {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> frames;  // SSE frames not yet written
  bool started = false;            // a frame was produced (the response is an SSE stream)
  bool done = false;               // Generate returned; `final_frames` and `status` are set
  bool cancelled = false;          // the client is gone or the response was dropped
  absl::Status status;
  std::string final_frames;
  std::string request_id;  // the core's id, known once started

  // Producer side: blocks while the queue is full. False when cancelled.
  bool Push(std::string f, const std::string& id, const std::atomic<bool>& stopping) {
    std::unique_lock<std::mutex> lock(mu);
    while (frames.size() >= kStreamQueueFrames && !cancelled && !stopping) {
      cv.wait_for(lock, kWaitSlice);
    }
    if (cancelled || stopping) return false;
    if (!started) {
      started = true;
      request_id = id;
    }
    frames.push_back(std::move(f));
    cv.notify_all();
    return true;
  }

  void Cancel() {
    std::lock_guard<std::mutex> lock(mu);
    cancelled = true;
    cv.notify_all();
  }

  bool IsCancelled() {
    std::lock_guard<std::mutex> lock(mu);
    return cancelled;
  }
};

// Owns the generating thread of one stream; joins it when destroyed (after cancelling it if it
// still runs). The thread itself holds only the StreamShared.
class StreamJob {
 public:
  explicit StreamJob(std::shared_ptr<StreamShared> shared) : shared_(std::move(shared)) {}
  ~StreamJob() { CancelAndJoin(); }
  void Run(std::function<void()> body) { thread_ = std::thread(std::move(body)); }
  // Idempotent: cancels the request unless it already ended, then waits for the thread.
  void CancelAndJoin() {
    std::lock_guard<std::mutex> lock(join_mu_);
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> l(shared_->mu);
      if (!shared_->done) shared_->cancelled = true;
      shared_->cv.notify_all();
    }
    thread_.join();
  }
  StreamShared& shared() { return *shared_; }

 private:
  std::shared_ptr<StreamShared> shared_;
  std::mutex join_mu_;
  std::thread thread_;
};

}  // namespace

class OpenAiHttpServer::Impl {
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
    }
    Configure();
  }

  httplib::Server& server() { return server_; }
  const HttpServerOptions& options() const { return options_; }
  std::atomic<bool> stopping{false};
  std::atomic<bool> draining{false};
  std::atomic<bool> listen_returned{false};

 private:
  void Configure();
  // Every request comes here: `reader` is null for methods without a body.
  void Handle(const httplib::Request& req, httplib::Response& res,
              const httplib::ContentReader* reader);
  void Dispatch(const httplib::Request& req, httplib::Response& res, const std::string& route,
                const std::string& body);
  void HandleGenerate(const httplib::Request& req, httplib::Response& res, const std::string& route,
                      const std::string& body, bool chat, absl::Time start);
  void Record(const std::string& route, int code, absl::Duration elapsed);

  GenerationCore* core_;
  HttpServerOptions options_;
  int64_t created_;
  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* duration_ = nullptr;
  httplib::Server server_;
};

void OpenAiHttpServer::Impl::Record(const std::string& route, int code, absl::Duration elapsed) {
  if (requests_ == nullptr) return;
  const std::string label = route.empty() ? "other" : route;
  requests_->Add({{"route", label}, {"code", std::to_string(code)}}).Increment();
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
  duration_->Add({{"route", label}}, kBuckets).Observe(absl::ToDoubleSeconds(elapsed));
}

void OpenAiHttpServer::Impl::Configure() {
  server_.new_task_queue = [n = std::max(1, options_.threads)] {
    return new httplib::ThreadPool(static_cast<size_t>(n));
  };
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which would let a second server
  // bind a port that is already in use.
  server_.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  server_.set_payload_max_length(options_.max_body_bytes);
  // Bodies httplib itself rejects (malformed request line, 414, …) get an OpenAI error body.
  server_.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request&, httplib::Response& res) {
        if (!res.body.empty() || res.is_chunked_content_provider_) {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        const std::string what = absl::StrCat("HTTP ", res.status);
        absl::Status status = res.status == 404   ? absl::NotFoundError("not found")
                              : res.status >= 500 ? absl::InternalError(what)
                                                  : absl::InvalidArgumentError(what);
        res.set_content(OpenAiErrorBody(status), kJson);
        return httplib::Server::HandlerResponse::Handled;
      }));
  server_.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        SetError(res, 500, absl::InternalError(absl::StrCat("internal error: ", what)));
      });
  auto plain = [this](const httplib::Request& req, httplib::Response& res) {
    Handle(req, res, nullptr);
  };
  auto with_body = [this](const httplib::Request& req, httplib::Response& res,
                          const httplib::ContentReader& reader) { Handle(req, res, &reader); };
  server_.Get(".*", plain);
  server_.Options(".*", plain);
  server_.Post(".*", with_body);
  server_.Put(".*", with_body);
  server_.Patch(".*", with_body);
  server_.Delete(".*", with_body);
}

void OpenAiHttpServer::Impl::Handle(const httplib::Request& req, httplib::Response& res,
                                    const httplib::ContentReader* reader) {
  const absl::Time start = absl::Now();
  const std::string route = RouteOf(req.path);
  const std::string local_id = LocalRequestId();
  res.set_header("X-Request-Id", local_id);

  // Read (or drain) the body first so that the connection stays usable after any answer.
  std::string body;
  bool too_large = false;
  bool read_failed = false;
  const bool has_body =
      req.has_header("Content-Length") ||
      absl::AsciiStrToLower(req.get_header_value("Transfer-Encoding")).find("chunked") !=
          std::string::npos;
  if (reader != nullptr && has_body) {
    const bool ok = (*reader)([&](const char* data, size_t len) {
      if (too_large) return true;  // drain
      if (body.size() + len > options_.max_body_bytes) {
        too_large = true;
        std::string().swap(body);
        return true;
      }
      body.append(data, len);
      return true;
    });
    if (!ok) {
      if (res.status == 413) {
        too_large = true;
      } else {
        read_failed = true;
      }
    }
  }

  if (route.empty()) {
    SetError(res, 404, absl::NotFoundError(absl::StrCat("unknown path: ", req.path)));
  } else if (IsPostRoute(route) ? req.method != "POST"
                                : (req.method != "GET" && req.method != "HEAD")) {
    const char* allow = IsPostRoute(route) ? "POST" : "GET, HEAD";
    res.set_header("Allow", allow);
    SetError(res, 405,
             absl::InvalidArgumentError(absl::StrCat("method ", req.method, " not allowed on ",
                                                     route, " (allowed: ", allow, ")")));
  } else if (absl::Status auth = (route == "/health" || route == "/ready")
                                     ? absl::OkStatus()
                                     : core_->CheckApiKey(BearerToken(req));
             !auth.ok()) {
    res.set_header("WWW-Authenticate", "Bearer");
    SetError(res, 401, auth);
  } else if (too_large) {
    SetError(res, 413,
             absl::InvalidArgumentError(
                 absl::StrCat("request body larger than ", options_.max_body_bytes, " bytes")));
  } else if (read_failed) {
    SetError(res, 400, absl::InvalidArgumentError("could not read the request body"));
  } else if (IsPostRoute(route)) {
    HandleGenerate(req, res, route, body, route == "/v1/chat/completions", start);
    return;  // records its own metrics (a stream ends later)
  } else {
    Dispatch(req, res, route, body);
  }
  Record(route, res.status, absl::Now() - start);
}

void OpenAiHttpServer::Impl::Dispatch(const httplib::Request& req, httplib::Response& res,
                                      const std::string& route, const std::string& body) {
  if (route == "/health") {
    res.status = 200;
    res.set_content(R"({"status":"ok"})", kJson);
  } else if (route == "/ready") {
    const bool is_draining = draining.load();
    const bool ready = !is_draining && core_->Ready();
    res.status = ready ? 200 : 503;
    res.set_content(nlohmann::json{{"status", ready         ? "ready"
                                              : is_draining ? "draining"
                                                            : "not_ready"}}
                        .dump(),
                    kJson);
  } else if (route == "/v1/models") {
    res.status = 200;
    res.set_content(ModelsListJson(core_->ListModels(), created_), kJson);
  } else if (route == "/v1/models/{id}") {
    const std::string id = req.path.substr(std::string("/v1/models/").size());
    const v1::ListModelsResponse models = core_->ListModels();
    for (const v1::ModelInfo& m : models.models()) {
      if (m.id() == id) {
        res.status = 200;
        res.set_content(ModelJson(m, created_), kJson);
        return;
      }
    }
    SetError(res, 404, absl::NotFoundError(absl::StrCat("model '", id, "' not found")), "model");
  }
}

void OpenAiHttpServer::Impl::HandleGenerate(const httplib::Request& req, httplib::Response& res,
                                            const std::string& route, const std::string& body,
                                            bool chat, absl::Time start) {
  const std::string local_id = res.get_header_value("X-Request-Id");
  auto finish = [&] { Record(route, res.status, absl::Now() - start); };

  absl::StatusOr<OpenAiRequest> parsed =
      chat ? ParseChatCompletionsRequest(body) : ParseCompletionsRequest(body);
  if (!parsed.ok()) {
    SetError(res, 400, parsed.status(), ErrorParam(parsed.status()));
    return finish();
  }
  absl::Duration timeout = options_.default_timeout;
  if (req.has_header("X-Request-Timeout")) {
    double seconds = 0;
    if (!absl::SimpleAtod(req.get_header_value("X-Request-Timeout"), &seconds) ||
        !std::isfinite(seconds) || seconds <= 0 || seconds > kMaxTimeoutSeconds) {
      SetError(
          res, 400,
          absl::InvalidArgumentError(absl::StrCat(
              "X-Request-Timeout: must be a number of seconds in (0, ", kMaxTimeoutSeconds, "]")));
      return finish();
    }
    timeout = absl::Seconds(seconds);
  }
  const absl::Time deadline = absl::Now() + timeout;
  ResponseContext ctx{local_id, parsed->model.empty() ? core_->model_id() : parsed->model,
                      absl::ToUnixSeconds(absl::Now()), chat};

  if (!parsed->stream) {
    ResponseAccumulator acc;
    absl::Status status = core_->Generate(
        parsed->request, deadline, [this] { return stopping.load(); },
        [&](const v1::GenerateEvent& event) {
          acc.OnEvent(event);
          return !stopping.load();
        });
    if (!acc.request_id().empty()) {
      res.headers.erase("X-Request-Id");  // set_header appends
      res.set_header("X-Request-Id", acc.request_id());
    }
    if (!status.ok()) {
      SetError(res, status);
    } else if (!acc.finished()) {
      SetError(res, absl::InternalError("generation ended without a finish event"));
    } else {
      res.status = 200;
      res.set_content(acc.Json(ctx), kJson);
    }
    return finish();
  }

  // Streaming: the generating thread feeds `shared`; this thread decides the status once the
  // first frame or the final status is there.
  auto shared = std::make_shared<StreamShared>();
  auto job = std::make_shared<StreamJob>(shared);
  job->Run([this, shared, request = std::move(parsed->request), deadline, ctx,
            include_usage = parsed->include_usage] {
    StreamFormatter formatter(ctx, include_usage);
    absl::Status status;
    try {
      status = core_->Generate(
          request, deadline, [this, &shared] { return stopping.load() || shared->IsCancelled(); },
          [&](const v1::GenerateEvent& event) {
            std::string frames = formatter.OnEvent(event);
            if (frames.empty()) return !(stopping.load() || shared->IsCancelled());
            return shared->Push(std::move(frames), formatter.context().request_id, stopping);
          });
    } catch (const std::exception& e) {
      status = absl::InternalError(absl::StrCat("internal error: ", e.what()));
    } catch (...) {
      status = absl::InternalError("internal error: unknown exception");
    }
    std::string final_frames = formatter.OnEnd(status);
    std::lock_guard<std::mutex> lock(shared->mu);
    shared->done = true;
    shared->status = status;
    shared->final_frames = std::move(final_frames);
    shared->cv.notify_all();
  });

  {
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->started || shared->done; });
    if (!shared->started) {
      // Nothing was produced: an ordinary HTTP response.
      absl::Status status = shared->status;
      lock.unlock();
      job->CancelAndJoin();
      if (status.ok()) status = absl::InternalError("generation ended without any event");
      SetError(res, status);
      return finish();
    }
    res.headers.erase("X-Request-Id");
    res.set_header("X-Request-Id", shared->request_id.empty() ? local_id : shared->request_id);
  }
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job](size_t, httplib::DataSink& sink) {
        StreamShared& s = job->shared();
        std::vector<std::string> batch;
        std::string final_frames;
        bool done = false;
        {
          std::unique_lock<std::mutex> lock(s.mu);
          const auto idle_until = std::chrono::steady_clock::now() + kKeepAliveInterval;
          while (s.frames.empty() && !s.done && !s.cancelled && !stopping.load() &&
                 std::chrono::steady_clock::now() < idle_until) {
            s.cv.wait_for(lock, kWaitSlice);
          }
          if (s.cancelled || stopping.load()) return false;
          while (!s.frames.empty()) {
            batch.push_back(std::move(s.frames.front()));
            s.frames.pop_front();
          }
          s.cv.notify_all();  // room in the queue
          if (s.done) {
            done = true;
            final_frames = s.final_frames;
          }
        }
        if (batch.empty() && !done) batch.push_back(": keep-alive\n\n");
        for (const std::string& f : batch) {
          if (!sink.write(f.data(), f.size())) {
            s.Cancel();
            return false;
          }
        }
        if (done) {
          if (!sink.write(final_frames.data(), final_frames.size())) return false;
          sink.done();
        }
        return true;
      },
      [this, job, route, start](bool) {
        job->CancelAndJoin();  // no-op when the stream ran to its end
        Record(route, 200, absl::Now() - start);
      });
}

OpenAiHttpServer::OpenAiHttpServer(GenerationCore* core, HttpServerOptions options,
                                   prometheus::Registry* registry)
    : impl_(std::make_unique<Impl>(core, std::move(options), registry)) {}

OpenAiHttpServer::~OpenAiHttpServer() { Stop(); }

absl::StatusOr<int> OpenAiHttpServer::Start() {
  if (started_ || impl_->stopping) {
    return absl::FailedPreconditionError("the HTTP server was already started or stopped");
  }
  httplib::Server& server = impl_->server();
  const HttpServerOptions& o = impl_->options();
  int port = o.port;
  if (o.port == 0) {
    port = server.bind_to_any_port(o.host);
  } else if (!server.bind_to_port(o.host, o.port)) {
    port = -1;
  }
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", o.host, ":", o.port,
                                               " (address in use, or not a local address)"));
  }
  started_ = true;
  Impl* impl = impl_.get();
  listen_thread_ = std::thread([impl] {
    impl->server().listen_after_bind();
    impl->listen_returned = true;
  });
  while (!server.is_running() && !impl->listen_returned.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!server.is_running()) {
    listen_thread_.join();
    return absl::UnavailableError(absl::StrCat("listening on ", o.host, ":", port, " failed"));
  }
  port_ = port;
  return port;
}

void OpenAiHttpServer::Stop() {
  impl_->stopping = true;
  if (!started_) return;
  impl_->server().stop();
  if (listen_thread_.joinable()) listen_thread_.join();
}

void OpenAiHttpServer::SetDraining(bool draining) { impl_->draining = draining; }

}  // namespace dgserve
