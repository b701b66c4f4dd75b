// Admission of generation requests at the gateway, shared by the gRPC and the HTTP front ends:
// at most `max_concurrent` requests run at once; up to `max_queued` more wait in FIFO order for
// a slot; beyond that a request is refused at once with RESOURCE_EXHAUSTED.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dgserve {

// Thread-safe. Acquire blocks only while the request waits in the queue (never when refused).
class Admission {
 public:
  // `max_concurrent` ≥ 1; `max_queued` ≥ 0 (0: no wait queue). `on_change` (may be empty) is
  // called with the running and queued counts whenever they change (under the lock: keep it
  // cheap, e.g. setting gauges).
  Admission(int max_concurrent, int max_queued,
            std::function<void(int running, int queued)> on_change = {});

  // Takes a slot: OK (the caller must call Release once), RESOURCE_EXHAUSTED at once when every
  // slot is taken and the queue is full, DEADLINE_EXCEEDED when `deadline` passes in the queue,
  // CANCELLED when `is_cancelled` (polled every 20 ms; may be empty) turns true in the queue.
  // `*waited` (may be null) gets the time spent queued. `on_queued` (may be empty) is called
  // once, without the lock, when the request has taken its place in the queue (not when it is
  // admitted or refused at once): a front end validates the request and sends its response head
  // there, so that a queued stream is visibly alive and a bad request is answered without waiting
  // for a slot. A non-OK status from it leaves the queue, and Acquire returns that status.
  absl::Status Acquire(absl::Time deadline, const std::function<bool()>& is_cancelled,
                       absl::Duration* waited, const std::function<absl::Status()>& on_queued = {});
  // Frees a slot taken by a successful Acquire; wakes the oldest queued request.
  void Release();

  // True when a new request would be refused right now (slots and queue full): a front end may
  // answer 429 without starting work. Advisory: Acquire decides.
  bool Saturated() const;
  int running() const;
  int queued() const;
  int max_concurrent() const { return max_concurrent_; }
  int max_queued() const { return max_queued_; }

 private:
  const int max_concurrent_;
  const int max_queued_;
  const std::function<void(int, int)> on_change_;
  mutable absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  int queued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;  // FIFO order of queued requests
  uint64_t serving_ ABSL_GUARDED_BY(mu_) = 0;      // the ticket whose turn is next
  std::vector<uint64_t> abandoned_ ABSL_GUARDED_BY(mu_);  // tickets that left the queue early
};

}  // namespace dgserve
