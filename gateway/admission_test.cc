// Admission with real threads: slots, the FIFO wait queue, refusal at once, deadline and
// cancellation while queued. Loops are bounded; nothing asserts on elapsed time.
#include "gateway/admission.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "common/testing/status_matchers.h"

namespace dgserve {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

// Waits (bounded) until `pred` holds.
template <typename Pred>
bool WaitFor(Pred pred) {
  for (int i = 0; i < 2000 && !pred(); ++i) absl::SleepFor(absl::Milliseconds(5));
  return pred();
}

TEST(AdmissionTest, RefusesAtOnceBeyondTheLimitWithoutQueue) {
  std::atomic<int> last_running{-1};
  Admission a(2, 0, [&](int running, int) { last_running = running; });
  const absl::Time far = absl::Now() + absl::Hours(1);
  EXPECT_THAT(a.Acquire(far, {}, nullptr), IsOk());
  EXPECT_FALSE(a.Saturated());
  EXPECT_THAT(a.Acquire(far, {}, nullptr), IsOk());
  EXPECT_TRUE(a.Saturated());
  EXPECT_EQ(last_running.load(), 2);
  // Ten more callers than the limit: every one refused, none waits.
  for (int i = 0; i < 10; ++i) {
    EXPECT_THAT(a.Acquire(far, {}, nullptr), StatusIs(absl::StatusCode::kResourceExhausted));
  }
  EXPECT_EQ(a.running(), 2);
  a.Release();
  EXPECT_FALSE(a.Saturated());
  EXPECT_THAT(a.Acquire(far, {}, nullptr), IsOk());
  a.Release();
  a.Release();
  EXPECT_EQ(a.running(), 0);
  EXPECT_EQ(last_running.load(), 0);
}

TEST(AdmissionTest, QueueIsFifoAndBounded) {
  std::atomic<int> last_queued{-1};
  Admission a(1, 3, [&](int, int queued) { last_queued = queued; });
  const absl::Time far = absl::Now() + absl::Hours(1);
  ASSERT_THAT(a.Acquire(far, {}, nullptr), IsOk());
  std::vector<int> order;
  absl::Mutex mu;
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&, i] {
      absl::Duration waited;
      ASSERT_THAT(a.Acquire(far, {}, &waited), IsOk());
      EXPECT_GT(waited, absl::ZeroDuration());
      {
        absl::MutexLock lock(&mu);
        order.push_back(i);
      }
      a.Release();
    });
    // Queue them one after another so that their order is known.
    ASSERT_TRUE(WaitFor([&] { return a.queued() == i + 1; }));
  }
  EXPECT_EQ(last_queued.load(), 3);
  EXPECT_TRUE(a.Saturated());
  // The queue is full: a fifth caller is refused at once.
  EXPECT_THAT(a.Acquire(far, {}, nullptr), StatusIs(absl::StatusCode::kResourceExhausted));
  a.Release();
  for (std::thread& t : waiters) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(a.running(), 0);
  EXPECT_EQ(a.queued(), 0);
}

TEST(AdmissionTest, DeadlineAndCancelWhileQueued) {
  Admission a(1, 2);
  ASSERT_THAT(a.Acquire(absl::InfiniteFuture(), {}, nullptr), IsOk());
  EXPECT_THAT(a.Acquire(absl::Now() + absl::Milliseconds(30), {}, nullptr),
              StatusIs(absl::StatusCode::kDeadlineExceeded));
  std::atomic<bool> cancel{false};
  absl::Status cancelled_status;
  std::thread t([&] {
    cancelled_status = a.Acquire(absl::InfiniteFuture(), [&] { return cancel.load(); }, nullptr);
  });
  ASSERT_TRUE(WaitFor([&] { return a.queued() == 1; }));
  // A second waiter behind the cancelled one still gets its turn.
  absl::Status second;
  std::thread t2([&] {
    second = a.Acquire(absl::InfiniteFuture(), {}, nullptr);
    if (second.ok()) a.Release();
  });
  ASSERT_TRUE(WaitFor([&] { return a.queued() == 2; }));
  cancel = true;
  t.join();
  EXPECT_THAT(cancelled_status, StatusIs(absl::StatusCode::kCancelled));
  a.Release();
  t2.join();
  EXPECT_THAT(second, IsOk());
  EXPECT_EQ(a.running(), 0);
  EXPECT_EQ(a.queued(), 0);
}

// `on_queued` runs once for a request that joins the queue, before its wait, and never for one
// admitted or refused at once; its error takes the request out of the queue without a slot (the
// gateway answers a queued bad request at once), and the request behind it keeps its turn.
TEST(AdmissionTest, OnQueuedRunsOnlyForQueuedRequestsAndItsErrorLeavesTheQueue) {
  Admission a(1, 2);
  const absl::Time far = absl::Now() + absl::Hours(1);
  int calls = 0;
  auto count_call = [&] {
    ++calls;
    return absl::OkStatus();
  };
  ASSERT_THAT(a.Acquire(far, {}, nullptr, count_call), IsOk());  // admitted at once
  EXPECT_EQ(calls, 0);

  // A queued request: the callback runs while it is queued, before any slot is free.
  std::atomic<int> queued_calls{0};
  std::atomic<int> queued_seen_in_callback{-1};
  absl::Status first;
  std::thread t([&] {
    first = a.Acquire(far, {}, nullptr, [&] {
      queued_seen_in_callback = a.queued();  // unlocked: may call back into Admission
      ++queued_calls;
      return absl::OkStatus();
    });
  });
  ASSERT_TRUE(WaitFor([&] { return queued_calls.load() == 1; }));
  EXPECT_EQ(queued_seen_in_callback.load(), 1);
  EXPECT_EQ(a.running(), 1);

  // A second queued request whose callback fails: out of the queue at once, with that status.
  EXPECT_THAT(a.Acquire(far, {}, nullptr,
                        [] { return absl::InvalidArgumentError("temperature: must be ≥ 0"); }),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(a.queued(), 1);
  EXPECT_EQ(a.running(), 1);

  // The queue is full (1 running, 2 queued): a third is refused without its callback.
  std::atomic<bool> third_waiting{false};
  absl::Status third;
  std::thread t3([&] {
    third = a.Acquire(far, {}, nullptr, [&] {
      third_waiting = true;
      return absl::OkStatus();
    });
    if (third.ok()) a.Release();
  });
  ASSERT_TRUE(WaitFor([&] { return third_waiting.load(); }));
  EXPECT_THAT(a.Acquire(far, {}, nullptr, count_call),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(calls, 0);

  a.Release();
  t.join();
  EXPECT_THAT(first, IsOk());
  EXPECT_EQ(queued_calls.load(), 1);
  a.Release();
  t3.join();
  EXPECT_THAT(third, IsOk());
  EXPECT_EQ(a.running(), 0);
  EXPECT_EQ(a.queued(), 0);
}

TEST(AdmissionTest, ManyThreadsNeverExceedTheLimit) {
  constexpr int kLimit = 3;
  Admission a(kLimit, 4);
  std::atomic<int> running{0}, max_running{0}, ok{0}, refused{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 24; ++i) {
    threads.emplace_back([&] {
      for (int j = 0; j < 20; ++j) {
        absl::Status s = a.Acquire(absl::InfiniteFuture(), {}, nullptr);
        if (!s.ok()) {
          ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
          ++refused;
          continue;
        }
        const int now = ++running;
        int prev = max_running.load();
        while (now > prev && !max_running.compare_exchange_weak(prev, now)) {
        }
        std::this_thread::yield();
        --running;
        ++ok;
        a.Release();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(max_running.load(), kLimit);
  EXPECT_EQ(ok.load() + refused.load(), 24 * 20);
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(a.running(), 0);
  EXPECT_EQ(a.queued(), 0);
}

}  // namespace
}  // namespace dgserve
