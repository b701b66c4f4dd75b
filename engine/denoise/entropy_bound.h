// Entropy-bound acceptance (spec §4.2 step 5, golden README §4; Ben-Hamu et al. 2505.24857).
#pragma once

#include <span>
#include <vector>

namespace dgserve {

// Returns the accepted positions of one canvas in ascending position order (the order of the
// golden data's `accepted` lists). `entropy` holds the float32 per-position entropies (nats,
// length C ≥ 0); `entropy_bound` is β > 0.
//
// Positions are ranked by entropy ascending, ties broken by the lower position first (NaN ranks
// last, as +inf). The position at rank k is accepted iff the sum, in double, of the float32
// entropies ranked strictly before it is ≤ entropy_bound (so a sum exactly equal to the bound is
// accepted, and rank 0 is always accepted). For non-negative entropies the accepted set is a
// prefix of the ranking. Empty input → empty result.
std::vector<int> AcceptPositions(std::span<const float> entropy, double entropy_bound);

}  // namespace dgserve
