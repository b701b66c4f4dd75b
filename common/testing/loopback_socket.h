// Raw TCP clients on loopback for tests and benchmarks that speak HTTP by hand (slow clients,
// half-written requests, many idle connections).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdint>
#include <string_view>

namespace dgserve::testing {

// A socket connected to 127.0.0.1:port with a receive timeout of `recv_timeout_s` seconds, or
// -1 when it cannot connect.
inline int ConnectLoopback(int port, int recv_timeout_s) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{recv_timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// A socket bound to 127.0.0.1 at a port the kernel chooses (written to `*port`), listening
// when `listening`; -1 when it cannot.
inline int BindLoopback(int* port, bool listening) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      (listening && listen(fd, 16) != 0) ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return -1;
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

// A socket listening on 127.0.0.1 at a port the kernel chooses (written to `*port`) that
// accepts TCP and never answers (a peer that does not speak), or -1 when it cannot listen.
inline int ListenLoopback(int* port) { return BindLoopback(port, /*listening=*/true); }

// A port on 127.0.0.1 that nothing listens on (a dead server): bound at a port the kernel
// chooses, then closed; -1 when it cannot bind.
inline int ClosedLoopbackPort() {
  int port = -1;
  const int fd = BindLoopback(&port, /*listening=*/false);
  if (fd < 0) return -1;
  close(fd);
  return port;
}

// Writes all of `data` to `fd`; false on a write error.
inline bool SendAll(int fd, std::string_view data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = write(fd, data.data() + off, data.size() - off);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace dgserve::testing
