// Connection capacity of the gateway's HTTP front end (OpenAiHttpServer) on loopback: how many
// idle keep-alive connections and concurrent SSE streams one server process holds, and what
// each costs in memory. The server runs in a child process with a fake GenerationCore whose
// streams send one event every --event_interval_ms until cancelled (no model, no workers: this
// measures the front end only); the parent opens the connections. Prints counts and ratios.
//
//   build/bench/http_capacity_bench --idle 10000 --streams 1000
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/testing/loopback_socket.h"
#include "gateway/http_server.h"

ABSL_FLAG(int, idle, 10000, "idle keep-alive connections to open");
ABSL_FLAG(int, streams, 1000, "concurrent SSE streams to open");
ABSL_FLAG(int, event_interval_ms, 1000, "a stream event every this many ms");
ABSL_FLAG(int, io_threads, 2, "the server's event-loop threads");

namespace dgserve {
namespace {

using ::dgserve::testing::ConnectLoopback;
using ::dgserve::testing::SendAll;

class StreamingCore : public GenerationCore {
 public:
  explicit StreamingCore(int interval_ms) : interval_ms_(interval_ms) {}
  absl::Status Generate(const v1::GenerateRequest&, absl::Time, const std::function<bool()>& c,
                        const EventCallback& cb, const AcceptedCallback&) override {
    v1::GenerateEvent ev;
    ev.set_request_id("bench");
    ev.mutable_block()->set_text("tick");
    while (!c()) {
      if (!cb(ev)) return absl::CancelledError("client gone");
      for (int i = 0; i < interval_ms_ / 10 && !c(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    return absl::CancelledError("client gone");
  }
  v1::ListModelsResponse ListModels() const override { return {}; }
  std::string model_id() const override { return "bench"; }
  bool Ready() const override { return true; }
  absl::Status CheckApiKey(const std::string&) const override { return absl::OkStatus(); }

 private:
  const int interval_ms_;
};

void RaiseFileLimit() {
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
}

// A /proc/PID/status field in kB (VmRSS) or a count (Threads).
long StatusField(pid_t pid, const std::string& field) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

// Kernel TCP buffer memory in pages (system-wide, /proc/net/sockstat "TCP: ... mem N").
long TcpMemPages() {
  std::ifstream f("/proc/net/sockstat");
  std::string word;
  bool tcp = false;
  while (f >> word) {
    if (word == "TCP:") tcp = true;
    if (tcp && word == "mem") {
      long v = -1;
      f >> v;
      return v;
    }
  }
  return -1;
}

// Reads until `needle` appears (or EOF/timeout).
bool ReadUntil(int fd, const std::string& needle) {
  std::string got;
  char buf[4096];
  while (got.find(needle) == std::string::npos) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) return false;
    got.append(buf, static_cast<size_t>(n));
  }
  return true;
}

const char kHealth[] = "GET /health HTTP/1.1\r\nHost: bench\r\n\r\n";

// One /health on a fresh connection.
bool HealthOk(int port) {
  int fd = ConnectLoopback(port, 30);
  if (fd < 0) return false;
  bool ok = SendAll(fd, kHealth) && ReadUntil(fd, R"({"status":"ok"})");
  close(fd);
  return ok;
}

int RunServer(int ready_fd, int stop_fd) {
  RaiseFileLimit();
  StreamingCore core(absl::GetFlag(FLAGS_event_interval_ms));
  HttpServerOptions o;
  o.io_threads = absl::GetFlag(FLAGS_io_threads);
  o.idle_timeout = absl::Minutes(30);
  OpenAiHttpServer server(&core, o, nullptr);
  absl::StatusOr<int> port = server.Start();
  const int p = port.ok() ? *port : -1;
  if (write(ready_fd, &p, sizeof(p)) != sizeof(p)) return 1;
  char c;
  while (read(stop_fd, &c, 1) > 0) {
  }
  server.Stop();
  return 0;
}

int Run() {
  RaiseFileLimit();
  int ready[2], stop[2];
  if (pipe(ready) != 0 || pipe(stop) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {
    close(ready[0]);
    close(stop[1]);
    _exit(RunServer(ready[1], stop[0]));
  }
  close(ready[1]);
  close(stop[0]);
  int port = -1;
  if (read(ready[0], &port, sizeof(port)) != sizeof(port) || port <= 0) {
    std::fprintf(stderr, "server did not start\n");
    return 1;
  }
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  std::printf("server pid %d, port %d, io_threads %d, RLIMIT_NOFILE %llu\n", child, port,
              absl::GetFlag(FLAGS_io_threads), static_cast<unsigned long long>(rl.rlim_cur));
  const long rss0 = StatusField(child, "VmRSS");
  const long tcp0 = TcpMemPages();
  std::printf("baseline: RSS %ld kB, threads %ld\n", rss0, StatusField(child, "Threads"));

  // 1. Idle keep-alive connections: each sends one /health and keeps the connection.
  const int want_idle = absl::GetFlag(FLAGS_idle);
  std::vector<int> idle;
  for (int i = 0; i < want_idle; ++i) {
    int fd = ConnectLoopback(port, 30);
    if (fd < 0 || !SendAll(fd, kHealth) || !ReadUntil(fd, R"({"status":"ok"})")) {
      std::printf("idle connection %d failed: %s\n", i, std::strerror(errno));
      if (fd >= 0) close(fd);
      break;
    }
    idle.push_back(fd);
  }
  // All still open and served: a second request on every one.
  int alive = 0;
  for (int fd : idle) alive += SendAll(fd, kHealth) && ReadUntil(fd, R"({"status":"ok"})");
  const long rss1 = StatusField(child, "VmRSS");
  const long tcp1 = TcpMemPages();
  std::printf(
      "idle keep-alive connections: %zu opened, %d answered a second request; server RSS %ld kB "
      "(+%.1f kB per connection), threads %ld; kernel TCP memory +%ld pages; fresh /health: %s\n",
      idle.size(), alive, rss1, idle.empty() ? 0.0 : double(rss1 - rss0) / idle.size(),
      StatusField(child, "Threads"), tcp1 - tcp0, HealthOk(port) ? "200" : "FAILED");

  // 2. Concurrent SSE streams (on top of the idle connections).
  const int want_streams = absl::GetFlag(FLAGS_streams);
  const std::string body = R"({"prompt": "x", "stream": true})";
  const std::string post = absl::StrCat(
      "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
      "Content-Length: ",
      body.size(), "\r\n\r\n", body);
  std::vector<int> streams;
  for (int i = 0; i < want_streams; ++i) {
    int fd = ConnectLoopback(port, 30);
    if (fd < 0 || !SendAll(fd, post)) {
      std::printf("stream %d failed: %s\n", i, std::strerror(errno));
      if (fd >= 0) close(fd);
      break;
    }
    streams.push_back(fd);
  }
  int first = 0;
  for (int fd : streams) first += ReadUntil(fd, "data: ");
  // A second event on every stream: they are all being written, not just opened.
  int second = 0;
  for (int fd : streams) second += ReadUntil(fd, "data: ");
  const long rss2 = StatusField(child, "VmRSS");
  const long tcp2 = TcpMemPages();
  std::printf(
      "SSE streams: %zu opened, %d got a first event, %d a later one; server RSS %ld kB "
      "(+%.1f kB per stream, its generating thread included), threads %ld; kernel TCP memory "
      "+%ld pages; fresh /health: %s\n",
      streams.size(), first, second, rss2,
      streams.empty() ? 0.0 : double(rss2 - rss1) / streams.size(), StatusField(child, "Threads"),
      tcp2 - tcp1, HealthOk(port) ? "200" : "FAILED");

  for (int fd : streams) close(fd);
  for (int fd : idle) close(fd);
  close(stop[1]);
  int status = 0;
  waitpid(child, &status, 0);
  return 0;
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  dgserve::InitCommandLine(
      "http_capacity_bench [--idle N] [--streams N] [--event_interval_ms MS] [--io_threads N]",
      "bench/http_capacity_bench.cc");
  dgserve::ParseCommandLine(argc, argv);  // --help exits 0 (common/cli.h)
  signal(SIGPIPE, SIG_IGN);
  return dgserve::Run();
}
