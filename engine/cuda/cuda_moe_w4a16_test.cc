// The W4A16 grouped GEMMs (cuda_moe.h: MoeGateUpW4A16 / MoeDownW4A16; issue 37) against the
// CPU's W4A16 weights (cpu::QuantMatrix): its widened values bit for bit, its QuantLinear and a
// float64 reference of them within float32 rounding, batch invariance, and bad weights refused
// (labels `gpu` and `gpu-emu`, as cuda_moe_test.cc).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/cuda/cuda_moe.h"
#include "engine/cuda/cuda_moe_test_util.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using moe_testing::Bits;
using moe_testing::CudaMoeTest;
using moe_testing::HostRoute;
using moe_testing::HostRouting;
using moe_testing::RandomBf16;
using moe_testing::RandomFloats;

// E experts of W4A16 weights [rows, in] with group size G: random q ∈ [−8, 7] and bf16-valued
// positive scales (as dgserve-quantize writes them), in the device layout (W4A16Weights: the
// checkpoint's weight_packed words and bf16 weight_scale) and as the CPU's QuantMatrix.
struct W4Experts {
  int E = 0, rows = 0, in = 0, group = 0;
  std::vector<uint32_t> packed;  // [E, rows, ceil(in/8)]
  std::vector<uint16_t> scales;  // [E, rows, ceil(in/G)] bf16 bits
  std::vector<cpu::QuantMatrix> cpu;

  W4Experts(int E_, int rows_, int in_, int group_, float scale_hi, uint32_t seed)
      : E(E_), rows(rows_), in(in_), group(group_) {
    std::mt19937 gen(seed);
    std::uniform_int_distribution<int> qd(-8, 7);
    std::uniform_real_distribution<float> sd(scale_hi / 8, scale_hi);
    const int words = (in + 7) / 8, groups = (in + group - 1) / group;
    packed.assign(size_t(E) * rows * words, 0);
    scales.resize(size_t(E) * rows * groups);
    for (int e = 0; e < E; ++e) {
      std::vector<int8_t> q(size_t(rows) * in);
      std::vector<float> s(size_t(rows) * groups);
      for (int r = 0; r < rows; ++r) {
        uint32_t* row_words = &packed[(size_t(e) * rows + r) * words];
        for (int c = 0; c < words * 8; ++c) {
          // Padding nibbles (c ≥ in) hold random values too: the kernel must ignore them.
          const int v = qd(gen);
          if (c < in) q[size_t(r) * in + c] = int8_t(v);
          row_words[c / 8] |= uint32_t(v + 8) << (4 * (c % 8));
        }
        for (int g = 0; g < groups; ++g) {
          const uint16_t b = ::dgserve::FloatToBf16(sd(gen));
          scales[(size_t(e) * rows + r) * groups + g] = b;
          s[size_t(r) * groups + g] = Bf16ToFloat(b);
        }
      }
      cpu.push_back(cpu::QuantMatrix::FromInt4(q.data(), s.data(), rows, in, group));
    }
  }
  // The CPU's widened weight W[e, r, c] (float32 q·s).
  float W(int e, int r, int c) const { return cpu[e].Widened(r, c); }
};

class CudaMoeW4A16Test : public CudaMoeTest {
 protected:
  W4A16Weights Device(const W4Experts& w) {
    return W4A16Weights{Upload(w.packed), Upload(w.scales), w.group};
  }
};

// The dequantization alone, exactly: one-hot activation rows through MoeDownW4A16 (float32 mode,
// routing weight 1) give y[n, d] = 1 · W[e, d, f] with one nonzero product, so the device's
// dequantized weight must be the CPU's widened float32 q·s bit for bit (nibble order, group of
// each input, scale, the padding of the last word), for every weight of every expert.
TEST_F(CudaMoeW4A16Test, DequantizedWeightsAreTheCpuWidenedBits) {
  struct Shape {
    int E, D, F, G;
  };
  for (const Shape& s : std::vector<Shape>{{2, 40, 70, 32}, {3, 24, 136, 128}, {1, 17, 33, 8}}) {
    SCOPED_TRACE(::testing::Message()
                 << "E " << s.E << " D " << s.D << " F " << s.F << " G " << s.G);
    const W4Experts wd(s.E, s.D, s.F, s.G, 0.05f, 500 + s.F);
    // Expert e's group: rows n = e·F + f, the one-hot e_f.
    const int n = s.E * s.F;
    std::vector<int32_t> offsets(s.E + 1);
    for (int e = 0; e <= s.E; ++e) offsets[e] = e * s.F;
    std::vector<float> act(size_t(n) * s.F, 0.0f);
    for (int r = 0; r < n; ++r) act[size_t(r) * s.F + r % s.F] = 1.0f;
    float* y = Alloc<float>(size_t(n) * s.D, 0xFF);
    ASSERT_THAT(MoeDownW4A16(Upload(act), Upload(offsets), Upload(std::vector<float>(n, 1.0f)),
                             Device(wd), n, 1, s.E, s.F, s.D, y),
                IsOk());
    const std::vector<float> got = Download(y, size_t(n) * s.D);
    int bad = 0;
    for (int r = 0; r < n; ++r) {
      for (int d = 0; d < s.D; ++d) {
        const float want = wd.W(r / s.F, d, r % s.F);
        if (Bits(got[size_t(r) * s.D + d]) != Bits(want) && ++bad <= 5) {
          ADD_FAILURE() << "expert " << r / s.F << " W[" << d << ", " << r % s.F << "]: device "
                        << got[size_t(r) * s.D + d] << ", cpu " << want;
        }
      }
    }
    EXPECT_EQ(bad, 0);
  }
}

// The W4A16 grouped GEMMs against float64 sums of the CPU's widened weights (the tolerances of
// GroupedGemmsMatchDoubleReference) and, for the down projection in float32 mode, against the
// CPU's W4A16 GEMM itself (cpu::QuantLinear on the same activations); groups of 0, 1, 16 and 33
// rows, group sizes 32 and 128, reductions that end inside a group and inside a packed word.
TEST_F(CudaMoeW4A16Test, GroupedGemmsMatchCpuW4A16) {
  struct Shape {
    int R, E, K, D, F;
    bool manual;  // groups of 0, 1, 16, 33 rows (K = 1, E = 4, R = 50), a shuffled gather
  };
  const std::vector<Shape> shapes = {{50, 4, 1, 136, 88, true},
                                     {37, 8, 2, 80, 45, false},
                                     {5, 16, 4, 33, 70, false},
                                     {20, 4, 2, 88, 176, false}};
  uint32_t seed = 600;
  double worst_gate_up = 0, worst_down = 0, worst_cpu = 0;  // largest |error| / tolerance seen
  for (const Shape& s : shapes) {
    for (int G : {32, 128}) {
      const int R = s.R, E = s.E, K = s.K, D = s.D, F = s.F;
      const size_t n = size_t(R) * K;
      const std::vector<float> x = RandomFloats(size_t(R) * D, -2.0f, 2.0f, seed++);
      std::vector<int32_t> offsets, gather;
      std::vector<float> slot_weight;
      if (s.manual) {
        offsets = {0, 0, 1, 17, 50};
        gather.resize(n);
        for (size_t i = 0; i < n; ++i) gather[i] = int32_t(i);
        std::shuffle(gather.begin(), gather.end(), std::mt19937(seed++));
        slot_weight = RandomFloats(n, 0.1f, 1.0f, seed++);
      } else {
        const std::vector<float> scores = RandomFloats(size_t(R) * E, -3.0f, 3.0f, seed++);
        const HostRouting h = HostRoute(scores, R, E, K, RandomFloats(E, 0.5f, 1.5f, seed++));
        offsets = h.offsets, gather = h.gather, slot_weight = h.slot_weight;
      }
      const W4Experts wgu(E, 2 * F, D, G, 0.05f, seed++);
      const W4Experts wd(E, D, F, G, 0.05f, seed++);
      const W4A16Weights d_wgu = Device(wgu), d_wd = Device(wd);
      const int32_t* d_offsets = Upload(offsets);
      const int32_t* d_gather = Upload(gather);
      const float* d_x = Upload(x);
      const float* d_slot_weight = Upload(slot_weight);
      {  // float32 activations, the only ones the W4A16 functions take (as cpu::QuantLinear)
        SCOPED_TRACE(::testing::Message()
                     << "R " << R << " E " << E << " D " << D << " F " << F << " G " << G);
        auto in = [](float v) { return double(v); };
        float* act = Alloc<float>(n * F, 0xFF);
        ASSERT_THAT(MoeGateUpW4A16(d_x, d_gather, d_offsets, d_wgu, R, K, E, D, F, act), IsOk());
        const std::vector<float> got_act = Download(act, n * F);
        int bad = 0;
        for (int e = 0; e < E; ++e) {
          for (int g = offsets[e]; g < offsets[e + 1]; ++g) {
            const float* xr = &x[size_t(gather[g]) * D];
            for (int f = 0; f < F; ++f) {
              double gs = 0, us = 0, ga = 0, ua = 0;
              for (int d = 0; d < D; ++d) {
                const double a = in(xr[d]);
                const double tg = a * wgu.W(e, f, d), tu = a * wgu.W(e, F + f, d);
                gs += tg, us += tu, ga += std::fabs(tg), ua += std::fabs(tu);
              }
              const double gelu =
                  0.5 * gs * (1.0 + std::tanh(0.7978845608028654 * (gs + 0.044715 * gs * gs * gs)));
              const double want = gelu * us;
              const double tol = 1e-5 * (1.2 * ga * std::fabs(us) + std::fabs(gelu) * ua) +
                                 1e-6 * std::fabs(want) + 1e-30;
              const double got = got_act[size_t(g) * F + f];
              worst_gate_up = std::max(worst_gate_up, std::fabs(got - want) / tol);
              if (!(std::fabs(got - want) <= tol) && ++bad <= 5) {
                ADD_FAILURE() << "gate_up: act[" << g << ", " << f << "] = " << got << ", want "
                              << want;
              }
            }
          }
        }
        EXPECT_EQ(bad, 0);
        float* y = Alloc<float>(n * D, 0xFF);
        ASSERT_THAT(MoeDownW4A16(act, d_offsets, d_slot_weight, d_wd, R, K, E, F, D, y), IsOk());
        const std::vector<float> got_y = Download(y, n * D);
        for (int e = 0; e < E; ++e) {
          const int g0 = offsets[e], m = offsets[e + 1] - offsets[e];
          // The CPU's W4A16 GEMM on this expert's rows (float32 activations as given).
          std::vector<float> a_e(size_t(m) * F), cpu_y(size_t(m) * D);
          for (int i = 0; i < m; ++i) {
            for (int f = 0; f < F; ++f)
              a_e[size_t(i) * F + f] = float(in(got_act[(g0 + i) * F + f]));
          }
          if (m > 0) cpu::QuantLinear(a_e.data(), m, wd.cpu[e], cpu_y.data());
          for (int i = 0; i < m; ++i) {
            const int g = g0 + i;
            for (int d = 0; d < D; ++d) {
              double sum = 0, abs_sum = 0;
              for (int f = 0; f < F; ++f) {
                const double t = double(a_e[size_t(i) * F + f]) * wd.W(e, d, f);
                sum += t, abs_sum += std::fabs(t);
              }
              const double want = double(slot_weight[g]) * sum;
              const double tol = 1e-5 * slot_weight[g] * abs_sum + 1e-30;
              const double got = got_y[size_t(g) * D + d];
              worst_down = std::max(worst_down, std::fabs(got - want) / tol);
              if (!(std::fabs(got - want) <= tol) && ++bad <= 5) {
                ADD_FAILURE() << "down: y[" << g << ", " << d << "] = " << got << ", want " << want;
              }
              // Against the CPU's float32 chain: both within float32 rounding of the sum.
              const double cpu = double(slot_weight[g]) * cpu_y[size_t(i) * D + d];
              worst_cpu = std::max(worst_cpu, std::fabs(got - cpu) / (2 * tol));
              if (!(std::fabs(got - cpu) <= 2 * tol) && ++bad <= 5) {
                ADD_FAILURE() << "down: y[" << g << ", " << d << "] = " << got
                              << ", cpu::QuantLinear " << cpu;
              }
            }
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
  std::printf(
      "w4a16 grouped GEMMs: largest |error| / tolerance: gate_up %.3g, down %.3g, down "
      "against cpu::QuantLinear %.3g\n",
      worst_gate_up, worst_down, worst_cpu);
}

// A row's W4A16 MoE output is the same bits alone as inside a batch.
TEST_F(CudaMoeW4A16Test, RowAloneEqualsRowInBatch) {
  const int R = 40, E = 8, K = 2, D = 48, F = 40;
  const std::vector<float> scores = RandomFloats(size_t(R) * E, -3.0f, 3.0f, 700);
  const std::vector<float> x = RandomFloats(size_t(R) * D, -2.0f, 2.0f, 701);
  const std::vector<float> scale = RandomFloats(E, 0.5f, 1.5f, 702);
  const W4A16Weights wgu = Device(W4Experts(E, 2 * F, D, 32, 0.05f, 703));
  const W4A16Weights wd = Device(W4Experts(E, D, F, 32, 0.05f, 704));
  auto moe = [&](const std::vector<float>& sc, const std::vector<float>& xs, int rows) {
    return DeviceMoeWith(
        sc, xs, rows, E, K, D, F, scale,
        [&](const float* x_d, const int32_t* gather, const int32_t* offsets, float* act) {
          return MoeGateUpW4A16(x_d, gather, offsets, wgu, rows, K, E, D, F, act);
        },
        [&](const float* act, const int32_t* offsets, const float* slot_weight, float* y) {
          return MoeDownW4A16(act, offsets, slot_weight, wd, rows, K, E, F, D, y);
        });
  };
  const std::vector<float> batch = moe(scores, x, R);
  for (int r : {0, 1, R / 2, R - 1}) {
    const std::vector<float> s1(scores.begin() + size_t(r) * E, scores.begin() + size_t(r + 1) * E);
    const std::vector<float> x1(x.begin() + size_t(r) * D, x.begin() + size_t(r + 1) * D);
    const std::vector<float> alone = moe(s1, x1, 1);
    for (int d = 0; d < D; ++d) {
      ASSERT_EQ(Bits(alone[d]), Bits(batch[size_t(r) * D + d])) << "row " << r << " column " << d;
    }
    EXPECT_TRUE(std::any_of(alone.begin(), alone.end(), [](float v) { return v != 0.0f; }));
  }
}

// DenseLinearW4A16 (a W4A16 checkpoint's dense projections) against float64 sums of the CPU's
// widened weights and against cpu::QuantLinear on the same float32 activations, group
// sizes 32 and 128, reductions that end inside a group and inside a packed word; a row alone is
// the same bits as inside the batch.
TEST_F(CudaMoeW4A16Test, DenseLinearMatchesCpuW4A16) {
  struct Shape {
    int R, in, out;
  };
  uint32_t seed = 800;
  double worst = 0, worst_cpu = 0;  // largest |error| / tolerance seen
  for (const Shape& s : std::vector<Shape>{{1, 136, 88}, {33, 45, 70}, {70, 176, 40}}) {
    for (int G : {32, 128}) {
      const W4Experts w(1, s.out, s.in, G, 0.05f, seed++);
      const W4A16Weights dw = Device(w);
      const std::vector<float> x = RandomFloats(size_t(s.R) * s.in, -2.0f, 2.0f, seed++);
      const float* d_x = Upload(x);
      {  // float32 activations, the only ones DenseLinearW4A16 takes (as cpu::QuantLinear)
        SCOPED_TRACE(::testing::Message()
                     << "R " << s.R << " in " << s.in << " out " << s.out << " G " << G);
        const std::vector<float>& a = x;
        std::vector<float> cpu_y(size_t(s.R) * s.out);
        cpu::QuantLinear(a.data(), s.R, w.cpu[0], cpu_y.data());
        float* y = Alloc<float>(size_t(s.R) * s.out, 0xFF);
        ASSERT_THAT(DenseLinearW4A16(d_x, dw, s.R, s.in, s.out, y), IsOk());
        const std::vector<float> got = Download(y, size_t(s.R) * s.out);
        int bad = 0;
        for (int r = 0; r < s.R; ++r) {
          for (int o = 0; o < s.out; ++o) {
            double sum = 0, abs_sum = 0;
            for (int i = 0; i < s.in; ++i) {
              const double t = double(a[size_t(r) * s.in + i]) * w.W(0, o, i);
              sum += t, abs_sum += std::fabs(t);
            }
            const double tol = 1e-5 * abs_sum + 1e-30;
            const double g = got[size_t(r) * s.out + o];
            const double c = cpu_y[size_t(r) * s.out + o];
            worst = std::max(worst, std::fabs(g - sum) / tol);
            worst_cpu = std::max(worst_cpu, std::fabs(g - c) / (2 * tol));
            if (!(std::fabs(g - sum) <= tol && std::fabs(g - c) <= 2 * tol) && ++bad <= 5) {
              ADD_FAILURE() << "y[" << r << ", " << o << "] = " << g << ", float64 " << sum
                            << ", cpu::QuantLinear " << c;
            }
          }
        }
        EXPECT_EQ(bad, 0);
        for (int r : {0, s.R / 2, s.R - 1}) {
          float* y1 = Alloc<float>(size_t(s.out), 0xFF);
          ASSERT_THAT(DenseLinearW4A16(d_x + size_t(r) * s.in, dw, 1, s.in, s.out, y1), IsOk());
          const std::vector<float> alone = Download(y1, size_t(s.out));
          for (int o = 0; o < s.out; ++o) {
            ASSERT_EQ(Bits(alone[o]), Bits(got[size_t(r) * s.out + o])) << "row " << r << " " << o;
          }
        }
      }
    }
  }
  std::printf("w4a16 dense: largest |error| / tolerance: float64 %.3g, cpu::QuantLinear %.3g\n",
              worst, worst_cpu);
}

TEST_F(CudaMoeW4A16Test, BadWeightsAreInvalidArgument) {
  uint32_t* p = Alloc<uint32_t>(8);
  uint16_t* s = Alloc<uint16_t>(8);
  for (int group : {0, 12, -8}) {
    EXPECT_THAT(MoeGateUpW4A16(nullptr, nullptr, nullptr, W4A16Weights{p, s, group}, 4, 2, 8, 16,
                               16, nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(MoeDownW4A16(nullptr, nullptr, nullptr, W4A16Weights{p, s, group}, 4, 2, 8, 16, 16,
                             nullptr),
                StatusIs(absl::StatusCode::kInvalidArgument));
  }
  EXPECT_THAT(MoeDownW4A16(nullptr, nullptr, nullptr, W4A16Weights{nullptr, s, 32}, 4, 2, 8, 16, 16,
                           nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(
      MoeDownW4A16(nullptr, nullptr, nullptr, W4A16Weights{p, s, 32}, 0, 2, 8, 16, 16, nullptr),
      IsOk());
  EXPECT_THAT(DenseLinearW4A16(nullptr, W4A16Weights{p, s, 12}, 4, 16, 16, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dgserve::cuda
