#include "engine/denoise/finalize.h"

#include <algorithm>

namespace dgserve {

bool FinalizeCanvas(std::span<int32_t> canvas, std::span<const int32_t> stop_ids, int32_t pad_id) {
  const auto first = std::find_if(canvas.begin(), canvas.end(), [&](int32_t t) {
    return std::find(stop_ids.begin(), stop_ids.end(), t) != stop_ids.end();
  });
  if (first == canvas.end()) return false;
  std::fill(first + 1, canvas.end(), pad_id);
  return true;
}

CompletionCut CutCompletion(std::span<const int32_t> tokens, std::span<const int32_t> stop_ids,
                            int completion_so_far, int max_tokens) {
  CompletionCut cut;
  for (int32_t id : tokens) {
    if (completion_so_far + cut.take >= max_tokens) {
      cut.length = true;
      break;
    }
    if (std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end()) {
      cut.stop_token = true;
      break;
    }
    ++cut.take;
  }
  return cut;
}

}  // namespace dgserve
