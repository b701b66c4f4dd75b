// Model math that both backends share (the CPU backend, and the CUDA backend on the host or as
// its device code's reference): the RoPE frequency table and the MoE router's decision, float32
// operations in a fixed order so that each backend gets the same bits.
#pragma once

#include <utility>
#include <vector>

namespace dgserve {

// Inverse frequencies of one RoPE variant (spec §3.1.4): f_j = θ^(−2j/head_dim) in float32 for
// j < rotated_pairs, 0 (identity) for rotated_pairs ≤ j < head_dim/2. Returns head_dim/2 values.
std::vector<float> RopeInvFreq(float theta, int head_dim, int rotated_pairs);

// Router decision for one token (spec §3.2 step 5): softmax over the E router scores, the top k
// by probability (ties → lower expert id), weights renormalised to sum 1 over the k, then
// multiplied by per_expert_scale[e]. Writes k (expert, weight) pairs, highest probability first.
// `scores` [E] is overwritten with the softmax. Needs 1 ≤ k ≤ num_experts.
void RouteTopK(float* scores, int num_experts, int k, const float* per_expert_scale,
               std::pair<int, float>* out);

}  // namespace dgserve
