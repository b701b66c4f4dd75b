#include "bench/bench_batches.h"

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace dgserve::bench {

absl::StatusOr<std::vector<int>> BatchSizes(const std::string& list, std::optional<int> batch) {
  std::vector<int> batches;
  if (!list.empty()) {
    for (absl::string_view part : absl::StrSplit(list, ',')) {
      int b = 0;
      if (!absl::SimpleAtoi(part, &b)) {
        return absl::InvalidArgumentError(absl::StrCat("--batches: '", part, "' is not a number"));
      }
      batches.push_back(b);
    }
    // An explicit --batch agrees with the list only when the list is that one batch.
    if (batch && !(batches.size() == 1 && batches[0] == *batch)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--batch ", *batch, " and --batches ", list,
                       " disagree: give one (--batches runs each batch of the list, --batch N is "
                       "--batches N)"));
    }
  } else {
    batches.push_back(batch.value_or(1));
  }
  for (int b : batches) {
    if (b < 1 || b > 256) {
      return absl::InvalidArgumentError(
          absl::StrCat(list.empty() ? "--batch" : "--batches", " must be in [1, 256], got ", b));
    }
  }
  return batches;
}

}  // namespace dgserve::bench
