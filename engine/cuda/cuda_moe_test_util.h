// The MoE tests' shared parts (cuda_moe_test.cc, cuda_moe_w4a16_test.cc): random inputs, the
// host routing CudaBackend::Moe built before routing moved to the device, and the CudaMoeTest
// fixture (device routing, grouping and the whole MoE chain).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/cuda/cuda_moe.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/model/model_math.h"
#include "gtest/gtest.h"

namespace dgserve::cuda::moe_testing {

using ::dgserve::testing::IsOk;

inline uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline std::vector<float> RandomFloats(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

inline std::vector<uint16_t> RandomBf16(size_t n, float scale, uint32_t seed) {
  const std::vector<float> f = RandomFloats(n, -scale, scale, seed);
  std::vector<uint16_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = ::dgserve::FloatToBf16(f[i]);
  return b;
}

// What CudaBackend::Moe built on the host before routing moved to the device (RouteTopK per
// row, then rows grouped by expert in ascending row order).
struct HostRouting {
  std::vector<int32_t> expert, offsets, gather, slot;
  std::vector<float> weight, slot_weight;
};

inline HostRouting HostRoute(const std::vector<float>& scores, int R, int E, int K,
                             const std::vector<float>& scale) {
  HostRouting h;
  h.expert.resize(size_t(R) * K);
  h.weight.resize(size_t(R) * K);
  std::vector<std::vector<std::pair<int, float>>> by_expert(E);
  std::vector<std::pair<int, float>> chosen(K);
  std::vector<float> row(E);
  for (int r = 0; r < R; ++r) {
    std::copy(scores.begin() + size_t(r) * E, scores.begin() + size_t(r + 1) * E, row.begin());
    RouteTopK(row.data(), E, K, scale.data(), chosen.data());
    for (const auto& [e, w] : chosen) by_expert[e].push_back({r, w});
    std::sort(chosen.begin(), chosen.end());
    for (int j = 0; j < K; ++j) {
      h.expert[size_t(r) * K + j] = chosen[j].first;
      h.weight[size_t(r) * K + j] = chosen[j].second;
    }
  }
  h.offsets.assign(E + 1, 0);
  h.slot.assign(size_t(R) * K, -1);
  std::vector<int> filled(R, 0);
  for (int e = 0; e < E; ++e) {
    for (const auto& [r, w] : by_expert[e]) {
      const int j = filled[r]++;
      h.slot[size_t(r) * K + j] = int32_t(h.gather.size());
      h.slot_weight.push_back(w);
      h.gather.push_back(r);
    }
    h.offsets[e + 1] = int32_t(h.gather.size());
  }
  return h;
}

class CudaMoeTest : public CudaTest {
 protected:
  struct Routed {
    std::vector<int32_t> expert, offsets, gather, slot;
    std::vector<float> weight, slot_weight;
  };
  // MoeRoute + MoeGroup on the device, everything downloaded.
  Routed DeviceRoute(const std::vector<float>& scores, int R, int E, int K,
                     const std::vector<float>& scale) {
    const size_t n = size_t(R) * K;
    int32_t* expert = Alloc<int32_t>(n, 0xFF);
    float* weight = Alloc<float>(n, 0xFF);
    int32_t* offsets = Alloc<int32_t>(E + 1, 0xFF);
    int32_t* gather = Alloc<int32_t>(n, 0xFF);
    int32_t* slot = Alloc<int32_t>(n, 0xFF);
    float* slot_weight = Alloc<float>(n, 0xFF);
    EXPECT_THAT(MoeRoute(Upload(scores), R, E, K, Upload(scale), expert, weight), IsOk());
    EXPECT_THAT(MoeGroup(expert, weight, R, E, K, offsets, gather, slot, slot_weight), IsOk());
    Routed d;
    d.expert = Download(expert, n);
    d.weight = Download(weight, n);
    d.offsets = Download(offsets, E + 1);
    d.gather = Download(gather, n);
    d.slot = Download(slot, n);
    d.slot_weight = Download(slot_weight, n);
    return d;
  }

  // Device routing == RouteTopK and the host grouping, bit for bit.
  void ExpectRoutingMatchesCpu(const std::vector<float>& scores, int R, int E, int K,
                               const std::vector<float>& scale, const char* what) {
    const HostRouting h = HostRoute(scores, R, E, K, scale);
    const Routed d = DeviceRoute(scores, R, E, K, scale);
    int bad = 0;
    for (int r = 0; r < R && bad < 5; ++r) {
      for (int j = 0; j < K; ++j) {
        const size_t i = size_t(r) * K + j;
        if (d.expert[i] != h.expert[i] || Bits(d.weight[i]) != Bits(h.weight[i])) {
          ++bad;
          ADD_FAILURE() << what << ": row " << r << " choice " << j << ": device (" << d.expert[i]
                        << ", " << d.weight[i] << "), cpu (" << h.expert[i] << ", " << h.weight[i]
                        << ")";
          break;
        }
      }
    }
    EXPECT_EQ(bad, 0) << what;
    EXPECT_EQ(d.offsets, h.offsets) << what;
    EXPECT_EQ(d.gather, h.gather) << what;
    EXPECT_EQ(d.slot, h.slot) << what;
    ASSERT_EQ(d.slot_weight.size(), h.slot_weight.size());
    for (size_t i = 0; i < h.slot_weight.size(); ++i) {
      ASSERT_EQ(Bits(d.slot_weight[i]), Bits(h.slot_weight[i])) << what << " gathered row " << i;
    }
  }

  // The whole MoE on the device: out[R, D] from scores [R, E] and x [R, D].
  std::vector<float> DeviceMoe(const std::vector<float>& scores, const std::vector<float>& x, int R,
                               int E, int K, int D, int F, const std::vector<float>& scale,
                               const uint16_t* w_gate_up, const uint16_t* w_down, GemmInput input,
                               MoeKernel kernel) {
    const size_t n = size_t(R) * K;
    int32_t* expert = Alloc<int32_t>(n, 0xFF);
    float* weight = Alloc<float>(n, 0xFF);
    int32_t* offsets = Alloc<int32_t>(E + 1, 0xFF);
    int32_t* gather = Alloc<int32_t>(n, 0xFF);
    int32_t* slot = Alloc<int32_t>(n, 0xFF);
    float* slot_weight = Alloc<float>(n, 0xFF);
    float* act = Alloc<float>(n * F, 0xFF);
    float* y = Alloc<float>(n * D, 0xFF);
    float* out = Alloc<float>(size_t(R) * D, 0xFF);
    EXPECT_THAT(MoeRoute(Upload(scores), R, E, K, Upload(scale), expert, weight), IsOk());
    EXPECT_THAT(MoeGroup(expert, weight, R, E, K, offsets, gather, slot, slot_weight), IsOk());
    EXPECT_THAT(MoeGateUp(Upload(x), gather, offsets, w_gate_up, R, K, E, D, F, input, act, nullptr,
                          kernel),
                IsOk());
    EXPECT_THAT(
        MoeDown(act, offsets, slot_weight, w_down, R, K, E, F, D, input, y, nullptr, kernel),
        IsOk());
    EXPECT_THAT(MoeSum(y, slot, R, K, D, out), IsOk());
    return Download(out, size_t(R) * D);
  }
};

}  // namespace dgserve::cuda::moe_testing
