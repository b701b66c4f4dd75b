#include "gateway/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dgserve {

Admission::Admission(int max_concurrent, int max_queued,
                     std::function<void(int running, int queued)> on_change)
    : max_concurrent_(std::max(1, max_concurrent)),
      max_queued_(std::max(0, max_queued)),
      on_change_(std::move(on_change)) {}

absl::Status Admission::Acquire(absl::Time deadline, const std::function<bool()>& is_cancelled,
                                absl::Duration* waited,
                                const std::function<absl::Status()>& on_queued) {
  if (waited != nullptr) *waited = absl::ZeroDuration();
  absl::MutexLock lock(&mu_);
  if (running_ < max_concurrent_ && queued_ == 0) {
    ++running_;
    if (on_change_) on_change_(running_, queued_);
    return absl::OkStatus();
  }
  if (queued_ >= max_queued_) {
    return absl::ResourceExhaustedError(
        max_queued_ == 0
            ? absl::StrCat("the gateway is at its limit of ", max_concurrent_,
                           " concurrent requests; retry later")
            : absl::StrCat("the gateway is at its limit of ", max_concurrent_,
                           " concurrent requests and ", max_queued_, " queued; retry later"));
  }
  const absl::Time start = absl::Now();
  const uint64_t ticket = next_ticket_++;
  ++queued_;
  if (on_change_) on_change_(running_, queued_);
  auto my_turn = [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return serving_ == ticket && running_ < max_concurrent_;
  };
  absl::Status status;
  if (on_queued) {
    // The callback may take a while (tokenizing) and may call back into the front end: it runs
    // unlocked. The ticket keeps the request's place; if its turn comes meanwhile, the loop
    // below takes it at once.
    mu_.Unlock();
    status = on_queued();
    mu_.Lock();
  }
  while (status.ok()) {
    if (my_turn()) break;
    if (absl::Now() >= deadline) {
      status = absl::DeadlineExceededError("deadline exceeded while queued for admission");
      break;
    }
    if (is_cancelled && is_cancelled()) {
      status = absl::CancelledError("request cancelled while queued for admission");
      break;
    }
    mu_.AwaitWithDeadline(absl::Condition(&my_turn),
                          std::min(deadline, absl::Now() + absl::Milliseconds(20)));
  }
  --queued_;
  if (status.ok()) {
    ++running_;
    ++serving_;
  } else if (serving_ == ticket) {
    ++serving_;  // the next in line takes our turn
  } else {
    // Leaving from the middle of the queue: tickets behind us keep their order; `serving_`
    // skips ours when it gets there.
    abandoned_.push_back(ticket);
  }
  // Skip tickets whose holders already left.
  for (auto it = std::find(abandoned_.begin(), abandoned_.end(), serving_); it != abandoned_.end();
       it = std::find(abandoned_.begin(), abandoned_.end(), serving_)) {
    abandoned_.erase(it);
    ++serving_;
  }
  if (on_change_) on_change_(running_, queued_);
  if (waited != nullptr) *waited = absl::Now() - start;
  return status;
}

void Admission::Release() {
  absl::MutexLock lock(&mu_);
  if (running_ > 0) --running_;
  if (on_change_) on_change_(running_, queued_);
}

bool Admission::Saturated() const {
  absl::MutexLock lock(&mu_);
  return running_ >= max_concurrent_ && queued_ >= max_queued_;
}

int Admission::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int Admission::queued() const {
  absl::MutexLock lock(&mu_);
  return queued_;
}

}  // namespace dgserve
