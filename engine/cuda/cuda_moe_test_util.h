// The MoE and quantized-kernel tests' shared parts (cuda_moe_test.cc, cuda_moe_w4a16_test.cc,
// cuda_fp8_test.cc, cuda_nvfp4_test.cc): random inputs and float bits, the host routing
// CudaBackend::Moe built before routing moved to the device, and the CudaMoeTest fixture (device
// routing, grouping and the whole MoE chain).
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
  // MoeRoute + MoeGroup's outputs on the device.
  struct DeviceRouting {
    int32_t *expert, *offsets, *gather, *slot;
    float *weight, *slot_weight;
  };
  DeviceRouting RouteOnDevice(const std::vector<float>& scores, int R, int E, int K,
                              const std::vector<float>& scale) {
    const size_t n = size_t(R) * K;
    DeviceRouting d;
    d.expert = Alloc<int32_t>(n, 0xFF);
    d.weight = Alloc<float>(n, 0xFF);
    d.offsets = Alloc<int32_t>(E + 1, 0xFF);
    d.gather = Alloc<int32_t>(n, 0xFF);
    d.slot = Alloc<int32_t>(n, 0xFF);
    d.slot_weight = Alloc<float>(n, 0xFF);
    EXPECT_THAT(MoeRoute(Upload(scores), R, E, K, Upload(scale), d.expert, d.weight), IsOk());
    EXPECT_THAT(MoeGroup(d.expert, d.weight, R, E, K, d.offsets, d.gather, d.slot, d.slot_weight),
                IsOk());
    return d;
  }

  struct Routed {
    std::vector<int32_t> expert, offsets, gather, slot;
    std::vector<float> weight, slot_weight;
  };
  // MoeRoute + MoeGroup on the device, everything downloaded.
  Routed DeviceRoute(const std::vector<float>& scores, int R, int E, int K,
                     const std::vector<float>& scale) {
    const size_t n = size_t(R) * K;
    const DeviceRouting r = RouteOnDevice(scores, R, E, K, scale);
    Routed d;
    d.expert = Download(r.expert, n);
    d.weight = Download(r.weight, n);
    d.offsets = Download(r.offsets, E + 1);
    d.gather = Download(r.gather, n);
    d.slot = Download(r.slot, n);
    d.slot_weight = Download(r.slot_weight, n);
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

  // The whole MoE on the device with the given expert GEMMs: out[R, D] from scores [R, E] and
  // x [R, D]. gate_up(x, gather, offsets, act) and down(act, offsets, slot_weight, y) launch the
  // two grouped GEMMs (act [R·K, F], y [R·K, D]) and return their status.
  template <typename GateUp, typename Down>
  std::vector<float> DeviceMoeWith(const std::vector<float>& scores, const std::vector<float>& x,
                                   int R, int E, int K, int D, int F,
                                   const std::vector<float>& scale, GateUp gate_up, Down down) {
    const size_t n = size_t(R) * K;
    const DeviceRouting r = RouteOnDevice(scores, R, E, K, scale);
    float* act = Alloc<float>(n * F, 0xFF);
    float* y = Alloc<float>(n * D, 0xFF);
    float* out = Alloc<float>(size_t(R) * D, 0xFF);
    EXPECT_THAT(gate_up(Upload(x), r.gather, r.offsets, act), IsOk());
    EXPECT_THAT(down(act, r.offsets, r.slot_weight, y), IsOk());
    EXPECT_THAT(MoeSum(y, r.slot, R, K, D, out), IsOk());
    return Download(out, size_t(R) * D);
  }

  // The same with bf16 experts (MoeGateUp / MoeDown).
  std::vector<float> DeviceMoe(const std::vector<float>& scores, const std::vector<float>& x, int R,
                               int E, int K, int D, int F, const std::vector<float>& scale,
                               const uint16_t* w_gate_up, const uint16_t* w_down, GemmInput input,
                               MoeKernel kernel) {
    return DeviceMoeWith(
        scores, x, R, E, K, D, F, scale,
        [&](const float* xs, const int32_t* gather, const int32_t* offsets, float* act) {
          return MoeGateUp(xs, gather, offsets, w_gate_up, R, K, E, D, F, input, act, nullptr,
                           kernel);
        },
        [&](const float* act, const int32_t* offsets, const float* slot_weight, float* y) {
          return MoeDown(act, offsets, slot_weight, w_down, R, K, E, F, D, input, y, nullptr,
                         kernel);
        });
  }
};

}  // namespace dgserve::cuda::moe_testing
