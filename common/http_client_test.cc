// HttpClient against a hand-written HTTP server on 127.0.0.1 (raw sockets, so that the test sees
// exactly the bytes curl sends and controls exactly what it answers).
#include "common/http_client.h"

#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dgserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Writes all of `data`; false once the client has gone (no SIGPIPE).
bool SendAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads one request (head and body, by Content-Length or chunked) from `fd`; "" on EOF.
std::string ReadRequest(int fd, std::string& buffer) {
  char buf[4096];
  auto fill = [&] {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) return false;
    buffer.append(buf, static_cast<size_t>(n));
    return true;
  };
  size_t head_end;
  while ((head_end = buffer.find("\r\n\r\n")) == std::string::npos) {
    if (!fill()) return "";
  }
  const std::string head = buffer.substr(0, head_end + 4);
  size_t end = head_end + 4;
  const size_t cl = head.find("Content-Length: ");
  if (cl != std::string::npos) {
    end += std::stoul(head.substr(cl + 16));
    while (buffer.size() < end) {
      if (!fill()) return "";
    }
  } else if (head.find("Transfer-Encoding: chunked") != std::string::npos) {
    size_t last;
    while ((last = buffer.find("0\r\n\r\n", head_end)) == std::string::npos) {
      if (!fill()) return "";
    }
    end = last + 5;
  }
  std::string request = buffer.substr(0, end);
  buffer.erase(0, end);
  return request;
}

// Accepts connections on 127.0.0.1 and runs `handler(fd)` for each on its own thread.
class RawServer {
 public:
  explicit RawServer(std::function<void(int)> handler) : handler_(std::move(handler)) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(listen_fd_, 16);
    socklen_t len = sizeof(addr);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    accept_thread_ = std::thread([this] {
      while (true) {
        const int fd = accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) return;
        ++accepted_;
        std::lock_guard<std::mutex> lock(mu_);
        connections_.emplace_back([this, fd] {
          handler_(fd);
          close(fd);
        });
      }
    });
  }
  ~RawServer() {
    shutdown(listen_fd_, SHUT_RDWR);
    close(listen_fd_);
    accept_thread_.join();
    for (std::thread& t : connections_) t.join();
  }
  int port() const { return port_; }
  int accepted() const { return accepted_; }

 private:
  std::function<void(int)> handler_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<int> accepted_{0};
  std::mutex mu_;
  std::vector<std::thread> connections_;
  std::thread accept_thread_;
};

// Answers every request on the connection with 200 and the raw request as the body.
void EchoRequests(int fd) {
  std::string buffer;
  for (std::string req; !(req = ReadRequest(fd, buffer)).empty();) {
    SendAll(fd,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Twice: 1\r\nx-twice: 2\r\n"
            "Content-Length: " +
                std::to_string(req.size()) + "\r\n\r\n" + req);
  }
}

TEST(HttpClientTest, GetAndPostSendWhatTheyAreGivenAndReuseTheConnection) {
  RawServer server(EchoRequests);
  HttpClient c("127.0.0.1", server.port());
  HttpResponse get = c.Get("/v1/models?x=1", {{"Authorization", "Bearer k"}});
  ASSERT_TRUE(get) << get.error;
  EXPECT_EQ(get.status, 200);
  EXPECT_EQ(get.Header("content-type"), "text/plain");
  EXPECT_EQ(get.Header("X-TWICE"), "1");
  EXPECT_EQ(get.HeaderCount("X-Twice"), 2u);
  EXPECT_EQ(get.Header("Absent"), "");
  EXPECT_THAT(get.body, HasSubstr("GET /v1/models?x=1 HTTP/1.1\r\n"));
  EXPECT_THAT(get.body, HasSubstr("\r\nAuthorization: Bearer k\r\n"));
  EXPECT_EQ(get.new_connections, 1);

  const std::string big(3000, 'b');  // over curl's 1 KiB "Expect: 100-continue" threshold
  HttpResponse post = c.Post("/v1/completions", big, {}, "text/plain");
  ASSERT_TRUE(post) << post.error;
  EXPECT_EQ(post.status, 200);
  EXPECT_THAT(post.body, HasSubstr("POST /v1/completions HTTP/1.1\r\n"));
  EXPECT_THAT(post.body, HasSubstr("\r\nContent-Type: text/plain\r\n"));
  EXPECT_THAT(post.body, HasSubstr("\r\nContent-Length: 3000\r\n"));
  EXPECT_THAT(post.body, Not(HasSubstr("Expect")));
  EXPECT_THAT(post.body, HasSubstr("\r\n\r\n" + big));
  EXPECT_EQ(post.new_connections, 0);  // the keep-alive connection of the GET

  HttpResponse del = c.Delete("/x");
  ASSERT_TRUE(del) << del.error;
  EXPECT_THAT(del.body, HasSubstr("DELETE /x HTTP/1.1\r\n"));
  EXPECT_EQ(server.accepted(), 1);
}

TEST(HttpClientTest, ChunkedBody) {
  RawServer server(EchoRequests);
  HttpClient c("127.0.0.1", server.port());
  HttpRequest req;
  req.method = "POST";
  req.path = "/up";
  req.body = "hello";
  req.chunked_body = true;
  HttpResponse r = c.Send(req);
  ASSERT_TRUE(r) << r.error;
  EXPECT_THAT(r.body, HasSubstr("\r\nTransfer-Encoding: chunked\r\n"));
  EXPECT_THAT(r.body, Not(HasSubstr("Content-Length")));
  EXPECT_THAT(r.body, HasSubstr("\r\n\r\n5\r\nhello\r\n0\r\n\r\n"));
}

TEST(HttpClientTest, ConnectFailureIsATransportError) {
  int port;
  {
    RawServer gone([](int) {});
    port = gone.port();
  }  // closed: nothing listens there now
  HttpClient c("127.0.0.1", port);
  HttpResponse r = c.Get("/health");
  EXPECT_FALSE(r);
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.error_kind, "connect");
  EXPECT_FALSE(r.error.empty());
}

// A chunked response written in three pieces with pauses.
void SlowChunks(int fd) {
  std::string buffer;
  if (ReadRequest(fd, buffer).empty()) return;
  SendAll(fd,
          "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
          "Transfer-Encoding: chunked\r\n\r\n");
  for (const char* piece : {"data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"}) {
    const std::string p = piece;
    char size[16];
    snprintf(size, sizeof(size), "%zx\r\n", p.size());
    if (!SendAll(fd, size + p + "\r\n")) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  SendAll(fd, "0\r\n\r\n");
}

TEST(HttpClientTest, StreamHandsOverEachChunkWithTheHead) {
  RawServer server(SlowChunks);
  HttpClient c("127.0.0.1", server.port());
  HttpRequest req;
  req.path = "/stream";
  std::vector<std::string> chunks;
  HttpResponse r = c.Stream(req, [&](const HttpResponse& head, std::string_view chunk) {
    EXPECT_EQ(head.status, 200);
    EXPECT_EQ(head.Header("Content-Type"), "text/event-stream");
    chunks.emplace_back(chunk);
    return true;
  });
  ASSERT_TRUE(r) << r.error;
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "");
  std::string all;
  for (const std::string& s : chunks) all += s;
  EXPECT_EQ(all, "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n");
  EXPECT_GE(chunks.size(), 2u);  // pieces written 50 ms apart arrive apart
}

TEST(HttpClientTest, StreamCallbackAborts) {
  RawServer server(SlowChunks);
  HttpClient c("127.0.0.1", server.port());
  HttpRequest req;
  std::string seen;
  HttpResponse r = c.Stream(req, [&](const HttpResponse&, std::string_view chunk) {
    seen.append(chunk);
    return false;
  });
  EXPECT_FALSE(r);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.error_kind, "aborted");
  EXPECT_THAT(seen, HasSubstr("data: 1"));
  EXPECT_THAT(seen, Not(HasSubstr("[DONE]")));
}

// Reads the request, sends the head of a response and then nothing until the client leaves.
void HeadThenSilence(int fd) {
  std::string buffer;
  if (ReadRequest(fd, buffer).empty()) return;
  SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab");
  char buf[64];
  while (read(fd, buf, sizeof(buf)) > 0) {
  }
}

TEST(HttpClientTest, WholeRequestTimeout) {
  RawServer server(HeadThenSilence);
  HttpClient c("127.0.0.1", server.port());
  c.set_timeout(absl::Milliseconds(300));
  HttpResponse r = c.Get("/");
  EXPECT_FALSE(r);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.error_kind, "timeout");
}

TEST(HttpClientTest, IdleTimeoutAndCancel) {
  RawServer server(HeadThenSilence);
  HttpClient c("127.0.0.1", server.port());
  c.set_timeout(absl::InfiniteDuration());
  c.set_idle_timeout(absl::Seconds(1));
  HttpResponse idle = c.Get("/");
  EXPECT_FALSE(idle);
  EXPECT_EQ(idle.error_kind, "timeout");
  EXPECT_THAT(idle.error, HasSubstr("no byte for 1s"));

  c.set_idle_timeout(absl::InfiniteDuration());
  std::atomic<bool> cancel{false};
  HttpRequest req;
  req.is_cancelled = [&] { return cancel.load(); };
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    cancel = true;
  });
  HttpResponse cancelled = c.Send(req);
  canceller.join();
  EXPECT_FALSE(cancelled);
  EXPECT_EQ(cancelled.error_kind, "aborted");
}

}  // namespace
}  // namespace dgserve
