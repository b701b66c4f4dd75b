// The FP8 kernels (cuda_fp8.h) against the CPU's definition of the format (engine/cpu/
// gemm_quant.h, common/fp8.h) and float64 sums of the same quantized values (labels `gpu`, skipped
// without a GPU, and `gpu-emu`).
//
// Tolerances. acc is a sum of exact products p (e4m3 × e4m3); any float32 order of its n − 1
// additions is within (n − 1)·u·Σ|p| of the exact sum (u = 2⁻²⁴ rounding to nearest, 2⁻²³ if
// the hardware truncates), so the device's acc and the CPU's fma chain are each within
// n·2⁻²³·Σ|p| of the float64 sum; the two epilogue products add 2·2⁻²⁴ of |y|. On a device the
// FP8 mma is reported (DeepSeek-V3 report §3.3.2, for Hopper) to keep only about 14 bits while it
// sums one instruction's 32 products, so there the per-mma sum is allowed 2⁻¹³·Σ|p| more.
#include "engine/cuda/cuda_fp8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/fp8.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/cuda/cuda_moe_test_util.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using moe_testing::Bits;
using moe_testing::RandomFloats;

// Relative bound of acc's float32 error per unit of Σ|p| for a reduction of n inputs (above).
double AccBound(int n) { return (n + 2) * 0x1p-23 + (kEmulated ? 0.0 : 0x1p-13); }

// E FP8 matrices [rows, cols]: random finite e4m3 codes of every exponent (NaN codes 0x7f, 0xff
// left out), scales in [1e-3, 1e-2]; the CPU's QuantMatrix of each.
struct Fp8Experts {
  int E, rows, cols;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<cpu::QuantMatrix> cpu;
  Fp8Experts(int e, int r, int c, uint32_t seed) : E(e), rows(r), cols(c) {
    std::mt19937 gen(seed);
    std::uniform_int_distribution<int> byte(0, 255);
    codes.resize(size_t(E) * rows * cols);
    for (uint8_t& q : codes) {
      do q = uint8_t(byte(gen));
      while ((q & 0x7f) == 0x7f);
    }
    scales = RandomFloats(size_t(E) * rows, 1e-3f, 1e-2f, seed + 1);
    for (int i = 0; i < E; ++i) {
      cpu.push_back(cpu::QuantMatrix::FromFp8(&codes[size_t(i) * rows * cols],
                                              &scales[size_t(i) * rows], rows, cols));
    }
  }
  double W(int e, int r, int c) const {
    return E4m3ToFloat(codes[(size_t(e) * rows + r) * cols + c]);
  }
  double S(int e, int r) const { return scales[size_t(e) * rows + r]; }
};

// One row quantized by the CPU's function: the e4m3 values and s_x.
struct QRow {
  std::vector<float> q;
  float s;
};
QRow CpuQuantize(const float* x, int k) {
  QRow r;
  r.q.resize(k);
  r.s = cpu::QuantizeRowFp8(x, k, r.q.data());
  return r;
}

// The float64 dot product of a quantized row with W[e, row] and Σ|p|.
std::pair<double, double> Dot(const QRow& a, const Fp8Experts& w, int e, int row) {
  double sum = 0, abs_sum = 0;
  for (int c = 0; c < w.cols; ++c) {
    const double p = double(a.q[c]) * w.W(e, row, c);
    sum += p;
    abs_sum += std::fabs(p);
  }
  return {sum, abs_sum};
}

class CudaFp8Test : public CudaTest {
 protected:
  Fp8Weights Device(const Fp8Experts& w) { return Fp8Weights{Upload(w.codes), Upload(w.scales)}; }
};

// Per-token quantization on the device: codes and scales bit for bit those of
// cpu::QuantizeRowFp8 (codes as FloatToE4m3 of its values) on zero rows, huge values (not
// infinities or NaN, where the CPU's and the device's default NaN differ in sign), float32
// subnormals, e4m3 subnormals, exact ties between e4m3 neighbours (normal and subnormal) and random
// rows of every magnitude, with k not a multiple of 32.
TEST_F(CudaFp8Test, QuantizationIsTheCpuBitForBit) {
  const int k = 45;
  std::vector<std::vector<float>> rows;
  rows.push_back(std::vector<float>(k, 0.0f));   // zeros: s = 1/(448·512)
  rows.push_back(std::vector<float>(k, -0.0f));  // negative zeros
  std::vector<float> huge(k, 1.0f);
  huge[3] = 3.0e38f, huge[4] = -1.0e30f, huge[5] = 1e-30f;
  rows.push_back(huge);
  std::vector<float> sub(k);
  for (int c = 0; c < k; ++c) sub[c] = float(c - 20) * 1e-41f;  // float32 subnormals
  rows.push_back(sub);
  // s = 1 (absmax 448): x/s exact, so ties land exactly between e4m3 neighbours.
  std::vector<float> ties = {448.0f,
                             1.0625f,
                             1.1875f,
                             -1.0625f,
                             3.0f * 0x1p-10f,
                             0x1p-10f,
                             5.0f * 0x1p-10f,
                             -7.0f * 0x1p-10f,
                             15.0f * 0x1p-10f,
                             17.0f * 0x1p-10f,
                             0x1p-6f + 0x1p-10f,
                             240.0f + 8.0f,
                             -232.0f,
                             0x1p-11f,
                             0x1.1p-11f,
                             2.0f * 0x1p-9f + 0x1p-10f};
  ties.resize(k, 0.5f);
  rows.push_back(ties);
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exp(-30, 30);
    std::vector<float> r(k);
    for (float& v : r) v = std::ldexp(mant(gen), exp(gen));
    rows.push_back(r);
  }
  const int n = int(rows.size());
  std::vector<float> x;
  for (const auto& r : rows) x.insert(x.end(), r.begin(), r.end());
  uint8_t* codes = Alloc<uint8_t>(size_t(n) * k, 0xAB);
  float* scales = Alloc<float>(n, 0xFF);
  ASSERT_THAT(QuantizeRowsFp8(Upload(x), n, k, codes, scales), IsOk());
  const std::vector<uint8_t> got = Download(codes, size_t(n) * k);
  const std::vector<float> got_s = Download(scales, n);
  int bad = 0;
  for (int r = 0; r < n; ++r) {
    const QRow want = CpuQuantize(&x[size_t(r) * k], k);
    EXPECT_EQ(Bits(got_s[r]), Bits(want.s)) << "row " << r << ": " << got_s[r] << " vs " << want.s;
    for (int c = 0; c < k; ++c) {
      const uint8_t code = got[size_t(r) * k + c];
      const uint8_t want_code = FloatToE4m3(want.q[c]);
      if ((code != want_code || Bits(E4m3ToFloat(code)) != Bits(want.q[c])) && ++bad <= 8) {
        ADD_FAILURE() << "row " << r << " col " << c << ": x " << x[size_t(r) * k + c]
                      << ", device code " << int(code) << ", cpu " << int(want_code) << " ("
                      << want.q[c] << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

// Routed groups for E experts and R rows with K distinct experts each: the manual layout (groups
// of 0, 1, 16 and 33 rows, a shuffled gather; K = 1, E = 4, R = 50) or random choices, rows in
// ascending order within a group.
struct Groups {
  std::vector<int32_t> offsets, gather;
  std::vector<float> slot_weight;
};
Groups MakeGroups(int R, int E, int K, bool manual, uint32_t seed) {
  Groups g;
  std::mt19937 gen(seed);
  if (manual) {
    g.offsets = {0, 0, 1, 17, 50};
    g.gather.resize(R);
    for (int i = 0; i < R; ++i) g.gather[i] = i;
    std::shuffle(g.gather.begin(), g.gather.end(), gen);
  } else {
    std::vector<std::vector<int32_t>> by_expert(E);
    std::vector<int> ids(E);
    for (int r = 0; r < R; ++r) {
      for (int e = 0; e < E; ++e) ids[e] = e;
      std::shuffle(ids.begin(), ids.end(), gen);
      for (int j = 0; j < K; ++j) by_expert[ids[j]].push_back(r);
    }
    g.offsets.push_back(0);
    for (int e = 0; e < E; ++e) {
      g.gather.insert(g.gather.end(), by_expert[e].begin(), by_expert[e].end());
      g.offsets.push_back(int32_t(g.gather.size()));
    }
  }
  g.slot_weight = RandomFloats(size_t(R) * K, 0.1f, 1.0f, seed + 1);
  return g;
}

// The grouped FP8 GEMMs against float64 sums of the CPU's quantized values and against
// cpu::QuantLinear (the CPU's FP8 GEMM on the same rows); reductions that are and are not
// multiples of 16 (the 16-byte weight copies and the byte path) and of 64 (a partial chunk).
TEST_F(CudaFp8Test, GroupedGemmsMatchDoubleReferenceAndCpu) {
  struct Shape {
    int R, E, K, D, F;
    bool manual;
  };
  const std::vector<Shape> shapes = {
      {50, 4, 1, 128, 88, true}, {37, 8, 2, 72, 45, false}, {5, 16, 4, 160, 70, false}};
  uint32_t seed = 100;
  double worst_gate_up = 0, worst_down = 0, worst_cpu = 0;  // largest |error| / tolerance
  for (const Shape& s : shapes) {
    const int R = s.R, E = s.E, K = s.K, D = s.D, F = s.F;
    SCOPED_TRACE(::testing::Message() << "R " << R << " E " << E << " D " << D << " F " << F);
    const size_t n = size_t(R) * K;
    const std::vector<float> x = RandomFloats(size_t(R) * D, -2.0f, 2.0f, seed++);
    const Groups grp = MakeGroups(R, E, K, s.manual, seed++);
    const Fp8Experts wgu(E, 2 * F, D, seed++), wd(E, D, F, seed++);
    float* act = Alloc<float>(n * F, 0xFF);
    const int32_t* d_offsets = Upload(grp.offsets);
    ASSERT_THAT(
        MoeGateUpFp8(Upload(x), Upload(grp.gather), d_offsets, Device(wgu), R, K, E, D, F, act),
        IsOk());
    const std::vector<float> got_act = Download(act, n * F);
    int bad = 0;
    for (int e = 0; e < E; ++e) {
      for (int g = grp.offsets[e]; g < grp.offsets[e + 1]; ++g) {
        const QRow a = CpuQuantize(&x[size_t(grp.gather[g]) * D], D);
        for (int f = 0; f < F; ++f) {
          const auto [gs, ga] = Dot(a, wgu, e, f);
          const auto [us, ua] = Dot(a, wgu, e, F + f);
          const double sg = a.s * wgu.S(e, f), su = a.s * wgu.S(e, F + f);
          const double gate = sg * gs, up = su * us;
          const double tg = AccBound(D) * sg * ga + 0x1p-23 * std::fabs(gate);
          const double tu = AccBound(D) * su * ua + 0x1p-23 * std::fabs(up);
          const double gelu =
              0.5 * gate *
              (1.0 + std::tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)));
          const double want = gelu * up;
          // |gelu'| ≤ 1.13; the float32 gelu and product: a few ulps of |gate · up|.
          const double tol = 1.2 * tg * std::fabs(up) + std::fabs(gelu) * tu + tg * tu +
                             4e-6 * std::fabs(gate * up) + 1e-30;
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
    ASSERT_THAT(MoeDownFp8(act, d_offsets, Upload(grp.slot_weight), Device(wd), R, K, E, F, D, y),
                IsOk());
    const std::vector<float> got_y = Download(y, n * D);
    for (int e = 0; e < E; ++e) {
      const int g0 = grp.offsets[e], m = grp.offsets[e + 1] - g0;
      std::vector<float> cpu_y(size_t(m) * D);
      if (m > 0) cpu::QuantLinear(&got_act[size_t(g0) * F], m, wd.cpu[e], cpu_y.data());
      for (int i = 0; i < m; ++i) {
        const int g = g0 + i;
        const QRow a = CpuQuantize(&got_act[size_t(g) * F], F);
        for (int d = 0; d < D; ++d) {
          const auto [sum, abs_sum] = Dot(a, wd, e, d);
          const double sc = double(grp.slot_weight[g]) * a.s * wd.S(e, d);
          const double want = sc * sum;
          const double tol = AccBound(F) * sc * abs_sum + 3 * 0x1p-24 * std::fabs(want) + 1e-30;
          const double got = got_y[size_t(g) * D + d];
          worst_down = std::max(worst_down, std::fabs(got - want) / tol);
          if (!(std::fabs(got - want) <= tol) && ++bad <= 5) {
            ADD_FAILURE() << "down: y[" << g << ", " << d << "] = " << got << ", want " << want;
          }
          // The CPU's chain is within (F + 2)·2⁻²³ of the same sum: the two differ by ≤ 2·tol.
          const double cpu = double(grp.slot_weight[g]) * cpu_y[size_t(i) * D + d];
          worst_cpu = std::max(worst_cpu, std::fabs(got - cpu) / (2 * tol));
          if (!(std::fabs(got - cpu) <= 2 * tol) && ++bad <= 5) {
            ADD_FAILURE() << "down: y[" << g << ", " << d << "] = " << got << ", cpu::QuantLinear "
                          << cpu;
          }
        }
      }
    }
    EXPECT_EQ(bad, 0);
  }
  std::printf(
      "fp8 grouped GEMMs: largest |error| / tolerance: gate_up %.3g, down %.3g, down against "
      "cpu::QuantLinear %.3g\n",
      worst_gate_up, worst_down, worst_cpu);
}

// The dense FP8 projection against float64 and cpu::QuantLinear; and every row's bits are the
// same alone (rows = 1) as inside the batch (rows = 45, two row tiles).
TEST_F(CudaFp8Test, DenseLinearMatchesCpuAndIsRowInvariant) {
  const int rows = 45, in = 200, out = 72;
  const Fp8Experts w(1, out, in, 300);
  const std::vector<float> x = RandomFloats(size_t(rows) * in, -3.0f, 3.0f, 301);
  const Fp8Weights dw = Device(w);
  float* y = Alloc<float>(size_t(rows) * out, 0xFF);
  ASSERT_THAT(DenseLinearFp8(Upload(x), dw, rows, in, out, y), IsOk());
  const std::vector<float> got = Download(y, size_t(rows) * out);
  std::vector<float> cpu_y(size_t(rows) * out);
  cpu::QuantLinear(x.data(), rows, w.cpu[0], cpu_y.data());
  double worst = 0;
  for (int r = 0; r < rows; ++r) {
    const QRow a = CpuQuantize(&x[size_t(r) * in], in);
    for (int o = 0; o < out; ++o) {
      const auto [sum, abs_sum] = Dot(a, w, 0, o);
      const double sc = a.s * w.S(0, o);
      const double want = sc * sum;
      const double tol = AccBound(in) * sc * abs_sum + 2 * 0x1p-24 * std::fabs(want) + 1e-30;
      const double g = got[size_t(r) * out + o];
      worst = std::max(worst, std::fabs(g - want) / tol);
      ASSERT_LE(std::fabs(g - want), tol) << "row " << r << " col " << o;
      ASSERT_LE(std::fabs(g - cpu_y[size_t(r) * out + o]), 2 * tol) << "row " << r << " col " << o;
    }
  }
  std::printf("fp8 dense: largest |error| / tolerance %.3g\n", worst);
  for (int r = 0; r < rows; r += 11) {
    float* y1 = Alloc<float>(out, 0xFF);
    const std::vector<float> xr(x.begin() + size_t(r) * in, x.begin() + size_t(r + 1) * in);
    ASSERT_THAT(DenseLinearFp8(Upload(xr), dw, 1, in, out, y1), IsOk());
    const std::vector<float> alone = Download(y1, out);
    for (int o = 0; o < out; ++o) {
      ASSERT_EQ(Bits(alone[o]), Bits(got[size_t(r) * out + o])) << "row " << r << " col " << o;
    }
  }
}

// A row's grouped results are the same bits alone (its expert's only row) as in a batch.
TEST_F(CudaFp8Test, GroupedRowAloneEqualsRowInBatch) {
  const int R = 40, E = 4, K = 2, D = 96, F = 40;
  const std::vector<float> x = RandomFloats(size_t(R) * D, -2.0f, 2.0f, 400);
  const Groups grp = MakeGroups(R, E, K, false, 401);
  const Fp8Weights wgu = Device(Fp8Experts(E, 2 * F, D, 402));
  const Fp8Weights wd = Device(Fp8Experts(E, D, F, 403));
  const size_t n = size_t(R) * K;
  const float* d_x = Upload(x);
  float* act = Alloc<float>(n * F, 0xFF);
  float* y = Alloc<float>(n * D, 0xFF);
  ASSERT_THAT(MoeGateUpFp8(d_x, Upload(grp.gather), Upload(grp.offsets), wgu, R, K, E, D, F, act),
              IsOk());
  ASSERT_THAT(MoeDownFp8(act, Upload(grp.offsets), Upload(grp.slot_weight), wd, R, K, E, F, D, y),
              IsOk());
  const std::vector<float> batch_act = Download(act, n * F), batch_y = Download(y, n * D);
  for (int e = 0; e < E; ++e) {
    for (int g = grp.offsets[e]; g < grp.offsets[e + 1]; g += 7) {
      // Row gather[g] alone: one routed row, in expert e's group (the others empty).
      std::vector<int32_t> offsets(E + 1, 0);
      for (int j = e + 1; j <= E; ++j) offsets[j] = 1;
      const std::vector<int32_t> gather = {grp.gather[g]};
      float* act1 = Alloc<float>(F, 0xFF);
      float* y1 = Alloc<float>(D, 0xFF);
      ASSERT_THAT(MoeGateUpFp8(d_x, Upload(gather), Upload(offsets), wgu, R, 1, E, D, F, act1),
                  IsOk());
      ASSERT_THAT(MoeDownFp8(act1, Upload(offsets), Upload(std::vector<float>{grp.slot_weight[g]}),
                             wd, 1, 1, E, F, D, y1),
                  IsOk());
      const std::vector<float> a1 = Download(act1, F), y1h = Download(y1, D);
      for (int f = 0; f < F; ++f) {
        ASSERT_EQ(Bits(a1[f]), Bits(batch_act[size_t(g) * F + f])) << "row " << g << " f " << f;
      }
      for (int d = 0; d < D; ++d) {
        ASSERT_EQ(Bits(y1h[d]), Bits(batch_y[size_t(g) * D + d])) << "row " << g << " d " << d;
      }
    }
  }
}

TEST_F(CudaFp8Test, BadArgumentsAreInvalidArgument) {
  const Fp8Weights none;
  float* y = Alloc<float>(16);
  EXPECT_THAT(DenseLinearFp8(y, none, 1, 4, 4, y), StatusIs(absl::StatusCode::kInvalidArgument));
  const Fp8Experts w(1, 4, 4, 500);
  const Fp8Weights dw = Device(w);
  EXPECT_THAT(DenseLinearFp8(y, dw, -1, 4, 4, y), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(DenseLinearFp8(y, dw, 1, 0, 4, y), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(MoeDownFp8(y, nullptr, y, dw, 1, 3, 2, 4, 4, y),
              StatusIs(absl::StatusCode::kInvalidArgument));  // k > experts
  EXPECT_THAT(QuantizeRowsFp8(y, 1, 0, nullptr, y), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dgserve::cuda
