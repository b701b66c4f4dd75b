// Worker addresses as the flags give them: host:port or dns:///name:port.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dgserve {

// OK when `target` is a gRPC address of a form these flags take: host:port, [v6]:port,
// dns:///host:port (also ipv4:/ipv6: before host:port), with a non-empty host and a decimal port
// in 1..65535; or unix:PATH / unix-abstract:NAME. INVALID_ARGUMENT naming `flag` otherwise (gRPC
// itself would take a port of 65536 + p as p, and an empty target as a failed channel).
absl::Status ValidateTarget(const std::string& flag, const std::string& target);

// The entries of a comma-separated address flag (SplitTargets), each checked by ValidateTarget;
// the first bad one's error otherwise. An empty list is returned as such (callers that need an
// address say so).
absl::StatusOr<std::vector<std::string>> ParseTargets(const std::string& flag,
                                                     const std::string& list);

// Splits "a,b , c" into trimmed non-empty entries.
std::vector<std::string> SplitTargets(const std::string& list);

// dns:///host:port → every address host resolves to now, as ip:port ([v6]:port), sorted and
// unique; UNAVAILABLE naming the target and getaddrinfo's reason when it does not resolve
// (INVALID_ARGUMENT without a port). Anything else → itself.
absl::StatusOr<std::vector<std::string>> ResolveTarget(const std::string& target);
// ResolveTarget, empty when it fails.
std::vector<std::string> ExpandTarget(const std::string& target);

// The addresses a process may dial on a caller's behalf (the prefill worker's kv_target): the
// entries as given and every address their dns:/// names resolve to. Thread-safe.
class TargetAllowList {
 public:
  explicit TargetAllowList(std::vector<std::string> entries);
  // OK when `target` is an entry or an address an entry resolves to (names are resolved again,
  // at most once a second, when a target is not found); PERMISSION_DENIED naming the target
  // otherwise. Nothing is dialled.
  absl::Status Check(const std::string& target);
  const std::vector<std::string>& entries() const { return entries_; }

 private:
  void ResolveLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<std::string> entries_;
  absl::Mutex mu_;
  std::set<std::string> allowed_ ABSL_GUARDED_BY(mu_);
  absl::Time last_resolve_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace dgserve
