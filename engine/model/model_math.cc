#include "engine/model/model_math.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace dgserve {

std::vector<float> RopeInvFreq(float theta, int head_dim, int rotated_pairs) {
  std::vector<float> f(head_dim / 2, 0.0f);
  for (int j = 0; j < rotated_pairs && j < head_dim / 2; ++j) {
    const float exponent = float(2 * j) / float(head_dim);
    f[j] = 1.0f / std::pow(theta, exponent);
  }
  return f;
}

void RouteTopK(float* s, int num_experts, int k, const float* per_expert_scale,
               std::pair<int, float>* out) {
  const float mx = *std::max_element(s, s + num_experts);
  float sum = 0;
  for (int e = 0; e < num_experts; ++e) sum += (s[e] = std::exp(s[e] - mx));
  for (int e = 0; e < num_experts; ++e) s[e] /= sum;
  std::vector<int> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
  float top = 0;
  for (int j = 0; j < k; ++j) top += s[order[j]];
  for (int j = 0; j < k; ++j) {
    const int e = order[j];
    out[j] = {e, s[e] / top * per_expert_scale[e]};
  }
}

}  // namespace dgserve
