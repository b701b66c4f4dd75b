// RunInParts over a fake pass that refuses more than a given number of inputs at once (as the
// CUDA backend's pool at its bound refuses a batch whose K/V it cannot hold).
#include "worker/run_in_parts.h"

#include <gtest/gtest.h>

#include <span>
#include <vector>

namespace dgserve {
namespace {

// Inputs are ints; a call with more than `max_inputs` of them, or containing `too_big`, is
// RESOURCE_EXHAUSTED; a call containing `broken` is INTERNAL. Records each call's inputs.
struct FakePass {
  size_t max_inputs;
  int too_big = -1;
  int broken = -1;
  std::vector<std::vector<int>>* calls;
  absl::Status operator()(std::span<const int> b) const {
    calls->emplace_back(b.begin(), b.end());
    for (int x : b) {
      if (x == broken) return absl::InternalError("broken");
    }
    for (int x : b) {
      if (x == too_big) return absl::ResourceExhaustedError("too big");
    }
    if (b.size() > max_inputs) return absl::ResourceExhaustedError("too many");
    return absl::OkStatus();
  }
};

TEST(RunInPartsTest, AWholeBatchThatFitsIsOneCall) {
  std::vector<std::vector<int>> calls;
  const std::vector<int> in = {1, 2, 3};
  const PartsRun run = RunInParts(std::span<const int>(in), FakePass{3, -1, -1, &calls});
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(run.parts, 0);
  EXPECT_EQ(run.largest, 3u);
  ASSERT_EQ(run.status.size(), 3u);
  for (const absl::Status& s : run.status) EXPECT_TRUE(s.ok());
}

TEST(RunInPartsTest, ARefusedBatchRunsInHalvesDownToWhatFits) {
  // 5 inputs, at most 2 at once: [0..5) refused → [0,2) runs, [2,5) refused → [2] and [3,5) run.
  std::vector<std::vector<int>> calls;
  const std::vector<int> in = {0, 1, 2, 3, 4};
  const PartsRun run = RunInParts(std::span<const int>(in), FakePass{2, -1, -1, &calls});
  const std::vector<std::vector<int>> want = {{0, 1, 2, 3, 4}, {0, 1}, {2, 3, 4}, {2}, {3, 4}};
  EXPECT_EQ(calls, want);
  EXPECT_EQ(run.parts, 4);  // calls beyond the first
  EXPECT_EQ(run.largest, 2u);
  for (const absl::Status& s : run.status) EXPECT_TRUE(s.ok());
}

TEST(RunInPartsTest, OnlyTheInputThatDoesNotFitAloneFails) {
  std::vector<std::vector<int>> calls;
  const std::vector<int> in = {0, 1, 2, 3};
  const PartsRun run = RunInParts(std::span<const int>(in), FakePass{4, 2, -1, &calls});
  // [0..4) refused; [0,1] runs; [2,3] refused; [2] fails alone; [3] runs.
  const std::vector<std::vector<int>> want = {{0, 1, 2, 3}, {0, 1}, {2, 3}, {2}, {3}};
  EXPECT_EQ(calls, want);
  EXPECT_EQ(run.parts, 4);
  EXPECT_EQ(run.largest, 2u);
  EXPECT_TRUE(run.status[0].ok());
  EXPECT_TRUE(run.status[1].ok());
  EXPECT_EQ(run.status[2].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(run.status[2].message(), "too big");
  EXPECT_TRUE(run.status[3].ok());
}

TEST(RunInPartsTest, OtherErrorsAreNotRetried) {
  std::vector<std::vector<int>> calls;
  const std::vector<int> in = {0, 1, 2};
  const PartsRun run = RunInParts(std::span<const int>(in), FakePass{1, -1, 1, &calls});
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(run.parts, 0);
  EXPECT_EQ(run.largest, 0u);
  for (const absl::Status& s : run.status) EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
}

TEST(RunInPartsTest, AnEmptyBatchMakesNoCall) {
  std::vector<std::vector<int>> calls;
  const PartsRun run = RunInParts(std::span<const int>(), FakePass{1, -1, -1, &calls});
  EXPECT_TRUE(calls.empty());
  EXPECT_TRUE(run.status.empty());
  EXPECT_EQ(run.parts, 0);
}

}  // namespace
}  // namespace dgserve
