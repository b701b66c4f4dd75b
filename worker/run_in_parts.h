// Running a batch of backend passes in parts when the backend's K/V memory refuses the whole
// (both workers: the prefill worker's encoder passes, the denoise worker's steps and commits).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace dgserve {

// `run` over `batch`, and where that is RESOURCE_EXHAUSTED with more than one input, over each
// half in turn instead (recursively): a backend's device memory may hold the K/V of fewer
// sequences at once than the batch (the CUDA backend's block pool at its bound, which frees the
// blocks of sequences outside the call, copying rows only it has to their caches), so the halves
// run where the whole did not. A failed call changes no cache (the backends' passes commit
// nothing then), so its inputs are run again as they are. Returns each input's status: a single
// input that still does not fit gets the error. `parts`: calls made beyond the first; `largest`:
// the most inputs of one call that succeeded. An empty batch makes no call.
template <typename In, typename Run>
std::vector<absl::Status> RunInParts(std::span<const In> batch, const Run& run, int* parts,
                                     size_t* largest) {
  std::vector<absl::Status> out(batch.size());
  if (batch.empty()) return out;
  const absl::Status s = run(batch);
  if (s.code() != absl::StatusCode::kResourceExhausted || batch.size() < 2) {
    if (s.ok()) *largest = std::max(*largest, batch.size());
    std::fill(out.begin(), out.end(), s);
    return out;
  }
  const size_t half = batch.size() / 2;
  for (const auto& [from, count] : {std::pair{size_t{0}, half}, {half, batch.size() - half}}) {
    ++*parts;
    const std::vector<absl::Status> part =
        RunInParts(batch.subspan(from, count), run, parts, largest);
    std::copy(part.begin(), part.end(), out.begin() + from);
  }
  return out;
}

}  // namespace dgserve
