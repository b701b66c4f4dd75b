// The HTTP server's connection handling against raw sockets and a real HTTP client on 127.0.0.1,
// with a fake GenerationCore: disconnects cancel, keep-alive and pipelining, header limits,
// deadlines, admission, slow clients, back-pressure and write timeouts, refusals counted.
#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "gateway/http_server_test_util.h"

namespace dgserve {
namespace {

using namespace ::dgserve::http_testing;  // NOLINT: the shared fixture and helpers
using ::dgserve::testing::StatusIs;
using ::testing::StartsWith;

TEST_F(HttpServerTest, NonStreamingClientDisconnectCancels) {
  std::atomic<bool> started{false}, cancelled{false};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>& c,
                       const GenerationCore::EventCallback&) {
    started = true;
    // Runs until cancelled (bounded: 20 s).
    for (int i = 0; i < 4000 && !c(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    cancelled = c();
    return absl::CancelledError("client gone");
  };
  StartServer();
  int fd = ConnectLoopback(port_, 10);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, PostRequest("/v1/completions", R"({"prompt": "x"})")));
  ASSERT_TRUE(Eventually([&] { return started.load(); }));
  close(fd);  // before any byte of the answer
  ASSERT_TRUE(Eventually([&] { return cancelled.load(); }));
  EXPECT_TRUE(cancelled.load());
  EXPECT_EQ(Client().Get("/health").status, 200);
}

TEST_F(HttpServerTest, KeepAliveAndPipelining) {
  core_.generate = AnswerWith("pipe");
  StartServer();
  int fd = ConnectLoopback(port_, 10);
  ASSERT_GE(fd, 0);
  // Three requests in one write: answered in order on the same connection.
  const std::string three = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n" +
                            PostRequest("/v1/completions", R"({"prompt": "x"})") +
                            "GET /v1/models/dg-tiny HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(SendAll(fd, three));
  const std::string out = ReadUntil(fd, "HTTP/1.1 200", 3);
  const size_t a = out.find(R"({"status":"ok"})");
  const size_t b = out.find(R"("text":"pipe")");
  const size_t c = out.find(R"("id":"dg-tiny")");
  ASSERT_NE(a, std::string::npos) << out;
  ASSERT_NE(b, std::string::npos) << out;
  ASSERT_NE(c, std::string::npos) << out;
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
  // Still open: one more request, then Connection: close ends it.
  ASSERT_TRUE(SendAll(fd, "GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  const std::string last = ReadUntil(fd, "\x01");  // until EOF
  EXPECT_THAT(last, HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(last, HasSubstr("Connection: close"));
  EXPECT_THAT(last, HasSubstr(R"({"status":"ready"})"));
  close(fd);
}

TEST_F(HttpServerTest, HeaderTooLargeIs431) {
  HttpServerOptions options;
  options.max_header_bytes = 1024;
  StartServer(options);
  const std::string out = RawRequest(
      port_, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(4000, 'a') + "\r\n\r\n");
  EXPECT_THAT(out, HasSubstr("HTTP/1.1 431"));
  EXPECT_THAT(out, HasSubstr("request head larger than 1024 bytes"));
}

// A request line longer than the head's limit is 414 URI Too Long, not 431 (which is for header
// fields).
TEST_F(HttpServerTest, RequestLineTooLongIs414) {
  HttpServerOptions options;
  options.max_header_bytes = 1024;
  StartServer(options);
  const std::string out = RawRequest(
      port_, "GET /v1/models?q=" + std::string(4000, 'a') + " HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_THAT(out, HasSubstr("HTTP/1.1 414 URI Too Long"));
  EXPECT_THAT(out, HasSubstr("request line (method and URI) longer than 1024 bytes"));
  EXPECT_THAT(out, HasSubstr(R"("code":"uri_too_long")"));
}

TEST_F(HttpServerTest, RequestTimeoutHeaderOnlyShortens) {
  std::atomic<double> seen_timeout{0};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time deadline,
                       const std::function<bool()>&, const GenerationCore::EventCallback& cb) {
    seen_timeout = absl::ToDoubleSeconds(deadline - absl::Now());
    cb(Finished());
    return absl::OkStatus();
  };
  HttpServerOptions options;
  options.default_timeout = absl::Seconds(20);
  StartServer(options);
  HttpClient cli = Client();
  // Longer than the server's limit: the server's limit holds.
  auto res = cli.Post("/v1/completions", R"({"prompt": "x"})", {{"X-Request-Timeout", "3600"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res.status, 200);
  EXPECT_LE(seen_timeout.load(), 20);
  EXPECT_GT(seen_timeout.load(), 10);
  // Given twice: refused, whichever comes first (the first used to win, so a proxy's longer
  // value before the client's shorter one lengthened the deadline).
  seen_timeout = 0;
  res = cli.Post("/v1/completions", R"({"prompt": "x"})",
                 {{"X-Request-Timeout", "5"}, {"X-Request-Timeout", "1"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res.status, 400);
  EXPECT_THAT(res.body, HasSubstr("X-Request-Timeout: given more than once"));
  EXPECT_EQ(seen_timeout.load(), 0);  // the core never ran
}

// More concurrent clients than the limit: those beyond it get 429 at once while the others
// run, and /health and /ready answer all along.
TEST_F(HttpServerTest, AdmissionLimitRefusesAtOnceAndHealthStaysUp) {
  constexpr int kLimit = 4;
  constexpr int kClients = 12;
  Admission admission(kLimit, 0);
  core_.admission = &admission;
  std::atomic<bool> release{false};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time deadline,
                       const std::function<bool()>& c, const GenerationCore::EventCallback& cb) {
    absl::Status s = admission.Acquire(deadline, c, nullptr);
    if (!s.ok()) return s;
    for (int i = 0; i < 4000 && !release && !c(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    admission.Release();
    cb(Block("done"));
    cb(Finished());
    return absl::OkStatus();
  };
  StartServer();
  std::vector<int> held;
  for (int i = 0; i < kLimit; ++i) {
    int fd = ConnectLoopback(port_, 10);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, PostRequest("/v1/completions", R"({"prompt": "x"})")));
    held.push_back(fd);
  }
  ASSERT_TRUE(Eventually([&] { return admission.running() == kLimit; }));
  // The others: 429 with Retry-After, answered while the first ones still run.
  for (int i = kLimit; i < kClients; ++i) {
    HttpClient cli = Client();
    auto res = cli.Post("/v1/completions", R"({"prompt": "x"})");
    ExpectErrorBody(res, 429, "rate_limit_error", "limit of concurrent requests");
    EXPECT_EQ(res.Header("Retry-After"), "1");
    EXPECT_EQ(cli.Get("/health").status, 200);
    EXPECT_EQ(cli.Get("/ready").status, 200);
  }
  EXPECT_EQ(admission.running(), kLimit);
  release = true;
  for (int fd : held) {
    EXPECT_THAT(ReadUntil(fd, R"("text":"done")"), HasSubstr("HTTP/1.1 200"));
    close(fd);
  }
  ASSERT_TRUE(Eventually([&] { return admission.running() == 0; }));
}

// Slow clients (slowloris: a partial request head, never finished) hold no thread: /health
// answers while they are connected, and the read timeout cuts them off with a 408 (they used to
// be closed without an answer).
TEST_F(HttpServerTest, SlowClientsAreCutOffAndDoNotBlockHealth) {
  HttpServerOptions options;
  options.read_timeout = absl::Milliseconds(300);
  options.io_threads = 1;
  StartServer(options);
  constexpr int kSlow = 64;
  std::vector<int> slow;
  for (int i = 0; i < kSlow; ++i) {
    int fd = ConnectLoopback(port_, 10);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n"));
    slow.push_back(fd);
  }
  HttpClient cli = Client();
  for (int i = 0; i < 10; ++i) EXPECT_EQ(cli.Get("/health").status, 200);
  // Each slow connection gets a 408 and then EOF, not the 10 s receive timeout.
  int timed_out = 0;
  for (int fd : slow) {
    const std::string answer = ReadToEnd(fd);
    if (answer.rfind("HTTP/1.1 408 ", 0) == 0 &&
        answer.find("Connection: close\r\n") != std::string::npos &&
        answer.find("\"code\":\"request_timeout\"") != std::string::npos) {
      ++timed_out;
    }
    close(fd);
  }
  EXPECT_EQ(timed_out, kSlow);
}

// A generation request whose head came but whose body stops short: 408 when the read timeout
// fires, counted as a refused generation request (DEADLINE_EXCEEDED); the core never sees it,
// and the bytes the client sends afterwards are not read as a request.
TEST_F(HttpServerTest, ABodyCutShortIsAnswered408) {
  std::atomic<int> generated{0};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                       const GenerationCore::EventCallback& cb) {
    ++generated;
    cb(Finished());
    return absl::OkStatus();
  };
  HttpServerOptions options;
  options.read_timeout = absl::Milliseconds(300);
  StartServer(options);
  const std::string body = R"({"prompt": "x"})";
  const std::string request = PostRequest("/v1/completions", body);
  int fd = ConnectLoopback(port_, 10);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, request.substr(0, request.size() - 4)));  // all but 4 body bytes
  const std::string answer = ReadUntil(fd, "}}");
  EXPECT_EQ(answer.rfind("HTTP/1.1 408 ", 0), 0u) << answer;
  EXPECT_THAT(answer, HasSubstr("\"type\":\"timeout_error\""));
  EXPECT_THAT(answer, HasSubstr("not received in full within 300ms"));
  // The rest of the body and a whole second request, sent late: neither is served.
  SendAll(fd, request.substr(request.size() - 4) + request);
  EXPECT_EQ(ReadToEnd(fd).find("HTTP/1.1"), std::string::npos);
  close(fd);
  EXPECT_EQ(core_.Refused(), std::vector<absl::StatusCode>{absl::StatusCode::kDeadlineExceeded});
  EXPECT_EQ(generated.load(), 0);
  EXPECT_EQ(Client().Post("/v1/completions", body).status, 200);
  EXPECT_EQ(generated.load(), 1);
}

// A client that stops reading a stream: the generating thread is held back (it does not run
// ahead and buffer everything), and the write timeout then closes the connection and cancels
// the request.
TEST_F(HttpServerTest, StreamBackPressureAndWriteTimeout) {
  constexpr int kEvents = 100000;
  const std::string big(16 << 10, 'z');  // 16 KiB of text per event (about 1.6 GB in all)
  std::atomic<int> sent{0};
  std::atomic<bool> cancelled{false};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>& c,
                       const GenerationCore::EventCallback& cb) {
    for (int i = 0; i < kEvents; ++i) {
      if (c() || !cb(Block(big))) {
        cancelled = true;
        return absl::CancelledError("client gone");
      }
      ++sent;
    }
    cb(Finished());
    return absl::OkStatus();
  };
  HttpServerOptions options;
  options.max_pending_stream_bytes = 64 << 10;
  options.write_timeout = absl::Milliseconds(500);
  StartServer(options);
  int fd = ConnectLoopback(port_, 10);
  ASSERT_GE(fd, 0);
  int rcvbuf = 16 << 10;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  ASSERT_TRUE(SendAll(fd, PostRequest("/v1/completions", R"({"prompt": "x", "stream": true})")));
  // Never read: the server's write stalls, the write timeout fires and cancels the request.
  ASSERT_TRUE(Eventually([&] { return cancelled.load(); }));
  // Bounded by the socket buffers plus max_pending_stream_bytes, far from all 100,000 events.
  EXPECT_LT(sent.load(), 2000);
  close(fd);
  EXPECT_EQ(Client().Get("/health").status, 200);
}

// Generation requests refused before the core runs them (405, 401, 400, 413) are counted in the
// core's request metrics (they used to be left out of dgserve_gateway_requests_total).
TEST_F(HttpServerTest, RefusalsAreCountedByTheCore) {
  core_.api_key = "sk-1";
  HttpServerOptions options;
  options.max_body_bytes = 1024;
  StartServer(options);
  HttpClient cli = Client();
  const HttpHeaders auth = {{"Authorization", "Bearer sk-1"}};
  EXPECT_EQ(cli.Get("/v1/completions", auth).status, 405);
  EXPECT_EQ(cli.Post("/v1/completions", R"({"prompt": "x"})").status, 401);
  EXPECT_EQ(cli.Post("/v1/chat/completions", "{bad", auth).status, 400);
  EXPECT_EQ(
      cli.Post("/v1/completions", R"({"prompt": ")" + std::string(2000, 'a') + "\"}", auth).status,
      413);
  // Not generation requests: not counted.
  EXPECT_EQ(cli.Get("/health").status, 200);
  EXPECT_EQ(cli.Get("/nothing", auth).status, 404);
  EXPECT_EQ(core_.Refused(),
            (std::vector<absl::StatusCode>{
                absl::StatusCode::kInvalidArgument, absl::StatusCode::kUnauthenticated,
                absl::StatusCode::kInvalidArgument, absl::StatusCode::kInvalidArgument}));
}

// A generation body over 64 KiB is parsed, checked and refused on a parse thread, never on the
// event loop (a 4 MiB body takes about half a second to parse, and on the loop it held every
// connection of that thread, /health included), and at most parse_threads at once (each
// costs about 20 times its size while parsed; a hostile probe had 16 parsed at once, 1.4 GB).
// Here the refusal of a bad body is held on the thread that parsed it (a stand-in for a slow
// parse, without timing anything): with one event-loop thread and two parse threads, /health is
// answered while two are held, the third body waits its turn (it cannot be parsed while both
// parse threads are held), and all three get their 400 once released.
TEST_F(HttpServerTest, BodiesAreParsedOffTheEventLoopTwoAtATime) {
  struct Hold {
    absl::Notification release;
    std::atomic<int> held{0};
  };
  // Shared with the server's threads: a failed assertion must not leave them a dangling one.
  auto hold = std::make_shared<Hold>();
  absl::Cleanup release_on_exit = [hold] {
    if (!hold->release.HasBeenNotified()) hold->release.Notify();
  };
  core_.on_refused = [hold](const absl::Status& status) {
    if (absl::StrContains(status.message(), "unsupported field: hold_me")) {
      ++hold->held;
      hold->release.WaitForNotificationWithTimeout(absl::Seconds(60));
    }
  };
  core_.generate = AnswerWith("fine");
  HttpServerOptions options;
  options.io_threads = 1;
  options.parse_threads = 2;
  StartServer(options);
  constexpr int kBodies = 3;
  // Over the size parsed inline on the event loop (64 KiB): these go to the parse pool.
  const std::string body =
      absl::StrCat(R"({"prompt": ")", std::string(100 << 10, 'x'), R"(", "hold_me": 1})");
  std::vector<int> fds;
  for (int i = 0; i < kBodies; ++i) {
    const int fd = ConnectLoopback(port_, 30);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(SendAll(fd, PostRequest("/v1/completions", body)));
    fds.push_back(fd);
  }
  ASSERT_TRUE(Eventually([&] { return hold->held.load() == options.parse_threads; }));
  HttpClient cli = Client();
  EXPECT_EQ(cli.Get("/health").status, 200);
  EXPECT_EQ(cli.Get("/v1/models").status, 200);
  EXPECT_EQ(hold->held.load(), options.parse_threads);  // the third waits for a parse thread
  hold->release.Notify();
  for (int fd : fds) {
    const std::string raw = ReadUntil(fd, "hold_me");
    EXPECT_EQ(raw.rfind("HTTP/1.1 400", 0), 0u) << raw;
    close(fd);
  }
  EXPECT_EQ(hold->held.load(), kBodies);
  auto res = cli.Post("/v1/completions", R"({"prompt": "y"})");
  ASSERT_TRUE(res) << res.error;
  EXPECT_EQ(res.status, 200);
  EXPECT_THAT(res.body, HasSubstr("fine"));
}

// A body that waited for a parse thread past its deadline is not parsed: it gets 504 at once
// (it was parsed, and a generation started after its deadline). One parse thread, held by a
// refusal (a body over the inline-parse size, so it goes to the pool); a second big body with a
// 50 ms X-Request-Timeout waits behind it past its deadline.
TEST_F(HttpServerTest, ABodyPastItsDeadlineIsNotParsed) {
  struct Hold {
    absl::Notification release;
    std::atomic<int> held{0};
    absl::Mutex mu;
    std::vector<std::string> refused;  // messages, in order
  };
  auto hold = std::make_shared<Hold>();
  absl::Cleanup release_on_exit = [hold] {
    if (!hold->release.HasBeenNotified()) hold->release.Notify();
  };
  core_.on_refused = [hold](const absl::Status& status) {
    {
      absl::MutexLock lock(&hold->mu);
      hold->refused.push_back(status.ToString());
    }
    if (absl::StrContains(status.message(), "unsupported field: hold_me")) {
      ++hold->held;
      hold->release.WaitForNotificationWithTimeout(absl::Seconds(60));
    }
  };
  HttpServerOptions options;
  options.io_threads = 1;
  options.parse_threads = 1;
  StartServer(options);
  const std::string big_prompt(100 << 10, 'x');  // over the inline-parse size
  const int held_fd = ConnectLoopback(port_, 30);
  ASSERT_GE(held_fd, 0);
  ASSERT_TRUE(SendAll(held_fd, PostRequest("/v1/completions", absl::StrCat(R"({"prompt": ")",
                                                                           big_prompt,
                                                                           R"(", "hold_me": 1})"))));
  ASSERT_TRUE(Eventually([&] { return hold->held.load() == 1; }));
  const int late_fd = ConnectLoopback(port_, 30);
  ASSERT_GE(late_fd, 0);
  ASSERT_TRUE(SendAll(late_fd, PostRequest("/v1/completions",
                                           absl::StrCat(R"({"prompt": ")", big_prompt,
                                                        R"(", "never_parsed": 1})"),
                                           "X-Request-Timeout: 0.05\r\n")));
  absl::SleepFor(absl::Milliseconds(300));  // past the 50 ms deadline (a wait, not a check)
  hold->release.Notify();
  const std::string late = ReadUntil(late_fd, "\"error\"");
  EXPECT_EQ(late.rfind("HTTP/1.1 504", 0), 0u) << late;
  EXPECT_THAT(late, HasSubstr("deadline exceeded before the request was read"));
  const std::string held = ReadUntil(held_fd, "hold_me");
  EXPECT_EQ(held.rfind("HTTP/1.1 400", 0), 0u) << held;
  close(late_fd);
  close(held_fd);
  absl::MutexLock lock(&hold->mu);
  ASSERT_EQ(hold->refused.size(), 2u);
  EXPECT_THAT(hold->refused[1], StartsWith("DEADLINE_EXCEEDED"));  // never "never_parsed"
}

// The bodies held at once (read, or waiting for a parse thread) are bounded by
// max_buffered_body_bytes across all connections: a body over it is refused on its head with
// 503, Retry-After and an OpenAI error, before it is read (40 concurrent 4 MB posts grew the
// gateway by about 6 MB each, past its 512 MiB limit). One parse thread, held by the first
// body's refusal (after its parse: its bytes are given back); two more wait for it (held in the
// budget); a fourth does not fit. Once released, the budget comes back to 0.
TEST_F(HttpServerTest, BodiesBeyondTheBufferedBudgetAre503OnTheirHead) {
  struct Hold {
    absl::Notification release;
    std::atomic<int> held{0};
  };
  auto hold = std::make_shared<Hold>();
  absl::Cleanup release_on_exit = [hold] {
    if (!hold->release.HasBeenNotified()) hold->release.Notify();
  };
  core_.on_refused = [hold](const absl::Status& status) {
    if (absl::StrContains(status.message(), "unsupported field: hold_me")) {
      ++hold->held;
      hold->release.WaitForNotificationWithTimeout(absl::Seconds(60));
    }
  };
  const std::string body =
      absl::StrCat(R"({"prompt": ")", std::string(100 << 10, 'x'), R"(", "hold_me": 1})");
  HttpServerOptions options;
  options.io_threads = 1;
  options.parse_threads = 1;
  options.max_buffered_body_bytes = 2 * body.size() + body.size() / 2;
  StartServer(options);
  std::vector<int> fds;
  auto post = [&] {
    const int fd = ConnectLoopback(port_, 30);
    EXPECT_GE(fd, 0);
    EXPECT_TRUE(SendAll(fd, PostRequest("/v1/completions", body)));
    fds.push_back(fd);
    return fd;
  };
  post();
  ASSERT_TRUE(Eventually([&] { return hold->held.load() == 1; }));
  EXPECT_EQ(server_->buffered_body_bytes(), 0u);  // parsed: given back
  post();
  post();
  ASSERT_TRUE(Eventually([&] { return server_->buffered_body_bytes() == 2 * body.size(); }));
  const int over = post();
  const std::string refused = ReadToEnd(over);
  EXPECT_EQ(refused.rfind("HTTP/1.1 503", 0), 0u) << refused.substr(0, 300);
  EXPECT_THAT(refused, HasSubstr("Retry-After: 1\r\n"));
  EXPECT_THAT(refused, HasSubstr("Connection: close\r\n"));
  const json error = json::parse(refused.substr(refused.find("\r\n\r\n") + 4), nullptr, false);
  ASSERT_FALSE(error.is_discarded()) << refused;
  EXPECT_EQ(error["error"]["type"], "service_unavailable") << refused;
  EXPECT_EQ(error["error"]["code"], "unavailable") << refused;
  EXPECT_THAT(error["error"]["message"].get<std::string>(), HasSubstr("max_buffered_body_bytes"));
  EXPECT_EQ(server_->buffered_body_bytes(), 2 * body.size());
  EXPECT_EQ(hold->held.load(), 1);  // the others were not parsed meanwhile
  hold->release.Notify();
  for (size_t i = 0; i + 1 < fds.size(); ++i) {
    const std::string raw = ReadUntil(fds[i], "hold_me");
    EXPECT_EQ(raw.rfind("HTTP/1.1 400", 0), 0u) << raw.substr(0, 300);
  }
  for (int fd : fds) close(fd);
  EXPECT_EQ(hold->held.load(), 3);
  ASSERT_TRUE(Eventually([&] { return server_->buffered_body_bytes() == 0; }));
  // A body fits again.
  core_.generate = AnswerWith("fine");
  auto res = Client().Post("/v1/completions", R"({"prompt": "y"})");
  ASSERT_TRUE(res) << res.error;
  EXPECT_EQ(res.status, 200);
  EXPECT_EQ(server_->buffered_body_bytes(), 0u);
}

// Bytes that are not UTF-8 in the request line or a header value that an error quotes: the
// error body is still JSON (U+FFFD for such bytes) and the server lives on (the strict JSON
// dump threw on the event-loop thread and ended the process; found by a hostile probe).
TEST_F(HttpServerTest, BytesThatAreNotUtf8InTheHeadGetAJsonError) {
  core_.api_key = "sk-1";  // unknown paths and bad heads are answered before the key check
  StartServer();
  struct Case {
    std::string request;
    std::string status;
  };
  const std::vector<Case> cases = {
      {"GET /v1/models/\xff HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-1\r\n"
       "Connection: close\r\n\r\n",
       "HTTP/1.1 404 "},
      {"GET /\xc3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "HTTP/1.1 404 "},
      {"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\xff\r\n"
       "Connection: close\r\n\r\n",
       "HTTP/1.1 501 "},
  };
  for (const Case& c : cases) {
    const std::string raw = RawRequest(port_, c.request);
    EXPECT_THAT(raw, StartsWith(c.status)) << raw;
    const size_t body_at = raw.find("\r\n\r\n");
    ASSERT_NE(body_at, std::string::npos) << raw;
    const json body = json::parse(raw.substr(body_at + 4), nullptr, false);
    ASSERT_FALSE(body.is_discarded()) << raw;
    EXPECT_THAT(body["error"]["message"].get<std::string>(), HasSubstr("\xef\xbf\xbd"));
    EXPECT_EQ(Client().Get("/health").status, 200);
  }
}

// Context-limit and token-range errors from the core name their field in `param` ("messages"
// for a chat request) and carry OpenAI's code "context_length_exceeded" where it applies.
TEST_F(HttpServerTest, CoreErrorsNameTheirField) {
  core_.generate = [](const v1::GenerateRequest& req, absl::Time, const std::function<bool()>&,
                      const GenerationCore::EventCallback&) {
    if (req.max_tokens() == 1) {
      return absl::InvalidArgumentError(
          "max_tokens: the prompt (3 tokens) plus 2 canvases of 256 tokens for max_tokens=1 "
          "exceed the context limit of 4096 positions");
    }
    if (req.max_tokens() == 2) {
      return absl::InvalidArgumentError("prompt: token id 999 is outside [0, 512)");
    }
    return absl::InvalidArgumentError(
        "prompt: 5000 tokens exceed the context limit of 4096 positions");
  };
  StartServer();
  HttpClient cli = Client();
  auto length = cli.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 1})");
  ExpectErrorBody(length, 400, "invalid_request_error", "exceed the context limit");
  EXPECT_EQ(json::parse(length.body)["error"]["param"], "max_tokens");
  EXPECT_EQ(json::parse(length.body)["error"]["code"], "context_length_exceeded");
  auto range = cli.Post("/v1/completions", R"({"prompt": [999], "max_tokens": 2})");
  ExpectErrorBody(range, 400, "invalid_request_error", "outside [0, 512)");
  EXPECT_EQ(json::parse(range.body)["error"]["param"], "prompt");
  EXPECT_EQ(json::parse(range.body)["error"]["code"], "invalid_argument");
  auto chat = cli.Post("/v1/chat/completions",
                       R"({"messages": [{"role": "user", "content": "x"}], "stream": true})");
  ExpectErrorBody(chat, 400, "invalid_request_error", "exceed the context limit");
  EXPECT_EQ(json::parse(chat.body)["error"]["param"], "messages");
  EXPECT_EQ(json::parse(chat.body)["error"]["code"], "context_length_exceeded");
}

// Stop() closes every open connection at once: an idle keep-alive client sees EOF while the
// server object still exists, not its idle timeout. (A connection the server lost track of
// stayed open until the server was destroyed: this read then timed out after 10 s.)
TEST_F(HttpServerTest, StopClosesIdleKeepAliveConnections) {
  HttpServerOptions options;
  options.idle_timeout = absl::Minutes(10);
  StartServer(options);
  int fd = ConnectLoopback(port_, 10);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  const std::string answer = ReadUntil(fd, R"({"status":"ok"})");
  EXPECT_THAT(answer, HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(answer, ::testing::Not(HasSubstr("Connection: close")));
  server_->Stop();
  char c;
  EXPECT_EQ(read(fd, &c, 1), 0) << "Stop() left the keep-alive connection open";
  close(fd);
}

// Stop() after the generations have ended (the gateway's drain) lets the answers in progress
// be written: a stream whose client reads slowly gets all of its frames and [DONE], and a
// non-streaming answer all of its body, before the connections close. (Stop() stopped the event
// loop as soon as the generating threads returned: the unwritten bytes were dropped.)
TEST_F(HttpServerTest, StopWritesTheAnswersInProgressFirst) {
  constexpr int kBlocks = 256;
  const std::string text(64 << 10, 'x');  // 16 MiB of frames: more than the socket buffers hold
  std::atomic<int> ended{0};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                       const GenerationCore::EventCallback& cb) {
    for (int i = 0; i < kBlocks; ++i) cb(Block(text));
    cb(Finished());
    ++ended;
    return absl::OkStatus();
  };
  HttpServerOptions options;
  options.max_pending_stream_bytes = 64 << 20;  // the generation never waits for the client
  StartServer(options);
  const int stream = ConnectLoopback(port_, 10);
  const int unary = ConnectLoopback(port_, 10);
  ASSERT_GE(stream, 0);
  ASSERT_GE(unary, 0);
  ASSERT_TRUE(SendAll(stream, PostRequest("/v1/completions", R"({"prompt": "1", "stream": true})")));
  ASSERT_TRUE(SendAll(unary, PostRequest("/v1/completions", R"({"prompt": "1"})")));
  std::string stream_out = ReadUntil(stream, "data: ");
  for (int i = 0; i < 1000 && ended < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(ended, 2);
  // Neither client has read its answer yet: most of it is still queued in the server.
  std::thread stopper([&] { server_->Stop(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  stream_out += ReadToEnd(stream);
  const std::string unary_out = ReadToEnd(unary);
  close(stream);
  close(unary);
  stopper.join();
  size_t frames = 0;
  for (size_t p = stream_out.find("data: "); p != std::string::npos;
       p = stream_out.find("data: ", p + 1)) {
    ++frames;
  }
  EXPECT_EQ(frames, size_t(kBlocks) + 2);  // the blocks, the finish reason, [DONE]
  EXPECT_TRUE(absl::EndsWith(stream_out, "data: [DONE]\n\n\r\n0\r\n\r\n"))
      << "the stream was cut after " << stream_out.size() << " bytes";
  const size_t body = unary_out.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  EXPECT_THAT(unary_out.substr(0, body), HasSubstr("HTTP/1.1 200"));
  const json answer = json::parse(unary_out.substr(body + 4), nullptr, false);
  ASSERT_FALSE(answer.is_discarded()) << "the answer was cut after " << unary_out.size() << " bytes";
  EXPECT_EQ(answer["choices"][0]["text"].get<std::string>().size(), size_t(kBlocks) * text.size());
}

// A Transfer-Encoding other than "chunked" alone leaves the body's length unknown: one 501,
// then the connection closes (the body was read as a second request, "bad method").
TEST_F(HttpServerTest, TransferEncodingOtherThanChunkedIsRefusedOnce) {
  core_.generate = AnswerWith("ok");
  StartServer();
  const std::string body = R"({"prompt": "1"})";
  for (const std::string coding : {"gzip", "chunked, gzip", "gzip, chunked", "identity"}) {
    SCOPED_TRACE(coding);
    const std::string raw = RawRequest(
        port_, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding +
                   "\r\n\r\n" + body);
    EXPECT_THAT(raw, StartsWith("HTTP/1.1 501 ")) << raw;
    EXPECT_THAT(raw, HasSubstr("only \\\"chunked\\\" is supported")) << raw;
    EXPECT_EQ(raw.find("HTTP/1.1 ", 1), std::string::npos) << "a second answer: " << raw;
  }
  EXPECT_EQ(core_.Refused().size(), 4u);
  // "chunked" alone is read as before.
  const std::string chunked =
      RawRequest(port_, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                        "Transfer-Encoding: chunked\r\n\r\n" +
                            absl::StrCat(absl::Hex(body.size())) + "\r\n" + body + "\r\n0\r\n\r\n");
  EXPECT_THAT(chunked, StartsWith("HTTP/1.1 200 ")) << chunked;
  EXPECT_THAT(chunked, HasSubstr(R"("text":"ok")")) << chunked;
}

// RFC 9112 §3.2: an HTTP/1.1 request without Host, and any request with two Host lines, is
// answered 400 with the usual error body, once, and the connection closes (both were served).
// HTTP/1.0 may leave Host out, and an empty Host is a Host.
TEST_F(HttpServerTest, MissingOrRepeatedHostFieldIsRefused) {
  std::atomic<int> generated{0};
  core_.generate = [&](const v1::GenerateRequest&, absl::Time, const std::function<bool()>&,
                       const GenerationCore::EventCallback& cb) {
    ++generated;
    cb(Block("ok"));
    cb(Finished());
    return absl::OkStatus();
  };
  StartServer();
  const std::string none = "the request has no Host header field";
  const std::string two = "the request has 2 Host header fields; at most one is allowed";
  const std::string body = R"({"prompt": "1"})";
  const struct {
    std::string request;
    std::string message;
  } refused[] = {
      {"GET /health HTTP/1.1\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n", none},
      {"GET /nowhere HTTP/1.1\r\nConnection: close\r\n\r\n", none},
      {"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", two},
      {"GET /health HTTP/1.1\r\nHost: x\r\nHost: x\r\n\r\n", two},
      {"GET /health HTTP/1.0\r\nHost: x\r\nHost: y\r\n\r\n", two},
      {absl::StrCat("POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                    "Content-Length: ",
                    body.size(), "\r\n\r\n", body),
       none},
  };
  for (const auto& c : refused) {
    SCOPED_TRACE(c.request);
    const std::string raw = RawRequest(port_, c.request);
    EXPECT_THAT(raw, StartsWith("HTTP/1.1 400 ")) << raw;
    EXPECT_THAT(raw, HasSubstr(c.message)) << raw;
    EXPECT_THAT(raw, HasSubstr(R"("type":"invalid_request_error")")) << raw;
    EXPECT_THAT(raw, HasSubstr("Connection: close\r\n")) << raw;
    EXPECT_EQ(raw.find("X-Request-Id:"), raw.rfind("X-Request-Id:")) << "a second answer: " << raw;
  }
  EXPECT_EQ(generated.load(), 0);
  EXPECT_EQ(core_.Refused().size(), 1u);  // the generation request
  // HEAD gets the status without the body.
  const std::string head = RawRequest(port_, "HEAD /health HTTP/1.1\r\n\r\n");
  EXPECT_THAT(head, StartsWith("HTTP/1.1 400 ")) << head;
  EXPECT_THAT(head, ::testing::Not(HasSubstr("\"error\""))) << head;
  // Served: HTTP/1.0 without Host, an empty Host, one Host.
  for (const std::string ok : {"GET /health HTTP/1.0\r\n\r\n",
                               "GET /health HTTP/1.1\r\nHost:\r\nConnection: close\r\n\r\n",
                               "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"}) {
    const std::string raw = RawRequest(port_, ok);
    EXPECT_THAT(raw, StartsWith("HTTP/1.1 200 ")) << ok << "\n" << raw;
    EXPECT_THAT(raw, HasSubstr(R"({"status":"ok"})")) << raw;
  }
  const std::string post = RawRequest(
      port_, absl::StrCat("POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                          "Content-Length: ",
                          body.size(), "\r\n\r\n", body));
  EXPECT_THAT(post, StartsWith("HTTP/1.1 200 ")) << post;
  EXPECT_EQ(generated.load(), 1);
}

// A request target in absolute form ("http://host/path", RFC 9112 §3.2.2) is served as its path
// (it was a 404 "unknown path: http://x/health").
TEST_F(HttpServerTest, AbsoluteFormTargetIsServedAsItsPath) {
  StartServer();
  const std::string health =
      RawRequest(port_, "GET http://x/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(health, StartsWith("HTTP/1.1 200 ")) << health;
  EXPECT_THAT(health, HasSubstr(R"({"status":"ok"})"));
  const std::string model = RawRequest(
      port_, "GET HTTPS://x:8000/v1/models/dg-tiny?a=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(model, StartsWith("HTTP/1.1 200 ")) << model;
  EXPECT_THAT(model, HasSubstr(R"("id":"dg-tiny")"));
  const std::string root =
      RawRequest(port_, "GET http://x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_THAT(root, StartsWith("HTTP/1.1 404 ")) << root;
  EXPECT_THAT(root, HasSubstr("unknown path: /"));
}

// Paths are percent-decoded before routing, as Starlette (under vLLM) does: "/v1/models/%64g-tiny"
// is the model "dg-tiny" (it was a 404). Bytes that are not text stay as sent, and the 404 that
// quotes them is valid JSON.
TEST_F(HttpServerTest, PathsArePercentDecoded) {
  StartServer();
  auto get = [&](const std::string& target) {
    return RawRequest(port_, "GET " + target + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  };
  for (const std::string target : {"/v1/models/%64g-tiny", "/v1/models/dg%2dtiny?x=%41",
                                   "/v1/%6Dodels/dg-tiny", "/v1/models/%64%67%2D%74iny"}) {
    const std::string model = get(target);
    EXPECT_THAT(model, StartsWith("HTTP/1.1 200 ")) << target << "\n" << model;
    EXPECT_THAT(model, HasSubstr(R"("id":"dg-tiny")")) << target;
  }
  EXPECT_THAT(get("/%68ealth"), StartsWith("HTTP/1.1 200 "));
  // Decoded, a model id may hold a slash (as Hugging Face names do).
  const std::string slash = get("/v1/models/google%2Fdg-tiny");
  EXPECT_THAT(slash, StartsWith("HTTP/1.1 404 ")) << slash;
  EXPECT_THAT(slash, HasSubstr("model 'google/dg-tiny' not found"));
  for (const std::string target : {"/v1/models/%FF", "/v1/models/a%00b", "/v1/models/%zz",
                                   "/v1/models/%4", "/v1/models/%0a"}) {
    const std::string raw = get(target);
    EXPECT_THAT(raw, StartsWith("HTTP/1.1 404 ")) << target << "\n" << raw;
    const size_t body_at = raw.find("\r\n\r\n");
    ASSERT_NE(body_at, std::string::npos) << raw;
    const json body = json::parse(raw.substr(body_at + 4), nullptr, false);
    ASSERT_FALSE(body.is_discarded()) << raw;
    EXPECT_THAT(body["error"]["message"].get<std::string>(),
                HasSubstr(target.substr(std::string("/v1/models/").size())))
        << target;
  }
}

}  // namespace
}  // namespace dgserve
