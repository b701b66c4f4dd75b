// Canvas templates (infilling, a clamped canvas): the positions of a canvas whose tokens are
// known, and the allowed token sets of the others. Implements the "logits processor" view of
// clamping on top of spec §4.2: a fixed position behaves as a hole whose allowed set is its one
// token (probability 1, entropy 0, always accepted, never renoised, its self-conditioning input
// the token's embedding); a restricted hole has the logits of the ids outside its set masked to
// −inf before temperature, softmax, entropy and sampling, and its initial and renoise tokens are
// drawn uniformly from the set.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace dgserve {

// One restricted hole as a client gives it.
struct TemplateHoleSpec {
  int position = 0;                        // 0 ≤ position < canvas_length
  std::vector<int32_t> allowed_token_ids;  // non-empty, ids in [0, vocab)
};

// A validated template for canvases of one length over one vocabulary. Immutable; share it
// between the denoisers of a request (and its samples) by shared_ptr.
class CanvasTemplate {
 public:
  // `token_ids[j]` is the fixed token at position j or −1 for a hole (positions past the end are
  // holes); `holes` restrict holes to allowed sets. INVALID_ARGUMENT, naming the entry, for
  // token_ids longer than `canvas_length`, an id outside [−1, vocab), a restricted hole outside
  // [0, canvas_length), on a fixed position, listed twice, with an empty allowed set or an id
  // outside [0, vocab).
  static absl::StatusOr<std::shared_ptr<const CanvasTemplate>> Create(
      std::span<const int32_t> token_ids, std::span<const TemplateHoleSpec> holes,
      int canvas_length, int32_t vocab);

  int canvas_length() const { return static_cast<int>(fixed_.size()); }
  int32_t vocab() const { return vocab_; }
  // The fixed token at `pos`, or −1 for a hole.
  int32_t fixed(int pos) const { return fixed_[pos]; }
  bool is_hole(int pos) const { return fixed_[pos] < 0; }
  // The allowed ids of the hole at `pos` (sorted, unique), or an empty span when any id is
  // allowed. Empty at fixed positions.
  std::span<const int32_t> allowed(int pos) const;
  // Whether `token` may appear at `pos` (the fixed token, a member of the allowed set, or any
  // id at an unrestricted hole).
  bool Allows(int pos, int32_t token) const;
  // Hole positions, ascending.
  std::span<const int> holes() const { return holes_; }

  // Per position, a vocabulary bit mask (bit v of word v/64 set ⇔ id v allowed) or nullptr for
  // an unrestricted hole: the fixed token's one-bit mask at fixed positions, the allowed set's
  // mask at restricted holes. [canvas_length] pointers into this object.
  std::span<const uint64_t* const> row_masks() const { return row_masks_; }

 private:
  CanvasTemplate() = default;

  int32_t vocab_ = 0;
  std::vector<int32_t> fixed_;                   // [C]
  std::vector<int> set_of_;                      // [C] index into sets_, −1 = none
  std::vector<std::vector<int32_t>> sets_;       // allowed sets, sorted, unique
  std::vector<int> holes_;                       // hole positions
  std::vector<std::vector<uint64_t>> masks_;     // one per set and per distinct fixed token
  std::vector<const uint64_t*> row_masks_;       // [C]
};

}  // namespace dgserve
