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

}  // namespace dgserve
