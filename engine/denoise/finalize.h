// Stop-token finalisation of a committed canvas (spec §4.1 step 3c, HF `_finalize_canvas`).
#pragma once

#include <cstdint>
#include <span>

namespace dgserve {

// Finds the first token of `canvas` that is in `stop_ids` (e.g. {1, 106, 50}), keeps it and
// replaces every token strictly after it with `pad_id` (0). Returns whether a stop token was
// found; without one the canvas is unchanged.
bool FinalizeCanvas(std::span<int32_t> canvas, std::span<const int32_t> stop_ids, int32_t pad_id);

}  // namespace dgserve
