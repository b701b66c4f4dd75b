// Running a batch of backend passes in parts when the backend's K/V memory refuses the whole
// (both workers: the prefill worker's encoder passes, the denoise worker's steps and commits).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace dgserve {

// What RunInParts did: each input's status, in order; `parts`: calls made beyond the first (0:
// the whole batch ran, or failed, in one call); `largest`: the most inputs of one call that
// succeeded (0 when none did).
struct PartsRun {
  std::vector<absl::Status> status;
  int parts = 0;
  size_t largest = 0;
};

namespace internal_run_in_parts {
template <typename In, typename Pass>
void Split(std::span<const In> batch, const Pass& run, size_t offset, PartsRun& out) {
  const absl::Status s = run(batch);
  if (s.code() != absl::StatusCode::kResourceExhausted || batch.size() < 2) {
    if (s.ok()) out.largest = std::max(out.largest, batch.size());
    std::fill_n(out.status.begin() + offset, batch.size(), s);
    return;
  }
  const size_t half = batch.size() / 2;
  out.parts += 2;
  Split(batch.first(half), run, offset, out);
  Split(batch.subspan(half), run, offset + half, out);
}
}  // namespace internal_run_in_parts

// `run` over `batch`, and where that is RESOURCE_EXHAUSTED with more than one input, over each
// half in turn instead (recursively): a backend's device memory may hold the K/V of fewer
// sequences at once than the batch (the CUDA backend's block pool at its bound, which frees the
// blocks of sequences outside the call, copying rows only it has to their caches), so the halves
// run where the whole did not. A failed call changes no cache (the backends' passes commit
// nothing then), so its inputs are run again as they are. A single input that still does not fit
// gets the error. An empty batch makes no call.
template <typename In, typename Pass>
PartsRun RunInParts(std::span<const In> batch, const Pass& run) {
  PartsRun out;
  out.status.resize(batch.size());
  if (!batch.empty()) internal_run_in_parts::Split(batch, run, 0, out);
  return out;
}

}  // namespace dgserve
