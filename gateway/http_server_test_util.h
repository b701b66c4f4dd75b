// Shared by the HTTP server's tests (http_server_test.cc, http_server_connection_test.cc): a
// fake GenerationCore, the fixture that serves it on 127.0.0.1, and raw-socket helpers.
#pragma once

#include "gateway/http_server.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <prometheus/registry.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/http_client.h"
#include "common/testing/loopback_socket.h"
#include "common/testing/status_matchers.h"
#include "gateway/admission.h"

namespace dgserve::http_testing {

using ::dgserve::testing::ConnectLoopback;
using ::dgserve::testing::SendAll;
using ::testing::HasSubstr;
using json = nlohmann::json;

class FakeCore : public GenerationCore {
 public:
  using GenerateFn = std::function<absl::Status(
      const v1::GenerateRequest&, absl::Time, const std::function<bool()>&, const EventCallback&)>;
  GenerateFn generate;  // unset → INVALID_ARGUMENT("prompt: must not be empty")
  std::string accept_as;  // set: Generate first calls on_accepted with it (the request's id)
  std::atomic<bool> ready{true};
  std::string api_key;  // "" = no keys configured
  mutable absl::Mutex reason_mu;
  std::string not_ready_reason ABSL_GUARDED_BY(reason_mu);  // what NotReadyReason answers
  Admission* admission = nullptr;  // set: CheckAdmission refuses while it is saturated
  absl::Mutex refused_mu;
  std::vector<absl::StatusCode> refused;  // what CountRefused was given

  // Set: called first by CountRefused, on the thread that counts (a test may hold it there).
  std::function<void(const absl::Status&)> on_refused;

  void CountRefused(const absl::Status& status) override {
    if (on_refused) on_refused(status);
    absl::MutexLock lock(&refused_mu);
    refused.push_back(status.code());
  }
  std::vector<absl::StatusCode> Refused() {
    absl::MutexLock lock(&refused_mu);
    return refused;
  }

  absl::Status CheckAdmission() override {
    if (admission != nullptr && admission->Saturated()) {
      return absl::ResourceExhaustedError("at the limit of concurrent requests");
    }
    return absl::OkStatus();
  }

  absl::Status Generate(const v1::GenerateRequest& request, absl::Time deadline,
                        const std::function<bool()>& is_cancelled, const EventCallback& on_event,
                        const AcceptedCallback& on_accepted) override {
    if (!accept_as.empty() && on_accepted) on_accepted(accept_as);
    if (generate) return generate(request, deadline, is_cancelled, on_event);
    return absl::InvalidArgumentError("prompt: must not be empty");
  }
  v1::ListModelsResponse ListModels() const override {
    v1::ListModelsResponse r;
    v1::ModelInfo* m = r.add_models();
    m->set_id("dg-tiny");
    m->set_context_length(4096);
    m->set_canvas_length(256);
    m->set_vocab_size(512);
    return r;
  }
  std::string model_id() const override { return "dg-tiny"; }
  bool Ready() const override { return ready; }
  std::string NotReadyReason() const override {
    absl::MutexLock lock(&reason_mu);
    return not_ready_reason;
  }
  absl::Status CheckApiKey(const std::string& bearer) const override {
    if (api_key.empty() || bearer == api_key) return absl::OkStatus();
    return absl::UnauthenticatedError("invalid API key");
  }
};

inline v1::GenerateEvent Block(const std::string& text) {
  v1::GenerateEvent e;
  e.set_request_id("req-7");
  e.mutable_block()->set_text(text);
  return e;
}

inline v1::GenerateEvent Finished() {
  v1::GenerateEvent e;
  e.set_request_id("req-7");
  e.mutable_finished()->set_finish_reason("stop");
  e.mutable_finished()->mutable_usage()->set_prompt_tokens(3);
  e.mutable_finished()->mutable_usage()->set_completion_tokens(2);
  e.mutable_finished()->mutable_usage()->set_total_tokens(5);
  return e;
}

// A generation that answers `text` as one block, then finishes.
inline FakeCore::GenerateFn AnswerWith(std::string text) {
  return [text = std::move(text)](const v1::GenerateRequest&, absl::Time,
                                  const std::function<bool()>&,
                                  const GenerationCore::EventCallback& cb) {
    cb(Block(text));
    cb(Finished());
    return absl::OkStatus();
  };
}

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpServerOptions options = {}) {
    server_ = std::make_unique<OpenAiHttpServer>(&core_, options, &registry_);
    absl::StatusOr<int> port = server_->Start();
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
    ASSERT_GT(port_, 0);
    EXPECT_EQ(server_->port(), port_);
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }
  HttpClient Client() {
    HttpClient cli("127.0.0.1", port_);
    cli.set_idle_timeout(absl::Seconds(10));
    return cli;
  }
  static void ExpectErrorBody(const HttpResponse& res, int status, const std::string& type,
                              const std::string& message_part) {
    ASSERT_TRUE(res) << res.error;
    EXPECT_EQ(res.status, status);
    EXPECT_THAT(res.Header("Content-Type"), HasSubstr("application/json"));
    json j = json::parse(res.body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << res.body;
    ASSERT_TRUE(j.contains("error")) << res.body;
    EXPECT_EQ(j["error"]["type"], type) << res.body;
    EXPECT_THAT(j["error"]["message"].get<std::string>(), HasSubstr(message_part));
    EXPECT_TRUE(j["error"].contains("param"));
    EXPECT_TRUE(j["error"].contains("code"));
  }

  FakeCore core_;
  prometheus::Registry registry_;
  std::unique_ptr<OpenAiHttpServer> server_;
  int port_ = 0;
};

// Payloads of the `data:` lines of an SSE body.
inline std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) break;
    std::string frame = body.substr(pos, end - pos);
    if (frame.rfind("data: ", 0) == 0) out.push_back(frame.substr(6));
    pos = end + 2;
  }
  return out;
}

// Sends raw bytes (with "Connection: close") and returns everything the server answers.
inline std::string RawRequest(int port, const std::string& request) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

inline std::string PostRequest(const std::string& path, const std::string& body,
                        const std::string& extra_headers = "") {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
         extra_headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// Reads until `needle` has been seen `count` times, EOF or the receive timeout.
inline std::string ReadUntil(int fd, const std::string& needle, int count = 1) {
  std::string out;
  char buf[8192];
  while (true) {
    int seen = 0;
    for (size_t p = out.find(needle); p != std::string::npos; p = out.find(needle, p + 1)) ++seen;
    if (seen >= count) break;
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Reads until EOF or the receive timeout.
inline std::string ReadToEnd(int fd) {
  std::string out;
  char buf[1 << 16];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  return out;
}

// Waits (bounded) until `pred` holds.
template <typename Pred>
bool Eventually(Pred pred) {
  for (int i = 0; i < 2000 && !pred(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

}  // namespace dgserve::http_testing
