// engine_bench's batch sizes from its --batch and --batches flags (bench/engine_bench.cc).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dgserve::bench {

// The batch sizes to run in turn: the comma-separated `list` (--batches) when it is not empty,
// else `batch` (--batch; 1 when not given). Every size must be in [1, 256] (the message names the
// flag it came from). INVALID_ARGUMENT,
// with the message engine_bench prints, for a part of the list that is not a number, a size out
// of range, or a `batch` given beside a list that is not exactly that one batch (--batch N is
// --batches N; the list used to override it silently).
absl::StatusOr<std::vector<int>> BatchSizes(const std::string& list, std::optional<int> batch);

}  // namespace dgserve::bench
