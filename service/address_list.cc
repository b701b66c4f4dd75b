#include "service/address_list.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace dgserve {

absl::Status ValidateTarget(const std::string& flag, const std::string& target) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": '", target, "' ", why, " (expected host:port, [v6]:port or dns:///host:port)"));
  };
  absl::string_view t = target;
  if (t.empty()) return bad("is empty");
  // A Unix socket has no port to misread.
  for (absl::string_view unix_scheme : {"unix:", "unix-abstract:"}) {
    if (absl::ConsumePrefix(&t, unix_scheme)) {
      return t.empty() ? bad("has no socket path") : absl::OkStatus();
    }
  }
  if (!absl::ConsumePrefix(&t, "dns:///") && !absl::ConsumePrefix(&t, "ipv4:") &&
      !absl::ConsumePrefix(&t, "ipv6:") && absl::StrContains(t, "://")) {
    return bad("uses a scheme these flags do not take");
  }
  const size_t colon = t.rfind(':');
  if (colon == absl::string_view::npos) return bad("has no port");
  const absl::string_view host = t.substr(0, colon), port = t.substr(colon + 1);
  if (host.empty() || host == "[]") return bad("has no host");
  if (host.find(':') != absl::string_view::npos &&
      !(host.size() > 2 && host.front() == '[' && host.back() == ']')) {
    return bad("has an IPv6 host outside brackets");
  }
  int value = 0;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      !absl::SimpleAtoi(port, &value) || value < 1 || value > 65535) {
    return bad("has a port outside 1..65535");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ParseTargets(const std::string& flag,
                                                     const std::string& list) {
  std::vector<std::string> targets = SplitTargets(list);
  for (const std::string& t : targets) {
    if (absl::Status s = ValidateTarget(flag, t); !s.ok()) return s;
  }
  return targets;
}

std::vector<std::string> SplitTargets(const std::string& list) {
  std::vector<std::string> out;
  for (absl::string_view p : absl::StrSplit(list, ',')) {
    p = absl::StripAsciiWhitespace(p);
    if (!p.empty()) out.emplace_back(p);
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> ResolveTarget(const std::string& target) {
  absl::string_view t = target;
  if (!absl::ConsumePrefix(&t, "dns:///")) return std::vector<std::string>{target};
  const size_t colon = t.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(target, ": no port (dns:///name:port)"));
  }
  std::string host(t.substr(0, colon));
  const std::string port(t.substr(colon + 1));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // getaddrinfo takes an IPv6 literal bare
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (const int error = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); error != 0) {
    return absl::UnavailableError(
        absl::StrCat(target, ": '", host, "' does not resolve (", gai_strerror(error), ")"));
  }
  std::vector<std::string> out;
  for (addrinfo* p = res; p != nullptr; p = p->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {0};
    if (p->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(p->ai_addr)->sin_addr, buf, sizeof buf);
      out.push_back(absl::StrCat(buf, ":", port));
    } else if (p->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(p->ai_addr)->sin6_addr, buf,
                sizeof buf);
      out.push_back(absl::StrCat("[", buf, "]:", port));
    }
  }
  freeaddrinfo(res);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<std::string> ExpandTarget(const std::string& target) {
  absl::StatusOr<std::vector<std::string>> addresses = ResolveTarget(target);
  return addresses.ok() ? *std::move(addresses) : std::vector<std::string>();
}

TargetAllowList::TargetAllowList(std::vector<std::string> entries)
    : entries_(std::move(entries)) {
  absl::MutexLock lock(&mu_);
  ResolveLocked();
}

void TargetAllowList::ResolveLocked() {
  last_resolve_ = absl::Now();
  std::set<std::string> next(entries_.begin(), entries_.end());
  for (const std::string& e : entries_) {
    for (std::string& a : ExpandTarget(e)) next.insert(std::move(a));
  }
  allowed_ = std::move(next);
}

absl::Status TargetAllowList::Check(const std::string& target) {
  absl::MutexLock lock(&mu_);
  if (allowed_.contains(target)) return absl::OkStatus();
  if (absl::Now() - last_resolve_ >= absl::Seconds(1)) {
    ResolveLocked();
    if (allowed_.contains(target)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "kv_target '", target, "' is not one of this worker's denoise workers (--denoise_workers: ",
      absl::StrJoin(entries_, ","), ")"));
}

}  // namespace dgserve
