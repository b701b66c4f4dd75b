// Stop-token finalisation of a committed canvas (spec §4.1 step 3c, HF `_finalize_canvas`), and
// the completion cut: which of a request's generated tokens are its completion.
#pragma once

#include <cstdint>
#include <span>

namespace dgserve {

// Finds the first token of `canvas` that is in `stop_ids` (e.g. {1, 106, 50}), keeps it and
// replaces every token strictly after it with `pad_id` (0). Returns whether a stop token was
// found; without one the canvas is unchanged.
bool FinalizeCanvas(std::span<int32_t> canvas, std::span<const int32_t> stop_ids, int32_t pad_id);

// Where the completion ends within the next piece of generated tokens (CutCompletion).
struct CompletionCut {
  int take = 0;             // the piece's first `take` tokens belong to the completion
  bool stop_token = false;  // it ended at a stop token (not part of the completion)
  bool length = false;      // it ended at max_tokens with tokens of the piece left over
};

// The completion cut, the one rule of every place that turns canvases into a completion (the
// generation loop, the denoise worker, the gateway): the completion is the generated tokens up
// to, not including, the first stop token, at most `max_tokens` of them. Fed the generated
// tokens in pieces (a canvas at a time), with `completion_so_far` tokens already taken by the
// earlier pieces (≤ max_tokens), it says how many of `tokens` to take and why it stopped
// taking: the limit is checked before each token, so a stop token right at the limit ends the
// completion on its length. A piece taken whole with the limit reached exactly at its end has
// neither flag set: only the next piece (if any) shows `length`.
CompletionCut CutCompletion(std::span<const int32_t> tokens, std::span<const int32_t> stop_ids,
                            int completion_so_far, int max_tokens);

}  // namespace dgserve
