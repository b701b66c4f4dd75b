// How the gateway classifies a worker call's status for its retry logic (WorkerCallStatus): a
// CANCELLED that neither the client nor the deadline caused is the worker's failure
// (UNAVAILABLE, retried or resumed); everything else is kept.
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gateway/request_run.h"
#include "gtest/gtest.h"

namespace dgserve::gateway_internal {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1'000'000);

TEST(WorkerCallStatusTest, CancelledByTheWorkersSideIsUnavailable) {
  // What the CI log showed (a KV transfer to a denoise worker that was shutting down).
  const absl::Status cancelled = absl::CancelledError(
      "KV transfer to 127.0.0.1:9 failed: KV transfer for att-1 to 127.0.0.1:9 failed: CANCELLED");
  const absl::Status st = WorkerCallStatus(cancelled, /*client_cancelled=*/false,
                                           kNow + absl::Seconds(30), kNow);
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  EXPECT_EQ(st.message(), cancelled.message());
  // Also with no deadline at all.
  EXPECT_TRUE(absl::IsUnavailable(
      WorkerCallStatus(cancelled, false, absl::InfiniteFuture(), kNow)));
}

TEST(WorkerCallStatusTest, CancelledByTheClientOrTheDeadlineStaysCancelled) {
  const absl::Status cancelled = absl::CancelledError("Cancelled");
  EXPECT_TRUE(absl::IsCancelled(
      WorkerCallStatus(cancelled, /*client_cancelled=*/true, kNow + absl::Seconds(30), kNow)));
  EXPECT_TRUE(absl::IsCancelled(WorkerCallStatus(cancelled, false, kNow, kNow)));
  EXPECT_TRUE(absl::IsCancelled(
      WorkerCallStatus(cancelled, false, kNow - absl::Seconds(1), kNow)));
}

TEST(WorkerCallStatusTest, OtherStatusesAreKept) {
  const absl::Time deadline = kNow + absl::Seconds(30);
  for (const absl::Status& s :
       {absl::OkStatus(), absl::UnavailableError("connection refused"),
        absl::DeadlineExceededError("deadline"), absl::InvalidArgumentError("bad prompt"),
        absl::ResourceExhaustedError("no KV blocks"), absl::InternalError("bug")}) {
    EXPECT_EQ(WorkerCallStatus(s, false, deadline, kNow), s);
    EXPECT_EQ(WorkerCallStatus(s, true, deadline, kNow), s);
  }
}

}  // namespace
}  // namespace dgserve::gateway_internal
