#include "bench/bench_batches.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace dgserve::bench {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BatchSizesTest, ListOrBatch) {
  EXPECT_THAT(BatchSizes("1,4,16", std::nullopt).value(), ElementsAre(1, 4, 16));
  EXPECT_THAT(BatchSizes("", std::nullopt).value(), ElementsAre(1));
  EXPECT_THAT(BatchSizes("", 8).value(), ElementsAre(8));
  // --batch beside the list: only the same one batch.
  EXPECT_THAT(BatchSizes("8", 8).value(), ElementsAre(8));
}

TEST(BatchSizesTest, RefusesBadInput) {
  const auto code = [](const std::string& list, std::optional<int> batch) {
    return BatchSizes(list, batch).status().code();
  };
  EXPECT_EQ(code("1,x", std::nullopt), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("1,,2", std::nullopt), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("0", std::nullopt), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("257", std::nullopt), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("", 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("1,4", 4), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(BatchSizes("1,2", 8).status().message()),
              HasSubstr("--batch 8 and --batches 1,2 disagree: give one"));
  EXPECT_THAT(std::string(BatchSizes("", 300).status().message()),
              HasSubstr("--batch must be in [1, 256], got 300"));
  // The flag the size came from.
  EXPECT_THAT(std::string(BatchSizes("4,0", std::nullopt).status().message()),
              HasSubstr("--batches must be in [1, 256], got 0"));
}

}  // namespace
}  // namespace dgserve::bench
