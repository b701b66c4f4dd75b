#include "engine/denoise/entropy_bound.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace dgserve {

std::vector<int> AcceptPositions(std::span<const float> entropy, double entropy_bound) {
  const int n = static_cast<int>(entropy.size());
  auto key = [&](int i) {
    const float h = entropy[i];
    return std::isnan(h) ? std::numeric_limits<float>::infinity() : h;
  };
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const float ka = key(a), kb = key(b);
    return ka < kb || (ka == kb && a < b);
  });
  std::vector<int> accepted;
  double before = 0.0;  // sum of the entropies ranked strictly before the current rank
  for (int k = 0; k < n; ++k) {
    const int pos = order[k];
    if (k == 0 || before <= entropy_bound) accepted.push_back(pos);
    before += static_cast<double>(entropy[pos]);
  }
  std::sort(accepted.begin(), accepted.end());
  return accepted;
}

}  // namespace dgserve
