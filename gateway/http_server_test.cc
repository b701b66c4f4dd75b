// The HTTP stack of OpenAiHttpServer against a real HTTP client (libcurl, common/http_client.h) on
// 127.0.0.1, with a fake GenerationCore (the real core is tested end to end by the gateway's own
// tests).
#include "gateway/http_server_test_util.h"

namespace dgserve {
namespace {

using namespace ::dgserve::http_testing;  // NOLINT: the shared fixture and helpers
using ::dgserve::testing::StatusIs;

TEST_F(HttpServerTest, HealthAndReady) {
  StartServer();
  HttpClient cli = Client();
  auto health = cli.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(json::parse(health.body)["status"], "ok");
  auto ready = cli.Get("/ready");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready.status, 200);
  core_.ready = false;
  auto not_ready = cli.Get("/ready");
  ASSERT_TRUE(not_ready);
  EXPECT_EQ(not_ready.status, 503);
  EXPECT_EQ(json::parse(not_ready.body)["status"], "not_ready");
  EXPECT_FALSE(json::parse(not_ready.body).contains("reason"));
  const std::string reason = "KV layout mismatch: prefill worker a has block_size 16, ...";
  {
    absl::MutexLock lock(&core_.reason_mu);
    core_.not_ready_reason = reason;
  }
  auto with_reason = cli.Get("/ready");
  ASSERT_TRUE(with_reason);
  EXPECT_EQ(with_reason.status, 503);
  EXPECT_EQ(json::parse(with_reason.body)["reason"], reason);
  core_.ready = true;
  server_->SetDraining(true);
  auto draining = cli.Get("/ready");
  ASSERT_TRUE(draining);
  EXPECT_EQ(draining.status, 503);
  EXPECT_EQ(json::parse(draining.body)["status"], "draining");
  EXPECT_EQ(cli.Get("/health").status, 200);
  server_->SetDraining(false);
  EXPECT_EQ(cli.Get("/ready").status, 200);
}

TEST_F(HttpServerTest, BadRequestBodyShape) {
  StartServer();
  HttpClient cli = Client();
  // The fake core answers INVALID_ARGUMENT("prompt: must not be empty").
  auto res = cli.Post("/v1/completions", R"({"prompt": "hi"})");
  ExpectErrorBody(res, 400, "invalid_request_error", "prompt: must not be empty");
  EXPECT_FALSE(res.Header("X-Request-Id").empty());
  // Parse errors name the field in `param`.
  auto bad = cli.Post("/v1/completions", R"({"prompt": "hi", "max_tokens": "x"})");
  ExpectErrorBody(bad, 400, "invalid_request_error", "max_tokens: must be an integer");
  EXPECT_EQ(json::parse(bad.body)["error"]["param"], "max_tokens");
  auto unsupported =
      cli.Post("/v1/chat/completions",
               R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})");
  ExpectErrorBody(unsupported, 400, "invalid_request_error", "unsupported field: logprobs");
  EXPECT_EQ(json::parse(unsupported.body)["error"]["param"], "logprobs");
  ExpectErrorBody(cli.Post("/v1/completions", "{bad"), 400, "invalid_request_error",
                  "malformed JSON");
  ExpectErrorBody(cli.Post("/v1/completions", ""), 400, "invalid_request_error", "malformed JSON");
}

TEST_F(HttpServerTest, Auth) {
  core_.api_key = "sk-1";
  StartServer();
  HttpClient cli = Client();
  auto none = cli.Post("/v1/completions", R"({"prompt": "hi"})");
  ExpectErrorBody(none, 401, "authentication_error", "invalid API key");
  EXPECT_EQ(none.Header("WWW-Authenticate"), "Bearer");
  // The connection stays usable after an early answer (the body was drained): the client's
  // next request goes over the same connection.
  auto after = cli.Get("/health");
  EXPECT_EQ(after.status, 200);
  EXPECT_EQ(after.new_connections, 0);
  EXPECT_EQ(cli.Get("/ready").status, 200);
  ExpectErrorBody(cli.Get("/v1/models"), 401, "authentication_error", "invalid API key");
  ExpectErrorBody(cli.Get("/v1/models", {{"Authorization", "Bearer sk-2"}}), 401,
                  "authentication_error", "invalid API key");
  // A scheme other than Bearer is named (it said "missing API key"); the value is not echoed.
  auto basic = cli.Get("/v1/models", {{"Authorization", "Basic dXNlcjpzay0x"}});
  ExpectErrorBody(basic, 401, "authentication_error",
                  "Authorization scheme 'Basic' is not supported: send 'Authorization: Bearer "
                  "<key>'");
  EXPECT_EQ(basic.Header("WWW-Authenticate"), "Bearer");
  ExpectErrorBody(cli.Get("/v1/models", {{"Authorization", "sk-1"}}), 401, "authentication_error",
                  "Authorization has no 'Bearer' scheme: send 'Authorization: Bearer <key>'");
  auto ok = cli.Get("/v1/models", {{"Authorization", "bearer  sk-1 "}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok.status, 200);
  auto passed =
      cli.Post("/v1/completions", R"({"prompt": "hi"})", {{"Authorization", "Bearer sk-1"}});
  ExpectErrorBody(passed, 400, "invalid_request_error", "prompt: must not be empty");
}

TEST_F(HttpServerTest, NotFoundAndMethodNotAllowed) {
  StartServer();
  HttpClient cli = Client();
  ExpectErrorBody(cli.Get("/v2/nothing"), 404, "not_found_error", "unknown path: /v2/nothing");
  ExpectErrorBody(cli.Post("/nothing", "{}"), 404, "not_found_error", "unknown path");
  auto get = cli.Get("/v1/completions");
  ExpectErrorBody(get, 405, "invalid_request_error", "method GET not allowed");
  EXPECT_EQ(get.Header("Allow"), "POST");
  auto post = cli.Post("/v1/models", "{}");
  ExpectErrorBody(post, 405, "invalid_request_error", "method POST not allowed");
  EXPECT_EQ(post.Header("Allow"), "GET, HEAD");
  ExpectErrorBody(cli.Delete("/v1/chat/completions"), 405, "invalid_request_error", "not allowed");
  EXPECT_EQ(cli.Get("/health").status, 200);
}

TEST_F(HttpServerTest, BodyTooLarge) {
  HttpServerOptions options;
  options.max_body_bytes = 1024;
  StartServer(options);
  HttpClient cli = Client();
  const std::string big = R"({"prompt": ")" + std::string(2000, 'a') + R"("})";
  ExpectErrorBody(cli.Post("/v1/completions", big), 413, "invalid_request_error",
                  "larger than 1024 bytes");
  // Chunked transfer encoding (no Content-Length) is capped too.
  HttpRequest chunked_request;
  chunked_request.method = "POST";
  chunked_request.path = "/v1/completions";
  chunked_request.headers = {{"Content-Type", "application/json"}};
  chunked_request.body = big;
  chunked_request.chunked_body = true;
  auto chunked = cli.Send(chunked_request);
  ExpectErrorBody(chunked, 413, "invalid_request_error", "larger than 1024 bytes");
  // A small body still reaches the core.
  ExpectErrorBody(cli.Post("/v1/completions", R"({"prompt": "x"})"), 400, "invalid_request_error",
                  "prompt: must not be empty");
}

// A generation's body is JSON: a form or text body (what a cross-site page can send without a
// CORS preflight, and what `curl -d` sends by default) is refused before it is parsed or run, on
// both routes.
TEST_F(HttpServerTest, GenerationBodiesMustBeJson) {
  std::atomic<int> runs{0};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                       const GenerationCore::EventCallback&) {
    ++runs;
    return absl::InvalidArgumentError("prompt: must not be empty");
  };
  StartServer();
  HttpClient cli = Client();
  const std::string completion = R"({"prompt": "hi"})";
  const std::string chat = R"({"messages": [{"role": "user", "content": "x"}]})";
  const std::vector<std::pair<std::string, std::string>> routes = {
      {"/v1/completions", completion}, {"/v1/chat/completions", chat}};
  int refused = 0;
  for (const auto& [path, body] : routes) {
    for (const std::string type :
         {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
          "text/json", "application/jsonx", "application/x/+json", "json", ";charset=utf-8",
          "application/js on"}) {
      SCOPED_TRACE(path + " " + type);
      auto res = cli.Post(path, body, {}, type);
      ExpectErrorBody(res, 415, "invalid_request_error",
                      "Content-Type: \"" + type + "\" is not JSON");
      EXPECT_EQ(json::parse(res.body)["error"]["code"], "unsupported_media_type");
      ++refused;
    }
  }
  EXPECT_EQ(runs, 0);
  // JSON types with parameters, in any case, are run, over the same connection.
  const int connections_before = cli.Get("/health").new_connections;
  int accepted = 0;
  for (const auto& [path, body] : routes) {
    for (const std::string type :
         {"application/json", "Application/JSON; charset=utf-8", " application/json ;charset=UTF-8",
          "application/vnd.api+json", "application/+json"}) {
      SCOPED_TRACE(path + " " + type);
      auto res = cli.Post(path, body, {}, type);
      ExpectErrorBody(res, 400, "invalid_request_error", "prompt: must not be empty");
      EXPECT_EQ(res.new_connections, 0);
      ++accepted;
    }
  }
  EXPECT_EQ(connections_before, 0);
  EXPECT_EQ(runs, accepted);
  // No Content-Type is read as JSON (as vLLM does), except from a browser (an Origin: an untyped
  // fetch or sendBeacon needs no preflight either); two are refused.
  auto raw = [&](const std::string& headers) {
    return RawRequest(port_, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                          "Connection: close\r\n", headers, "Content-Length: ",
                                          completion.size(), "\r\n\r\n", completion));
  };
  const std::string untyped = raw("");
  EXPECT_THAT(untyped, HasSubstr("HTTP/1.1 400"));
  EXPECT_THAT(untyped, HasSubstr("prompt: must not be empty"));
  EXPECT_EQ(runs, accepted + 1);
  const std::string from_browser = raw("Origin: https://elsewhere.example\r\n");
  EXPECT_THAT(from_browser, HasSubstr("HTTP/1.1 415"));
  EXPECT_THAT(from_browser, HasSubstr("Content-Type: missing on a request with an Origin"));
  const std::string typed_from_browser =
      raw("Origin: https://elsewhere.example\r\nContent-Type: application/json\r\n");
  EXPECT_THAT(typed_from_browser, HasSubstr("HTTP/1.1 400"));
  EXPECT_THAT(typed_from_browser, HasSubstr("prompt: must not be empty"));
  EXPECT_EQ(runs, accepted + 2);
  const std::string twice =
      raw("Content-Type: application/json\r\nContent-Type: text/plain\r\n");
  EXPECT_THAT(twice, HasSubstr("HTTP/1.1 400"));
  EXPECT_THAT(twice, HasSubstr("Content-Type: given more than once"));
  EXPECT_EQ(runs, accepted + 2);
  // Refusals are counted as such.
  EXPECT_EQ(core_.Refused().size(), size_t(refused + 2));
}

TEST_F(HttpServerTest, PostWithoutBodyDoesNotHang) {
  StartServer();
  const std::string out =
      RawRequest(port_, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(out, HasSubstr("HTTP/1.1 400"));
  EXPECT_THAT(out, HasSubstr("malformed JSON"));
  // A garbage request line gets an OpenAI error body from the server's error path.
  const std::string garbage = RawRequest(port_, "NONSENSE\r\n\r\n");
  EXPECT_THAT(garbage, HasSubstr("HTTP/1.1 400"));
  EXPECT_THAT(garbage, HasSubstr("\"error\""));
}

TEST_F(HttpServerTest, Models) {
  StartServer();
  HttpClient cli = Client();
  auto list = cli.Get("/v1/models");
  ASSERT_TRUE(list);
  EXPECT_EQ(list.status, 200);
  json j = json::parse(list.body);
  EXPECT_EQ(j["object"], "list");
  ASSERT_EQ(j["data"].size(), 1u);
  EXPECT_EQ(j["data"][0]["id"], "dg-tiny");
  EXPECT_EQ(j["data"][0]["context_length"], 4096);
  auto one = cli.Get("/v1/models/dg-tiny");
  ASSERT_TRUE(one);
  EXPECT_EQ(one.status, 200);
  EXPECT_EQ(json::parse(one.body)["id"], "dg-tiny");
  ExpectErrorBody(cli.Get("/v1/models/other"), 404, "not_found_error", "model 'other'");
}

TEST_F(HttpServerTest, NonStreamingSuccessAndRateLimit) {
  core_.generate = [](const v1::GenerateRequest& req, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback& cb) {
    if (req.max_tokens() == 99) return absl::ResourceExhaustedError("queue full");
    cb(Block("Hel"));
    cb(Block("lo"));
    cb(Finished());
    return absl::OkStatus();
  };
  StartServer();
  HttpClient cli = Client();
  auto res = cli.Post("/v1/chat/completions",
                      R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})");
  ASSERT_TRUE(res);
  EXPECT_EQ(res.status, 200);
  EXPECT_EQ(res.Header("X-Request-Id"), "req-7");
  EXPECT_EQ(res.HeaderCount("X-Request-Id"), 1u);
  json j = json::parse(res.body);
  EXPECT_EQ(j["id"], "chatcmpl-req-7");
  EXPECT_EQ(j["model"], "dg-tiny");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hello");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"]["total_tokens"], 5);

  auto limited = cli.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 99})");
  ExpectErrorBody(limited, 429, "rate_limit_error", "queue full");
  EXPECT_EQ(limited.Header("Retry-After"), "1");
}

TEST_F(HttpServerTest, RequestTimeoutHeader) {
  std::atomic<double> seen_timeout{0};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time deadline,
                       const std::function<bool()>&, const GenerationCore::EventCallback& cb) {
    seen_timeout = absl::ToDoubleSeconds(deadline - absl::Now());
    cb(Finished());
    return absl::OkStatus();
  };
  StartServer();
  HttpClient cli = Client();
  auto ok = cli.Post("/v1/completions", R"({"prompt": "x"})", {{"X-Request-Timeout", "2.5"}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok.status, 200);
  EXPECT_GT(seen_timeout.load(), 1.5);
  EXPECT_LE(seen_timeout.load(), 2.5);
  auto dflt = cli.Post("/v1/completions", R"({"prompt": "x"})");
  ASSERT_TRUE(dflt);
  EXPECT_GT(seen_timeout.load(), 500);  // the 10-minute default
  ExpectErrorBody(
      cli.Post("/v1/completions", R"({"prompt": "x"})", {{"X-Request-Timeout", "soon"}}), 400,
      "invalid_request_error", "X-Request-Timeout");
  ExpectErrorBody(cli.Post("/v1/completions", R"({"prompt": "x"})", {{"X-Request-Timeout", "-1"}}),
                  400, "invalid_request_error", "X-Request-Timeout");
  // Decimal only: hexadecimal (0x10 was read as 16 s) and the other spellings strtod takes are
  // refused; an exponent is a decimal number.
  for (const char* bad : {"0x10", "0X1p3", "infinity", "nan", "1_0", "+", "."}) {
    ExpectErrorBody(cli.Post("/v1/completions", R"({"prompt": "x"})", {{"X-Request-Timeout", bad}}),
                    400, "invalid_request_error", "X-Request-Timeout");
  }
  auto exp = cli.Post("/v1/completions", R"({"prompt": "x"})", {{"X-Request-Timeout", "2e0"}});
  ASSERT_TRUE(exp);
  EXPECT_EQ(exp.status, 200);
  EXPECT_LE(seen_timeout.load(), 2.5);
}

TEST_F(HttpServerTest, PortInUseAndDoubleStart) {
  StartServer();
  HttpServerOptions options;
  options.port = port_;
  OpenAiHttpServer second(&core_, options, nullptr);
  EXPECT_THAT(second.Start(), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(server_->Start(), StatusIs(absl::StatusCode::kFailedPrecondition));
  server_->Stop();
  EXPECT_THAT(server_->Start(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(HttpServerTest, Metrics) {
  StartServer();
  HttpClient cli = Client();
  cli.Get("/health");
  cli.Get("/health");
  cli.Get("/nope");
  bool found_health = false, found_other = false, found_hist = false;
  for (const prometheus::MetricFamily& f : registry_.Collect()) {
    if (f.name == "dgserve_gateway_http_requests_total") {
      for (const prometheus::ClientMetric& m : f.metric) {
        std::map<std::string, std::string> labels;
        for (const auto& l : m.label) labels[l.name] = l.value;
        if (labels["route"] == "/health" && labels["code"] == "200") {
          found_health = true;
          EXPECT_EQ(m.counter.value, 2);
        }
        if (labels["route"] == "other" && labels["code"] == "404") found_other = true;
      }
    }
    if (f.name == "dgserve_gateway_http_request_duration_seconds") found_hist = true;
  }
  EXPECT_TRUE(found_health);
  EXPECT_TRUE(found_other);
  EXPECT_TRUE(found_hist);
}

// The value of the unlabelled gauge `name` in `registry`; -1 when absent.
double GaugeValue(prometheus::Registry& registry, const std::string& name) {
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name == name && f.metric.size() == 1) return f.metric[0].gauge.value;
  }
  return -1;
}

// The open-connection and open-stream gauges go up while a connection or a stream is open and
// back to 0 once it ends (a gauge that only went up would report every connection ever made).
TEST_F(HttpServerTest, OpenConnectionAndStreamGaugesReturnToZero) {
  std::atomic<bool> release{false};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                       const GenerationCore::EventCallback& cb) {
    cb(Block("a"));
    Eventually([&] { return release.load(); });
    cb(Finished());
    return absl::OkStatus();
  };
  StartServer();
  const std::string kConnections = "dgserve_gateway_http_open_connections";
  const std::string kStreams = "dgserve_gateway_http_open_streams";
  EXPECT_EQ(GaugeValue(registry_, kConnections), 0);
  int fd = ConnectLoopback(port_, 10);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, PostRequest("/v1/completions", R"({"prompt": "x", "stream": true})")));
  EXPECT_THAT(ReadUntil(fd, "data: "), HasSubstr("text/event-stream"));
  EXPECT_TRUE(Eventually([&] { return GaugeValue(registry_, kStreams) == 1; }));
  EXPECT_EQ(GaugeValue(registry_, kConnections), 1);
  release = true;
  EXPECT_THAT(ReadUntil(fd, "data: [DONE]"), HasSubstr("data: [DONE]"));
  EXPECT_TRUE(Eventually([&] { return GaugeValue(registry_, kStreams) == 0; }))
      << GaugeValue(registry_, kStreams);
  EXPECT_EQ(GaugeValue(registry_, kConnections), 1);  // keep-alive: still open
  close(fd);
  EXPECT_TRUE(Eventually([&] { return GaugeValue(registry_, kConnections) == 0; }))
      << GaugeValue(registry_, kConnections);
}

// The HTTP status and the error body's type and code of a raw response ("" when absent).
struct RawError {
  int status = 0;
  std::string type, code;
};
RawError ParseRawError(const std::string& raw) {
  RawError e;
  if (raw.rfind("HTTP/1.1 ", 0) == 0) e.status = std::atoi(raw.c_str() + 9);
  const size_t body = raw.find("\r\n\r\n");
  if (body == std::string::npos) return e;
  json j = json::parse(raw.substr(body + 4), nullptr, false);
  if (j.is_discarded() || !j.contains("error")) return e;
  e.type = j["error"].value("type", "");
  e.code = j["error"].value("code", "");
  return e;
}

// Every error status's body names that status: 405, 413 and 431 (which no status code maps to)
// have codes of their own, not the "invalid_argument" of the status they were built from; the
// others follow their status code (reviewer finding: a 413 said "invalid_argument").
TEST_F(HttpServerTest, EveryErrorStatusHasItsOwnCode) {
  HttpServerOptions options;
  options.max_body_bytes = 1024;
  options.max_header_bytes = 2048;
  StartServer(options);
  core_.generate = [](const v1::GenerateRequest& r, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback&) -> absl::Status {
    if (r.text() == "busy") return absl::ResourceExhaustedError("busy");
    if (r.text() == "down") return absl::UnavailableError("down");
    if (r.text() == "late") return absl::DeadlineExceededError("late");
    return absl::InvalidArgumentError("max_tokens: bad");
  };
  auto post = [&](const std::string& body, const std::string& extra = "") {
    return ParseRawError(RawRequest(
        port_, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
                            extra, "Content-Type: application/json\r\nContent-Length: ",
                            body.size(), "\r\n\r\n", body)));
  };
  struct Case {
    RawError got;
    int status;
    std::string type, code;
  };
  const std::vector<Case> cases = {
      {post(R"({"prompt": ")" + std::string(2000, 'a') + R"("})"), 413, "invalid_request_error",
       "request_too_large"},
      {post("{}", "X-Big: " + std::string(4000, 'h') + "\r\n"), 431, "invalid_request_error",
       "request_header_fields_too_large"},
      {ParseRawError(RawRequest(
           port_, "GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")),
       405, "invalid_request_error", "method_not_allowed"},
      {ParseRawError(
           RawRequest(port_, "GET /v2/none HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")),
       404, "not_found_error", "not_found"},
      {post(R"({"prompt": "x"})"), 400, "invalid_request_error", "invalid_argument"},
      {post(R"({"prompt": "busy"})"), 429, "rate_limit_error", "resource_exhausted"},
      {post(R"({"prompt": "down"})"), 503, "service_unavailable", "unavailable"},
      {post(R"({"prompt": "late"})"), 504, "timeout_error", "deadline_exceeded"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.got.status, c.status);
    EXPECT_EQ(c.got.type, c.type) << c.status;
    EXPECT_EQ(c.got.code, c.code) << c.status;
  }
}

}  // namespace
}  // namespace dgserve
