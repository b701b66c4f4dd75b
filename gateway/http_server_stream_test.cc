// OpenAiHttpServer's SSE streams against a real HTTP client on 127.0.0.1 with a fake
// GenerationCore: framing, the head and keep-alives of an accepted stream, HTTP/1.0 clients,
// Expect: 100-continue, errors before and after the first event, disconnects and Stop().
#include "absl/synchronization/notification.h"
#include "gateway/http_server_test_util.h"

namespace dgserve {
namespace {

using ::testing::EndsWith;
using ::testing::Not;
using ::testing::StartsWith;

using namespace ::dgserve::http_testing;  // NOLINT: the shared fixture and helpers

TEST_F(HttpServerTest, StreamingSuccess) {
  core_.generate = [](const v1::GenerateRequest& req, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback& cb) {
    EXPECT_EQ(req.stream_options().canvas_step_interval(), 2);
    v1::GenerateEvent step;
    step.set_request_id("req-7");
    step.mutable_canvas_step()->set_step(1);
    if (!cb(step)) return absl::CancelledError("client gone");
    for (int i = 0; i < 200; ++i) {  // more than the queue holds: exercises back-pressure
      if (!cb(Block("x"))) return absl::CancelledError("client gone");
    }
    cb(Finished());
    return absl::OkStatus();
  };
  StartServer();
  HttpClient cli = Client();
  auto res = cli.Post("/v1/chat/completions",
                      R"({"messages": [{"role": "user", "content": "hi"}], "stream": true,
                          "stream_options": {"include_usage": true}, "canvas_step_interval": 2})");
  ASSERT_TRUE(res);
  EXPECT_EQ(res.status, 200);
  EXPECT_THAT(res.Header("Content-Type"), HasSubstr("text/event-stream"));
  EXPECT_EQ(res.Header("Cache-Control"), "no-cache");
  EXPECT_EQ(res.Header("X-Request-Id"), "req-7");
  std::vector<std::string> frames = SseData(res.body);
  ASSERT_EQ(frames.size(), 1u + 200u + 1u + 1u + 1u);
  json step = json::parse(frames[0]);
  EXPECT_EQ(step["dgserve"]["canvas_step"]["step"], 1);
  json first = json::parse(frames[1]);
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (size_t i = 1; i <= 200; ++i) {
    text += json::parse(frames[i])["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(text, std::string(200, 'x'));
  EXPECT_EQ(json::parse(frames[201])["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(json::parse(frames[202])["usage"]["total_tokens"], 5);
  EXPECT_EQ(frames[203], "[DONE]");
}

// A stream the core has accepted but that waits for its first event (behind other requests'
// canvases) gets its status, headers and SSE keep-alive comments at once (it sent nothing for
// minutes: clients and proxies could not tell it from a dead one); an error found after that
// comes in-stream.
TEST_F(HttpServerTest, AnAcceptedStreamSendsItsHeadAndKeepAlivesBeforeItsFirstEvent) {
  absl::Notification head_seen;
  core_.accept_as = "req-7";
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                       const GenerationCore::EventCallback& cb) {
    head_seen.WaitForNotificationWithTimeout(absl::Seconds(30));  // queued, no event yet
    cb(Block("late"));
    cb(Finished());
    return absl::OkStatus();
  };
  HttpServerOptions options;
  options.sse_keepalive_interval = absl::Milliseconds(40);
  StartServer(options);
  const int fd = ConnectLoopback(port_, 10);  // each read bounded by a 10 s receive timeout
  ASSERT_GE(fd, 0);
  const std::string body = R"({"prompt": "x", "stream": true})";
  SendAll(fd, absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           "Content-Type: application/json\r\nContent-Length: ",
                           body.size(), "\r\n\r\n", body));
  // Read until the head and two keep-alive comments have arrived, while no event exists.
  std::string got;
  char buf[4096];
  auto keepalives = [&got] {
    int n = 0;
    for (size_t p = got.find(": keep-alive\n\n"); p != std::string::npos;
         p = got.find(": keep-alive\n\n", p + 1)) {
      ++n;
    }
    return n;
  };
  for (int i = 0; i < 500 && keepalives() < 2; ++i) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, size_t(n));
  }
  EXPECT_THAT(got, HasSubstr("HTTP/1.1 200 OK"));
  EXPECT_THAT(got, HasSubstr("Content-Type: text/event-stream"));
  EXPECT_THAT(got, HasSubstr("X-Request-Id: req-7"));
  EXPECT_GE(keepalives(), 2) << got;
  EXPECT_THAT(got, Not(HasSubstr("data:"))) << "no event was produced yet";
  head_seen.Notify();
  while (true) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, size_t(n));
  }
  close(fd);
  EXPECT_THAT(got, HasSubstr("\"late\""));
  EXPECT_THAT(got, HasSubstr("data: [DONE]"));
}

// An accepted stream whose request then fails ends with an SSE error and [DONE] (its head, 200,
// is already out).
TEST_F(HttpServerTest, AnAcceptedStreamReportsALaterErrorInStream) {
  core_.accept_as = "req-7";
  core_.generate = [](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback&) {
    return absl::UnavailableError("no healthy denoise worker");
  };
  StartServer();
  HttpClient cli = Client();
  auto res = cli.Post("/v1/completions", R"({"prompt": "x", "stream": true})");
  ASSERT_TRUE(res);
  EXPECT_EQ(res.status, 200);
  EXPECT_EQ(res.Header("X-Request-Id"), "req-7");
  EXPECT_THAT(res.body, HasSubstr("no healthy denoise worker"));
  EXPECT_THAT(res.body, HasSubstr("data: [DONE]"));
}

// HTTP/1.0 has no chunked coding (RFC 9112 §6.1): a stream to a 1.0 client is the SSE bytes as
// they are, ended by closing the connection (the chunk sizes were read as part of the events);
// an HTTP/1.1 stream is chunked. A 1.0 connection kept alive is told so.
TEST_F(HttpServerTest, StreamsToHttp10ClientsAreNotChunked) {
  // Two blocks with a silence between them long enough for keep-alive comments.
  core_.generate = [](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback& cb) {
    cb(Block("ab"));
    absl::SleepFor(absl::Milliseconds(300));
    cb(Block("c"));
    cb(Finished());
    return absl::OkStatus();
  };
  HttpServerOptions options;
  options.sse_keepalive_interval = absl::Milliseconds(40);
  StartServer(options);
  const std::string body = R"({"prompt": "x", "stream": true})";
  auto post = [&](const std::string& version, const std::string& connection) {
    return RawRequest(port_, absl::StrCat("POST /v1/completions ", version,
                                          "\r\nHost: x\r\nConnection: ", connection,
                                          "\r\nContent-Type: application/json\r\nContent-Length: ",
                                          body.size(), "\r\n\r\n", body));
  };
  // Kept alive or not, a 1.0 stream ends with the connection (RawRequest reads until EOF).
  for (const std::string connection : {"close", "keep-alive"}) {
    SCOPED_TRACE(connection);
    const std::string out10 = post("HTTP/1.0", connection);
    const size_t split = out10.find("\r\n\r\n");
    ASSERT_NE(split, std::string::npos) << out10;
    const std::string head = out10.substr(0, split), sse = out10.substr(split + 4);
    EXPECT_THAT(head, HasSubstr("200 OK"));
    EXPECT_THAT(head, Not(HasSubstr("Transfer-Encoding")));
    EXPECT_THAT(head, HasSubstr("Connection: close"));
    EXPECT_THAT(head, Not(HasSubstr("keep-alive")));
    ASSERT_THAT(sse, StartsWith("data: {"));  // no chunk size before the first frame
    EXPECT_THAT(sse, EndsWith("data: [DONE]\n\n"));
    EXPECT_THAT(sse, HasSubstr("\n\n: keep-alive\n\n"));  // the comments unframed too
    const std::vector<std::string> frames = SseData(sse);
    ASSERT_EQ(frames.size(), 4u) << sse;
    EXPECT_EQ(json::parse(frames[0])["choices"][0]["text"], "ab");
    EXPECT_EQ(json::parse(frames[1])["choices"][0]["text"], "c");
  }
  const std::string out11 = post("HTTP/1.1", "close");
  EXPECT_THAT(out11, HasSubstr("Transfer-Encoding: chunked"));
  EXPECT_THAT(out11, HasSubstr("\r\ne\r\n: keep-alive\n\n\r\n"));  // one chunk of 14 bytes
  EXPECT_THAT(out11, EndsWith("\r\n0\r\n\r\n"));
}

// Expect: 100-continue is answered with an interim 100 for HTTP/1.1, and ignored for HTTP/1.0,
// which has no interim responses (RFC 9110 §10.1.1: a 1.0 client took the 100 as the answer).
TEST_F(HttpServerTest, ExpectContinueOnlyForHttp11) {
  core_.generate = [](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback& cb) {
    cb(Block("ab"));
    cb(Finished());
    return absl::OkStatus();
  };
  StartServer();
  const std::string body = R"({"prompt": "x"})";
  for (const std::string version : {"HTTP/1.1", "HTTP/1.0"}) {
    SCOPED_TRACE(version);
    const int fd = ConnectLoopback(port_, 10);
    ASSERT_GE(fd, 0);
    SendAll(fd, absl::StrCat("POST /v1/completions ", version,
                             "\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\n"
                             "Content-Type: application/json\r\nContent-Length: ",
                             body.size(), "\r\n\r\n"));
    std::string head;
    if (version == "HTTP/1.1") {
      head = ReadUntil(fd, "\r\n\r\n");
      EXPECT_EQ(head, "HTTP/1.1 100 Continue\r\n\r\n");
    } else {
      // Time for the server to read the head (and, before the fix, to answer 100 to it).
      absl::SleepFor(absl::Milliseconds(300));
    }
    SendAll(fd, body);
    const std::string answer = ReadToEnd(fd);  // Connection: close
    close(fd);
    EXPECT_THAT(answer, StartsWith("HTTP/1.1 200 OK"));
    EXPECT_THAT(answer, Not(HasSubstr("100 Continue")));
  }
  // Keep-alive on 1.0 is confirmed; a 1.0 request without it is closed after the answer.
  const std::string kept = RawRequest(
      port_, "GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /health HTTP/1.0\r\n\r\n");
  EXPECT_THAT(kept, HasSubstr("Connection: keep-alive"));
  size_t answers = 0;
  for (size_t p = kept.find("200 OK"); p != std::string::npos; p = kept.find("200 OK", p + 1)) {
    ++answers;
  }
  EXPECT_EQ(answers, 2u) << kept;
}

// A head that is refused on its own gets its final answer instead of "100 Continue" (RFC 9110
// §10.1.1): the client need not send the body. Counted once; the connection closes.
TEST_F(HttpServerTest, ExpectContinueRefusedByItsHeadGetsTheFinalAnswer) {
  std::atomic<int> generated{0};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                       const GenerationCore::EventCallback& cb) {
    ++generated;
    cb(Block("ab"));
    cb(Finished());
    return absl::OkStatus();
  };
  core_.api_key = "secret";
  StartServer();
  struct Case {
    std::string head;  // header lines after the request line, each ending in \r\n
    std::string route;
    std::string want;  // the status line
  };
  const std::string json = "Content-Type: application/json\r\n";
  const std::string auth = "Authorization: Bearer secret\r\n";
  const Case cases[] = {
      {"POST /v1/completions HTTP/1.1\r\n" + json, "/v1/completions", "HTTP/1.1 401 "},
      {"POST /v1/completions HTTP/1.1\r\n" + auth + "Content-Type: text/plain\r\n",
       "/v1/completions", "HTTP/1.1 415 "},
      {"POST /v1/chat/completions HTTP/1.1\r\n" + auth + json + "X-Request-Timeout: 0x10\r\n",
       "/v1/chat/completions", "HTTP/1.1 400 "},
      {"PUT /v1/completions HTTP/1.1\r\n" + auth + json, "/v1/completions", "HTTP/1.1 405 "},
      {"POST /v1/nothing HTTP/1.1\r\n" + auth + json, "", "HTTP/1.1 404 "},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.head);
    const int fd = ConnectLoopback(port_, 10);
    ASSERT_GE(fd, 0);
    // The body is never sent: the answer must come without it.
    SendAll(fd, c.head + "Host: x\r\nExpect: 100-continue\r\nContent-Length: 15\r\n\r\n");
    const std::string answer = ReadToEnd(fd);  // the server closes after the refusal
    close(fd);
    EXPECT_THAT(answer, StartsWith(c.want));
    EXPECT_THAT(answer, Not(HasSubstr("100 Continue")));
    EXPECT_THAT(answer, HasSubstr("X-Request-Id: "));
    EXPECT_THAT(answer, HasSubstr("\"error\""));
  }
  EXPECT_EQ(generated.load(), 0);
  // The four refusals on generation routes were counted once each (the 404 is not a
  // generation request).
  EXPECT_EQ(core_.Refused().size(), 4u);
  // A head that passes still gets 100 Continue, and its request runs.
  const int fd = ConnectLoopback(port_, 10);
  ASSERT_GE(fd, 0);
  SendAll(fd, "POST /v1/completions HTTP/1.1\r\n" + auth + json +
                  "Host: x\r\nConnection: close\r\nExpect: 100-continue\r\n"
                  "Content-Length: 15\r\n\r\n");
  EXPECT_EQ(ReadUntil(fd, "\r\n\r\n"), "HTTP/1.1 100 Continue\r\n\r\n");
  SendAll(fd, R"({"prompt": "x"})");
  EXPECT_THAT(ReadToEnd(fd), StartsWith("HTTP/1.1 200 OK"));
  close(fd);
  EXPECT_EQ(generated.load(), 1);
}

TEST_F(HttpServerTest, StreamingErrorBeforeFirstEventIsAnHttpError) {
  core_.generate = [](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback&) {
    return absl::ResourceExhaustedError("KV cache exhausted");
  };
  StartServer();
  HttpClient cli = Client();
  auto res = cli.Post("/v1/completions", R"({"prompt": "x", "stream": true})");
  ExpectErrorBody(res, 429, "rate_limit_error", "KV cache exhausted");
  EXPECT_EQ(res.Header("Retry-After"), "1");
}

TEST_F(HttpServerTest, StreamingErrorAfterFirstEventIsAnSseError) {
  core_.generate = [](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback& cb) {
    cb(Block("partial"));
    return absl::UnavailableError("denoise worker lost");
  };
  StartServer();
  HttpClient cli = Client();
  auto res = cli.Post("/v1/completions", R"({"prompt": "x", "stream": true})");
  ASSERT_TRUE(res);
  EXPECT_EQ(res.status, 200);
  std::vector<std::string> frames = SseData(res.body);
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_EQ(json::parse(frames[0])["choices"][0]["text"], "partial");
  json err = json::parse(frames[1]);
  EXPECT_EQ(err["error"]["message"], "denoise worker lost");
  EXPECT_EQ(err["error"]["type"], "service_unavailable");
  EXPECT_EQ(frames[2], "[DONE]");
}

TEST_F(HttpServerTest, StreamingClientDisconnectCancels) {
  std::atomic<bool> cancelled{false};
  std::atomic<int> sent{0};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>& c,
                       const GenerationCore::EventCallback& cb) {
    const std::string big(4096, 'y');
    for (int i = 0; i < 100000; ++i) {
      if (c() || !cb(Block(big))) {
        cancelled = true;
        return absl::CancelledError("client gone");
      }
      ++sent;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    cb(Finished());
    return absl::OkStatus();
  };
  StartServer();
  // A raw client: send the request, read a little, close the socket.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port_));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string body = R"({"prompt": "x", "stream": true})";
  const std::string request =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
      "Content-Type: application/json\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  ASSERT_EQ(write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  char buf[8192];
  ssize_t n = read(fd, buf, sizeof(buf));
  ASSERT_GT(n, 0);
  EXPECT_THAT(std::string(buf, n), HasSubstr("200"));
  close(fd);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!cancelled && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(cancelled.load());
  EXPECT_LT(sent.load(), 100000);
  // The server still serves.
  EXPECT_EQ(Client().Get("/health").status, 200);
}

TEST_F(HttpServerTest, StopCancelsInFlightStream) {
  std::atomic<bool> in_generate{false};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>& c,
                       const GenerationCore::EventCallback& cb) {
    cb(Block("a"));
    in_generate = true;
    while (!c()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return absl::CancelledError("stopping");
  };
  StartServer();
  std::thread client([&] {
    HttpClient cli = Client();
    cli.Post("/v1/completions", R"({"prompt": "x", "stream": true})");
  });
  while (!in_generate) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  server_->Stop();  // must return: the core sees is_cancelled
  client.join();
  server_->Stop();  // idempotent
}

}  // namespace
}  // namespace dgserve
